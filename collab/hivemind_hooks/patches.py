"""Every run-time patch collab makes to hivemind, and every private hivemind function it calls, in one place: one
function each, with one line on why. Nothing here runs at import time; the callers say when. (Those of its
matchmaking, made per averager: collab.hivemind_hooks.matchmaking.)
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterator, Optional

import torch
from hivemind import DHT
from hivemind.averaging import allreduce
from hivemind.averaging.control import StepControl
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from collab.hivemind_hooks.locks import DeathSafeLock

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


def public_keys_also_read_by(prefix: bytes, read: Callable[[bytes], object]) -> None:
    """hivemind reads every public key a record's owner marker or an access token names with RSAPublicKey.from_bytes
    (its signature validator, its TokenAuthorizerBase): keys that start with `prefix` are read by `read` instead
    (collab.records.keys: Ed25519), so a run's records and requests may be signed by either kind. Once per process,
    before the DHT's process forks."""
    if getattr(RSAPublicKey.from_bytes, "_collab_also_read", False):
        return
    read_rsa = RSAPublicKey.from_bytes

    def from_bytes(cls, key: bytes):
        return read(key) if isinstance(key, bytes) and key.startswith(prefix) else read_rsa(key)

    from_bytes._collab_also_read = True
    RSAPublicKey.from_bytes = classmethod(from_bytes)


def identities_also_read_by(read: Callable[[bytes], Optional[str]]) -> None:
    """hivemind's PeerID.from_identity reads only RSA identity files, and P2P.create calls it on every start that
    bootstraps (to ask whether another peer runs with the same identity): `read(file bytes)` answers first with the
    peer id (base58) of the kinds it knows (collab.records.identity: Ed25519), None for hivemind's to read. Once per
    process, before the DHT's process forks."""
    if getattr(PeerID.from_identity, "_collab_also_read", False):
        return
    read_rsa = PeerID.from_identity

    def from_identity(cls, data: bytes):
        peer_id = read(data)
        return cls.from_base58(peer_id) if peer_id is not None else read_rsa(data)

    from_identity._collab_also_read = True
    PeerID.from_identity = classmethod(from_identity)


def step_controls_in_flight() -> list:
    """Every averaging round this process has made and not finished, including those hivemind's background optimizer
    step makes and keeps nowhere collab can reach (cancelled on a signal, so leaving is not held by them)."""
    futures = [ref() for ref in list((MPFuture._active_futures or {}).values())]
    return [f for f in futures if isinstance(f, StepControl)]


def update_scheduler(state_averager) -> None:
    """Move the learning-rate schedule to the state averager's epoch (set by collab when it adopts its groupmates'
    epoch after a lineage split); hivemind does this only inside its own step."""
    state_averager._update_scheduler()


def step_pool_initializer(state_averager, initializer: Callable[[], None]) -> None:
    """hivemind's TrainingStateAverager runs optimizer steps and state rounds in a thread pool it makes itself: a new
    pool of the same size, whose threads run `initializer` first, takes its place (collab.train.cpu_threads: one
    OpenMP team per CPU peer). Before the pool's first step."""
    old = state_averager.step_executor
    state_averager.step_executor = ThreadPoolExecutor(
        max_workers=old._max_workers, thread_name_prefix="state-averager-step", initializer=initializer)
    old.shutdown(wait=True)


def p2pd_address(dht):
    """The DHT's p2pd listen address, read in the DHT's process: a second client of the same daemon (a thread's own
    event loop serving the run's files) connects to it."""
    return dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)


def dht_takes_requests(dht, within: float = 0.0) -> bool:
    """Whether the DHT's process would take a request now (or within `within` s): its pipe has room for one. A DHT
    process that stopped reading it (its loop blocked or ended) leaves it full, and hivemind's next send to it, from
    any of its methods, blocks for good: a stack dump of a leave that overran its grace had its main thread there
    (asking for the exit figures) and the progress tracker's thread too (a read). A request of collab's is a few
    hundred bytes; a pipe that selects writable has a free 4-KiB page."""
    try:
        _, writable, _ = select.select([], [dht._outer_pipe.fileno()], [], max(0.0, within))
    except (OSError, ValueError):  # closed: the DHT was shut down
        return False
    return bool(writable)


def close_p2p_client(p2p) -> None:
    """Close a replicated client of p2pd without stopping the daemon, which the DHT owns (P2P.shutdown would)."""
    p2p._terminate()


