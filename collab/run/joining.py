"""Which run a starting peer joins, and with what config: the three ways in.

- the organizer, `collab join --run DIR`: the folder's manifest and key;
- the first peer of a quick-start run (no `--initial-peers`, no folder): a key and manifest made now;
- everyone else: the manifest fetched from the swarm and checked against `--run-key` (without it,
  the one key the swarm offers is trusted, and said), then the tokenizer fetched and checked; the run's
  token shards are fetched as training reaches them (collab.data.feed, collab.run.shard_fetch).

In every case the config a peer trains with is the manifest's, with only the per-peer settings its
user gave; a run-wide setting the user gave that differs from the manifest's is refused.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Optional

from collab.config import RunConfig
from collab.data.cache import cache_dir, write_atomically
from collab.data.feed import AHEAD
from collab.data.paths import SHARDS_PREFIX
from collab.data.shard_cache import ShardCache
from collab.data.shards import file_sha256
from collab.errors import UserError
from collab.run.access import AccessList, make_invite
from collab.run.folder import REVOKED, ephemeral_run, load_run_folder
from collab.run.gate import MEMBERS_SUFFIX
from collab.run.manifest import DATASET_FIELD, Manifest, config_for_peer, contradictions, user_sets, user_value
from collab.run.shard_fetch import RunShards, max_shard_bytes, shard_infos
from collab.run.sharer import SharedRun
from collab.run.sharing import TOKENIZER_NAME, fetch_manifest, fetch_run_file
from collab.run.watch import PrivateRun, publish

ORGANIZER_INVITE_SECONDS = 10 * 365 * 86400.0  # the organizer's own peer: as long as the run lives
DATA_CACHE_GB = 20.0  # default disk budget for the run's token shards on a volunteer's machine


def as_organizer(folder: Path, user: dict, source: Optional[str], peer_id: str) -> tuple[RunConfig, SharedRun]:
    run = load_run_folder(folder)
    _refuse_contradictions(run.manifest, user, source)
    shards = None
    if run.manifest.data is not None:
        _refuse_own_dataset(run.manifest, user)
        shards = RunShards(run.manifest.data, run.shards_folder)
    config = config_for_peer(run.manifest, user, run.tokenizer_file, shards.folder if shards else None)
    private = None
    if run.manifest.private:  # the organizer's peer invites itself, and publishes what 'collab revoke' writes

        invite = make_invite(run.manifest.run_id, peer_id, run.organizer_key, lifetime=ORGANIZER_INVITE_SECONDS)
        private = PrivateRun(invite, AccessList(run.manifest.run_id, run.manifest.organizer_key), folder / REVOKED)
    return config, SharedRun(run.signed, run.fingerprint, run.tokenizer_file, private, run.organizer_key, shards)


def as_first_peer(run_id: str, local: RunConfig, user: dict) -> tuple[RunConfig, SharedRun]:
    run = ephemeral_run(run_id, local)
    shards = RunShards(run.manifest.data, run.shards_folder) if run.manifest.data is not None else None
    # user: its checkpoint dir, not shared
    config = config_for_peer(run.manifest, user, run.tokenizer_file, run.shards_folder)
    return config, SharedRun(run.signed, run.fingerprint, run.tokenizer_file, organizer_key=run.organizer_key,
                             shards=shards)


def as_volunteer(swarm, run_key: Optional[str], user: dict, source: Optional[str],
                 stop: threading.Event, invite=None,
                 data_cache_gb: float = DATA_CACHE_GB) -> tuple[RunConfig, SharedRun]:
    """`invite`: this peer's invite to a private run (its DHT node already presents it on every request);
    `data_cache_gb`: how much disk the run's token shards may take here (the least recently used go first)."""
    run_id = swarm.peer.run_id
    if invite is not None:  # members serve the run's files to members only: be one before asking for them

        publish(swarm.dht, run_id + MEMBERS_SUFFIX, swarm.public_key, invite.to_text())
    manifest, signed, holders = fetch_manifest(swarm.dht, run_id, run_key, stop=stop)
    if run_key is None:
        print(f"No --run-key given: trusting the key the swarm offers for run {run_id!r} ({manifest.fingerprint}). "
              f"Pass --run-key {manifest.fingerprint} to be sure it is the organizer's.", flush=True)
    _refuse_contradictions(manifest, user, source)
    shards = volunteer_shards(manifest, user, data_cache_gb) if manifest.data is not None else None
    tokenizer = None
    if manifest.tokenizer_sha256 is not None:
        tokenizer = cache_dir() / "runs" / f"tokenizer-{manifest.tokenizer_sha256}.json"
        if not tokenizer.is_file():  # cached: a restarted peer does not fetch it again
            ask = list(dict.fromkeys([*holders, *swarm.peer.initial_peer_ids]))  # every peer that holds the manifest, then the ones given
            data = fetch_run_file(swarm.dht, [p for p in ask if p != swarm.peer_id], TOKENIZER_NAME,
                                  manifest.tokenizer_sha256)
            tokenizer.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(tokenizer, data)
    config = config_for_peer(manifest, user, tokenizer, shards.folder if shards is not None else None)
    private = None
    if invite is not None:
        private = PrivateRun(invite, AccessList(run_id, manifest.organizer_key))
    return config, SharedRun(signed, manifest.fingerprint, tokenizer, private, shards=shards)


