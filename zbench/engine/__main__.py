"""`python -m zbench.engine <case_dir>`: train the case described by `<case_dir>/config.yaml`.

`--session <dir>` serves trials one after another and `--trial <dir> <case_dir>` is one trial's client
(`zbench.engine.session`)."""

import os
import sys


def private_ray_env() -> None:
    """Keep a case's private Ray (no ZBENCH_RAY_ADDRESS) and its process groups on loopback.

    Set before Ray is imported, which reads it once: on Linux Ray otherwise replaces 127.0.0.1 by the machine's
    address and binds its GCS, raylet, workers and agents on every interface
    (`ray._private.ray_constants.ENABLE_RAY_CLUSTER`, `services.resolve_ip_for_localhost`); with it, every Ray
    server binds 127.0.0.1. Gloo's pairs follow GLOO_SOCKET_IFNAME; the daemons and workers inherit both."""
    if not os.environ.get("ZBENCH_RAY_ADDRESS", "").strip():
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--session", "--trial"):
        private_ray_env()
        from zbench.engine.session import main as session_main

        sys.exit(session_main(sys.argv[1:]))
    if len(sys.argv) != 2:
        print("usage: python -m zbench.engine <case_dir> | --session <dir> | --trial <dir> <case_dir>",
              file=sys.stderr)
        sys.exit(2)
    private_ray_env()
    from zbench.engine.trainer import main

    sys.exit(main(sys.argv[1]))
