"""Run by tests/test_launch.py as ``python -m launch_probe ARGS``: reports what a launched role sees, then exits 3
(or sleeps with ``sleep``)."""

import json
import os
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("LAUNCH_PROBE"),
                      "leader": os.getpgid(0) == os.getpid(), "main": __name__}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1:2] == ["sleep"]:
        time.sleep(600)
    sys.exit(3)