# --- the DHT's and the averagers' processes ---

class _WholeMessages:
    """A multiprocessing Connection whose recv() waits for the rest of a message that is still arriving, and says a
    message it cannot unpack is lost (ConnectionError) rather than end its reader."""

    def __init__(self, connection):
        self._connection = connection

    def __getattr__(self, name):
        return getattr(self._connection, name)

    def recv(self):
        os.set_blocking(self._connection.fileno(), True)
        message = self._connection.recv_bytes()  # (EOFError here: every sender is gone, and so is the pipe's use)
        try:
            return ForkingPickler.loads(message)
        except (EOFError, OSError) as e:
            # a request carries its MPFuture's pipe end, which the sender's process hands over when it is unpacked:
            # one that exited meanwhile (an averager's, shut down with a read in flight) fails it with EOFError, which
            # hivemind's loop does not catch, and the DHT's process died, its p2pd's socket file left in /tmp (a CI
            # run). The message is whole: the next one reads as usual. hivemind's loop logs this and goes on
            raise ConnectionError(f"a request whose sender exited before it was read was dropped ({e!r})") from e


def pipe_reads_take_whole_messages(process) -> None:
    """hivemind's DHT process watches its end of the request pipe with uvloop's add_reader, which makes it
    non-blocking, then reads a message once poll() says bytes have come. A message still being written (a sender
    whose requests filled the pipe: a lone linreg peer at 16 epochs a second) failed half-read with EAGAIN, the
    pipe lost its framing, the process stopped taking requests, and the next send blocked for good: the peer's leave
    overran its grace (3 of 5 lone peers of scale.py here, one on the device). The read now waits for the whole
    message. hivemind's averager processes read their pipes the same way: the same for them. In the DHT's (or the
    averager's) process, before hivemind's run()."""
    process._inner_pipe = _WholeMessages(process._inner_pipe)


# --- a process forked from the simulation's fork server ---

def fresh_process_state() -> None:
    """What a new interpreter would have: hivemind's process-shared module-level state (the MPFuture backend, the
    executor lock), unshared from the fork server that forked this process."""
    MPFuture.reset_backend()
    death_safe_locks(anew=True)


# --- before this process forks its first hivemind process (the DHT's, an averager's) ---

def death_safe_locks(anew: bool = False) -> None:
    """hivemind's process-shared locks (an MPFuture update's, the MPFuture backend's, SharedBytes', the executor's)
    as locks a holder's death releases (collab.hivemind_hooks.locks): one process killed while it held one blocked
    every other for good. Once per process, before the processes that share them are forked; `anew` replaces them
    even so (a fork server's child, whose copies are its server's)."""
    if isinstance(MPFuture._update_lock, DeathSafeLock) and not anew:
        return
    MPFuture._initialization_lock = DeathSafeLock()
    MPFuture._update_lock = DeathSafeLock()
    SharedBytes._lock = DeathSafeLock(quiet_at_fork=True)  # its section shares memory: torch_shares_after_fork
    _AsyncContextWrapper.EXECUTOR_LOCK = DeathSafeLock()
    torch_shares_after_fork()


_torch_hook = False  # whether this process (or the one it was forked from) registered torch_shares_after_fork's


def torch_shares_after_fork() -> None:
    """torch guards every share_memory_ with a module lock (torch.storage's _share_memory_lock) and a lock per
    storage, and does not renew them in a forked child: a process forked while another of its threads was sharing a
    tensor has them held for good. hivemind shares memory for every 16th MPFuture (SharedBytes), and a peer's tracker
    thread makes futures while its trainer forks the averagers. One of 12 peers of a scale run never started: its
    trainer waited for the gradient averager's process to say it was ready, and its tracker thread waited on
    SharedBytes' lock, held by another of the peer's processes, as a child stuck in its first share would. A child
    gets torch's locks new (and SharedBytes' lock is quiet_at_fork). Once per process tree."""
    global _torch_hook
    if not _torch_hook:
        _torch_hook = True
        os.register_at_fork(after_in_child=_new_share_locks)


def _new_share_locks() -> None:
    import torch.storage  # (imported with torch; by name, as torch's own code reads it at each share)

    torch.storage._share_memory_lock = threading.Lock()
    torch.storage._share_memory_map.clear()


