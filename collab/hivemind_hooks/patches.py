"""Every run-time patch collab makes to hivemind, and every private hivemind function it calls, in one place: one
function each, with one line on why. Nothing here runs at import time; the callers say when.
"""

from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from hivemind import DHT
from hivemind.averaging import allreduce
from hivemind.averaging.control import StepControl
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture


# --- inside an all-reduce: hivemind's part container, made per round in the averager's process ---

def before_failed_reducer(container, hook: Callable[[int], None]) -> Callable[[int], None]:
    """Run `hook(peer_index)` when a reducer fails mid-round, then hivemind's handling (keep this peer's own values
    for that reducer's span): collab must know which reducers were lost, and one average must not read hivemind's
    zero differences as averages. Returns the handling as it was before this hook, to call directly."""
    keep_own = container.register_failed_reducer

    def failed(peer_index: int) -> None:
        hook(peer_index)
        keep_own(peer_index)

    container.register_failed_reducer = failed
    return keep_own


def check_returned_parts(container, check: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
    """Pass every part a reducer returns through `check(peer_index, part_index, part)`, whose result hivemind's
    container registers: returned averages are bounded and turned into differences before they are applied."""
    register = container.register_processed_part
    container.register_processed_part = lambda peer_index, part_index, part: register(
        peer_index, part_index, check(peer_index, part_index, part))


def never_ask_leaders(matchmaking, refused: Callable) -> None:
    """hivemind's Matchmaking asks every leader it finds in the DHT, and any a disbanding leader suggests, through
    one private method: a leader `refused(peer_id)` names (a banned peer) is never asked. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_checked", False):
        return
    request_join = matchmaking._request_join_group

    async def unless_refused(leader):
        return None if refused(leader) else await request_join(leader)

    matchmaking._request_join_group, matchmaking._collab_checked = unless_refused, True


def decode_averages_with(decode: Callable) -> None:
    """hivemind's all-reduce decodes the parts reducers send back with its module's deserialize_torch_tensor: collab's
    decoder (a fixed 8-bit decode, DGC's sparse parts) takes its place there; hivemind's codec table stays as it is.
    Call before the averagers' processes start."""
    allreduce.deserialize_torch_tensor = decode


# --- the trainer process ---

def sign_progress_with(private_key) -> None:
    """hivemind's ProgressTracker signs with the process-wide key, and its signature validator merges every instance
    into the first: make that key the libp2p identity's, so each record this peer writes is signed by the key its
    peer id derives from, and readers can check that."""
    RSAPrivateKey._process_wide_key = private_key


def step_controls_in_flight() -> list:
    """Every averaging round this process has made and not finished, including those hivemind's background optimizer
    step makes and keeps nowhere collab can reach (cancelled on a signal, so leaving is not held by them)."""
    futures = [ref() for ref in list((MPFuture._active_futures or {}).values())]
    return [f for f in futures if isinstance(f, StepControl)]


def update_scheduler(state_averager) -> None:
    """Move the learning-rate schedule to the state averager's epoch (set by collab when it adopts its groupmates'
    epoch after a lineage split); hivemind does this only inside its own step."""
    state_averager._update_scheduler()


def p2pd_address(dht):
    """The DHT's p2pd listen address, read in the DHT's process: a second client of the same daemon (a thread's own
    event loop serving the run's files) connects to it."""
    return dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)


def close_p2p_client(p2p) -> None:
    """Close a replicated client of p2pd without stopping the daemon, which the DHT owns (P2P.shutdown would)."""
    p2p._terminate()


# --- a process forked from the simulation's fork server ---

def fresh_process_state() -> None:
    """What a new interpreter would have: hivemind's process-shared module-level state (the MPFuture backend, the
    executor lock), unshared from the fork server that forked this process."""
    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


@contextmanager
def donors_reached_through(averager, stub: Callable) -> Iterator[None]:
    """While a state download runs, hivemind reaches each donor through one call of the averager's get_stub:
    `stub(inner, p2p, peer, namespace)` decides instead (a non-member or an implausible donor is not asked; `inner`
    makes the stub as before). Nested uses stack."""
    own = averager.__dict__.get("get_stub")
    inner = own or type(averager).get_stub

    def get_stub(p2p, peer, *, namespace=None):
        return stub(inner, p2p, peer, namespace)

    averager.get_stub = get_stub
    try:
        yield
    finally:
        if own is None:
            del averager.get_stub
        else:
            averager.get_stub = own