def volunteer_shards(manifest: Manifest, user: dict, cache_gb: float) -> RunShards:
    """Where a volunteer reads the run's shards: a copy it brought (--dataset), used only if every shard in it is the
    manifest's, or else its disk cache, which fetching from the swarm fills."""
    data, infos = manifest.data, shard_infos(manifest.data)
    if _brings_data(user):
        given = str(user_value(user, DATASET_FIELD))
        folder = Path(given.removeprefix(SHARDS_PREFIX)).expanduser()
        for info in infos:
            path = folder / info.name
            problem = "missing" if not path.is_file() else None
            if problem is None and file_sha256(path) != info.sha256:
                problem = "its sha256 is not the manifest's"
            if problem is not None:
                raise UserError(f"--dataset {given} is not a copy of run {manifest.run_id!r}'s token shards ({info.name}: "
                                f"{problem}); leave --dataset out and the shards come from the swarm")
        return RunShards(data, folder)
    biggest = max(max_shard_bytes(info.tokens) for info in infos)
    # the shard being read and the ones fetched ahead must fit, or each fetch would evict the next one to read
    need = (AHEAD + 2) * biggest * 1e-9
    if cache_gb < need:
        raise UserError(f"--data-cache-gb {cache_gb:g} cannot hold the {AHEAD + 2} shards a peer reads and fetches "
                        f"ahead (up to {biggest / 1e6:.3g} MB each); pass --data-cache-gb {need:.2g} or more")
    digest = hashlib.sha256("".join(i.sha256 for i in infos).encode()).hexdigest()[:16]
    cache = ShardCache(cache_dir() / "shards" / digest, infos, int(cache_gb * 1e9))
    return RunShards(data, cache.folder, cache)


def _brings_data(user: dict) -> bool:
    """Whether the user named data of their own (the default, `embedded`, written out in a config file, is none)."""
    return user_sets(user, DATASET_FIELD) and user_value(user, DATASET_FIELD) != "embedded"


def _refuse_own_dataset(manifest: Manifest, user: dict) -> None:
    if _brings_data(user):
        raise UserError(f"run {manifest.run_id!r} trains on the token shards its manifest lists: leave --dataset "
                        "(and the config's task.data.dataset) out")


def _refuse_contradictions(manifest: Manifest, user: dict, source: Optional[str]) -> None:
    found = contradictions(manifest, user, source)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; a run's model and math come from its manifest: drop that setting "
                        "(a volunteer needs only the join line)")
