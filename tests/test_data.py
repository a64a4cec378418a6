"""Datasets in the GSM8K parquet schema: synthetic problems, jsonl conversion, loading errors."""

import json
import os
import re
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zbench.data import INSTRUCTION, convert_gsm8k, load_prompts, synthetic_problems, write_synthetic
from zbench.engine.reward import compute_score

GSM8K_DIR = Path(os.environ.get("ZBENCH_GSM8K_DIR") or Path(__file__).resolve().parents[2] / "shared/data/gsm8k")


def assert_schema(row: dict, split: str) -> None:
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert isinstance(row["data_source"], str) and row["ability"] == "math"
    assert [m["role"] for m in row["prompt"]] == ["user"]
    assert row["prompt"][0]["content"].endswith(INSTRUCTION)
    assert row["reward_model"]["style"] == "rule"
    assert isinstance(row["reward_model"]["ground_truth"], str)
    extra = row["extra_info"]
    assert set(extra) == {"split", "index", "answer", "question"} and extra["split"] == split
    assert row["prompt"][0]["content"] == f"{extra['question']} {INSTRUCTION}"


def test_synthetic_is_deterministic_and_split_dependent():
    a = synthetic_problems(50, seed=3, split="train")
    assert a == synthetic_problems(50, seed=3, split="train")
    assert a != synthetic_problems(50, seed=4, split="train")
    assert a != synthetic_problems(50, seed=3, split="test")
    assert synthetic_problems(10, seed=3, split="train") == a[:10]


def test_synthetic_answers_are_gsm8k_style_and_correct():
    rows = synthetic_problems(300, seed=0, split="train")
    n_steps = set()
    for i, row in enumerate(rows):
        assert_schema(row, "train")
        assert row["extra_info"]["index"] == i
        *lines, final = row["extra_info"]["answer"].splitlines()
        n_steps.add(len(lines))
        for line in lines:
            m = re.fullmatch(r"(\d+) ([-+*]) (\d+) = <<(\d+)([-+*])(\d+)=(\d+)>>(\d+)", line)
            assert m, line
            a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[8])
            assert a < 100 and b < 100 and result >= 0
            assert result == {"+": a + b, "-": a - b, "*": a * b}[op]
            assert (m[4], m[5], m[6], m[7]) == (m[1], m[2], m[3], m[8])
        truth = row["reward_model"]["ground_truth"]
        assert final == f"#### {truth}"
        assert compute_score(row["extra_info"]["answer"], truth) == 1.0
    assert n_steps == {1, 2}
    assert len({row["extra_info"]["question"] for row in rows}) > 290


def test_write_synthetic_and_load(tmp_path):
    paths = write_synthetic(tmp_path, n_train=20, n_test=5, seed=1)
    assert [p.name for p in paths] == ["train.parquet", "test.parquet"]
    train, test = load_prompts(paths[0]), load_prompts(paths[1])
    assert len(train) == 20 and len(test) == 5
    assert train == synthetic_problems(20, seed=1, split="train")
    assert_schema(test[0], "test")


def _real_lines(n: int) -> list[str]:
    path = GSM8K_DIR / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found in {GSM8K_DIR} (set ZBENCH_GSM8K_DIR)")
    with path.open(encoding="utf-8") as f:
        return list(islice(f, n))


def test_convert_real_gsm8k_lines(tmp_path):
    lines = _real_lines(5)
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(lines), encoding="utf-8")
    (src / "test.jsonl").write_text("".join(lines[:2]), encoding="utf-8")
    paths = convert_gsm8k(src, tmp_path / "out")
    assert [p.name for p in paths] == ["train.parquet", "test.parquet"]
    rows = load_prompts(paths[0])
    assert len(rows) == 5 and len(load_prompts(paths[1])) == 2
    for i, (row, line) in enumerate(zip(rows, lines, strict=True)):
        record = json.loads(line)
        assert_schema(row, "train")
        assert row["data_source"] == "openai/gsm8k" and row["extra_info"]["index"] == i
        assert row["extra_info"]["answer"] == record["answer"]
        assert row["reward_model"]["ground_truth"] == record["answer"].split("####")[-1].strip().replace(",", "")
    assert rows[0]["reward_model"]["ground_truth"] == "72"  # Natalia's clips
    single = convert_gsm8k(src / "test.jsonl", tmp_path / "single")
    assert [p.name for p in single] == ["test.parquet"]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ('{"question": "q"}', "'question' and 'answer'"),
    ('{"question": "q", "answer": "it is 4"}', "must be '#### N'"),
    ('{"question": "q", "answer": "x\\n####  "}', "empty final answer"),
])
def test_convert_names_file_and_line_of_bad_input(tmp_path, line, message):
    src = tmp_path / "train.jsonl"
    src.write_text('{"question": "q", "answer": "#### 1"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{src}:2: ") + ".*" + re.escape(message)):
        convert_gsm8k(src, tmp_path / "out")


def test_convert_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl"):
        convert_gsm8k(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        convert_gsm8k(tmp_path / "nope.jsonl", tmp_path / "out")


def test_load_prompts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"absent\.parquet"):
        load_prompts(tmp_path / "absent.parquet")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"data_source": ["x"], "prompt": [[{"role": "user", "content": "hi"}]]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet: missing column\(s\) ability, reward_model, extra_info"):
        load_prompts(bad)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file"):
        load_prompts(junk)
