"""`collab revoke`: the organizer shuts a peer out of a private run; its peers apply it within a minute."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from collab.commands.invite import check_peer_id
from collab.data.cache import write_atomically
from collab.errors import UserError
from collab.records.identity import load_or_create_identity
from collab.run.access import Revocations, make_invite
from collab.run.folder import REVOKED, load_run_folder

# hivemind, torch and psutil are imported inside _publish_now(), only when a list is published now: 'collab --help'
# and flag errors stay instant


def add_parser(sub) -> None:
    p = sub.add_parser("revoke", help="revoke a peer's invite to a private run",
                       description="Add a peer id to the run's signed revocation list (DIR/revoked.json). The "
                                   "organizer's running peer publishes it to the swarm; with --initial-peers it is "
                                   "published now. Every peer then refuses the revoked one within a minute.")
    p.add_argument("--run", dest="run_dir", type=Path, required=True, metavar="DIR", help="the run's folder (collab init)")
    p.add_argument("--peer", required=True, metavar="PEER_ID", help="the peer id to shut out")
    p.add_argument("--initial-peers", action="extend", nargs="+", default=[], metavar="MADDR",
                   help="publish through these peers now (not needed while 'collab join --run DIR' runs)")
    p.set_defaults(run=run, hard_exit=True)


def run(args: argparse.Namespace) -> int:
    check_peer_id(args.peer)
    folder = load_run_folder(args.run_dir)
    manifest = folder.manifest
    if not manifest.private:
        raise UserError(f"run {manifest.run_id!r} is open: there are no invites to revoke")
    path = args.run_dir / REVOKED
    revoked: list[str] = []
    if path.is_file():
        try:
            current = Revocations.model_validate_json(path.read_bytes())
        except Exception:
            raise UserError(f"{path} is malformed; restore it from your copy (or delete it to start a new list)") from None
        if not current.valid_for(manifest.run_id, manifest.organizer_key):
            raise UserError(f"{path} is not signed by this run's key; restore it from your copy")
        revoked = list(current.peer_ids)
    if args.peer not in revoked:
        revoked.append(args.peer)
    listed = Revocations(run_id=manifest.run_id, peer_ids=revoked, issued_at=time.time()).signed(folder.organizer_key)
    write_atomically(path, listed.model_dump_json().encode())
    if args.initial_peers:
        _publish_now(folder, args.initial_peers, listed)
        print(f"Revoked {args.peer}; published to the swarm: its peers refuse it within a minute", flush=True)
    else:
        print(f"Revoked {args.peer} in {path}; the organizer's peer ('collab join --run {args.run_dir}') publishes it "
              "within seconds (or pass --initial-peers to publish now)", flush=True)
    return 0


def _publish_now(folder, initial_peers: list[str], listed) -> None:
    """A short-lived client peer, invited by the organizer key on the spot, stores the list in the swarm."""
    from collab.process.lifecycle import reap_children
    from collab.run.gate import REVOKED_SUFFIX, RunAuthorizer
    from collab.run.watch import publish
    from collab.swarm.node import Swarm, peer_config_from_flags

    run_id = folder.manifest.run_id
    identity = load_or_create_identity(None)
    invite = make_invite(run_id, identity.peer_id, folder.organizer_key, lifetime=600)
    peer = peer_config_from_flags(run_id=run_id, initial_peers=initial_peers, client_mode=True,
                                  host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    swarm = Swarm(peer, identity, authorizer=RunAuthorizer(identity.key, invite))
    try:
        publish(swarm.dht, run_id + REVOKED_SUFFIX, swarm.public_key, listed.model_dump_json())
        stored = swarm.dht.get(run_id + REVOKED_SUFFIX, latest=True)
        if stored is None or not stored.value:
            raise UserError("could not store the revocation list through --initial-peers; it is saved in the run "
                            "folder: start 'collab join --run DIR' or try again")
    finally:
        swarm.shutdown()
        reap_children()
