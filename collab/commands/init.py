"""`collab init`: make a run's folder - the organizer's key, config, tokenizer and signed manifest."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from collab.config import DEFAULT_CONFIG_NAME, check_run_id, load_config, resolve_config_path
from collab.data.paths import dataset_parts
from collab.errors import UserError
from collab.run.folder import SHARD_TOKENS, create_run_folder
from collab.run.manifest import shards_url


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
    p.add_argument("--dataset", default=None, metavar="PATH",
                   help="tokenize this corpus once into the run's token shards, which peers fetch from the swarm: "
                        "text files or folders, .jsonl (a 'text' field), .parquet (a 'text' column), hf:NAME or "
                        "'embedded'; comma-separated for several. Run the same command again to resume")
    p.add_argument("--shards-url", default=None, metavar="URL",
                   help="a URL prefix (or hf:REPO, a hub dataset repository) where you upload the shards too: peers "
                        "download them from there first, and from the swarm when it fails")
    p.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                   help="tokens per shard (default: 16777216, 32 MiB of 16-bit ids)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_run_id(args.run_id, "RUN_ID")
    config_path = resolve_config_path(args.config)
    config = load_config(config_path)
    folder = args.dir if args.dir is not None else Path(args.run_id)
    if args.shard_tokens is not None and args.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be at least 1, got {args.shard_tokens}; leave it out for 16777216")
    url = shards_url(args.shards_url) if args.shards_url is not None else None
    if url is not None and args.dataset is None:
        raise UserError("--shards-url says where the run's token shards live: add the --dataset they are made from")
    if args.dataset is not None:
        dataset_parts(args.dataset, "text, .jsonl or .parquet files")  # a missing path fails now, before any work
    with _PreparationDisplay(args.dataset) as display:
        run_ = create_run_folder(args.run_id, config_path, config, folder, args.private, dataset=args.dataset,
                                 shard_tokens=args.shard_tokens or SHARD_TOKENS, progress=display.update,
                                 shards_url=url)
    data = run_.manifest.data
    if data is not None:
        print(f"Prepared {data.total_tokens:,} tokens of {args.dataset} in {len(data.shards)} shard(s) in "
              f"{folder}/data/ ({display.rate()}).", flush=True)
        if data.url is not None:
            print(f"Upload {folder}/data/*.shard to {data.url} (peers try there first, then the swarm).", flush=True)
    kind = "private" if args.private else "open"
    print(f"Created {kind} run {args.run_id!r} in {folder}/ (organizer key {run_.fingerprint}).\n"
          f"Keep {folder}/organizer.key safe: whoever holds it defines the run.\n"
          f"Start the first peer with:\n  collab join --run {folder}\n"
          "It prints the line volunteers run to join.", flush=True)
    return 0


class _PreparationDisplay:
    """A progress bar for the tokenization of --dataset (text read, tokens written, MB/s); nothing without one."""

    def __init__(self, dataset):
        self.dataset, self.bytes, self.started, self.progress = dataset, 0, time.monotonic(), None

    def __enter__(self) -> "_PreparationDisplay":
        if self.dataset is not None and sys.stderr.isatty():  # a log file gets the summary line only
            from rich.console import Console
            from rich.progress import Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("tokenizing {task.description}: {task.fields[mb]:.1f} MB of text, "
                                                "{task.fields[tokens]:,} tokens, {task.fields[rate]}"),
                                     TimeElapsedColumn(), transient=True, console=Console(stderr=True))
            self.task = self.progress.add_task(self.dataset, total=None, mb=0.0, tokens=0, rate="")
            self.progress.start()
        return self

    def update(self, read: int, tokens: int) -> None:
        if read == 0:  # the reading starts: the rate counts from here, not from the key and the tokenizer
            self.started = time.monotonic()
        self.bytes = read
        if self.progress is not None:
            self.progress.update(self.task, mb=read / 1e6, tokens=tokens, rate=self.rate())

    def rate(self) -> str:
        return f"{self.bytes / 1e6 / max(time.monotonic() - self.started, 1e-9):.1f} MB/s"

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
