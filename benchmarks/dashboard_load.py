"""Load on a live dashboard: 200 concurrent clients on /api/run for 30 s.

A real peer trains (albert-tiny, one thread) and `collab dashboard` serves its run from a separate
process. The load comes from wrk (Debian package `wrk`) when it is installed, else from this process
(httpx, asyncio; on 2 cores that client is itself the bottleneck). Routes read the collector's cached
snapshot, so the swarm sees one DHT read per interval however many browsers watch.

    python3 benchmarks/dashboard_load.py [--clients 200] [--seconds 30]

Goal: p99 < 100 ms and 0 errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def load(url: str, clients: int, seconds: float) -> tuple[list[float], int]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=10) as client:
        async def one_client():
            nonlocal errors
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    response = await client.get(url)
                    if response.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies, errors


def load_wrk(url: str, clients: int, seconds: float) -> tuple[float, float, float, int]:
    """requests/s, p50 ms, p99 ms, errors, from `wrk --latency`."""
    out = subprocess.run(["wrk", "-t1", f"-c{clients}", f"-d{int(seconds)}s", "--latency", url],
                         capture_output=True, text=True, check=True).stdout

    def ms(label: str) -> float:
        value = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        number, unit = float(value.group(1)), value.group(2)
        return number / 1000 if unit == "us" else number * 1000 if unit == "s" else number

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, ms("50%"), ms("99%"), errors + (int(non2xx.group(1)) if non2xx else 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    from collab.peers.launcher import LocalSwarm

    env = dict(os.environ, OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="ERROR")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            LocalSwarm(1, f"load-{os.getpid()}", Path(tmp), ["--max-epochs", "100000"], env=env) as swarm:
        swarm.start()
        dashboard = subprocess.Popen([sys.executable, "-m", "collab", "dashboard", "--run-id", swarm.run_id,
                                      "--initial-peers", swarm.initial_peer, "--port", str(port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/api/run"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            else:
                raise SystemExit("the dashboard served no snapshot within 120 s")
            if shutil.which("wrk"):
                client = "wrk"
                rps, p50, p99, errors = load_wrk(url, args.clients, args.seconds)
            else:
                client = "httpx"
                latencies, errors = asyncio.run(load(url, args.clients, args.seconds))
                latencies.sort()
                rps = len(latencies) / args.seconds
                p50, p99 = latencies[len(latencies) // 2] * 1000, latencies[int(len(latencies) * 0.99)] * 1000
        finally:
            dashboard.terminate()
            try:
                dashboard.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(dashboard.pid, 9)
    print(f"{args.clients} clients x {args.seconds:.0f} s on /api/run of a live run (1 peer training beside it), "
          f"load from {client}")
    print(f"{'requests/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'p99 / goal':>11}")
    print(f"{rps:>12.0f} {p50:>8.1f} {p99:>8.1f} {errors:>7} {p99 / 100:>11.2f}")
    print(f"goal p99 < 100 ms and 0 errors: {'met' if p99 < 100 and errors == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
