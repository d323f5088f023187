"""hivemind's progress tracker, honest about this peer and wary of the others.

Every peer's tracker reads every other peer's progress record and takes the highest epoch as the
swarm's: one forged record (another peer's id, an epoch of a million, a time far in the future)
would make every honest peer think it is behind and reload state, or stop it from ever stepping.
Here each record passes collab.records.untrusted' checks before hivemind sees it, and what is dropped is
counted and said once per signer.

hivemind also ends an epoch on a forecast: when its ETA passes, whatever the swarm has counted. The forecast
extrapolates every peer's last record at that peer's rate, and the ETA runs on the wall clock: both count seconds
in which nobody computed (a state round, a checkpoint, a state download after a step) as training. A linreg run
checkpointing every 10 epochs and averaging state every 5 stepped at exactly those epochs on rounds of 48-1100
samples for a target of 3072 (10-16% of its rounds under 3/4 of the target), each at the full learning rate;
with AdaScale's gain of 3.9 one such step raised the loss 1.26x, and those rounds alone explained why a 4x
target's samples were worth 0.82-0.88 of what SGD's loss factor predicts (every round's own batch put into SGD's
loss factor matched what was measured within 4%). Here a record extrapolates by at most one micro-batch (a peer that
has computed one reports it, so a record older than that is a peer in a pause, or gone; mid-epoch a record may be up
to REPORT_EVERY old, near the end a fraction of a read, which only makes a forecast later, never early) and never
for longer than EXTRAPOLATE_AT_MOST, and a forecast ends an epoch only if it was made after this peer began
computing toward it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Callable, Optional

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from collab.hivemind_hooks.optimizer import TrackerHooks
from collab.hivemind_hooks.patches import dht_takes_requests
from collab.process.lifecycle import StopOnSignal
from collab.records.identity import signer_peer_id
from collab.records.shared_reads import READ_EVERY_MOST, share_for
from collab.records.untrusted import Rejections, accept, drop_implausible_epochs

logger = get_logger(__name__)

EXTRAPOLATE_AT_MOST = 5.0  # seconds: a computing peer stores a record every fraction of a read near an epoch's end
# hivemind stores a progress record after every micro-batch, unthrottled: each store signs the record, walks the DHT
# and has every node it reaches validate the whole progress key (every peer's signed record, parsed again), so the
# cost grows with micro-batches per second times peers. On 3 micro peers here that was ~8 stores a second per peer
# and a quarter of the 2 cores, in the DHT processes. Mid-epoch a record is now stored at most every REPORT_EVERY
# seconds; within NEAR_THE_END seconds of the swarm's ETA more often (below), and at an epoch's first micro-batch
REPORT_EVERY = 0.5
NEAR_THE_END = 1.0
# ... in a swarm of up to PEERS_PER_REPORT peers. Each store's walk had every node it reached answer with all N
# records, so a swarm's store traffic grew with N^2 per peer (12 linreg peers: the progress key was 78% of a peer's
# ~6 MB of DHT traffic a minute). The walk now carries no records (collab.hivemind_hooks.patches.
# store_walks_without_values), but each of the N - 1 others' reads still carries every record: mid-epoch the period
# grows with N, up to REPORT_EVERY_MOST. The others extrapolate a record at its rate for up to EXTRAPOLATE_AT_MOST
# seconds, and an epoch's end is stored more often (below)
PEERS_PER_REPORT = 4
REPORT_EVERY_MOST = EXTRAPOLATE_AT_MOST / 2
# Near an epoch's end a record was stored after every micro-batch: a cheap task's peer (linreg, 58 micro-batches a
# second) then stored as fast as its stores completed, 490 of its 600 stores in 40 s with 2 peers, and every store
# lands on the same few nodes (the key's nearest), whose load grew with N times the micro-batch rate. Nobody reads
# the key more often than every share_for(N) seconds, so near the end a record is stored at most every
# share_for(N) / NEAR_THE_END_STORES_PER_READ. Others extrapolate a record by one micro-batch at most, so a record up
# to that old is under-counted, never over-counted: the swarm sees its end that much later, never early
NEAR_THE_END_STORES_PER_READ = 4
# Reads, likewise: each read of the progress key brings every peer's record back, and near an epoch's end hivemind
# reads every min_refresh_period (0.5 s), so a peer's read bytes grew with N (at 32 and 64 peers on 16 cores: 636
# and 2588 KB of DHT traffic per peer and epoch, most of it the progress key). In a swarm of more than PEERS_PER_READ
# peers the least time between two reads grows with N, up to READ_EVERY_MOST: N records per period stays flat. An
# epoch's end is then found by the ETA of records extrapolated at their rates (hivemind's ready_to_update_epoch),
# which a bigger swarm makes steadier; a new epoch's first micro-batch still reads at once (_read_soon). The peer's
# other readers of the key (its sync thread, donor waits, averager processes) share these reads
# (collab.records.shared_reads: the same period, share_for)
assert READ_EVERY_MOST <= EXTRAPOLATE_AT_MOST / 2
# A read that finds no record at all, not even this peer's own (stored at least every half of its 60-s lifetime), is a
# read that failed: the key's nodes did not answer in time. hivemind takes it for an empty swarm: 0 peers, an epoch
# that ends on this peer's own forecast, and no gradient round at the step ("could not start"). Within this many
# seconds of a read that found others, the last read stands and the key is read again soon
FOUND_NOTHING_KEPT = 10.0
GOODBYE_WAIT = 2.0  # seconds a leaving peer waits for its goodbye (its progress record cleared) to be stored
GOODBYE_KEEP = 4.0  # seconds of a signalled leave's grace kept for what follows (averagers, checkpoint, DHT)


class HonestProgressTracker(TrackerHooks):
    """Never publishes an epoch this replica has not made with the swarm (after an own step it says the epoch
    before, so that leaving peers wait to be its state donor), and ignores other peers' untrusted records."""

    members: Optional[Callable[[str], bool]] = None  # a private run's member check: others' records are ignored
    micro_batch_size: Optional[int] = None  # this run's: how far a record may be extrapolated
    reads = 0  # how many times the swarm's progress was read (hivemind's schedule and refresh() alike)
    read_at = float("-inf")  # time.monotonic() of the last read
    found_nothing = 0  # reads that found no record at all, its own included, while others were training (failed)
    _found_others_at = float("-inf")  # time.monotonic() of the last read that found another peer's record
    forecast_at = float("-inf")  # dht time of the read that made the current ETA
    computing_since: Optional[float] = None  # dht time of this epoch's first micro-batch; None before it
    _stored_at = float("-inf")  # time.monotonic() of this peer's last stored record (_store_due)
    _stored_epoch: Optional[int] = None
    _reached_stored: Optional[int] = None  # the epoch whose target this peer last stored a record at (_store_due)
    trained = False  # whether this peer has computed a micro-batch (report_progress_forever)
    peers_seen: list = []  # (epoch, client mode) of each peer in the last read
    records_seen: dict = {}  # base58 -> (epoch, client_mode) of each peer in the last read

    def __init__(self, *args, hold: Callable[[], Optional[int]] = lambda: None, **kwargs):
        self.hold = hold  # the most epoch this peer's record may claim now (collab.modes.replica_sync); None: its own
        self.rejected = Rejections()
        self._said: set[str] = set()
        super().__init__(*args, **kwargs)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        if samples_accumulated <= 0:
            self.computing_since = None
        else:
            self.trained = True
            if self.computing_since is None:
                # a forecast read before now counted this peer's pause since its last step as training: read again
                self.computing_since = get_dht_time()
                self._read_soon()
        held = self.hold()
        if held is not None and local_epoch > held:
            local_epoch, samples_accumulated = held, 0
        if self._store_due(local_epoch, samples_accumulated):
            if self.trained:
                # (before the first micro-batch the reporter stores nothing: a catch-up's report noted as stored made
                # the first micro-batch's look not due, and a --wait-peers peer, holding after it, went unseen for the
                # reporter's 30-s wake-up while the peer it waited for trained on alone)
                self._stored_at, self._stored_epoch = time.monotonic(), local_epoch
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        # hivemind's reporter stores a record as soon as this event is set (clearing it after is too late): the
        # progress is taken in, and the next micro-batch that is due stores it
        event, self.should_report_progress = self.should_report_progress, _Muted(self.should_report_progress)
        try:
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self.should_report_progress = event

    def report_every(self) -> float:
        """Seconds between this peer's stores mid-epoch, in a swarm of the size it last read."""
        peers = max(1, self.global_progress.num_peers)
        return min(REPORT_EVERY_MOST, REPORT_EVERY * max(1.0, peers / PEERS_PER_REPORT))

    def near_the_end_every(self) -> float:
        """Seconds between this peer's stores near an epoch's end, in a swarm of the size it last read."""
        return share_for(max(1, self.global_progress.num_peers)) / NEAR_THE_END_STORES_PER_READ

    def _store_due(self, epoch: int, samples: int) -> bool:
        if epoch != self._stored_epoch or samples <= 0:
            return True
        since = time.monotonic() - self._stored_at
        if since >= self.report_every():
            return True
        # (the swarm's count as it will be with this micro-batch's samples, which hivemind adds after this look)
        new = samples - self.local_progress.samples_accumulated if epoch == self.local_progress.epoch else 0
        reached = self.global_progress.samples_accumulated + max(0, new) >= self.target_batch_size
        if reached and self._reached_stored != epoch:
            # this peer sees the target reached and stops for the round: its last samples are stored now, or the
            # others would count without them until a slow peer among them made up the difference
            self._reached_stored = epoch
            return True
        near = reached or self.global_progress.eta_next_epoch - get_dht_time() <= NEAR_THE_END
        return near and since >= self.near_the_end_every()

    def parse_swarm_progress(self, metadata):
        if self._read_failed(metadata):
            self.found_nothing += 1
            progress = self.global_progress
            logger.debug(f"a progress read found no record, its own included: {progress.num_peers} peers kept")
            progress.next_fetch_time = get_dht_time() + self.min_refresh_period
            return progress
        if isinstance(metadata, dict):
            metadata = forecastable(trusted_progress(metadata, self.rejected, self._said, self.members),
                                    get_dht_time(), self.micro_batch_size)
            # (epoch, client) of every trusted record, this peer's included: why a round found no group
            values = [entry.value for entry in metadata.values() if isinstance(entry.value, dict)]
            self.peers_seen = [(v["epoch"], bool(v.get("client_mode"))) for v in values if type(v.get("epoch")) is int]
            # by peer: who planned the last round's group (collab.averaging.planned_leader) after an even split
            by_peer = ((_base58(v.get("peer_id")), v) for v in values if type(v.get("epoch")) is int)
            self.records_seen = {peer: SimpleNamespace(epoch=v["epoch"], client_mode=bool(v.get("client_mode")))
                                 for peer, v in by_peer if peer}
        due = getattr(getattr(self, "global_progress", None), "next_fetch_time", None)  # (None: the first read)
        progress = super().parse_swarm_progress(metadata)
        self.reads, self.read_at, self.forecast_at = self.reads + 1, time.monotonic(), get_dht_time()
        if progress.num_peers > 1:
            self._found_others_at = self.read_at
        # (a peer that learns of an epoch's end late begins its round late: at 32 peers on 2 cores, reads landed a
        # median 1.2 s after due, a tenth over 4 s)
        if due is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug(f"progress read {self.forecast_at - due:.2f} s after due: {progress.num_peers} peers, "
                         f"{progress.samples_accumulated} samples of {self.target_batch_size}, epoch "
                         f"{progress.epoch}, ETA in {progress.eta_next_epoch - self.forecast_at:.1f} s")
        progress.next_fetch_time = max(progress.next_fetch_time, self.forecast_at + self.read_every(progress.num_peers))
        return progress

    def _read_failed(self, metadata) -> bool:
        """Whether a read found no record, not even this peer's own, within FOUND_NOTHING_KEPT of one that found
        others: a read that failed, not a swarm that left (a peer that leaves clears its record, and this peer's own
        stays). Before this peer's first micro-batch it has stored no record, and nothing is what there is."""
        if isinstance(metadata, dict) and metadata:
            return False
        return self.trained and time.monotonic() - self._found_others_at < FOUND_NOTHING_KEPT

    def read_every(self, peers: int) -> float:
        """The least seconds between two of this peer's scheduled reads of the swarm's progress."""
        return share_for(peers, self.min_refresh_period)

    @property
    def ready_to_update_epoch(self) -> bool:
        """hivemind's rule, with the forecast trusted only when it was made after this peer began computing toward
        this epoch (a forecast made during its own pause after the last step passes too early)."""
        if (self.global_epoch > self.local_progress.epoch
                or self.global_progress.samples_accumulated >= self.target_batch_size):
            return True
        return (self.computing_since is not None and self.forecast_at >= self.computing_since
                and get_dht_time() >= self.global_progress.eta_next_epoch)

    async def report_progress_forever(self):
        """hivemind's reporter (a record stored when a report is due, and at least every half of its lifetime), less
        one rule: it stops storing once the records it stored carried no samples for two epochs (an auxiliary
        peer's). Its task reads the progress when it wakes; with sub-second epochs that was often after the epoch had
        moved on (samples 0), and a trainer's record froze epochs back: at --max-epochs every peer of a 4-peer
        linreg run saw the others 1-3 epochs behind and stayed on as their state donor until the records expired
        (60 s of a 79-s run). collab has no auxiliary peers: a peer that is behind says so (peers_behind). As in
        hivemind, nothing is stored before this peer's first micro-batch: a record says a peer that trains (the
        others' --wait-peers hold counts it; stored at start, the first peer began while the last was still loading)."""
        last_report_time = -float("inf")
        store_task = None
        try:
            while not self.shutdown_triggered.is_set():
                wait_timeout = max(0.0, last_report_time - get_dht_time() + self.metadata_expiration / 2) \
                    if self.trained else self.metadata_expiration / 2  # (untrained: until the first micro-batch's)
                event = getattr(self.should_report_progress, "event", self.should_report_progress)  # not _Muted
                await asyncio.get_event_loop().run_in_executor(None, event.wait, wait_timeout)
                event.clear()
                if self.shutdown_triggered.is_set():
                    break  # hivemind's shutdown stores the goodbye
                if not self.trained:
                    continue  # before the first micro-batch
                last_report_time = get_dht_time()
                store_task = asyncio.create_task(asyncio.wait_for(self.dht.store(
                    key=self.training_progress_key, subkey=self._local_public_key, value=self.local_progress.dict(),
                    expiration_time=last_report_time + self.metadata_expiration, return_future=True),
                    timeout=self.metadata_expiration))
        finally:
            if store_task is not None:
                store_task.cancel()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """hivemind's, and then the goodbye waited for: hivemind sends it (the progress record cleared) without
        waiting, and the DHT was shut down under it often enough (2 peers, one leaving at --max-epochs: 3 of 10
        times) that the peer that stayed saw the other's record for PRESENT_FRESH_SECONDS, took it for a donor and
        waited out load_state_timeout (30 s) on it. The same store again, awaited: it is idempotent.
        A DHT process that stopped reading its pipe gets no goodbye (hivemind's send would block the leave for
        good): the reporter is stopped as hivemind stops it, and the record expires by itself."""
        if not dht_takes_requests(self.dht):
            for event in (self.shutdown_triggered, self.should_report_progress, self.global_state_updated):
                event.set()
            self.shutdown_complete.wait(timeout)
            return
        super().shutdown(timeout)
        try:
            self.dht.store(self.training_progress_key, subkey=self._local_public_key, value=None,
                           expiration_time=get_dht_time() + self.metadata_expiration, return_future=True
                           ).result(timeout=StopOnSignal.budget(GOODBYE_WAIT, keep=GOODBYE_KEEP))
        except Exception:  # a DHT too busy to answer in time: the record expires by itself
            pass

    def _read_soon(self) -> None:
        self.global_progress.next_fetch_time = get_dht_time()
        self.global_state_updated.set()  # wakes the reader, which then finds the read due

    def refresh(self, timeout: float) -> bool:
        """Read the swarm's progress now, not at hivemind's next scheduled read; whether it was read within
        `timeout` seconds. hivemind schedules the next read by this peer's own ETA (up to max_refresh_period
        ahead): a peer that saw nobody at its start (the others had not trained a micro-batch yet, so had no
        record) may not read again before it has made the whole target alone."""
        before = self.reads
        self._read_soon()
        deadline = time.monotonic() + timeout
        while self.reads == before:
            if time.monotonic() > deadline or self.shutdown_triggered.is_set():
                return False
            time.sleep(0.02)
        return True


