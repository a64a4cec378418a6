"""The README is a manual that stays true: its config reference is generated from the config's own field comments,
and its command list names exactly the commands `zbench --help` offers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from zbench.config import dotted_keys, reference, reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_config_reference_is_generated_and_complete() -> None:
    text = README.read_text()
    start = text.index("<!-- config-reference:start")
    block = text[text.index("\n", start) + 1 : text.index("<!-- config-reference:end -->")]
    assert block == reference_markdown(), "README's config reference is stale: paste `zbench keys --markdown`"
    rows = reference()
    assert [k for k, _, _ in rows] == dotted_keys()
    assert not [k for k, _, meaning in rows if not meaning], "every config key needs a comment on its line"


def test_readme_is_short_and_lists_every_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    help_text = subprocess.run([sys.executable, "-m", "zbench", "--help"], capture_output=True, text=True,
                               timeout=120, env={"COLUMNS": "200", "PATH": ""}).stdout
    offered = set(re.findall(r"^│ (\w[\w-]*) ", help_text, flags=re.M))
    documented = set(re.findall(r"^    zbench (\w[\w-]*)", text, flags=re.M))
    assert offered and offered == documented, (offered - documented, documented - offered)
