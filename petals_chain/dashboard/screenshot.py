"""Screenshots of the dashboard in headless Chromium (how docs/dashboard.png is made).

    python -m petals_chain.dashboard.screenshot --url http://127.0.0.1:8000 --out docs/dashboard.png
    python -m petals_chain.dashboard.screenshot --demo --out docs/dashboard.png --phone-out docs/dashboard-phone.png

``--demo`` runs ``python -m petals_chain.demo --keep-running``, sends bursts of requests so chains are busy,
and captures the orchestrator's page mid-burst. Needs the ``dev`` extra (Playwright) and Debian's
``chromium`` (``bash scripts/setup.sh dev``); it never downloads a browser.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def capture(url: str, out: Path, phone_out: Optional[Path] = None, during: Optional[callable] = None,
            settle_s: float = 1.3) -> list[str]:
    """Open ``url`` (refresh 1 s) at desktop (and phone) width and save full-page PNGs; returns console errors.

    ``during()``, if given, is started in a thread before the capture (e.g. a request burst) and joined after.
    """
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("Debian chromium is not installed (bash scripts/setup.sh dev)")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            pages = []
            for viewport, path in ((DESKTOP, out), (PHONE, phone_out)):
                if path is None:
                    continue
                page = browser.new_context(viewport=viewport).new_page()
                # a 503 is a standalone dashboard that has not read the swarm yet (the page waits for it), no error
                page.on("console", lambda m: errors.append(m.text)
                        if m.type == "error" and "status of 503" not in m.text else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url.rstrip("/") + "/?refresh=1")
                page.wait_for_selector("#servers-table tbody tr", timeout=30_000)
                pages.append((page, path))
            worker = threading.Thread(target=during, daemon=True) if during is not None else None
            if worker is not None:
                worker.start()
                _wait_busy(url, timeout_s=30)
            time.sleep(settle_s)  # one page refresh (1 s) after the swarm got busy
            for page, path in pages:
                path.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(path), full_page=True)
            if worker is not None:
                worker.join()
        finally:
            browser.close()
    return errors


def _wait_busy(url: str, timeout_s: float) -> None:
    """Wait until the swarm reports jobs running or queued (the burst has reached the dispatcher)."""
    import httpx

    deadline = time.monotonic() + timeout_s  # a wait, not a date: an NTP step must not end it or stretch it
    while time.monotonic() < deadline:
        try:
            view = httpx.get(f"{url.rstrip('/')}/api/v1/swarm", timeout=10).json()
            running = sum(int(ch.get("active") or 0) for ch in view.get("chains", []))
            if running or view.get("queue_length"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)


def _burst(url: str, n: int, max_tokens: int) -> None:
    import httpx

    model = httpx.get(f"{url}/api/v1/swarm", timeout=10).json()["model"]

    def one(i: int) -> None:
        try:
            httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": f"request {i} to the swarm",
                                                      "max_tokens": max_tokens, "temperature": 0.8}, timeout=300)
        except Exception as e:  # noqa: BLE001 - a failed request shows up on the dashboard, that is fine
            print(f"request {i} failed: {e}", file=sys.stderr)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_demo_and_capture(out: Path, phone_out: Optional[Path], burst: int = 24, timeout_s: float = 480) -> list[str]:
    """Start the demo swarm, warm it with one burst, capture during a second burst, stop the demo."""
    work = tempfile.mkdtemp(prefix="petals-chain-shot-")
    log_path = Path(work) / "demo.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "petals_chain.demo", "--keep-running", "--work-dir", work],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            url = None
            deadline = time.monotonic() + timeout_s
            while url is None:
                match = re.search(r"Dashboard: (http://\S+?)/\s", log_path.read_text(errors="replace"))
                if match:
                    url = match.group(1)
                elif proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the demo did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
                else:
                    time.sleep(1)
            print(f"demo swarm at {url}", flush=True)
            _burst(url, burst, 40)
            return capture(url, out, phone_out, during=lambda: _burst(url, burst, 40))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGINT)  # the demo stops its swarm cleanly on Ctrl+C
                proc.wait(timeout=90)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
            shutil.rmtree(work, ignore_errors=True)


def _png_path(text: str) -> Path:
    """A screenshot's path, checked before the browser (and with --demo the swarm) starts: a directory or an
    unwritable one failed only at the capture."""
    from petals_chain.swarm.paths import output_file_arg_making_dirs

    return Path(output_file_arg_making_dirs(text))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m petals_chain.dashboard.screenshot", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running orchestrator or standalone dashboard")
    src.add_argument("--demo", action="store_true", help="run the demo swarm and capture it under load")
    p.add_argument("--out", type=_png_path, required=True, help="desktop screenshot (PNG)")
    p.add_argument("--phone-out", type=_png_path, default=None, help="phone-width screenshot (PNG)")
    args = p.parse_args(argv)
    errors = (run_demo_and_capture(args.out, args.phone_out) if args.demo
              else capture(args.url, args.out, args.phone_out))
    print(f"saved {args.out}" + (f" and {args.phone_out}" if args.phone_out else ""))
    if errors:
        print("console errors:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
