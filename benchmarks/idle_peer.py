"""What an idle peer's processes cost: one `collab join` that waits for a second peer that never comes (its DHT
node, averagers and p2pd all up, nothing to average), sampled per process over `--seconds`.

    python3 benchmarks/idle_peer.py [--config configs/albert-tiny.yaml] [--seconds 30]

Goal (issue 36): the helper processes (everything but the training process) under 5% of a core together.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.05  # of a core, the helpers together


def role(process: psutil.Process, root_pid: int) -> str:
    if process.pid == root_pid:
        return "training process"
    command = " ".join(process.cmdline())
    if "p2pd" in process.name():
        return "p2pd"
    if "collab.process.reaper" in command:
        return "reaper"
    return f"helper ({process.num_threads()} threads)"  # hivemind's DHT and averager processes: forks of the peer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "albert-tiny.yaml"))
    parser.add_argument("--seconds", type=float, default=30.0, help="at most 120 (the peer waits 180 s in all)")
    parser.add_argument("--start-up", type=float, default=40.0, help="seconds to wait before sampling")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, open(Path(workdir) / "peer.log", "w+") as log:
        peer = subprocess.Popen([sys.executable, "-m", "collab", "join", "--run-id", "idle-peer", "--config",
                                 args.config, "--wait-peers", "2", "--no-live"],
                                stdout=subprocess.DEVNULL, stderr=log, cwd=workdir,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
        try:
            time.sleep(args.start_up)
            if peer.poll() is not None:  # (--wait-peers waits 180 s: start-up + seconds must stay under that)
                log.seek(0)
                raise SystemExit(f"the peer exited ({peer.returncode}) before it was sampled:\n{log.read()[-2000:]}")
            root = psutil.Process(peer.pid)
            processes = [root, *root.children(recursive=True)]
            before = {p.pid: sum(p.cpu_times()[:2]) for p in processes}
            time.sleep(args.seconds)
            rows = []
            for p in processes:
                try:
                    rows.append((role(p, peer.pid), p.pid, (sum(p.cpu_times()[:2]) - before[p.pid]) / args.seconds))
                except psutil.Error:
                    rows.append(("(exited)", p.pid, 0.0))
        finally:
            os.killpg(peer.pid, signal.SIGTERM)
            try:
                peer.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(peer.pid, signal.SIGKILL)
                peer.wait(10)
    print(f"one idle peer ({Path(args.config).name}), {args.seconds:.0f} s, {psutil.cpu_count()} cores")
    print("process | pid | % of a core")
    for name, pid, cpu in rows:
        print(f"{name} | {pid} | {100 * cpu:.1f}")
    helpers = sum(cpu for name, _, cpu in rows if name != "training process")
    print(f"helpers together: {100 * helpers:.1f}% of a core (goal < {100 * GOAL:.0f}%: "
          f"{'met' if helpers < GOAL else 'MISSED'})")


if __name__ == "__main__":
    main()