def cancelled_enters_exit() -> None:
    """hivemind enters a blocking context from async code (a round's hold of the averaged tensors' lock, which the
    trainer's optimizer step shares) in a worker thread. A task cancelled while that thread still waits (a round
    past its allreduce_timeout, a peer thawed after a freeze) stops waiting, but the thread goes on, takes the lock,
    and nothing exits the context: the lock stayed held until the context was garbage-collected, for good while
    the cancellation's traceback was kept, and the trainer's next step waited on it for good (a frozen peer's, 120 s
    in a CI run). Here a cancelled enter exits the context as soon as the thread has entered it. Once per process,
    before it forks the averagers' (they inherit the class)."""
    if getattr(_AsyncContextWrapper, "_collab_exits_cancelled", False):
        return

    async def enter(self):
        entering = self.get_process_wide_executor().submit(self._context.__enter__)
        try:
            return await asyncio.shield(asyncio.wrap_future(entering))
        except asyncio.CancelledError:
            entering.add_done_callback(lambda entered: entered.exception() is None
                                       and self._context.__exit__(None, None, None))
            raise

    _AsyncContextWrapper.__aenter__ = enter
    _AsyncContextWrapper._collab_exits_cancelled = True


def failed_p2pd_starts_leave_no_file() -> None:
    """hivemind's P2P.create starts p2pd, which binds its socket file in /tmp. A p2pd that then fails (it reached no
    initial peer: a stale join line) exits without removing it, and hivemind removes the file only of a daemon still
    running: each failed join left one per attempt (3). And a DHTNode.create that fails after its p2pd started (a
    private run's peers answer no ping from a stranger: "bootstrap failed") leaves that p2pd to outlive the DHT's
    process and its file behind. Here a failed P2P.create removes the file, and a failed DHTNode.create shuts down
    the p2pd it started (each object is its create's own `self`, found in the failure's traceback). Once per
    process, before it forks the DHT's."""
    if getattr(P2P, "_collab_tidy_starts", False):
        return
    p2p_create, node_create = P2P.create.__func__, DHTNode.create.__func__

    def made_by(error: BaseException, create) -> Iterator:
        trace = error.__traceback__
        while trace is not None:
            if trace.tb_frame.f_code is create.__code__ and "self" in trace.tb_frame.f_locals:
                yield trace.tb_frame.f_locals["self"]
            trace = trace.tb_next

    async def tidy_p2p_create(cls, *args, **kwargs):
        try:
            return await p2p_create(cls, *args, **kwargs)
        except BaseException as e:
            # (its p2pd is left to hivemind: it exits by itself after saying why, and a signal from here raced
            # asyncio's reaping of it, which then logged "Unknown child process" on the volunteer's terminal)
            for p2p in made_by(e, p2p_create):
                try:
                    os.remove(p2p._daemon_listen_maddr["unix"])
                except (OSError, AttributeError, KeyError, TypeError):
                    pass  # never bound, or already removed
            raise

    async def tidy_node_create(cls, *args, **kwargs):
        try:
            return await node_create(cls, *args, **kwargs)
        except BaseException as e:
            for node in made_by(e, node_create):
                if getattr(node, "_should_shutdown_p2p", False) and getattr(node, "p2p", None) is not None:
                    with suppress(Exception):
                        await node.p2p.shutdown()  # (ends a running p2pd and removes its file)
            raise

    P2P.create, DHTNode.create = classmethod(tidy_p2p_create), classmethod(tidy_node_create)
    P2P._collab_tidy_starts = True


def p2pd_starts_given(seconds: float) -> None:
    """hivemind's P2P.create first checks that the peer's identity is not in use, with a second, anonymous p2pd
    (is_identity_taken) started with create's default startup_timeout, 15 s, whatever the peer gave its own: on a busy
    machine that start failed ("Daemon failed to start in 15.0 seconds": 3 of 64 peers started together on 2 cores),
    where the peer's own p2pd has 60 s. Here a create that names no startup_timeout gets `seconds`. Before the DHT's
    process forks (it inherits the patch)."""
    if not getattr(P2P, "_collab_startup_timeout", None):
        create = P2P.create.__func__

        async def create_given(cls, *args, **kwargs):
            kwargs.setdefault("startup_timeout", P2P._collab_startup_timeout)
            return await create(cls, *args, **kwargs)

        P2P.create = classmethod(create_given)
    P2P._collab_startup_timeout = seconds


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
