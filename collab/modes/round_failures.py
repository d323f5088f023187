"""Why a gradient round failed, in words: for the peer's log (why_no_group: what hivemind's "could not find a group"
meant here) and in a few words that add up across peers (round_failure: the simulator's and scale benchmark's
"rounds failed, and why"). Used by collab.modes.sync."""

from __future__ import annotations

import asyncio
from concurrent.futures import CancelledError, TimeoutError as FutureTimeout

from collab.averaging.left_out import LeftOutOfRound


class NobodyLeftToJoin(Exception):
    """A peer's last gradient round, ended because every other peer had finished that epoch without it."""


def why_no_group(epoch: int, client_mode: bool, peers_seen: list, matchmaking_time: float) -> str:
    """Why a gradient round found no group, from the last read of the run's progress records: (epoch, client mode)
    of each peer, this one's included. hivemind says only "could not find a group"."""
    others = max(0, len(peers_seen) - 1)
    if others == 0:
        return "no group found: this peer is alone in the run (no other peer's progress record)"
    leaders = sum(not client for _, client in peers_seen)
    if client_mode and leaders == 0:
        return (f"no group found: the {others} other peer(s) are clients too, and only a reachable peer can lead a "
                "round: one of you needs an open port (collab doctor says how)")
    same = sum(e == epoch for e, _ in peers_seen) - 1
    if same <= 0:
        theirs = sorted({e for e, _ in peers_seen if e != epoch})
        return (f"no group found: the other peers are on epoch {', '.join(map(str, theirs))}, this one on {epoch} (a "
                "round groups one epoch's peers); it re-syncs with them")
    return (f"no group found: {same} other peer(s) on this epoch, but none matched within {matchmaking_time:g} s: on "
            "slow or distant links raise averaging.matchmaking_time")


def why_not_begun(control, peers: int) -> str:
    """Why hivemind began no gradient round at the step, from what it reads there: the pre-scheduled round
    (`control`, a StepControl or None) as it was before the step, and how many peers the tracker counted. hivemind
    says why only at debug level; a CI run's 12-peer test failed on such a round once with nothing in the log."""
    if control is not None and control.done():
        what = "been cancelled" if control.cancelled() else f"ended ({control.exception() or 'averaged'})"
        return f"its pre-scheduled round had {what} before the step"
    if control is not None and control.triggered:
        return "its pre-scheduled round had been triggered before the step (hivemind uses such a round no more)"
    if peers <= 1:
        return f"the tracker counted {peers} peer(s) training at the step"
    return "hivemind's step raised (the error is above)"


def round_failure(error: BaseException) -> str:
    """Why a gradient round failed, in a few words that add up across peers (the simulator's and scale
    benchmark's "rounds failed, and why")."""
    text = str(error)
    if isinstance(error, NobodyLeftToJoin):
        return "nobody left to join"
    if isinstance(error, LeftOutOfRound):
        return "left out by a reducer"
    if "could not find a group" in text:
        return "no group found"
    if isinstance(error, (TimeoutError, FutureTimeout)):
        return "timed out"
    if isinstance(error, (CancelledError, asyncio.CancelledError)):
        return "cancelled"
    return f"{type(error).__name__}: {text[:60]}" if text else type(error).__name__
