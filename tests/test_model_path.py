"""model.path given as a Hugging Face hub id: taken from the local Hugging Face cache when it is there; otherwise
`zbench run` (with --dry-run too) refuses it before anything starts, saying to download it and pass the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zbench.models import resolve_model


def zbench(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(tmp / "hf")} | env
    return subprocess.run([sys.executable, "-m", "zbench", *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp, env=full)


@pytest.mark.parametrize("offline", [None, "1"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_uncached_hub_id_is_refused_with_what_to_do(tmp_path: Path, offline: str | None, dry_run: bool) -> None:
    env = {"HF_HUB_OFFLINE": offline} if offline else {}
    res = zbench(tmp_path, "run", "six-case", "--steps", "2", "--set", "model.path=Qwen/Qwen3-0.6B",
                 *(["--dry-run"] if dry_run else []), "--results-dir", str(tmp_path / "results"), **env)
    assert res.returncode == 2, res.stdout + res.stderr
    err = " ".join(res.stderr.split())
    assert "model.path: 'Qwen/Qwen3-0.6B' is not a local directory" in err
    assert "hf download Qwen/Qwen3-0.6B --local-dir models/Qwen3-0.6B" in err
    assert "--set model.path=models/Qwen3-0.6B" in err and "Traceback" not in res.stderr
    assert not (tmp_path / "results").exists()  # refused before a run root was made


def test_hub_id_in_the_local_cache_resolves_to_its_snapshot(tmp_path: Path, monkeypatch) -> None:
    """The cache layout huggingface_hub reads (refs/main names the snapshot) holding a model folder."""
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-lm"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    res = zbench(tmp_path, "run", "six-case", "--dry-run", "--set", "model.path=acme/tiny-lm", HF_HUB_OFFLINE="1")
    assert res.returncode == 0, res.stderr
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    assert resolve_model("acme/tiny-lm") == snapshot


def test_missing_local_directory_is_refused_at_dry_run(tmp_path: Path) -> None:
    res = zbench(tmp_path, "run", "six-case", "--dry-run", "--set", "model.path=./models/none")
    assert res.returncode == 2
    assert "model.path: './models/none': models/none is not a directory; give 'tiny', 'qwen3-0.6b'" in res.stderr
