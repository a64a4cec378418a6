"""A case that trains all its steps and exits 0."""

from _common import case_dir, run_all

run_all(case_dir())
