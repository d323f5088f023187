"""Every run-time patch collab makes to hivemind, and every private hivemind function it calls, in one place: one
function each, with one line on why. Nothing here runs at import time; the callers say when.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterator, Optional

import torch
from hivemind import DHT
from hivemind.averaging import allreduce
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from collab.hivemind_hooks.locks import DeathSafeLock

_log = logging.getLogger(__name__)


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


LEADER_LOOK = 0.25  # seconds between a planned leader's looks, past its plan's window, at whether anyone follows it


def follow_a_plan(matchmaking, plan: Callable[[], Optional[tuple]], slack: float, ask_again: float) -> None:
    """A search that asks a planned leader first (collab.averaging.planned_leader). `plan()` says, each time hivemind
    takes its next leader to ask: None (hivemind's search), or (leader PeerID, until, latest: dht times). Before
    `until`, a peer whose planned leader is another asks it (again after `ask_again` s when it was asked a moment ago:
    not searching yet), and the planned leader asks no one; after it, hivemind's search goes on, unless the leader's
    last answer said its search is yet to begin (NOT_DECLARED: collab.averaging.woken_leader): then the peer asks on
    until `latest`. At 64 peers on 2 cores the planned leader began its search 8 s after the first of its followers,
    whose 3-s plans had ended: they grouped apart in hivemind's search (10 groups, none a majority). A planned leader
    with followers leads its whole search: it hands over to hivemind's search only at its declared expiration (then its
    group begins) or once nobody follows it. hivemind's pop_next_leader, asked at the plan's end, ended the search at
    once (the averager had declared itself meanwhile, which reads as a timeout, and a leader with followers begins on
    one): at 32 peers on 2 cores the leader began its group of 11 at 2.5 s of a 4.9-s search, and the 21 that came
    after it grouped apart. A planned leader accepts a follower whose search ends up to `slack` s before its own
    (hivemind refuses such a follower: its join request would expire first). Wraps PotentialLeaders.pop_next_leader
    and Matchmaking._check_reasons_to_reject; hears answers through hear_first_answers. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_planned", False):
        return
    leaders = matchmaking.potential_leaders
    pop_next_leader, check = leaders.pop_next_leader, matchmaking._check_reasons_to_reject
    asked, heard = [float("-inf")], hear_first_answers(matchmaking)

    def coming(leader) -> bool:
        code, when = heard.get(leader, (None, float("-inf")))
        return code == averaging_pb2.NOT_DECLARED and when >= asked[0]  # (its answer to the last ask)

    async def planned_first():
        while True:
            current, now = plan(), get_dht_time()
            if current is not None and current[0] == matchmaking.peer_id:  # the planned leader waits for followers
                ends = leaders.declared_expiration_time if matchmaking.current_followers else float("-inf")
                if now < current[1] or now < ends < float("inf"):
                    await asyncio.sleep(max(0.0, min(LEADER_LOOK, max(current[1], ends) - now)))
                    continue
            if current is None or (now >= current[1] and not (now < current[2] and coming(current[0]))):
                return await pop_next_leader()
            leader = current[0]
            wait = asked[0] + ask_again - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if now >= current[1]:
                _log.debug(f"planned leader ...{str(leader)[-6:]} has yet to begin its search: asked again "
                           f"{now - current[1]:.1f} s past the plan")
            asked[0] = time.monotonic()
            return leader

    def leniently(request, context):
        current = plan()
        declared = leaders.declared_expiration_time
        if (current is not None and current[0] == matchmaking.peer_id
                and isinstance(request.expiration, float) and declared - slack <= request.expiration < declared):
            lenient = type(request)()
            lenient.CopyFrom(request)
            lenient.expiration = declared
            return check(lenient, context)
        return check(request, context)

    leaders.pop_next_leader, matchmaking._check_reasons_to_reject = planned_first, leniently
    matchmaking._collab_planned = True


def hear_first_answers(matchmaking) -> dict:
    """hivemind's join request reads a leader's first answer and keeps only whether it was ACCEPTED. Returns a dict
    that each answer fills in: leader PeerID -> (its first answer's code, time.monotonic() when heard). Wraps the
    Matchmaking's servicer type (whose get_stub the request calls) for this Matchmaking only. Once per Matchmaking."""
    if isinstance(matchmaking._servicer_type, _HeardStubs):
        return matchmaking._servicer_type.heard
    matchmaking._servicer_type = _HeardStubs(matchmaking._servicer_type)
    return matchmaking._servicer_type.heard


class _HeardStubs:
    """A servicer type whose join-request streams tell `heard` each leader's first answer."""

    def __init__(self, servicer_type):
        self._servicer_type, self.heard = servicer_type, {}

    def __getattr__(self, name):
        return getattr(self._servicer_type, name)

    def get_stub(self, p2p, peer, *, namespace=None):
        return _HeardStub(self._servicer_type.get_stub(p2p, peer, namespace=namespace), peer, self.heard)


