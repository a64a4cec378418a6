"""Prompt datasets in verl's GSM8K parquet schema: real GSM8K converted from jsonl, or generated arithmetic.

One row: ``data_source`` (str), ``prompt`` (chat messages ``[{"role", "content"}]``), ``ability`` ("math"),
``reward_model`` (``{"style": "rule", "ground_truth": str}``), ``extra_info``
(``{"split", "index", "answer", "question"}``).
"""

from __future__ import annotations

import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SOURCE = "openai/gsm8k"
SYNTHETIC_SOURCE = "zbench/synthetic-arithmetic"
REQUIRED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def make_row(question: str, answer: str, ground_truth: str, split: str, index: int, source: str) -> dict:
    """One dataset row in verl's GSM8K schema."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def write_parquet(rows: list[dict], path: Path) -> Path:
    """Write rows to ``path`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------- GSM8K jsonl


def _gsm8k_rows(path: Path, split: str) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("question"), str) \
                    or not isinstance(record.get("answer"), str):
                raise ValueError(f"{where}: expected an object with string fields 'question' and 'answer'")
            last_line = record["answer"].strip().splitlines()[-1] if record["answer"].strip() else ""
            if not last_line.startswith("####"):
                raise ValueError(f"{where}: the answer's last line must be '#### N', got {last_line!r}")
            ground_truth = last_line[4:].strip().replace(",", "")
            if not ground_truth:
                raise ValueError(f"{where}: empty final answer after '####'")
            rows.append(make_row(record["question"], record["answer"], ground_truth, split, len(rows),
                                 GSM8K_SOURCE))
    if not rows:
        raise ValueError(f"{path}: no records")
    return rows


def convert_gsm8k(src_dir_or_jsonl: str | Path, out_dir: str | Path) -> list[Path]:
    """Convert GSM8K jsonl (``question``, ``answer`` ending ``#### N``) into ``<split>.parquet`` files.

    A directory must hold ``train.jsonl`` and/or ``test.jsonl``; a single file is converted under its stem's name.
    """
    src, out = Path(src_dir_or_jsonl), Path(out_dir)
    if src.is_dir():
        sources = [src / f"{split}.jsonl" for split in ("train", "test") if (src / f"{split}.jsonl").is_file()]
        if not sources:
            raise FileNotFoundError(f"{src}: neither train.jsonl nor test.jsonl found")
    elif src.is_file():
        sources = [src]
    else:
        raise FileNotFoundError(f"{src}: no such file or directory")
    return [write_parquet(_gsm8k_rows(p, p.stem), out / f"{p.stem}.parquet") for p in sources]


# ---------------------------------------------------------------------------------------- synthetic problems

_NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Emma", "Jack", "Nina", "Omar",
          "Ruth", "Carl", "Ivy")
_ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "cards", "shells", "coins", "toys")
_CONTAINERS = ("boxes", "bags", "jars", "baskets", "packs")


def _step(rng: random.Random, value: int, name: str, items: str) -> tuple[str, str, int]:
    """A follow-up operation on a running total: (sentence, operator, operand); operands stay single-digit."""
    op = rng.choice("+-*")
    if op == "-" and value < 2:
        op = "+"
    if op == "*" and value > 9:
        op = rng.choice("+-")
    if op == "+":
        b = rng.randint(1, 9)
        text = rng.choice((f"Then {name} gets {b} more.", f"Then {name} finds {b} more {items}.",
                           f"A friend gives {name} {b} more."))
    elif op == "-":
        b = rng.randint(1, min(value - 1, 9))
        text = rng.choice((f"Then {name} gives away {b}.", f"Then {name} loses {b} of them.",
                           f"Then {name} sells {b} {items}."))
    else:
        b = rng.randint(2, 3)
        text = rng.choice((f"Then the number of {items} grows {b} times.",
                           f"Then {name} ends up with {b} times as many."))
    return text, op, b


def _first(rng: random.Random, name: str, items: str) -> tuple[str, int, str, int]:
    """The opening fact: (sentences, a, operator, b), with single-digit operands."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        text = f"{name} has {a} {items}. {name} buys {b} more {items}."
        return text, a, "+", b
    if kind == 1:
        a = rng.randint(3, 9)
        b = rng.randint(1, a - 1)
        text = rng.choice((f"{name} has {a} {items}. {name} gives {b} {items} to a friend.",
                           f"{name} had {a} {items} and lost {b} of them."))
        return text, a, "-", b
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    box = rng.choice(_CONTAINERS)
    text = f"{name} has {a} {box} with {b} {items} in each."
    return text, a, "*", b


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def synthetic_problems(n: int, seed: int, split: str) -> list[dict]:
    """``n`` GSM8K-style word problems of small arithmetic (one or two operations), deterministic for
    ``(seed, split)``, as rows of the GSM8K schema with GSM8K-style answers (``<<a+b=c>>`` annotations,
    ``#### N``)."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(split.encode()))
    rows = []
    for index in range(n):
        name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
        text, a, op, b = _first(rng, name, items)
        value = _apply(a, op, b)
        steps = [(a, op, b, value)]
        if rng.random() < 0.3:
            more, op2, c = _step(rng, value, name, items)
            text = f"{text} {more}"
            steps.append((value, op2, c, _apply(value, op2, c)))
            value = steps[-1][3]
        question = f"{text} How many {items} does {name} have now?"
        lines = [f"{x} {o} {y} = <<{x}{o}{y}={r}>>{r}" for x, o, y, r in steps]
        answer = "\n".join([*lines, f"#### {value}"])
        rows.append(make_row(question, answer, str(value), split, index, SYNTHETIC_SOURCE))
    return rows


def write_synthetic(out_dir: str | Path, n_train: int, n_test: int, seed: int) -> list[Path]:
    """Write ``train.parquet`` and ``test.parquet`` of synthetic problems into ``out_dir``."""
    out = Path(out_dir)
    return [write_parquet(synthetic_problems(n_train, seed, "train"), out / "train.parquet"),
            write_parquet(synthetic_problems(n_test, seed, "test"), out / "test.parquet")]


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a parquet file in the GSM8K schema; names the file and the missing column on error."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: prompt file not found")
    try:
        table = pq.read_table(p)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{p}: not a readable parquet file ({e})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{p}: missing column(s) {', '.join(missing)}; expected {', '.join(REQUIRED_COLUMNS)}")
    return table.to_pylist()
