"""GSM8K rule reward: extract the final number of a solution and compare it with the ground truth.

Two extraction methods, as in verl: ``strict`` accepts only the GSM8K answer line ``#### N`` (so it rewards the
format as well as the answer), ``flexible`` takes the last number anywhere in the text.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")
METHODS = ("strict", "flexible")
# Only the tail can hold the final answer; scanning a runaway generation in full would cost for nothing.
_TAIL_CHARS = 400


def normalize_number(text: str) -> str:
    """Canonical text of a number: no ``$`` or thousands commas, no trailing ``.``/decimal zeros (``"1,200.50"``
    -> ``"1200.5"``)."""
    out = text.replace("$", "").replace(",", "").strip().rstrip(".")
    if "." in out:
        out = out.rstrip("0").rstrip(".")
    return "0" if out == "-0" else out


def extract_solution(text: str, method: str = "strict") -> str | None:
    """Final answer of ``text`` as a normalised number string, or ``None`` when none is found.

    ``strict``: the last ``#### N`` line; ``flexible``: the last number in the text.
    """
    if method not in METHODS:
        raise ValueError(f"unknown extraction method {method!r}; choose one of {', '.join(METHODS)}")
    tail = text[-_TAIL_CHARS:]
    pattern = _STRICT if method == "strict" else _NUMBER
    matches = pattern.findall(tail)
    if not matches:
        return None
    answer = normalize_number(matches[-1])
    return answer or None


def compute_score(
    solution_text: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    correct_score: float | None = None,
) -> float:
    """Reward of one solution: 0 without an extractable answer, ``format_score`` if wrong, ``score`` if right.

    ``correct_score`` is the reward config's name for ``score`` (when given it takes its place), so the config's
    fields ``method``, ``format_score`` and ``correct_score`` pass straight through as keywords.
    """
    answer = extract_solution(solution_text, method)
    if answer is None:
        return 0.0
    right = score if correct_score is None else correct_score
    return float(right) if answer == normalize_number(ground_truth) else float(format_score)
