"""docs/dashboard.png: `inferd serve` under a mixed load for a while, its /dashboard in headless Chromium, a screenshot.

    .venv/bin/python bench/dashboard_screenshot.py --seconds 90 --out docs/dashboard.png [--model PATH]

Three tenants (interactive, standard with a tight token quota, batch) stream completions from more clients than the
worker's batch and the line hold, so the page shows queues, 429s and 503s. Not a test: the browser test is
tests/api/test_dashboard.py.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to serve (default: inferd's default model)")
    ap.add_argument("--seconds", type=float, default=90.0, help="load before the screenshot")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from inferd.gateway.tenants import create_key

    folder = Path(tempfile.mkdtemp(prefix="inferd-dash-"))
    keys_path = folder / "keys.json"
    tenants = {"web-app": {"tier": "interactive", "tpm": 200000, "max_concurrency": 6},
               "analytics": {"tier": "standard", "tpm": 1500},
               "nightly-batch": {"tier": "batch"}}
    keys = {name: create_key(str(keys_path), name, **limits)[0] for name, limits in tenants.items()}
    command = [sys.executable, "-m", "inferd", "serve", "--port", "0", "--keys", str(keys_path),
               "--max-num-seqs", "4", "--worker-queue-depth", "0", "--max-queue-requests", "3",
               "--tenant-queue-share", "1", "--heartbeat-interval", "0.2"]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    url = None
    for line in server.stdout:
        match = re.match(r"READY (http://\S+)", line)
        if match:
            url = match[1]
            break
    if url is None:
        print("the server did not start", file=sys.stderr)
        return 1
    threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
    stop = threading.Event()

    def client(tenant: str, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"prompt": f"Write a short note number {n} for {tenant} about request {i}.",
                        "max_tokens": 96 if tenant != "analytics" else 200, "stream": True}
                with http.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {keys[tenant]}"}) as r:
                    for _ in r.iter_lines():
                        pass
                if r.status_code != 200:
                    stop.wait(0.5)

    names = ["web-app", "analytics", "nightly-batch"]
    threads = [threading.Thread(target=client, args=(names[i % 3], i), daemon=True) for i in range(args.clients)]
    try:
        for t in threads:
            t.start()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(url + "/dashboard")
            time.sleep(args.seconds)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(f"wrote {args.out}")
    finally:
        stop.set()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
