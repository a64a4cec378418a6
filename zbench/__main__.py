"""`python -m zbench`: the command line."""

from zbench.cli import main

main()
