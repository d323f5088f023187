"""What a peer's DHT node sends the swarm: requests (find, store, ping) and their bytes, counted in the DHT's own
process (collab.hivemind_hooks.dht_node.count_dht_requests) and read from there with the DHT's run_coroutine.

As a swarm grows, each peer's DHT traffic is one of the costs that must not grow with it (benchmarks/scale.py reads
it from each peer's summary, per minute)."""

from __future__ import annotations

import time
from collections import defaultdict
from functools import partial
from typing import Iterable, Mapping, Optional, Union

from hivemind.dht.routing import DHTID

from collab.adaptive.batch_plan import PLAN_SUFFIX
from collab.hivemind_hooks.dht_node import count_dht_requests, twin_key
from collab.hivemind_hooks.patches import dht_takes_requests
from collab.records.metrics import METRICS_SUFFIX, PROGRESS_SUFFIX
from collab.records.shared_reads import counts_here
from collab.run.gate import MEMBERS_SUFFIX, REVOKED_SUFFIX
from collab.run.shard_fetch import CLAIMS_SUFFIX, HOLDINGS_SUFFIX
from collab.run.sharing import MANIFEST_SUFFIX

READ_TIMEOUT = 5.0


class DHTRequests:
    """Counts per RPC: requests sent, failed (no reply), request and reply bytes; and per key asked for (find and
    store name their keys by DHT id), requests and bytes; since the counting started."""

    def __init__(self):
        self.started = time.monotonic()
        self.by_rpc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self.by_key: dict[bytes, list[int]] = defaultdict(lambda: [0, 0])

    def count(self, rpc: str, request, reply) -> None:
        sent, received = request.ByteSize(), reply.ByteSize() if reply is not None else 0
        row = self.by_rpc[rpc.removeprefix("rpc_")]
        row[0] += 1
        row[1] += reply is None
        row[2] += sent
        row[3] += received
        keys = list(getattr(request, "keys", ()))
        for key in keys:  # a request for several keys: its bytes shared among them
            self.by_key[bytes(key)][0] += 1
            self.by_key[bytes(key)][1] += (sent + received) // len(keys)

    def report(self, names: Union[Iterable[str], Mapping[str, str]] = ()) -> dict:
        """`names`: keys this peer knows (the run's progress, metrics, group keys...), or key -> the row it counts
        in (each epoch's group keys in one): the others are "other"."""
        rows = {rpc: dict(requests=r[0], failed=r[1], bytes_sent=r[2], bytes_received=r[3])
                for rpc, r in sorted(self.by_rpc.items())}
        labels = names if isinstance(names, Mapping) else {name: name for name in names}
        named: dict[bytes, str] = {}
        for name, label in labels.items():
            key_id = DHTID.generate(source=name)
            named[key_id.to_bytes()] = label
            # a store's walk, and the walk for the nodes a shared read asks, ask for the key's twin (dht_node)
            named[twin_key(key_id).to_bytes()] = f"{label} (walks for its nodes)"
        by_key: dict[str, dict] = {}
        for key, (requests, size) in self.by_key.items():
            row = by_key.setdefault(named.get(key, "other"), dict(requests=0, bytes=0))
            row["requests"] += requests
            row["bytes"] += size
        return {"seconds": round(time.monotonic() - self.started, 1),
                "requests": sum(r["requests"] for r in rows.values()),
                "bytes_sent": sum(r["bytes_sent"] for r in rows.values()),
                "bytes_received": sum(r["bytes_received"] for r in rows.values()),
                "by_rpc": rows, "by_key": dict(sorted(by_key.items(), key=lambda kv: -kv[1]["bytes"]))}


GROUP_BITS = ("", "0", "1", "00", "01", "10", "11")  # hivemind's group keys are PREFIX.0bBITS
EPOCHS_NAMED = 1000  # each epoch's group keys are named for this many epochs back from a peer's last


def known_keys(run_id: str, epochs: Iterable[int] = ()) -> dict[str, str]:
    """The DHT keys of a run that its peers read and write (collab's records; hivemind's progress, its averagers'
    donor lists and group keys; the gradient rounds' group keys of `epochs`, which each round is matched under:
    collab.averaging.grad_averager.EpochGroups), each with the row of a report it counts in."""
    names = [run_id + suffix for suffix in (PROGRESS_SUFFIX, METRICS_SUFFIX, PLAN_SUFFIX, MANIFEST_SUFFIX,
                                            HOLDINGS_SUFFIX, MEMBERS_SUFFIX, REVOKED_SUFFIX, CLAIMS_SUFFIX)]
    for averager in ("_grad_averager", "_state_averager"):
        names += [f"{run_id}{averager}.all_averagers", *(f"{run_id}{averager}.0b{bits}" for bits in GROUP_BITS)]
    labels = {name: name for name in names}
    for epoch in epochs:
        for bits in GROUP_BITS:
            labels[f"{run_id}_grad_averager_epoch{epoch}.0b{bits}"] = f"{run_id}_grad_averager_epoch*.0b (rounds)"
    return labels


_counting: Optional[DHTRequests] = None  # in the DHT's process


async def _start(_dht, node) -> None:
    global _counting
    if _counting is None:
        _counting = DHTRequests()
        count_dht_requests(node.protocol, _counting.count)


async def _report(dht, _node, names: tuple = (), run_id: str = "") -> Optional[dict]:
    if _counting is None:
        return None
    report = _counting.report(names)
    verdicts = getattr(dht, "verdicts", None)  # collab.swarm.node.OwnGroupDHT's: records checked, and remembered
    if verdicts is not None:
        report["records"] = verdicts.counts()
    # the shared keys' reads: walked, spared, asked of the nearest nodes (collab.records.shared_reads); the progress
    # key's, and the metrics key's (without a run id: all shared keys' in one)
    shared = counts_here(run_id + PROGRESS_SUFFIX if run_id else None)
    if shared is not None:
        report["shared_reads"] = shared
        if run_id:
            report["shared_metrics_reads"] = counts_here(run_id + METRICS_SUFFIX)
    return report


def start_counting(dht) -> None:
    """From any process holding the DHT: count its node's requests from now on."""
    dht.run_coroutine(_start)


def ask_for_counts(dht, run_id: str = "", last_epoch: Optional[int] = None):
    """Ask the DHT's process for the counts so far, with the run's known keys named (and the rounds' group keys up to
    `last_epoch`); the answer (a future, None if the DHT could not be asked) is read with `counts_answered`. Asked
    before a slow step (the averagers' shutdown), it is answered meanwhile."""
    epochs = range(max(0, last_epoch + 2 - EPOCHS_NAMED), last_epoch + 2) if last_epoch is not None else ()
    if not dht_takes_requests(dht):  # a DHT process that stopped reading its pipe: the ask would block for good
        return None
    try:
        report = partial(_report, names=known_keys(run_id, epochs) if run_id else (), run_id=run_id)
        return dht.run_coroutine(report, return_future=True)
    except Exception:  # a DHT shutting down: no figures this time
        return None


def counts_answered(asked, timeout: float = READ_TIMEOUT) -> Optional[dict]:
    """What `ask_for_counts` asked for (None if counting never started, or the DHT did not answer in time)."""
    try:
        return asked.result(timeout=timeout) if asked is not None else None
    except Exception:  # too busy to answer: no figures this time
        return None


def dht_requests(dht, run_id: str = "", timeout: float = READ_TIMEOUT) -> Optional[dict]:
    """The counts so far, with the run's known keys named (None if counting never started, or the DHT did not
    answer in time)."""
    return counts_answered(ask_for_counts(dht, run_id), timeout)
