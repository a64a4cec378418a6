"""A run root on disk: the case-directory contract, the run root and its lock, summary.tsv, merge, and the read side."""
