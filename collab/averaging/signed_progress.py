"""An averager's view of the run's signed progress records, read in its own process (a CheckedRounds mixin).

Each peer's tracker publishes a signed record of its epoch, samples and rate (collab.records.untrusted drops the
untrusted ones). The averager re-reads them in the background, at most every PROGRESS_REFRESH s, so no round waits
for a read: they cap the weight each sender may claim in a round (`_weight_caps`), and they say who trains, which
plans a gradient round's group (collab.averaging.round_plans). Before the first read is back, the trainer may hand
over its own tracker's view (`read_progress_soon`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from types import SimpleNamespace
from typing import Optional

from hivemind.utils import get_dht_time

from collab.records.untrusted import progress_records

PROGRESS_SLACK = 2.0  # a weight may be up to this many times what the sender's signed progress makes plausible
PROGRESS_REFRESH = 5.0  # seconds: the signed progress records are re-read (in the background) at most this often
FIRST_READ_WAIT = 2.0  # seconds a reducer waits for its first read of the records (collab.swarm.state, ~0.1-1 s)


class ReadsSignedProgress:
    """A mixin of a DecentralizedAverager (its `dht`, `prefix`, `kind`, `_outer_pipe`): the run's signed progress
    records as last read, cached per process in `_progress_cache`."""

    def _weight_caps(self, epoch: Optional[int] = None) -> dict[str, float]:
        """Per peer id, the most averaging weight (samples) its signed progress makes plausible now: the samples
        it reported plus its reported rate times the time since, with slack (records lag; rates are averages).
        `epoch`: the round's; a record of another epoch bounds nothing (the group's median does)."""
        now, caps, records = get_dht_time(), {}, self._signed_progress()
        # hivemind's rate is an EMA of seconds per sample, whose first intervals (a cold first batch) are slow: a
        # peer that started seconds ago reports a fraction of its rate (a late joiner's went 13 -> 52 -> 126
        # samples/s over its first three outer steps, and its honest weight was capped). No peer is held to less
        # than the run's median rate, which one peer cannot move
        rates = [r.samples_per_second for r in records.values()
                 if isinstance(getattr(r, "samples_per_second", None), float) and r.samples_per_second >= 1e-3]
        floor = statistics.median(rates) if rates else 0.0
        for peer, record in records.items():
            # a record of another epoch says nothing of the samples toward this one. A peer that stepped on its own
            # gradients publishes the epoch before with no samples (collab.modes.replica_sync), freshly timed, while
            # it computes toward the swarm's epoch: capped by that record, its honest weight was cut to a micro-batch
            # or two and reported, and in a 2-peer run, where both step alone after a failed round, each peer then
            # called the other a suspect (a dashboard test in CI)
            if epoch is not None and getattr(record, "epoch", None) != epoch:
                continue
            try:
                rate = record.samples_per_second
                plausible = record.samples_accumulated + max(rate, floor) * max(0.0, now - record.time)
            except (AttributeError, TypeError):
                continue
            # hivemind's rate is over compute time only, so rate x wall time over-estimates: honest weights pass.
            # A record with no rate yet (a peer that just started) bounds nothing: a cap would wrong a new peer
            if rate >= 1e-3 and math.isfinite(plausible):
                caps[peer] = max(1.0, PROGRESS_SLACK * plausible)
        return caps

    def read_progress_soon(self, seen: dict) -> None:
        """(the trainer's process) Before this averager's first round: `seen`, the trainer's tracker's last
        view of the run's progress records (base58 -> (epoch, client mode), signed records only), is this averager's
        until its own read of the records is back; that read starts now. Without it, a first round starts the read
        itself and waits FIRST_PLAN_WAIT for it: 24 peers on 2 cores, 21 of them had none back by then (a read took
        4-6 s), so no planned leader and no group target, and the first round split into groups of 2-8; every
        later round, with the records, had one plan on every peer. The view names who trains, at which epoch, and
        who can lead: all a plan needs (weight caps wait for the signed records themselves)."""
        if self.is_alive():
            self._outer_pipe.send(("_read_progress_soon", [dict(seen)], {}))

    async def _read_progress_soon(self, seen: dict) -> None:
        cache = self._progress_state()
        if not cache["records"]:
            cache["records"] = {peer: SimpleNamespace(epoch=epoch, client_mode=client) for peer, (epoch, client)
                                in seen.items() if type(epoch) is int and type(client) is bool}
        if cache["task"] is None or cache["task"].done():
            cache["read_at"] = float("-inf")  # whatever the last read's age: the swarm may have grown since
            self._signed_progress()

    def _signed_progress(self) -> dict:
        """The run's progress records (hivemind's tracker, signed; collab.swarm.state drops untrusted ones) as last
        read; a read older than PROGRESS_REFRESH starts another in the background, so no round waits for one."""
        cache = self._progress_state()
        if (cache["task"] is None or cache["task"].done()) and time.monotonic() - cache["read_at"] > PROGRESS_REFRESH:
            cache["read_at"] = time.monotonic()
            cache["task"] = asyncio.ensure_future(self._read_signed_progress(cache))
        return cache["records"]

    def _progress_state(self) -> dict:
        """(the averager's process) The last read of the records, when it started, and the read under way."""
        return self.__dict__.setdefault("_progress_cache", {"read_at": float("-inf"), "records": {}, "task": None})

    async def _read_signed_progress(self, cache: dict) -> None:
        try:
            records = await asyncio.get_event_loop().run_in_executor(
                None, progress_records, self.dht, run_id_of(self.prefix))
            # an empty read (a walk that found nothing: on a busy machine one can time out) keeps the records it
            # had, the trainer's view among them (read_progress_soon): a plan from those beats none
            if records or not cache["records"]:
                cache["records"] = records
        except Exception as e:  # no records: no caps from them this time (the median cap still holds)
            logging.getLogger(__name__).debug(f"could not read the run's progress: {e!r}")
        finally:
            cache["read_once"] = True

    async def _first_progress_read(self, timeout: float = FIRST_READ_WAIT) -> None:
        """A peer's first rounds come before its first read of the records is back: without them, only the
        group's median bounds a weight, and an honest peer's whole outer step (472 samples beside a late joiner's
        8) was capped at 10x it. Wait a moment for that first read; later rounds use the last one at once."""
        cache = self.__dict__.get("_progress_cache")
        if cache is not None and not cache.get("read_once") and cache["task"] is not None:
            await asyncio.wait({cache["task"]}, timeout=timeout)


def run_id_of(prefix: str) -> str:
    """hivemind names a run's averagers RUN_ID + "_grad_averager" / "_state_averager"."""
    for suffix in ("_grad_averager", "_state_averager"):
        if prefix.endswith(suffix):
            return prefix[:-len(suffix)]
    return prefix
