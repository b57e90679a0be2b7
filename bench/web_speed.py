"""Speed of ``vramplan web``: time from page load (navigation start) to the frame that shows
the first analytic answer (target ≤ 200 ms), median of several fresh page loads in headless
Chromium; and how long the trace then takes to stream in. Prints each figure and its ratio
to the target, and the CLI's end-to-end analytic estimate as a reference.

    .venv/bin/python bench/web_speed.py [--runs 7] [--screenshot docs/web.png]

Needs the web extra and playwright (pip install 'vramplan[web]' playwright) and a Chromium
(apt-get install chromium; CHROMIUM=/path overrides /usr/bin/chromium). The server runs with
one worker process and is measured warm (its worker has imported torch), as a user meets it
a few seconds after `vramplan web`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TARGET_MS = 200.0
QUERY = "model=llama-3.2-1b&task=train&batch=4&seq=1024&checkpointing=full&gpu=rtx-4090"
CLI_ARGS = ["llama-3.2-1b", "--task", "train", "--batch", "4", "--seq", "1024", "--checkpointing", "full",
            "--gpu", "rtx-4090", "--method", "analytic", "--json"]
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_server() -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vramplan.cli.main", "web", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 180:
        try:
            with urllib.request.urlopen(f"{base}/api/status", timeout=2) as r:  # noqa: S310 - local
                if json.loads(r.read())["warmed"] >= 1:
                    print(f"server up and warm after {time.perf_counter() - t0:.1f} s")
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("vramplan web did not start")


def cli_seconds(runs: int = 3) -> float:
    exe = shutil.which("vramplan", path=str(Path(sys.executable).parent)) or "vramplan"
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([exe, "estimate", *CLI_ARGS], check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--screenshot", metavar="PNG", help="also save the main view once the trace is in")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    proc, base = start_server()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROME_ARGS)
            firsts, traces = [], []
            for i in range(args.runs + 1):  # the first load warms the browser's own caches: not counted
                ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = ctx.new_page()
                page.goto(f"{base}/?{QUERY}&batch={4 + i}")  # a new workload each time: nothing cached
                page.wait_for_function("window.__vramplan.firstAnalyticMs !== null", timeout=30_000)
                # the frame that shows the answer, from navigation start (time origin)
                first = page.evaluate("window.__vramplan.firstAnalyticMs")
                t = time.perf_counter()
                page.wait_for_function("window.__vramplan.traces > 0", timeout=300_000)
                trace_s = time.perf_counter() - t + first / 1e3
                if i:
                    firsts.append(first)
                    traces.append(trace_s)
                if args.screenshot and i == args.runs:
                    page.goto(f"{base}/?{QUERY}")
                    page.wait_for_function("window.__vramplan.traces > 0", timeout=300_000)
                    page.wait_for_function("document.getElementById('timeline').dataset.kind === 'timeline'")
                    page.wait_for_timeout(300)
                    page.screenshot(path=args.screenshot)
                    print(f"screenshot written to {args.screenshot}")
                ctx.close()
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = statistics.median(firsts)
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} CPUs, load average {load:.1f} (1 min) during the run")
    print(f"first analytic answer on the page: median {med:.0f} ms of {len(firsts)} loads "
          f"(min {min(firsts):.0f}, max {max(firsts):.0f}); target ≤ {TARGET_MS:.0f} ms → {med / TARGET_MS:.2f}× the target")
    print(f"trace streamed in after: median {statistics.median(traces):.1f} s (page stayed responsive: analytic first)")
    ref = cli_seconds()
    print(f"reference: `vramplan estimate … --method analytic` end to end {ref * 1e3:.0f} ms → page is "
          f"{ref * 1e3 / med:.1f}× faster to its first answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
