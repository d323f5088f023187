"""Measure averaging rounds among k processes on shaped links: hivemind's all-reduce or gloo's.

Used by benchmarks/allreduce.py and the asymmetric-link test. Each process runs
benchmarks.lab.averaging_probe in its own namespace of a NetworkLab; the values and the interface byte
counters come back per round, so a test can check what was averaged and who carried the traffic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from collab.peers.netns import NetworkLab
from collab.peers.profiles import LinkSpec
from collab.process.reaper import remove_unbound_sockets

ROOT = Path(__file__).resolve().parents[2]  # benchmarks.lab.averaging_probe runs from here

GLOO_PORT = 29500


@dataclass
class RoundOutcome:
    seconds: float  # first trigger to last finish, over all processes
    group_sizes: list[int]
    max_error: float  # worst |value - exact mean| over all processes
    bytes_sent: list[int]  # per process, on its interface, during the round
    bytes_received: list[int]
    errors: list[str]  # per process: how its round failed ("" when it did not)


class ProbeFailed(RuntimeError):
    pass


def _stall_timeout(links: list[LinkSpec], size: int, wire: str) -> float:
    """How long a part may take before hivemind gives its sender up: four times the whole vector's time on the
    slowest uplink, plus slack for 2 busy cores. A round broken by a lost part then costs that, not minutes
    (a CI run spent 3 of its 15 minutes in one such round at hivemind's 100-120 s)."""
    megabits = size * (2 if wire == "fp16" else 4) * 8 / 1e6
    slowest = min((link.upload_mbit for link in links if link.upload_mbit), default=1000.0)
    return 20.0 + 4 * megabits / slowest


def measure_rounds(links: list[LinkSpec], backend: str, size: int, workdir: Path, rounds: int = 2,
                   wire: str = "fp32", announce_bandwidth: bool = True, timeout: float = 600,
                   part_size: Optional[int] = None, private: bool = False,
                   aggregation: Optional[str] = None) -> list[RoundOutcome]:
    """`rounds` all-reduces of a `size`-element vector among len(links) processes, one per shaped link; fewer if a
    process is still running after `timeout` s (the rounds that every process finished).
    `private`: hivemind's processes are members of a private run (DHT authorizer, members-only averager)."""
    workdir.mkdir(parents=True, exist_ok=True)
    organizer_key = None
    if private:
        from hivemind.utils.crypto import RSAPrivateKey

        organizer_key = workdir / "organizer.key"
        organizer_key.write_bytes(RSAPrivateKey().to_bytes())
    world, started = len(links), time.time()
    rendezvous = workdir / f"rendezvous-{backend}-{time.monotonic_ns()}"
    # the processes' own temporary files (multiprocessing's pymp-*, torch's torch-shm-dir-*) go to a folder removed at
    # the end: a process killed at the timeout left them in /tmp. A short path: under pytest's tmp_path the socket of
    # torch_shm_manager passes a unix socket's 108 characters, and the probes fail at once
    with tempfile.TemporaryDirectory(prefix="collab-lab-", dir="/tmp", ignore_cleanup_errors=True) as scratch:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1", TMPDIR=scratch,
                   HIVEMIND_LOGLEVEL=os.environ.get("PROBE_LOGLEVEL", "WARNING"))
        with NetworkLab(links) as lab:
            processes = []
            for i, link in enumerate(links):
                out = workdir / f"{backend}-{i}.json"
                out.unlink(missing_ok=True)
                command = [*lab.command_prefix(i), sys.executable, "-m", "benchmarks.lab.averaging_probe",
                           "--backend", backend, "--index", str(i), "--world", str(world), "--size", str(size),
                           "--rounds", str(rounds),
                           "--wire", wire, "--host", lab.address(i), "--rendezvous", str(rendezvous),
                           "--master", f"{lab.address(0)}:{GLOO_PORT}", "--out", str(out)]
                if backend == "hivemind" and aggregation:
                    command += ["--aggregation", aggregation]
                if backend == "hivemind" and organizer_key is not None:
                    command += ["--organizer-key", str(organizer_key)]
                if backend == "hivemind" and part_size:
                    command += ["--part-size", str(part_size)]
                if backend == "hivemind":
                    command += ["--stall-timeout", f"{_stall_timeout(links, size, wire):.0f}"]
                if backend == "hivemind" and announce_bandwidth and link.upload_mbit is not None:
                    command += ["--bandwidth", str(link.upload_mbit)]
                log = open(workdir / f"{backend}-{i}.log", "wb")
                processes.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True), out, log))
                log.close()
            deadline, timed_out = time.monotonic() + timeout, []
            for i, (process, _, _) in enumerate(processes):
                try:
                    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out.append(i)
                    continue
                if code != 0:
                    raise ProbeFailed(f"{backend} process {i} exited {code}:\n{_log_tail(workdir, backend, i)}")
            # the lab's exit kills anything left in its namespaces
        for i in timed_out:
            processes[i][0].wait(timeout=10)
        if timed_out:  # killed with the lab, they left their hivemind socket files (and they have no watcher)
            remove_unbound_sockets(made_since=started)
    # each process saves its rounds as it goes: one that hung in a later round leaves the earlier ones to count
    per_process = [json.loads(out.read_text()) if out.exists() else [] for _, out, _ in processes]
    done = min(len(records) for records in per_process)
    if timed_out and done == 0:
        raise ProbeFailed(f"{backend} process {timed_out[0]} timed out before every process had finished a round:\n"
                          f"{_log_tail(workdir, backend, timed_out[0])}")
    if done < rounds:
        print(f"{backend}: process(es) {timed_out} still running after {timeout:.0f} s; the {done} round(s) of "
              f"{rounds} that every process finished are counted", flush=True)
    outcomes = []
    for r in range(done):
        records = [p[r] for p in per_process]
        outcomes.append(RoundOutcome(
            seconds=max(x["finished"] for x in records) - min(x["started"] for x in records),
            group_sizes=[x["group_size"] for x in records], max_error=max(x["max_error"] for x in records),
            bytes_sent=[x["bytes_sent"] for x in records], bytes_received=[x["bytes_received"] for x in records],
            errors=[x.get("error", "") for x in records]))
    return outcomes


def _log_tail(workdir: Path, backend: str, index: int) -> str:
    return (workdir / f"{backend}-{index}.log").read_text(errors="replace")[-2000:]


def lower_bound_seconds(size_bytes: float, world: int, bandwidth_mbit: float) -> float:
    """Bandwidth-optimal all-reduce: each process sends and receives 2(k-1)/k of the vector."""
    return 2 * (world - 1) / world * size_bytes * 8 / (bandwidth_mbit * 1e6)


def best_of(outcomes: list[RoundOutcome]) -> Optional[RoundOutcome]:
    return min(outcomes, key=lambda o: o.seconds) if outcomes else None