class _Muted:
    """A threading.Event whose set() does nothing (hivemind's reporter thread may wait on it meanwhile)."""

    def __init__(self, event):
        self.event = event

    def set(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self.event, name)


def forecastable(metadata: dict, now: float, micro_batch_size: Optional[int],
                 at_most: float = EXTRAPOLATE_AT_MOST) -> dict:
    """Progress records as hivemind's forecast should extrapolate them: by at most one micro-batch at the record's
    rate (this run's micro-batch size stands for every peer's: a larger one is under-counted, so its epoch ends a
    little later, never early) and at most `at_most` seconds. Counted samples are untouched."""
    view = {}
    for subkey, entry in metadata.items():
        value = entry.value
        if isinstance(value, dict) and isinstance(value.get("time"), (int, float)):
            age = at_most
            rate = value.get("samples_per_second")
            if micro_batch_size and isinstance(rate, (int, float)) and rate > 0:
                age = min(age, micro_batch_size / rate)
            if value["time"] < now - age:
                entry = ValueWithExpiration({**value, "time": now - age}, entry.expiration_time)
        view[subkey] = entry
    return view


def trusted_progress(metadata: dict, rejected: Rejections, said: set,
                     members: Optional[Callable[[str], bool]] = None) -> dict:
    """The entries of hivemind's progress key that pass collab.records.untrusted' checks (and, in a private run, whose
    signer is a member); the others are added to `rejected`, and each signer not yet in `said` is named once
    in the log."""
    now = get_dht_time()
    by_signer, subkeys = [], {}
    for subkey, entry in metadata.items():
        if not isinstance(entry, ValueWithExpiration) or entry.value is None:
            continue  # a peer's goodbye (hivemind stores None as it leaves)
        signer = signer_peer_id(subkey)
        by_signer.append((signer, entry.value))
        subkeys.setdefault(signer, subkey)
    now_rejected = Rejections()
    kept = accept(by_signer, LocalTrainingProgress.parse_obj, lambda item: PeerID(item.peer_id).to_base58(),
                  now_rejected, now)
    kept = drop_implausible_epochs(kept, now_rejected, now)
    if members is not None:
        for signer in [signer for signer in kept if not members(signer)]:
            kept.pop(signer)
            now_rejected.add("not a member of the private run", signer)
    rejected.by_reason.update(now_rejected.by_reason)
    rejected.by_signer.update(now_rejected.by_signer)
    for signer in now_rejected.by_signer:
        if signer not in said:
            said.add(signer)
            logger.warning(f"Ignoring untrusted progress records from {signer} "
                           f"({', '.join(sorted(now_rejected.by_reason))})")
    return {subkeys[signer]: metadata[subkeys[signer]] for signer in kept}


def _base58(peer_id) -> Optional[str]:
    """A record's peer id (bytes) in base58, None if it is none (records reach here checked:
    collab.records.untrusted)."""
    try:
        return PeerID(peer_id).to_base58() if isinstance(peer_id, bytes) else None
    except Exception:
        return None
