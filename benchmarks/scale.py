"""How the protocol holds as a swarm grows: N real peers of a task too cheap for compute to be the bound.

For each N, `collab simulate` runs N `collab join` peers of the linreg task (a 100k-parameter linear model,
micro-batch 16, target 64 per peer by default, so an epoch's work per peer stays the same as N grows) on 127.0.0.1,
while this script samples the CPU time and memory (PSS) of every process of the swarm (p2pd, the DHT and averager
processes included). One peer alone first: "linear" is N times its rate. A rate is each peer's samples over its own
training loop (start-up, the wait for the others and the leave not counted), summed over the peers. Per N it prints
the swarm's samples/s against linear, epochs per minute, rounds ok and failed, the mean group size, the spread of
the peers' final epochs, CPU cores per peer (and of them its training process, its DHT process, its p2pd and its
other helpers: the averagers' processes, the reaper) and resident memory per peer, the share of the records each DHT
node read that it answered from memory (collab.records.verdicts), and how many peers overran the leave's grace when
the swarm was stopped (forced exits).

    python3 benchmarks/scale.py [--peers 4,8,16] [--duration 120] [--dim 100000] [--rtt-ms 0,20,100] [--reports DIR]
        [--target-per-peer 64] [--overlap none] [--profile SECONDS]

On a 2-core machine the peers share the cores, so from a few peers on the CPU is the bound: that is said in the
table (cores per peer x N against the machine's cores). Where a 16-core machine is at hand, run it to 64.

Per round, from the peers' summaries: seconds finding the group (matchmaking) and in the all-reduce; per peer and
minute, the requests its DHT node sent and their bytes (collab.swarm.dht_traffic; each summary's `dht.by_key` says
which keys they were for, and after the table each swarm's requests per peer and epoch by key), of them the progress
key's reads, and the share of its reads a peer's readers took from a read under way or just made
(collab.records.shared_reads); of the reads it made, the share that asked the key's two nearest nodes instead of
walking, the records such a read found, and the live records the last walk had found that it missed (none when the
nearest hold every record). Why the failed rounds failed (collab.modes.round_failures.round_failure), and the
replicas' spread: the furthest replica from the replicas' mean at the start of an epoch, relative to their norm, the
worst epoch of the run (estimated from each peer's per-epoch sketches; collab.peers.report). `--rtt-ms 0,20,100`
adds rows with that round trip between any two peers (network namespaces, as root; peers/delayer.py where the kernel
has no netem).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
LONE_SECONDS = 120.0  # the most the one peer alone runs


def linreg_config(folder: Path, peers: int, args, overlap: str) -> Path:
    path = folder / f"linreg-{peers}-{overlap}.yaml"
    path.write_text(yaml.safe_dump({
        "task": {"name": "linreg", "dim": args.dim},
        "training": {"micro_batch_size": 16, "target_batch_size": args.target_per_peer * peers,
                     "learning_rate": 1e-4, "warmup_steps": 0, "device": "cpu", "compile": "off"},
        "averaging": {"matchmaking_time": 3.0, "averaging_timeout": 30.0, "overlap": overlap,
                      "next_chunk_timeout": args.next_chunk_timeout},
    }))
    return path


class TreeSampler:
    """CPU seconds and memory (PSS: shared pages, torch's libraries among them, counted once across the processes
    that share them) of a process and all its descendants, sampled every `every` seconds. CPU seconds also by role
    (ROLES): a peer is a child of the fork server; its p2pd, the DHT process that started that p2pd, and its other
    helpers (the two averagers' processes, the reaper) are below it."""

    def __init__(self, pid: int, every: float = 5.0):
        self.root, self.every = psutil.Process(pid), every
        self.cpu: dict[int, float] = {}  # pid -> its last CPU seconds (a process that exits keeps its last)
        self.roles: dict[int, str] = {}  # pid -> its role, as last seen
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            rss = 0
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                continue
            self.roles.update(_roles(processes))
            for p in processes:
                try:
                    times = p.cpu_times()
                    # its own time only: a parent's reaped children (the fork server's peers) were sampled themselves
                    self.cpu[p.pid] = times.user + times.system
                    rss += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> tuple[float, int, dict[str, float]]:
        """CPU seconds, the peak PSS, and CPU seconds by role."""
        self._stop.set()
        self._thread.join()
        by_role = dict.fromkeys(ROLES, 0.0)
        for pid, seconds in self.cpu.items():
            by_role[self.roles.get(pid, "harness")] += seconds
        return sum(self.cpu.values()), self.peak_rss, by_role


ROLES = ("trainer", "dht", "p2pd", "helpers", "harness")  # harness: simulate and its fork server


def _roles(processes: list) -> dict[int, str]:
    parent, name = {}, {}
    for p in processes:
        try:
            parent[p.pid], name[p.pid] = p.ppid(), p.name()
        except psutil.Error:
            pass
    starts_p2pd = {parent[pid] for pid in parent if name[pid] == "p2pd"}  # the DHT processes
    forkers = {pid for pid in parent if "forkserver" in _cmdline(pid)}
    server = {pid for pid in forkers if parent[pid] not in forkers}
    roles = {}
    for pid in parent:
        chain, up = [], pid
        while up in parent and up not in server:
            chain.append(up)
            up = parent[up]
        if up not in server or not chain:
            roles[pid] = "harness"
        elif len(chain) == 1:
            roles[pid] = "trainer"
        elif name[pid] == "p2pd":
            roles[pid] = "p2pd"
        elif pid in starts_p2pd:
            roles[pid] = "dht"
        else:
            roles[pid] = "helpers"
    return roles


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def profile_one_peer(simulate_pid: int, args, path: Path) -> None:
    """py-spy on one peer of the swarm (its training process, DHT, averagers), `args.profile` seconds in the second
    half of its run, idle stacks and thread names included: collapsed stacks, one line per stack with its sample
    count (py-spy's raw format). Where a peer's time goes when it is not computing is what the table cannot say."""
    time.sleep(max(args.duration / 2, args.duration - args.profile - 5))
    try:  # simulate -> its fork server -> one fork per peer (the training process; its helpers below it)
        server = next(c for c in psutil.Process(simulate_pid).children() if "forkserver" in " ".join(c.cmdline()))
        peer = min(server.children(), key=lambda c: c.pid)
    except (StopIteration, ValueError, psutil.Error):
        print(f"(no peer to profile in {path.name})", file=sys.stderr)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["py-spy", "record", "--nonblocking", "--subprocesses", "--threads", "--idle", "-r", "50",
                           "-d", str(int(args.profile)), "-f", "raw", "-o", str(path), "-p", str(peer.pid)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"(py-spy on peer {peer.pid}: {done.stderr.strip()[-300:]})", file=sys.stderr)


def latency_profile(folder: Path, rtt_ms: float) -> list[str]:
    """simulate's flags for a round trip of `rtt_ms` between any two peers (each link delays what it sends by
    half; network namespaces, and peers/delayer.py where the kernel has no netem); none for 0 (127.0.0.1)."""
    if not rtt_ms:
        return []
    path = folder / f"rtt-{rtt_ms:g}.yaml"
    path.write_text(yaml.safe_dump({"default": {"delay_ms": rtt_ms / 2}}))
    return ["--profile", str(path)]


def run_swarm(peers: int, args, folder: Path, rtt_ms: float = 0.0, overlap: str = "none") -> dict:
    config = linreg_config(folder, peers, args, overlap)
    # one peer alone reaches its rate within seconds: a long --duration is for the big swarms' start-up and rounds
    duration = min(args.duration, LONE_SECONDS) if peers == 1 else args.duration
    workdir = folder / f"swarm-{peers}-{rtt_ms:g}-{overlap}"
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "collab", "simulate", "--peers", str(peers), "--config",
                                str(config), "--duration", str(duration), "--workdir", str(workdir), "--json",
                                *latency_profile(folder, rtt_ms)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    sampler = TreeSampler(process.pid)
    if args.profile and args.reports:
        name = f"profile-{peers}-rtt{rtt_ms:g}-{overlap}.txt"
        threading.Thread(target=profile_one_peer, args=(process.pid, args, args.reports / name), daemon=True).start()
    out, err = process.communicate(timeout=duration + 600)
    cpu, rss, by_role = sampler.stop()
    if process.returncode not in (0, 1):  # 1: the report's own verdict (e.g. loss did not fall), still a report
        raise SystemExit(f"collab simulate --peers {peers} failed ({process.returncode}):\n{err[-3000:]}")
    if "{" not in out:
        raise SystemExit(f"collab simulate --peers {peers} printed no report (rc {process.returncode}):\n{err[-3000:]}")
    report = json.loads(out[out.index("{"):])
    return {"report": report, "cpu": cpu, "rss": rss, "by_role": by_role, "wall": time.monotonic() - started,
            "workdir": workdir, "dht_keys": dht_requests_by_key(workdir)}


def row(peers: int, result: dict, single_rate: float, rtt_ms: float = 0.0, overlap: str = "none") -> dict:
    report = result["report"]
    per_peer = report["peers"]
    seconds = report["duration_seconds"]
    # each peer's samples over its own training loop, summed: start-up, the wait for the others and the leave are
    # not training (a swarm of 64 takes longer to start than one peer, and the same wall time would count it)
    timed = [p for p in per_peer if p.get("train_seconds")]
    rate = (sum(p["samples_contributed"] / p["train_seconds"] for p in timed) if timed
            else sum(p["samples_contributed"] for p in per_peer) / seconds)
    ok, failed = sum(p["rounds_joined"] for p in per_peer), sum(p["rounds_failed"] for p in per_peer)
    sizes = [p["mean_group_size"] for p in per_peer if p["mean_group_size"]]
    epochs = [p["final_epoch"] for p in per_peer]
    reasons: dict[str, int] = {}
    for p in per_peer:
        for reason, n in p.get("rounds_failed_by_reason", {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
    replayed = sum(p.get("rounds_replayed", 0) for p in per_peer)  # missed rounds applied from a peer that made them
    spreads = report.get("spread_by_epoch") or {}
    return {
        "peers": peers, "rtt_ms": rtt_ms, "overlap": overlap, "samples_per_s": rate,
        "vs_linear": rate / (peers * single_rate) if single_rate else None,
        "epochs_per_min": report["epochs_per_minute"], "rounds_ok": ok, "rounds_failed": failed,
        "ok_share": ok / (ok + failed) if ok + failed else None,
        "mean_group": sum(sizes) / len(sizes) if sizes else None, "epochs": _epochs(epochs),
        "cores_per_peer": result["cpu"] / result["wall"] / peers, "rss_mb_per_peer": result["rss"] / peers / 2**20,
        "role_cores": {role: seconds / result["wall"] / peers for role, seconds in result["by_role"].items()},
        "matchmaking_s": _mean(p["matchmaking_seconds"] for p in per_peer),
        "allreduce_s": _mean(p["allreduce_seconds"] for p in per_peer),
        "dht_requests": _mean(p["dht_requests_per_minute"] for p in per_peer),
        "dht_kb": _mean(p["dht_kb_per_minute"] for p in per_peer),
        "progress_kb": _mean(p.get("progress_read_kb_per_minute") for p in per_peer),
        "progress_shared": _mean(p.get("progress_reads_shared") for p in per_peer),
        "from_nearest": _mean(p.get("progress_reads_from_nearest") for p in per_peer),
        "records_nearest": _mean(p.get("records_per_nearest_read") for p in per_peer),
        "records_missed": _mean(p.get("records_missed_per_nearest_read") for p in per_peer),
        "found_nothing": _mean(p.get("progress_reads_found_nothing") for p in per_peer),
        "failed_why": ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:2])
        + (f" ({replayed} replayed)" if replayed else ""),
        "spread": max(spreads.values()) if spreads else None,
        "remembered": _mean(p.get("records_remembered") for p in per_peer),
        "forced_exits": sum("forced exit" in (p.get("exit") or "") for p in per_peer),  # overran the leave's grace
        "state_rounds": _state_rounds(per_peer),
    }


def _state_rounds(per_peer: list[dict]) -> str:
    """The peers' state rounds: ok / given up (cancelled: no group in time, sat out, or left) / failed, and the ok
    rounds' mean group."""
    counts = sum((Counter(p.get("state_rounds") or {}) for p in per_peer), Counter())
    ok = counts.get("ok", 0)
    text = f"{ok} / {counts.get('given_up', 0)} / {counts.get('failed', 0)}"
    return text + (f" ({counts.get('peers', 0) / ok:.1f})" if ok else "")


def _epochs(epochs: list[int]) -> str:
    """The peers' final epochs, and how many ended within one of the furthest (the goal: all of them)."""
    text = f"{min(epochs)}-{max(epochs)}"
    if max(epochs) - min(epochs) > 1:
        text += f" ({sum(e >= max(epochs) - 1 for e in epochs)} of {len(epochs)} within 1)"
    return text


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="4,8,16", help="comma-separated swarm sizes")
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds each swarm runs, its start-up included (64 peers on 2 cores take ~3.5 min to "
                        "start); the one peer alone runs at most 120 s")
    parser.add_argument("--dim", type=int, default=100_000, help="linreg's parameters")
    parser.add_argument("--target-per-peer", type=int, default=64, help="the target batch is this x N: 64 makes an "
                        "epoch's compute a few hundredths of a second (the protocol is the bound); thousands make "
                        "compute the bound, where 'vs linear' says what the rounds cost")
    parser.add_argument("--overlap", default="none", help="comma-separated averaging.overlap values (none, "
                        "optimizer, full: full computes the next micro-batches while the gradient round runs)")
    parser.add_argument("--rtt-ms", default="0", help="comma-separated round trips between peers, e.g. 0,20,100 "
                        "(above 0: each peer in a network namespace, as root)")
    parser.add_argument("--reports", type=Path, default=None,
                        help="a folder to keep each swarm's full `collab simulate --json` report and its peers' "
                        "logs (logs-N-rttMS-OVERLAP.tar.gz) in")
    parser.add_argument("--next-chunk-timeout", type=float, default=10.0,
                        help="averaging.next_chunk_timeout: a reducer leaves out a sender whose next part takes "
                        "longer (low values, e.g. 1.5, make the left-out senders of a starved machine common)")
    parser.add_argument("--profile", type=float, default=0.0, help="seconds of py-spy (installed separately) on "
                        "one peer of each swarm, late in its run, kept in --reports")
    args = parser.parse_args()
    sizes = [int(n) for n in args.peers.split(",")]
    rtts = [float(ms) for ms in args.rtt_ms.split(",")]
    overlaps = args.overlap.split(",")
    if not set(overlaps) <= {"none", "optimizer", "full"}:
        parser.error(f"--overlap {args.overlap}: each value must be none, optimizer or full")
    cores = psutil.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        single = row(1, _measured(1, args, folder, 0.0, overlaps[0]), 0.0)
        print(f"linreg dim {args.dim}, micro-batch 16, target {args.target_per_peer} x N, "
              f"{args.duration:.0f} s per swarm, 127.0.0.1 (RTT 0) "
              f"or namespaces, {cores} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; one peer alone: "
              f"{single['samples_per_s']:.0f} samples/s")
        print(" | ".join(HEADER), flush=True)
        keys = []
        for rtt in rtts:
            for overlap in overlaps:
                for n in sizes:  # each row as soon as it is measured: a long run cut short keeps what it measured
                    result = _measured(n, args, folder, rtt, overlap)
                    print(_line(row(n, result, single["samples_per_s"], rtt, overlap), cores), flush=True)
                    keys.append(f"{n} peers, RTT {rtt:g} ms, {overlap}: " + ", ".join(
                        f"{key} {total:.1f} ({walks:.1f} walking)" for key, (total, walks) in
                        sorted(result["dht_keys"].items(), key=lambda kv: -kv[1][0])[:KEYS_SHOWN]))
    print("goals (issue 36): >= 95% of rounds ok, every peer within one epoch, replica spread <= 1e-3, >= 0.9 of "
          "linear where the CPU is not shared")
    print("DHT requests per peer and epoch, by key (of them, the walks that found the key's nodes):")
    print("\n".join(keys))


