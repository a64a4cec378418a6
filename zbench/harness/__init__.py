"""The harness: matrices into cases, one supervised process per case, runner profiles, live progress."""
