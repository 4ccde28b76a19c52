"""Screenshots of the MLflow UI for the README: the runs table and one run's validation curve.

    python scripts/screenshots.py                              # trains a small demo sweep first (CPU, minutes)
    python scripts/screenshots.py --store sqlite:///mlruns.db  # or shows an existing store

Starts `mlflow ui` on the store, opens the pages in headless Chromium (`apt-get install -y chromium`;
`--chromium` for another binary) over the DevTools protocol, and writes docs/screenshots/runs_table.png and validation_curve.png.
The run whose curve is shown is the finished one with the best final val/p_at_3.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A sweep small enough for a CPU in minutes, with curves that rise over several epochs.
DEMO = ["model=uniform,dense", "model.intermediate=null,64", "dataset.num_train=3000", "dataset.num_test=1000",
        "dataset.max_epochs=6", "trainer.progress_bar=false"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]
SIZE = (1600, 900)


def train_demo(folder: Path) -> str:
    uri = f"sqlite:///{folder / 'mlruns.db'}"
    print(f"training the demo sweep into {uri} ...", flush=True)
    subprocess.run([sys.executable, "-m", "xmc_repro", "-m", *DEMO, f"logger.tracking_uri={uri}"], cwd=folder,
                   check=True, stdout=subprocess.DEVNULL)
    return uri


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ui(uri: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,  # its workers in one group
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            time.sleep(1)
    stop(server)
    raise SystemExit(f"error: mlflow ui did not answer on port {port} within 120 s")


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)  # the group started above: the server and its workers, nothing else
    server.wait(timeout=30)


def pick_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise SystemExit(f"error: no experiment {experiment!r} in {uri}; run python -m xmc_repro first")
    runs = client.search_runs([found.experiment_id], "attributes.status = 'FINISHED'",
                              order_by=["metrics.`val/p_at_3` DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished run in {uri}; run python -m xmc_repro first")
    return found.experiment_id, runs[0]


def curve_url(base: str, experiment_id: str, run_id: str) -> str:
    """MLflow's metric page: val P@1/3/5 of one run over training steps."""
    keys = ["val/p_at_1", "val/p_at_3", "val/p_at_5"]
    query = {
        "runs": json.dumps([run_id]), "metric": json.dumps("val/p_at_3"), "experiments": json.dumps([experiment_id]),
        "plot_metric_keys": json.dumps(keys), "plot_layout": "{}", "x_axis": "step", "y_axis_scale": "linear",
        "line_smoothness": "1", "show_point": "true", "deselected_curves": "[]", "last_linear_y_axis_range": "[]",
    }
    return f"{base}/#/metric?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


# Before any page script runs: MLflow 3 opens its assistant panel over a third of the page on a first visit.
NO_ASSISTANT = "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"


class Browser:
    """Headless Chromium driven over the DevTools protocol (aiohttp, which MLflow requires, speaks WebSocket)."""

    def __init__(self, chromium: str, profile: str):
        self.process = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             f"--window-size={SIZE[0]},{SIZE[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise SystemExit(f"error: {chromium} did not start its DevTools endpoint")
            time.sleep(0.2)
        self.port = int(port_file.read_text().split()[0])
        self.next_id = 0

    async def connect(self, session):
        async with session.get(f"http://127.0.0.1:{self.port}/json/list") as response:
            page = next(t for t in await response.json() if t["type"] == "page")
        self.ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.call("Page.enable")
        await self.call("Page.addScriptToEvaluateOnNewDocument", source=NO_ASSISTANT)
        await self.call("Emulation.setDeviceMetricsOverride", width=SIZE[0], height=SIZE[1], deviceScaleFactor=1,
                        mobile=False)

    async def call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        async for message in self.ws:
            reply = message.json()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise RuntimeError(f"{method}: the browser closed the connection")

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def open(self, url: str, ready_text: str, timeout: float = 90):
        """Load `url` and wait until the page shows `ready_text` (the app renders after its API calls)."""
        await self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not await self.evaluate(f"document.body && document.body.innerText.includes({json.dumps(ready_text)})"):
            if time.monotonic() > deadline:
                raise SystemExit(f"error: {url} did not show {ready_text!r} within {timeout:.0f} s")
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)  # charts and icons settle

    async def screenshot(self, out: Path, url: str):
        data = await self.call("Page.captureScreenshot", format="png")
        out.write_bytes(base64.b64decode(data["data"]))
        print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}  ({url})")

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=30)


async def shoot_all(chromium: str, base: str, experiment_id: str, run_id: str, out: Path):
    import aiohttp

    with tempfile.TemporaryDirectory() as profile:  # a fresh profile every time
        browser = Browser(chromium, profile)
        try:
            async with aiohttp.ClientSession() as session:
                await browser.connect(session)
                table = f"{base}/#/experiments/{experiment_id}/runs"
                await browser.open(table, "matching runs")
                await browser.screenshot(out / "runs_table.png", table)
                curve = curve_url(base, experiment_id, run_id)
                await browser.open(curve, "(step=")
                await browser.screenshot(out / "validation_curve.png", curve)
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="an MLflow tracking URI (default: train a demo sweep into a fresh store)")
    parser.add_argument("--experiment", default="xmc_repro")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    if not Path(args.chromium).is_file():
        raise SystemExit(f"error: no Chromium at {args.chromium}; apt-get install -y chromium, or pass --chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        uri = args.store or train_demo(Path(scratch))
        experiment_id, run = pick_run(uri, args.experiment)
        port = free_port()
        server = start_ui(uri, port)
        try:
            asyncio.run(shoot_all(args.chromium, f"http://127.0.0.1:{port}", experiment_id, run.info.run_id, args.out))
        finally:
            stop(server)
    print(f"validation curve of run {run.info.run_name} ({run.info.run_id})")


if __name__ == "__main__":
    main()
