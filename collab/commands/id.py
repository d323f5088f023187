"""`collab id`: print this peer's id, to send to a private run's organizer for an invite."""

from __future__ import annotations

import argparse

from collab.records.identity import load_or_create_identity
from collab.run.credentials import add_identity_flag, default_identity_path


def add_parser(sub) -> None:
    p = sub.add_parser("id", help="print this peer's id (send it to an organizer for an invite)",
                       description="Print the peer id of your identity key (created if missing). A private run's "
                                   "organizer makes your invite for this id: join with the same --identity.")
    add_identity_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = args.identity if args.identity is not None else default_identity_path()
    print(load_or_create_identity(path).peer_id, flush=True)
    return 0
