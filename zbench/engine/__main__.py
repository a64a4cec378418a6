"""`python -m zbench.engine <case_dir>`: train the case described by `<case_dir>/config.yaml`."""

import sys

from zbench.engine.trainer import main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m zbench.engine <case_dir>", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
