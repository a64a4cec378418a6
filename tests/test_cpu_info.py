"""py-cpuinfo's CPU description is probed once per boot and read from disk after that (zbench.engine.cpu_info): what
DeepSpeed's op loads ask for in every worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cpuinfo
import pytest

from zbench.engine import cpu_info


def counting_probe(calls: list[int]):
    def probe() -> dict:
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "fma"], "vendor_id_raw": "GenuineIntel"}
    return probe


def test_one_probe_per_boot_across_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZBENCH_CACHE", str(tmp_path))
    calls: list[int] = []
    first = cpu_info.cached(counting_probe(calls))
    assert first() == first() and len(calls) == 1  # once in this process
    written = cpu_info.cache_file()
    assert written is not None and written.parent == tmp_path / "cpuinfo"
    assert json.loads(written.read_text())["flags"] == ["avx2", "fma"]
    later = cpu_info.cached(counting_probe(calls))  # another process: reads what the first one kept
    assert later()["flags"] == ["avx2", "fma"] and len(calls) == 1
    assert [p.name for p in written.parent.iterdir()] == [written.name]  # no temporary file left beside it


def test_a_damaged_or_unwritable_cache_costs_a_probe_not_the_answer(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZBENCH_CACHE", str(tmp_path))
    (tmp_path / "cpuinfo").mkdir()
    cpu_info.cache_file().write_text('{"arch": ')  # a cut-off file: probed again, and rewritten whole
    calls: list[int] = []
    assert cpu_info.cached(counting_probe(calls))()["arch"] == "X86_64" and len(calls) == 1
    assert json.loads(cpu_info.cache_file().read_text())["arch"] == "X86_64"
    if os.geteuid() != 0:  # root writes anywhere
        cpu_info.cache_file().unlink()
        (tmp_path / "cpuinfo").chmod(0o500)
        try:
            assert cpu_info.cached(counting_probe(calls))()["arch"] == "X86_64" and len(calls) == 2
        finally:
            (tmp_path / "cpuinfo").chmod(0o700)


def test_no_cache_to_be_had_still_answers_and_answers_are_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_home() -> None:
        raise RuntimeError("Could not determine home directory.")  # what Path.home() says for a uid without one

    monkeypatch.setattr(cpu_info, "cache_file", no_home)
    calls: list[int] = []
    get = cpu_info.cached(counting_probe(calls))
    for _ in range(2):  # the probed answer, then the kept one
        answer = get()
        answer["flags"].append("changed by a caller")
        answer["arch"] = "changed"
    assert get() == {"arch": "X86_64", "flags": ["avx2", "fma"], "vendor_id_raw": "GenuineIntel"} and len(calls) == 1


def test_an_empty_probe_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZBENCH_CACHE", str(tmp_path))
    answers = [{}, {"arch": "ARM_8", "flags": ["neon"]}]
    get = cpu_info.cached(lambda: answers.pop(0))
    assert get() == {} and not cpu_info.cache_file().exists()
    assert get()["arch"] == "ARM_8" and json.loads(cpu_info.cache_file().read_text())["arch"] == "ARM_8"


def test_the_cache_is_keyed_by_the_machine_type_and_cpu_as_well_as_the_boot(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """An emulated architecture on the same kernel, or a VM restored on another host with the same boot id, gets
    its own file."""
    monkeypatch.setenv("ZBENCH_CACHE", str(tmp_path))
    here = cpu_info.cache_file()
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "aarch64-emulated")
    emulated = cpu_info.cache_file()
    other_cpu = tmp_path / "cpuinfo.txt"
    other_cpu.write_text("model name\t: Another CPU\nflags\t\t: fpu\n")
    monkeypatch.setattr(cpu_info, "PROC_CPUINFO", other_cpu)
    assert len({here, emulated, cpu_info.cache_file()}) == 3


def test_deepspeed_op_builders_get_the_real_description_once(tmp_path: Path) -> None:
    """In a fresh interpreter, as a worker is: the real probe runs once for several op-builder questions, and they
    get what py-cpuinfo itself says."""
    script = (
        "import os, json\n"
        "os.environ['DS_ACCELERATOR'] = 'cpu'\n"
        "import cpuinfo\n"
        "from zbench.engine import cpu_info\n"
        "calls = []\n"
        "real = cpuinfo.get_cpu_info\n"
        "cpuinfo.get_cpu_info = lambda: calls.append(1) or real()\n"
        "cpu_info.install()\n"
        "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder\n"
        "b = CPUAdamBuilder()\n"
        "b.cpu_arch(), b.simd_width(), b.cpu_arch()\n"
        "print(json.dumps({'calls': len(calls), 'flags': cpuinfo.get_cpu_info()['flags']}))\n"
    )
    env = {**os.environ, "ZBENCH_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True,
                         timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["calls"] == 1
    assert got["flags"] == cpuinfo.get_cpu_info()["flags"]
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True,
                           timeout=300)
    assert json.loads(again.stdout.strip().splitlines()[-1])["calls"] == 0  # this boot's description, from disk
