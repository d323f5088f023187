"""`collab invite`: the organizer lets one peer id into a private run, until the invite expires."""

from __future__ import annotations

import argparse
from pathlib import Path

from collab.errors import UserError
from collab.run.access import make_invite, parse_duration
from collab.run.folder import load_run_folder


def add_parser(sub) -> None:
    p = sub.add_parser("invite", help="invite a peer to a private run (prints its token)",
                       description="Sign an invite to the run in --run DIR for one peer id ('collab id' prints it on "
                                   "the invited machine). Send the printed line; they join with --token-file.")
    p.add_argument("--run", dest="run_dir", type=Path, required=True, metavar="DIR", help="the run's folder (collab init)")
    p.add_argument("--peer", required=True, metavar="PEER_ID", help="the invited peer's id")
    p.add_argument("--expires", default="30d", metavar="DURATION", help="how long the invite holds (default 30d)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    lifetime = parse_duration(args.expires)
    check_peer_id(args.peer)
    folder = load_run_folder(args.run_dir)
    if not folder.manifest.private:
        raise UserError(f"run {folder.manifest.run_id!r} in {args.run_dir} is open: anyone with the join line may "
                        "join, no invite needed (make a private run with 'collab init RUN_ID --private')")
    print(make_invite(folder.manifest.run_id, args.peer, folder.organizer_key, lifetime).to_text(), flush=True)
    return 0


def check_peer_id(text: str) -> None:
    from hivemind.p2p import PeerID  # heavy (hivemind, torch): imported when the command runs, not for --help

    try:
        PeerID.from_base58(text)
    except Exception:
        raise UserError(f"--peer {text!r} is not a peer id; it looks like Qm… ('collab id' prints it)") from None