KEYS_SHOWN = 6


def dht_requests_by_key(workdir: Path) -> dict[str, tuple[float, float]]:
    """From the peers' summaries (`dht.by_key`, collab.swarm.dht_traffic): each key's requests per peer and epoch,
    and of them the walks for its nodes; the run id is left out of the key's name."""
    requests: dict[str, list[float]] = {}
    epochs = 0
    for path in workdir.glob("*.summary.json"):
        try:
            summary = json.loads(path.read_text())
            by_key = summary["dht"]["by_key"]
            epochs += max(0, int(summary["final_epoch"]) - int(summary["start_epoch"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for name, counts in by_key.items():
            walk = name.endswith(WALKS)
            key = name.removesuffix(WALKS).split("_", 1)[-1]
            totals = requests.setdefault(key, [0.0, 0.0])
            totals[0] += counts.get("requests", 0)
            totals[1] += counts.get("requests", 0) if walk else 0
    return {key: (total / epochs, walks / epochs) for key, (total, walks) in requests.items()} if epochs else {}


WALKS = " (walks for its nodes)"  # collab.swarm.dht_traffic's suffix for the requests that found a key's nodes


HEADER = ("peers", "RTT ms", "overlap", "samples/s", "vs linear", "epochs/min", "rounds ok/failed", "ok %",
          "failed: why", "mean group", "epochs", "replica spread", "matchmaking s/round", "all-reduce s/round",
          "DHT requests/min/peer", "DHT KB/min/peer", "progress reads KB/min/peer",
          "progress reads shared %", "progress reads from nearest %", "records a nearest read: found / missed",
          "progress reads that found nothing/peer",
          "cores/peer", "of them trainer / DHT / p2pd / helpers", "CPU bound", "PSS MB/peer",
          "records from memory %", "forced exits", "state rounds ok / given up / failed (mean group)")


def _measured(peers: int, args, folder: Path, rtt_ms: float, overlap: str) -> dict:
    result = run_swarm(peers, args, folder, rtt_ms, overlap)
    if args.reports:
        args.reports.mkdir(parents=True, exist_ok=True)
        path = args.reports / f"swarm-{peers}-rtt{rtt_ms:g}-{overlap}.json"
        path.write_text(json.dumps(result["report"], indent=1))
        _keep_logs(result["workdir"], args.reports / f"logs-{peers}-rtt{rtt_ms:g}-{overlap}.tar.gz")
    return result


def _keep_logs(workdir: Path, archive: Path) -> None:
    """Every peer's log (and summaries) of one swarm, so that a slow or split run can be read afterwards: the report
    says what happened, the logs say why. Compressed: a 64-peer run's logs are tens of MB as text."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(workdir.glob("*")):
            if path.is_file() and path.suffix in (".log", ".json"):
                tar.add(path, arcname=f"{workdir.name}/{path.name}")


def _line(r: dict, cores: int) -> str:
    bound = "yes" if r["cores_per_peer"] * r["peers"] > 0.8 * cores else "no"
    return " | ".join([str(r["peers"]), f"{r['rtt_ms']:g}", r["overlap"], f"{r['samples_per_s']:.0f}",
                       f"{r['vs_linear']:.2f}", f"{r['epochs_per_min']:.1f}", f"{r['rounds_ok']}/{r['rounds_failed']}",
                       f"{100 * r['ok_share']:.0f}" if r["ok_share"] is not None else "-", r["failed_why"] or "-",
                       f"{r['mean_group']:.1f}" if r["mean_group"] else "-", r["epochs"],
                       "-" if r["spread"] is None else f"{r['spread']:.1e}",
                       _fmt(r["matchmaking_s"], 2), _fmt(r["allreduce_s"], 2), _fmt(r["dht_requests"], 0),
                       _fmt(r["dht_kb"], 0), _fmt(r["progress_kb"], 0),
                       _fmt(100 * r["progress_shared"] if r["progress_shared"] is not None else None, 0),
                       _fmt(100 * r["from_nearest"] if r["from_nearest"] is not None else None, 0),
                       f"{_fmt(r['records_nearest'], 1)} / {_fmt(r['records_missed'], 2)}",
                       _fmt(r["found_nothing"], 1),
                       f"{r['cores_per_peer']:.2f}",
                       " / ".join(f"{r['role_cores'][role]:.3f}" for role in ROLES[:4]), bound,
                       f"{r['rss_mb_per_peer']:.0f}",
                       _fmt(100 * r["remembered"] if r["remembered"] is not None else None, 0),
                       str(r["forced_exits"]), r["state_rounds"]])


if __name__ == "__main__":
    main()
