"""A real server process whose tau_p profiling and first block load are slowed (test helper, not a test).

    python tests/slow_server.py PROFILE_S LOAD_S SERVER_ARGS...

``PROFILE_S``: seconds the tau_p measurement sleeps before announcing 0.01 s (ignored with ``--tau-p``);
``LOAD_S``: seconds the first ``load_block`` call sleeps (later loads run at full speed). Both patch the
functions the server calls, so everything else is the unchanged server (``python -m petals_chain.server``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this file belongs to


def main() -> int:
    profile_s, load_s = float(sys.argv[1]), float(sys.argv[2])
    import petals_chain.server.profiling as profiling
    import petals_chain.server.runner as runner

    real_load = runner.load_block
    loads: list[int] = []

    def slow_measure(*args, **kwargs) -> float:
        time.sleep(profile_s)
        return 0.01

    def slow_load(*args, **kwargs):
        if not loads:
            time.sleep(load_s)
        loads.append(1)
        return real_load(*args, **kwargs)

    profiling.measure_tau_p = slow_measure
    runner.load_block = slow_load
    from petals_chain.server.__main__ import main as server_main

    return server_main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
