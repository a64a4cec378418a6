"""GSM8K rule reward: extraction cases, scoring, and agreement with OpenAI's labelled model solutions."""

import json
import os
import re
from pathlib import Path

import pytest

from zbench.engine.reward import compute_score, extract_solution

GSM8K_DIR = Path(os.environ.get("ZBENCH_GSM8K_DIR") or Path(__file__).resolve().parents[2] / "shared/data/gsm8k")
SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


@pytest.mark.parametrize(("text", "method", "expected"), [
    ("3 + 5 = 8\n#### 8", "strict", "8"),
    ("#### 1\nwait, no\n#### 2", "strict", "2"),  # the last answer line wins
    ("She pays #### $1,234 in total", "strict", "1234"),
    ("#### -7", "strict", "-7"),
    ("#### 2.50", "strict", "2.5"),
    ("The answer is 42.", "strict", None),
    ("The answer is 42.", "flexible", "42"),
    ("It costs $1,200.00 for 3 days", "flexible", "3"),
    ("It costs $1,200.00.", "flexible", "1200"),
    ("no number here", "flexible", None),
    ("", "strict", None),
])
def test_extract_solution(text, method, expected):
    assert extract_solution(text, method) == expected


def test_extract_solution_rejects_unknown_method():
    with pytest.raises(ValueError, match="strict, flexible"):
        extract_solution("#### 1", "fuzzy")


def test_compute_score_levels():
    assert compute_score("The answer is 8.", "8") == 0.0  # no '####' line: nothing found
    assert compute_score("#### 9", "8", format_score=0.1) == 0.1
    assert compute_score("#### 8", "8", format_score=0.1) == 1.0
    assert compute_score("#### 8", "8", score=2.0) == 2.0
    assert compute_score("The answer is 8.", "8", method="flexible") == 1.0
    assert compute_score("#### 1,000", "1000") == 1.0


def test_compute_score_takes_reward_config_fields():
    config = {"method": "strict", "format_score": 0.1, "correct_score": 0.5}
    assert compute_score("#### 8", "8", **config) == 0.5
    assert compute_score("#### 7", "8", **config) == 0.1


def _labelled():
    path = GSM8K_DIR / "example_model_solutions.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K example solutions not found in {GSM8K_DIR} (set ZBENCH_GSM8K_DIR)")
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        truth = row["ground_truth"].strip().splitlines()[-1].removeprefix("A:").strip()
        for solver in SOLVERS:
            yield row[solver]["solution"], truth, row[solver]["is_correct"]


def test_agreement_with_labelled_solutions():
    """The labels mark a solution correct when its final ``A: N`` equals the reference answer, so an
    extractor that reads the final number exactly must agree on (nearly) every one of the 5,276 solutions;
    0.99 leaves room for a few oddly written numbers. Strict extraction sees no ``####`` in these solutions
    and must never reward them; rewritten into the ``#### N`` format it must agree as well as flexible."""
    rows = list(_labelled())
    flexible = sum((compute_score(s, t, "flexible") == 1.0) == ok for s, t, ok in rows) / len(rows)
    strict_raw = sum((compute_score(s, t, "strict") == 1.0) == ok for s, t, ok in rows) / len(rows)
    rewritten = [(re.sub(r"A:\s*(\S+)\s*$", r"#### \1", s.strip()), t, ok) for s, t, ok in rows]
    strict = sum((compute_score(s, t, "strict") == 1.0) == ok for s, t, ok in rewritten) / len(rows)
    incorrect_share = sum(not ok for _, _, ok in rows) / len(rows)
    print(f"\nagreement over {len(rows)} labelled solutions: flexible {flexible:.4f}, strict on '####' "
          f"rewrite {strict:.4f}, strict as written {strict_raw:.4f} (= share labelled incorrect "
          f"{incorrect_share:.4f})")
    assert len(rows) == 4 * 1319
    assert flexible >= 0.99
    assert strict >= 0.99
    assert strict_raw == pytest.approx(incorrect_share)
