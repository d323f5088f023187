"""Two faults on real local peers, measured: a peer frozen mid-run (SIGSTOP), and a swarm split in two.

Shared by tests/swarm/test_faults.py (short faults, strict checks) and benchmarks/faults.py (the full 60 s).
Each scenario returns what happened; it judges nothing. Every wait is bounded (FaultTimeout).
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from collab.peers.launcher import LocalSwarm
from collab.peers.netns import NetworkLab
from collab.peers.profiles import LinkSpec


class FaultTimeout(RuntimeError):
    pass


def progress(peer) -> dict:
    """The peer's summary as of its last epoch (it rewrites it at each), or an empty one before its first."""
    try:
        return json.loads(peer.summary_path.read_text())
    except (OSError, ValueError):
        return {"final_epoch": -1, "rounds_joined": 0, "samples_contributed": 0, "group_sizes": []}


def epochs(peers) -> list[int]:
    return [progress(p)["final_epoch"] for p in peers]


def logs(swarm: LocalSwarm) -> str:
    return "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)


def hold_fault(seconds: float, epochs_of_its_own: int, moved: Callable[[], int], most: float) -> None:
    """A fault lasts `seconds`, and then on until the swarm made `epochs_of_its_own` epochs in it (`moved`), up to
    `most` seconds: what must fit in a fault is some of the swarm's own epochs, and a slower or busier machine
    makes them slower (beside a CPU hog, a 15-s freeze left the others no time for an epoch), while what takes
    fixed time (the DHT forgetting the other half of a split) does not stretch with it."""
    started = time.monotonic()
    time.sleep(seconds)
    while moved() < epochs_of_its_own and time.monotonic() - started < most:
        time.sleep(0.5)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, swarm: LocalSwarm) -> float:
    """Seconds it took; FaultTimeout (with the peers' logs) if it did not happen within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.5)
    raise FaultTimeout(f"timed out after {timeout:.0f} s waiting for {what}\n{logs(swarm)}")


@dataclass
class FreezeResult:
    others_epochs_while_frozen: int  # how far the run went while the peer was stopped
    seconds_to_catch_up: float  # after SIGCONT, until it had the swarm's epoch and averaged with others twice
    at_freeze: dict = field(default_factory=dict)  # the frozen peer's summary when it was stopped
    after: dict = field(default_factory=dict)  # ... and once it had caught up


def freeze_scenario(workdir: Path, run_id: str, config: Path, seconds: float, env: Optional[dict] = None,
                    warmup_epochs: int = 2, forks=None, epochs_while_frozen: int = 0) -> FreezeResult:
    """3 peers; once every peer reached `warmup_epochs`, peer 2's whole session gets SIGSTOP for `seconds` (and on
    until the others made `epochs_while_frozen`, up to 4x as long: hold_fault) while it is matching or averaging
    (its epochs start their matchmaking before the last one ends, so a peer is in a round most of the time), then
    SIGCONT."""
    with LocalSwarm(3, run_id, workdir, ["--config", str(config)], env=env, forks=forks) as swarm:
        swarm.start()
        frozen, others = swarm.peers[2], swarm.peers[:2]
        wait_until(lambda: min(epochs(swarm.peers)) >= warmup_epochs, 240, f"epoch {warmup_epochs} on every peer",
                   swarm)
        before = progress(frozen)["final_epoch"]
        wait_until(lambda: progress(frozen)["final_epoch"] > before, 60, "the next epoch on the peer to freeze", swarm)
        time.sleep(3)  # into the next round's matchmaking
        frozen.signal_session(signal.SIGSTOP)
        try:
            at_freeze, others_at_freeze = progress(frozen), min(epochs(others))
            hold_fault(seconds, epochs_while_frozen, lambda: min(epochs(others)) - others_at_freeze, 4 * seconds)
            others_at_thaw = min(epochs(others))
        finally:
            frozen.signal_session(signal.SIGCONT)
        took = wait_until(lambda: progress(frozen)["final_epoch"] >= min(epochs(others)) - 1
                          and progress(frozen)["rounds_joined"] >= at_freeze["rounds_joined"] + 2, 120,
                          "the thawed peer to catch up", swarm)
        return FreezeResult(others_at_thaw - others_at_freeze, took, at_freeze, progress(frozen))


@dataclass
class SplitResult:
    split_at: list[int]  # each peer's epoch when the network was cut
    healed_at: list[int]  # ... and when it was healed
    apart: float  # largest parameter difference across the halves at one epoch number while split (0: none)
    first_common_epoch: Optional[int]  # the first epoch >= 3 after the heal that all four checkpointed
    difference_after: float  # largest parameter difference among all four there (inf: none)
    found_back: list[int] = field(default_factory=list)  # peers each one reached again (collab.swarm.rejoin)


def split_scenario(workdir: Path, run_id: str, config: Path, seconds: float, env: Optional[dict] = None,
                   warmup_epochs: int = 2, stop_at_first_common: bool = False, forks=None,
                   epochs_while_split: int = 0) -> SplitResult:
    """4 peers in network namespaces (root); once every peer reached `warmup_epochs`, peers 0, 1 and peers 2, 3
    lose each other for `seconds` (their switch ports on two bridges; and on until every peer made
    `epochs_while_split`, up to 4x as long: hold_fault), then the network heals. `config` must
    checkpoint every epoch. The swarm runs until every peer is 5 epochs past the heal; `stop_at_first_common`: or
    until all four have checkpointed one epoch of the 3 that are judged, whichever comes first (the same epoch is
    judged: a peer checkpoints its epochs in order, so no earlier one of the 3 becomes common later)."""
    per_peer = {i: ["--checkpoint-dir", str(workdir / f"peer{i}")] for i in range(4)}
    links = [LinkSpec()] * 4
    with NetworkLab(links) as lab, LocalSwarm(4, run_id, workdir, ["--config", str(config)], per_peer_args=per_peer,
                                              env=env, network=lab, links=links, forks=forks) as swarm:
        swarm.start()
        wait_until(lambda: min(epochs(swarm.peers)) >= warmup_epochs, 240, f"epoch {warmup_epochs} on every peer",
                   swarm)
        split_at = epochs(swarm.peers)
        lab.partition([2, 3])
        try:
            hold_fault(seconds, epochs_while_split,
                       lambda: min(now - then for now, then in zip(epochs(swarm.peers), split_at)), 4 * seconds)
            healed_at = epochs(swarm.peers)
        finally:
            lab.heal()
        target = max(healed_at) + 3

        def done() -> bool:
            if stop_at_first_common and _common_epochs(workdir, target):
                return True
            return min(epochs(swarm.peers)) >= target + 2
        wait_until(done, 180, f"epoch {target + 2} on every peer", swarm)
    # from the summaries each peer writes as it leaves: one written each epoch can predate a rejoin found in it (a
    # hog run stopped at the first common epoch read 0 there, where the peers' last summaries said 2)
    found_back = [progress(p).get("peers_found_back", 0) for p in swarm.peers]
    checkpoints = [_checkpoints(workdir / f"peer{i}") for i in range(4)]
    # any peer of one half against any of the other, at an epoch both checkpointed while split (each peer's own
    # window: the halves may be at different epochs when it heals; a peer that stepped alone when the cut broke
    # its round checkpoints that epoch only once re-synced)
    def while_split(i: int) -> set[int]:
        return set(checkpoints[i]) & set(range(split_at[i] + 1, healed_at[i] + 1))
    apart = max((_max_difference([checkpoints[a][epoch], checkpoints[b][epoch]])
                 for a in (0, 1) for b in (2, 3) for epoch in while_split(a) & while_split(b)), default=0.0)
    common = _common_epochs(workdir, target)
    after = _max_difference([c[common[0]] for c in checkpoints]) if common else float("inf")
    return SplitResult(split_at, healed_at, apart, common[0] if common else None, after, found_back)


def _common_epochs(workdir: Path, target: int) -> list[int]:
    """The epochs target..target+2 that all four peers checkpointed."""
    checkpoints = [_checkpoints(workdir / f"peer{i}") for i in range(4)]
    return sorted(set.intersection(*(set(c) for c in checkpoints)) & set(range(target, target + 3)))


def _checkpoints(directory: Path) -> dict[int, Path]:
    from collab.train.checkpoint import list_checkpoints

    return {int(path.name.split("-")[1]): path for path in list_checkpoints(directory)}


def _max_difference(paths) -> float:
    from safetensors.torch import load_file

    weights = [load_file(str(path / "model.safetensors")) for path in paths]
    return max(float((weights[0][name].float() - other[name].float()).abs().max())
               for other in weights[1:] for name in weights[0])