class _HeardStub:
    """A leader's stub whose join-request stream tells `heard` its first answer."""

    def __init__(self, stub, peer, heard: dict):
        self._stub, self._peer, self._heard = stub, peer, heard

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_join_group(self, request):
        return self._first_heard(await self._stub.rpc_join_group(request))

    async def _first_heard(self, stream):
        try:
            first = True
            async for message in stream:
                if first:
                    self._heard[self._peer], first = (message.code, time.monotonic()), False
                yield message
        finally:
            await stream.aclose()


class _AcceptedToGroup(asyncio.Event):
    """hivemind's Matchmaking.was_accepted_to_group, set from a leader's ACCEPTED until the follower's join request
    ends. While it is set, the matchmaking's request_timeout (which the wait for the group's start reads) is
    `factor` times its own; when it is cleared, `ended(leader, seconds accepted, whether the group began)`."""

    def __init__(self, matchmaking, factor: float, ended: Callable[[object, float, bool], None]):
        super().__init__()
        self._matchmaking, self._factor, self._ended = matchmaking, factor, ended
        self._own, self._since = matchmaking.request_timeout, None

    def set(self) -> None:
        self._matchmaking.request_timeout, self._since = self._own * self._factor, time.monotonic()
        super().set()

    def unscaled(self) -> None:
        """A new join request waits for its answer request_timeout, as in hivemind: also the one made, while this is
        still set, to the leader a disbanding leader suggests (patience there would slow the breaking of hivemind's
        deadlocks of peers asking each other)."""
        self._matchmaking.request_timeout = self._own

    def clear(self) -> None:
        super().clear()
        self._matchmaking.request_timeout = self._own
        if self._since is not None:
            self._ended(self._matchmaking.current_leader, time.monotonic() - self._since,
                        self._matchmaking.assembled_group.done())
            self._since = None


def patient_followers(matchmaking, factor: float, ended: Callable[[object, float, bool], None]) -> None:
    """A follower that a leader accepted waits for the group's start (hivemind's BEGIN_ALLREDUCE) until its own
    search's deadline plus `factor` x request_timeout, not plus one: a CPU-starved leader that began the group a
    moment after its follower stopped waiting counted it in, and the group's members then waited next_chunk_timeout
    for a peer that was looking for another group (a failed round, 30 s, in CI). Waiting longer costs nothing when
    the leader is gone (its stream closes) or disbands (it says so). `ended(leader, seconds, began)` hears of
    every accepted request as it ends. Once per Matchmaking, before its first search."""
    if isinstance(matchmaking.was_accepted_to_group, _AcceptedToGroup):
        return
    accepted = _AcceptedToGroup(matchmaking, factor, ended)
    request_join = matchmaking._request_join_group

    async def request(leader):
        accepted.unscaled()
        return await request_join(leader)

    matchmaking.was_accepted_to_group, matchmaking._request_join_group = accepted, request


def time_matchmaking(matchmaking, record: Callable[[float, Optional[GroupInfo]], None]) -> None:
    """Each search for a group (hivemind's Matchmaking.look_for_group, whatever it finds) is timed:
    `record(seconds, the group or None)` after it ends, so a round's matchmaking is measured apart from its
    all-reduce, and what it found is known. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_timed", False):
        return
    look_for_group = matchmaking.look_for_group

    async def timed(*args, **kwargs):
        started, group = time.monotonic(), None
        try:
            group = await look_for_group(*args, **kwargs)
            return group
        finally:
            record(time.monotonic() - started, group)

    matchmaking.look_for_group, matchmaking._collab_timed = timed, True


def pace_group_reads(matchmaking, every: float) -> None:
    """hivemind's matchmaking re-reads its group key from the DHT each time its queue of leaders runs dry, and a peer
    that would lead (every other peer ranks below it) finds it dry at once, again and again: in a 2-peer swarm each
    peer sent 84 DHT finds a second, each also a round trip to the DHT's process. Start at most one read every
    `every` seconds (a follower still hears of a leader within that; a leader waits for join requests, which
    come to it directly). Once per Matchmaking."""
    keys = matchmaking.group_key_manager
    if getattr(keys, "_collab_paced", False):
        return
    get_averagers, last = keys.get_averagers, [float("-inf")]

    async def paced(*args, **kwargs):
        wait = last[0] + every - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last[0] = time.monotonic()
        found = await get_averagers(*args, **kwargs)
        _log.debug(f"group key read: {len(found)} averager(s) in {time.monotonic() - last[0]:.2f} s")
        return found

    keys.get_averagers, keys._collab_paced = paced, True


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
    SharedBytes._lock = DeathSafeLock()
    _AsyncContextWrapper.EXECUTOR_LOCK = DeathSafeLock()


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
