"""`collab init`: make a run's folder - the organizer's key, config, tokenizer and signed manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from collab.config import DEFAULT_CONFIG_NAME


def add_parser(sub) -> None:
    p = sub.add_parser("init", help="create a run: its signed manifest and the organizer's key",
                       description="Create the run's folder: the organizer's signing key (keep it safe), the config, "
                                   "the tokenizer and the manifest that peers check. Then start the first peer "
                                   "with 'collab join --run DIR'.")
    p.add_argument("run_id", metavar="RUN_ID", help="name of the run (letters, digits, '_' or '-')")
    p.add_argument("--config", type=Path, default=None,
                   help=f"run config: a YAML file or a shipped one's name (default: {DEFAULT_CONFIG_NAME})")
    p.add_argument("--private", action="store_true", help="only peers with an invite from this folder may join")
    p.add_argument("--dir", type=Path, default=None, help="where to create the run's folder (default: ./RUN_ID)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from collab.config import check_run_id, load_config, resolve_config_path

    check_run_id(args.run_id, "RUN_ID")
    config_path = resolve_config_path(args.config)
    config = load_config(config_path)
    folder = args.dir if args.dir is not None else Path(args.run_id)

    from collab.run.folder import create_run_folder

    run_ = create_run_folder(args.run_id, config_path, config, folder, args.private)
    kind = "private" if args.private else "open"
    print(f"Created {kind} run {args.run_id!r} in {folder}/ (organizer key {run_.fingerprint}).\n"
          f"Keep {folder}/organizer.key safe: whoever holds it defines the run.\n"
          f"Start the first peer with:\n  collab join --run {folder}\n"
          "It prints the line volunteers run to join.", flush=True)
    return 0
