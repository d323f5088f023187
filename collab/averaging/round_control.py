"""Cancelling an averaging round from any thread, and whether one is still looking for its group."""

from __future__ import annotations

from concurrent.futures import InvalidStateError

from hivemind.averaging.control import AveragingStage
from hivemind.utils.mpfuture import MPFuture


def still_matching(control) -> bool:
    """Whether an averaging round's control (None: no round) is still looking for its group."""
    return control is not None and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP


def cancel_round(control) -> None:
    """Cancel an averaging round's control unless it is over. Two threads may race to it (on a signal, the
    on-stop thread's abort_rounds and the main thread's shutdown): hivemind's cancel then raises for the second
    ("Can't set_result to a future that is FINISHED"), which would crash a leaving peer."""
    if control is None or control.done():
        return
    try:
        control.cancel()
    except InvalidStateError:  # the other thread set the round's cancel signal first: cancel the control itself
        if not control.done():
            MPFuture.cancel(control)
