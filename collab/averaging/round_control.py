"""Cancelling an averaging round from any thread."""

from __future__ import annotations

from concurrent.futures import InvalidStateError

from hivemind.utils.mpfuture import MPFuture


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
