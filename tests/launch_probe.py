"""Run by tests/test_launch.py as ``python -m launch_probe ARGS``: reports what a launched role sees, then exits 3
(or sleeps with ``sleep``)."""

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("LAUNCH_PROBE"),
                      "leader": os.getpgid(0) == os.getpid(), "main": __name__, "tmpdir": tempfile.gettempdir()}),
          flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1:2] == ["sleep"]:
        time.sleep(600)
    if sys.argv[1:2] == ["hold-hivemind-lock"]:  # dies (SIGKILL by the test) holding hivemind's result-pipe lock
        from hivemind.utils.mpfuture import MPFuture

        MPFuture._update_lock.acquire()
        print("holding", flush=True)
        time.sleep(600)
    if sys.argv[1:2] == ["mpfuture"]:  # a forked child fulfils an MPFuture, as a DHT process does for its role
        import multiprocessing

        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        child = multiprocessing.get_context("fork").Process(target=future.set_result, args=(42,))
        child.start()
        try:
            print("result", future.result(timeout=30), flush=True)
        except TimeoutError:
            print("stuck", flush=True)
        child.kill()
    sys.exit(3)
