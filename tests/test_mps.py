"""trainer.critic_sm_percent: the case's private NVIDIA MPS server (zbench.engine.mps) and the checks around it.

MPS needs an NVIDIA GPU and its driver's `nvidia-cuda-mps-control`; on a CPU host the daemon's lifecycle runs
against a stand-in control program that keeps the real one's contract as zbench uses it (`-f`: run in the
foreground and make `$CUDA_MPS_PIPE_DIRECTORY/control`; no argument: pass stdin's command to the daemon; `quit`:
exit). The whole path, a PPO case's workers as MPS clients, runs on a GPU (marked `gpu`).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from zbench.config import ConfigError, from_dict
from zbench.engine.mps import CONTROL, LOG_ENV, LOGS, PIPE_ENV, MPSError, MPSServer

STAND_IN = f"""#!{sys.executable}
import os, sys
control = os.path.join(os.environ["{PIPE_ENV}"], "control")
if sys.argv[1:] == ["-f"]:
    print("daemon up, CUDA_VISIBLE_DEVICES:", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    if os.environ.get("STAND_IN_FAIL"):
        print("no CUDA-capable device is detected", flush=True)
        sys.exit(3)
    os.mkfifo(control)
    while True:
        with open(control) as pipe:
            command = pipe.read().strip()
        print("got", command, flush=True)
        if command.startswith("client "):  # what the real daemon prints in the foreground as a process connects
            print(f"[2026-11-27 02:50:06.369 Control  1063] NEW CLIENT {{command.split()[1]}} from user 0: "
                  "Server already exists", flush=True)
        if command == "quit" and not os.environ.get("STAND_IN_DEAF"):
            os.unlink(control)
            sys.exit(0)
else:
    with open(control, "w") as pipe:
        pipe.write(sys.stdin.read())
"""


@pytest.fixture
def control(tmp_path: Path) -> str:
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir()
    path.write_text(STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_server_starts_serves_its_pipe_and_quits(tmp_path: Path, control: str) -> None:
    server = MPSServer(tmp_path / "mps" / "pipe", tmp_path / "mps" / "log", control=control)
    server.start()
    try:
        assert stat.S_ISFIFO((tmp_path / "mps" / "pipe" / "control").stat().st_mode)
        assert server.client_env() == {PIPE_ENV: str(tmp_path / "mps" / "pipe"), LOG_ENV: str(tmp_path / "mps" / "log")}
        assert oct((tmp_path / "mps" / "pipe").stat().st_mode & 0o777) == oct(0o700)
        daemon = server.proc
        assert daemon is not None and daemon.poll() is None
    finally:
        server.stop()
    assert daemon.returncode == 0  # it quit when asked, not killed
    assert "got quit" in (tmp_path / "mps" / "log" / "daemon.out").read_text()
    server.stop()  # twice is fine


CONTROL_LOG = """\
[2026-11-27 02:42:28.788 Control  1063] Starting control daemon using socket /tmp/zbench-mps/pipe/control
[2026-11-27 02:50:05.607 Control  1063] Accepting connection...
[2026-11-27 02:50:05.607 Control  1063] User did not send valid credentials
[2026-11-27 02:50:05.608 Control  1063] NEW CLIENT 1866 from user 0: Server is not ready, push client to pending list
[2026-11-27 02:50:05.608 Control  1922] Starting new server 1922 for user 0
[2026-11-27 02:50:05.875 Control  1063] NEW SERVER 1922: Ready
[2026-11-27 02:50:06.369 Control  1063] NEW CLIENT 1866 from user 0: Server already exists
[2026-11-27 02:50:18.762 Control  1063] NEW CLIENT 1987 from user 0: Server already exists
"""  # as the daemon wrote it on an H100 (results/reference/h100-gpu-share-20261127/logs/mps-vllm/control.log)


def test_clients_are_the_processes_the_daemon_logged(tmp_path: Path) -> None:
    server = MPSServer(tmp_path / "pipe", tmp_path / "log", control="/bin/true")
    assert server.clients() == set()  # no log yet: nobody connected
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "control.log").write_text(CONTROL_LOG)
    assert server.clients() == {1866, 1987}


def tell(server: MPSServer, command: str) -> None:
    subprocess.run([server.control], input=command.encode(), env={**os.environ, **server.client_env()}, check=True,
                   timeout=10)


def test_clients_counts_this_daemon_s_connections_only(tmp_path: Path, control: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A retried case starts a new daemon over the same log folder: the connections the last one logged are not
    this one's. The daemon sees every GPU, whatever the engine's CUDA_VISIBLE_DEVICES (clients count among its)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pipe, logs = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    first = MPSServer(pipe, logs, control=control)
    first.start()
    tell(first, "client 111")
    time.sleep(0.2)
    assert first.clients() == {111}
    first.stop()
    second = MPSServer(pipe, logs, control=control)
    second.start()
    try:
        tell(second, "client 222")
        time.sleep(0.2)
        assert second.clients() == {222}
    finally:
        second.stop()
    assert "CUDA_VISIBLE_DEVICES: None" in (logs / "daemon.out").read_text()


def test_a_stale_pipe_does_not_pass_for_a_running_daemon(tmp_path: Path, control: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = tmp_path / "mps" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "control").write_text("")  # left by a daemon killed with its case
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    with pytest.raises(MPSError, match="exited with code 3"):
        MPSServer(pipe, tmp_path / "mps" / "log", control=control).start()


def test_a_daemon_that_ignores_quit_is_killed(tmp_path: Path, control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_DEAF", "1")
    server = MPSServer(tmp_path / "mps" / "pipe", tmp_path / "mps" / "log", control=control)
    server.start()
    daemon = server.proc
    start = time.monotonic()
    server.stop(timeout_s=1.0)
    assert daemon is not None and daemon.returncode == -9 and time.monotonic() - start < 10
    assert not psutil.pid_exists(daemon.pid) or psutil.Process(daemon.pid).status() == psutil.STATUS_ZOMBIE


def test_the_daemon_goes_down_with_a_killed_case(tmp_path: Path, control: str) -> None:
    """The harness kills a hung case's process group; the daemon, the engine's child, is in it (no session of its
    own), so it goes too."""
    engine = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from zbench.engine.mps import MPSServer; "
         "s = MPSServer(Path(sys.argv[1]) / 'pipe', Path(sys.argv[1]) / 'log', control=sys.argv[2]); s.start(); print(s.proc.pid, flush=True); "
         "time.sleep(300)", str(tmp_path / "mps"), control],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert engine.stdout is not None
    daemon = psutil.Process(int(engine.stdout.readline()))
    assert os.getpgid(daemon.pid) == engine.pid
    os.killpg(engine.pid, 9)
    engine.wait(10)
    gone, _ = psutil.wait_procs([daemon], timeout=10)
    assert gone or daemon.status() == psutil.STATUS_ZOMBIE


def test_a_daemon_that_fails_is_reported_with_its_output(tmp_path: Path, control: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    server = MPSServer(tmp_path / "mps" / "pipe", tmp_path / "mps" / "log", control=control)
    with pytest.raises(MPSError, match=r"exited with code 3 .*no CUDA-capable device is detected"):
        server.start()
    assert server.proc is None


def test_no_control_program_names_the_way_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MPSError, match=r"nvidia-cuda-mps-control is not on PATH.*trainer.critic_sm_percent=0"):
        MPSServer(tmp_path / "mps" / "pipe", tmp_path / "mps" / "log")


PPO_OVERLAP = {"algorithm": "ppo", "trainer": {"critic_update": "overlap", "critic_sm_percent": 50}}


@pytest.mark.parametrize(("changes", "says"), [
    ({"trainer": {"critic_sm_percent": 101}}, "must be a share of the SMs in 1..100, or 0 for no MPS; got 101"),
    ({"trainer": {"critic_update": "serial"}}, "critic_update=serial the critic's update runs alone"),
    ({"trainer": {"device": "cpu"}}, "trainer.device=cpu has none"),
    ({"algorithm": "grpo", "rollout": {"n": 2}}, "the grpo estimator trains no critic: use 0"),
])
def test_config_refuses_what_mps_cannot_help(changes: dict, says: str) -> None:
    data = {"algorithm": PPO_OVERLAP["algorithm"], "trainer": dict(PPO_OVERLAP["trainer"])}
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    with pytest.raises(ConfigError, match="critic_sm_percent") as err:
        from_dict(data)
    assert says in str(err.value)


def test_config_names_the_missing_critic_before_the_serial_update() -> None:
    with pytest.raises(ConfigError, match="the grpo estimator trains no critic: use 0"):
        from_dict({"algorithm": "grpo", "rollout": {"n": 2}, "trainer": {"critic_sm_percent": 50}})


def test_config_takes_a_share_with_the_critic_beside_other_work() -> None:
    for mode in ("overlap", "concurrent"):
        cfg = from_dict({"algorithm": "ppo", "trainer": {"critic_update": mode, "critic_sm_percent": 40}})
        assert cfg.trainer.critic_sm_percent == 40


def test_gpu_defaults_put_the_critic_beside_the_rollout_where_a_share_is_asked() -> None:
    """On a GPU, ZeRO-1/2 without offload take critic_update=overlap by default, so an SM share needs no more; where
    the default stays serial (ZeRO-3 without offload) the share is refused, naming what to set."""
    from zbench.harness.matrix import expand, load_matrix

    sets = [("trainer.device", "cuda"), ("trainer.critic_sm_percent", 50)]
    [case] = expand(load_matrix("six-case"), sets=sets, case_globs=["zero1_no_offload"], device_defaults=True,
                    on_cuda=True)
    assert case.config.trainer.critic_update == "overlap" and case.config.trainer.critic_sm_percent == 50
    with pytest.raises(ConfigError, match=r"critic_sm_percent: with trainer.critic_update=serial .*use critic_update=overlap"):
        expand(load_matrix("six-case"), sets=sets, case_globs=["zero3_no_offload"], device_defaults=True, on_cuda=True)


def test_trainer_on_a_gpu_host_refuses_a_share_it_cannot_serve(tmp_path: Path, control: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything starts: a Ray cluster, whose other nodes the case cannot start a daemon on, and a host without
    the control program are config errors naming the key (and the program, with the way out)."""
    from zbench.engine.cluster import ray_tmpdir
    from zbench.engine.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # only what `_mps_server` reads: a GPU host and the case's process folder
    trainer.on_cuda, trainer.process_dir = True, tmp_path
    monkeypatch.setenv("ZBENCH_RAY_ADDRESS", "10.0.0.2:6379")
    with pytest.raises(ConfigError, match=r"trainer.critic_sm_percent: .* but this case runs on a Ray cluster"):
        trainer._mps_server()
    monkeypatch.delenv("ZBENCH_RAY_ADDRESS")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no nvidia-cuda-mps-control there
    with pytest.raises(ConfigError, match=rf"trainer.critic_sm_percent: {CONTROL} is not on PATH.*critic_sm_percent=0"):
        trainer._mps_server()
    monkeypatch.setenv("PATH", str(Path(control).parent))
    server = trainer._mps_server()  # found, not started: `open` starts it
    assert server.control == control and server.proc is None
    assert server.pipe == ray_tmpdir(tmp_path) / "mps" and server.logs == tmp_path / "mps"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the refusal on a host without a GPU")
def test_engine_without_a_gpu_exits_2_naming_the_key(tmp_path: Path) -> None:
    from zbench.config import dump_yaml

    case = tmp_path / "mps"
    case.mkdir()
    (case / "config.yaml").write_text(dump_yaml(from_dict({"name": "mps", **PPO_OVERLAP, "steps": 1})))
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    assert ("trainer.critic_sm_percent: runs the case's GPU processes through a private NVIDIA MPS server, but this "
            "host has no CUDA device: use 0") in res.stdout


@pytest.mark.gpu
def test_ppo_case_runs_its_critic_through_mps(tmp_path: Path) -> None:
    """On a GPU with MPS: a PPO case whose critic updates behind the rollout through the private server finishes,
    says so in its log and its result (every worker connected), and leaves no MPS process behind."""
    import torch

    if not torch.cuda.is_available() or shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("needs a CUDA GPU and nvidia-cuda-mps-control")
    from zbench.config import dump_yaml

    case = tmp_path / "mps"
    case.mkdir()
    cfg = {"name": "mps", **PPO_OVERLAP, "steps": 3, "trainer": {**PPO_OVERLAP["trainer"], "world_size": 1}}
    (case / "config.yaml").write_text(dump_yaml(from_dict(cfg)))
    res = subprocess.run([sys.executable, "-m", "zbench.engine", str(case)], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    assert "NVIDIA MPS server at" in res.stdout and "at most 50 % of each GPU's SMs" in res.stdout
    assert len((case / "metrics.jsonl").read_text().splitlines()) == 3
    # both workers (actor and critic) connected to the server, as its log in the case's folder says
    assert json.loads((case / "result.json").read_text())["mps"] == {"critic_sm_percent": 50, "client_processes": 2}
    # in the foreground the daemon logs to its output (daemon.out); control.log where it writes one as well
    assert "NEW CLIENT" in "".join(f.read_text() for f in (case / "mps").iterdir() if f.name in LOGS)
    # the case's daemon runs in the foreground (-f); a host's own MPS daemon (-d) is not the case's
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[:1] and p.info["cmdline"][0].endswith(CONTROL) and "-f" in p.info["cmdline"]]
    assert not left, left
