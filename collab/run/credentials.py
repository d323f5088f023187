"""The flags that say who a peer is and which run it trusts: --identity, --run-key, --token / --token-file.

`collab join`, `collab status` and `collab dashboard` all take them: a dashboard reading a private run
is a peer like any other and needs an invite for its own peer id.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from collab.data.cache import cache_dir
from collab.errors import UserError
from collab.records.identity import Identity, load_or_create_identity
from collab.run.access import expired, read_invite


def default_identity_path() -> Path:
    return cache_dir() / "identity.key"


def add_identity_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", type=Path, default=None, metavar="PATH",
                   help="private key file that keeps your peer id across restarts (created if missing); with "
                        "--token the default is the one 'collab id' uses")


def add_access_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=None, metavar="INVITE", help="your invite to a private run ('collab invite')")
    p.add_argument("--token-file", type=Path, default=None, metavar="PATH", help="a file holding your invite")


@dataclass
class Credentials:
    identity: Identity
    invite: Optional["object"]  # collab.run.access.Invite; None: an open run
    run_key: Optional[str]

    def authorizer(self):
        if self.invite is None:
            return None
        from collab.run.gate import RunAuthorizer  # hivemind: not imported for `collab join --help`

        return RunAuthorizer(self.identity.key, self.invite)


def credentials_from_flags(args: argparse.Namespace, run_id: str) -> Credentials:
    token, where = args.token, "--token"
    if token is not None and args.token_file is not None:
        raise UserError("pass the invite once: --token or --token-file, not both")
    if args.token_file is not None:
        where = f"--token-file {args.token_file}"
        try:
            token = args.token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {where} ({e.strerror or e}); pass the file 'collab invite' output was saved to") from None
    run_key = getattr(args, "run_key", None)
    if token is None:
        return Credentials(load_or_create_identity(args.identity), None, run_key)
    invite = read_invite(token, where)
    identity_path = args.identity if args.identity is not None else default_identity_path()
    identity = load_or_create_identity(identity_path)
    if invite.run_id != run_id:
        raise UserError(f"{where} is an invite to run {invite.run_id!r}, not {run_id!r}; check --run-id")
    if invite.peer_id != identity.peer_id:
        raise UserError(f"{where} invites peer {invite.peer_id}, but this peer is {identity.peer_id} (identity "
                        f"{identity_path}); pass the --identity whose id you sent the organizer ('collab id "
                        "--identity PATH' prints it)")
    if expired(invite.expires_at):
        raise UserError(f"{where} expired; ask the run's organizer for a new invite")
    if run_key is not None and run_key != invite.fingerprint:
        raise UserError(f"--run-key {run_key} is not the key that signed {where} ({invite.fingerprint}); "
                        "check the join line")
    return Credentials(identity, invite, invite.fingerprint)
