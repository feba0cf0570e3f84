#!/usr/bin/env bash
# Installs everything petals-chain needs on a fresh machine (idempotent; fast when already set up).
#   bash scripts/setup.sh        runtime dependencies (demo, server, orchestrator, simulator)
#   bash scripts/setup.sh dev    plus test dependencies and headless Chromium for the browser tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "dev" ]; then
    "$PY" -m pip install -q -e ".[dev]"
    if ! command -v chromium >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || echo "warning: could not install chromium; browser tests will be skipped" >&2
    fi
else
    "$PY" -m pip install -q -e .
fi
