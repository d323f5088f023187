"""`collab join`: run a trainer peer in a collaborative run."""

from __future__ import annotations

import argparse
import tempfile
import threading
import traceback
from pathlib import Path

from collab.config import COMPRESSIONS, DEFAULT_CONFIG_NAME, FLAG_TO_FIELD, check_run_id, load_config, user_settings
from collab.data.paths import dataset_parts, require_tokenizer_file
from collab.errors import InternalError, UserError
from collab.process.ports import require_free_port
from collab.records.identity import load_or_create_identity
from collab.run.credentials import add_access_flags, add_identity_flag, credentials_from_flags
from collab.run.folder import MANIFEST, load_run_folder

# hivemind, torch and the trainer are imported inside the functions that need them, once the flags and the config are
# checked, and psutil (collab.process.lifecycle) inside run(): 'collab --help' and a flag or config mistake stay quick


def add_parser(sub) -> None:
    p = sub.add_parser("join", help="train with a swarm (or start a new one)",
                       description="Join a collaborative run as a trainer. Without --initial-peers, start a "
                                   "new swarm and print the command others use to join it.")
    add_join_flags(p)
    p.set_defaults(run=run, hard_exit=True)


def add_join_flags(p) -> None:
    """The flags of a join line; `collab doctor` takes the same line, so that a volunteer checks exactly it."""
    p.add_argument("--run-id", default=None, help="name of the run; all peers of a run use the same one")
    p.add_argument("--run-key", default=None, metavar="FINGERPRINT",
                   help="the organizer's key (from the join line): the run's manifest must be signed by it")
    p.add_argument("--run", dest="run_dir", type=Path, default=None, metavar="DIR",
                   help="start as the run's organizer, from the folder 'collab init' made")
    p.add_argument("--initial-peers", action="extend", nargs="+", default=[], metavar="MADDR",
                   help="multiaddr of any peer already in the run (/ip4/…/tcp/…/p2p/…); repeatable")
    p.add_argument("--config", type=Path, default=None,
                   help=f"run config for a new run: a YAML file or the name of a shipped one (default: "
                        f"{DEFAULT_CONFIG_NAME}; see configs/). Peers that join take the run's config from its "
                        "manifest; theirs may only set per-peer things (micro-batch size, dataset, bandwidth)")
    p.add_argument("--host-maddrs", nargs="+", default=None, metavar="MADDR",
                   help="addresses to listen on (default /ip4/0.0.0.0/tcp/0: all interfaces, a free port)")
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="addresses others should dial, e.g. your public IP and forwarded port")
    p.add_argument("--client-mode", action="store_true",
                   help="for peers behind NAT or a firewall: connect out only, accept no connections")
    add_identity_flag(p)
    add_access_flags(p)
    p.add_argument("--max-epochs", type=int, default=None, metavar="N", help="leave once the run reaches epoch N")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save checkpoints here and resume from them")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="checkpoint every N epochs")
    p.add_argument("--micro-batch-size", type=_number_or_auto, default=None, metavar="N|auto",
                   help="samples per local step (config: training); auto: the largest that fits your GPU")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="where this peer computes (default auto: its GPU if torch sees one)")
    p.add_argument("--precision", default=None, choices=("auto", "fp32", "fp16", "bf16"),
                   help="autocast precision of forward/backward (default auto: fp16 on a GPU, fp32 on a CPU)")
    p.add_argument("--compile", default=None, choices=("auto", "on", "off"),
                   help="torch.compile the model (default auto: on a GPU only); a "
                        "failure falls back to eager")
    p.add_argument("--gpus", default=None, metavar="all|0,1",
                   help="one peer for several GPUs: a process per GPU, gradients summed inside the machine (default: "
                        "one process on --device)")
    p.add_argument("--data-workers", type=_number_or_auto, default=None, metavar="0|1|auto",
                   help="worker processes that make batches ahead of training (default auto: 1 on a GPU, 0 on a CPU)")
    p.add_argument("--target-batch-size", type=_number_or_auto, default=None, metavar="N|auto",
                   help="swarm-wide batch per optimizer step; auto: it follows the measured gradient noise scale")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--dataset", default=None,
                   help="'embedded', local text files/folders (comma-separated), or hf:NAME (a Hugging Face dataset)")
    p.add_argument("--data-cache-gb", type=float, default=None, metavar="GB",
                   help="disk the run's token shards may take on this machine (default 20); the least recently "
                        "used go first")
    p.add_argument("--tokenizer", default=None, help="'embedded', a tokenizer.json, a tokenizer folder, or a hub name")
    p.add_argument("--compression", default=None, choices=COMPRESSIONS,
                   help="how gradients travel, for a new run (default fp16; powersgd sends ~10x+ fewer bytes)")
    p.add_argument("--mode", default=None, choices=("sync", "diloco", "gossip"),
                   help="how the swarm averages (fixed for a run by its manifest): sync (gradients every target "
                        "batch), diloco (inner steps, then pseudo-gradients every target batch) or gossip (local "
                        "steps, pairwise merges with random peers)")
    p.add_argument("--matchmaking-time", type=float, default=None, help="seconds to form an averaging group")
    p.add_argument("--group-size", type=int, default=None,
                   help="begin a round once this many peers joined it, before --matchmaking-time is up")
    p.add_argument("--bandwidth", type=float, default=None, metavar="MBPS",
                   help="your upload bandwidth in Mbit/s; slow peers get a smaller share of the all-reduce")
    p.add_argument("--wait-peers", type=int, default=1, metavar="N",
                   help="wait until N peers are in the run before training (giving up after 3 minutes in which "
                        "no new peer came); for simulations")
    p.add_argument("--dashboard-port", type=int, default=None, metavar="P",
                   help="also serve the run's dashboard from this peer on 127.0.0.1:P")
    p.add_argument("--summary-json", type=Path, default=None, help="write a JSON summary here when the peer exits")
    p.add_argument("--no-live", action="store_true", help="print one line per epoch instead of a live bar")


def _number_or_auto(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a whole number nor 'auto'") from None


# a forced exit reaps the children and exits within its reap's timeouts (collab.process.lifecycle._force_exit)
FORCED_EXIT_WAIT = 10.0


def raise_internal_error(error: Exception):
    """A bug, not a user mistake: one line on the terminal, the traceback in a file to attach to a report."""
    from collab.process.lifecycle import StopOnSignal

    StopOnSignal.wait_out_forced_exit(FORCED_EXIT_WAIT)  # an error of the forced exit's own making: no report
    # formatted first, written in one call: a report is whole or absent, never an empty file
    text = "".join(traceback.format_exception(error))
    fd, path = tempfile.mkstemp(prefix="collab-crash-", suffix=".log")
    with open(fd, "w") as f:
        f.write(text)
    raise InternalError(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
                        f"(traceback in {path}; please report it)") from None


def run(args: argparse.Namespace) -> int:
    from collab.process.lifecycle import StopOnSignal, reap_children

    # first: a SIGTERM while torch and hivemind are still importing must be a graceful leave, not a kill
    stop = getattr(args, "early_stop", None) or threading.Event()  # set if a signal came during start-up
    guard = StopOnSignal(stop).install()
    try:
        return _join(args, stop)
    finally:
        guard.cancel()
        reap_children()


def _run_id(args: argparse.Namespace) -> str:
    """--run-id, or the run folder's; both given must agree."""
    token = args.token is not None or args.token_file is not None
    if args.run_dir is None:
        if args.run_key is not None and not args.initial_peers:
            raise UserError("--run-key checks the manifest of a run you join: add the join line's --initial-peers")
        if token and not args.initial_peers:
            raise UserError("--token is an invite to a private run you join: add the join line's --initial-peers")
        if args.run_id is None:
            raise UserError("the following arguments are required: --run-id (or --run DIR, for the organizer)")
        return check_run_id(args.run_id)
    if args.run_key is not None or token:
        flag = "--run-key" if args.run_key is not None else "--token"
        raise UserError(f"{flag} is for volunteers; the organizer's peer (--run) holds the key itself: drop it")
    folder_id = load_run_folder(args.run_dir).manifest.run_id
    if args.run_id is not None and args.run_id != folder_id:
        raise UserError(f"--run-id {args.run_id!r} differs from the run in {args.run_dir / MANIFEST} ({folder_id!r}); "
                        "drop --run-id")
    return folder_id


def _join(args: argparse.Namespace, stop: threading.Event) -> int:
    if args.max_epochs is not None and args.max_epochs < 0:
        raise UserError(f"--max-epochs {args.max_epochs} is negative; pass a whole number >= 0")
    if args.dashboard_port is not None:
        require_free_port(args.dashboard_port, "--dashboard-port")
    if args.wait_peers < 1:
        raise UserError(f"--wait-peers {args.wait_peers} must be at least 1")
    if args.data_cache_gb is not None and not args.data_cache_gb > 0:
        raise UserError(f"--data-cache-gb {args.data_cache_gb} must be a positive number of gigabytes")
    if args.data_cache_gb is not None and (args.run_dir is not None or not args.initial_peers):
        raise UserError("--data-cache-gb bounds the shards a volunteer fetches; the organizer's peer reads its run "
                        "folder: drop it")
    run_id = _run_id(args)
    overrides = {FLAG_TO_FIELD[name]: getattr(args, name) for name in FLAG_TO_FIELD}
    config = load_config(args.config, overrides)  # a bad config is reported before hivemind and torch import
    user = user_settings(args.config, overrides)
    _check_data_flags(args, config.task.name)
    source = f"--config {args.config}" if args.config is not None else None

    from collab.swarm.node import peer_config_from_flags

    peer_flags = dict(run_id=run_id, initial_peers=args.initial_peers, announce_maddrs=args.announce_maddrs,
                      client_mode=args.client_mode, identity=args.identity)
    if args.host_maddrs:
        peer_flags["host_maddrs"] = args.host_maddrs
    peer = peer_config_from_flags(**peer_flags)

    from collab.run import joining
    from collab.train import trainer

    options = trainer.JoinOptions(max_epochs=args.max_epochs, summary_path=args.summary_json,
                                  live_display=False if args.no_live else None, wait_peers=args.wait_peers,
                                  dashboard_port=args.dashboard_port)
    swarm = None
    try:
        from collab.swarm.node import Swarm

        if args.run_dir is not None:
            identity = load_or_create_identity(args.identity)
            config, shared = joining.as_organizer(args.run_dir, user, source, identity.peer_id)
            if shared.private is not None:  # its own DHT node already answers only to invited peers
                from collab.run.gate import RunAuthorizer

                swarm = Swarm(peer, identity, authorizer=RunAuthorizer(identity.key, shared.private.invite))
        elif not args.initial_peers:
            config, shared = joining.as_first_peer(run_id, config, user)
        else:  # the run's config and tokenizer come from the swarm: join it first
            credentials = credentials_from_flags(args, run_id)
            swarm = Swarm(peer, credentials.identity, authorizer=credentials.authorizer())
            swarm, peer = _as_reachable_as_it_is(
                swarm, peer, lambda client: Swarm(client, credentials.identity, authorizer=credentials.authorizer()),
                stop)
            cache_gb = args.data_cache_gb if args.data_cache_gb is not None else joining.DATA_CACHE_GB
            config, shared = joining.as_volunteer(swarm, credentials.run_key, user, source, stop, credentials.invite,
                                                  cache_gb)
        summary = trainer.run(config, peer, options, stop, shared=shared, swarm=swarm)
    except UserError:
        if not stop.is_set():
            raise
        # a signal during start-up (a simulation ending, churn) cuts the DHT's bootstrap short: that failure is
        # the leave the user asked for, not an error. Nothing had joined, so nothing is lost
        trainer.leave_before_start(options)
        print("Left during start-up (stopped by signal)", flush=True)
        return 0
    except Exception as e:
        raise_internal_error(e)
    finally:
        if swarm is not None:
            swarm.shutdown()
    if shared.private is not None and shared.private.lost is not None:
        raise UserError(shared.private.lost)
    losses = list(summary.loss_by_epoch.values())
    trend = f", loss {losses[0]:.3f} -> {losses[-1]:.3f}" if len(losses) >= 2 else ""
    print(f"Left the run at epoch {summary.final_epoch} ({summary.exit_reason}): contributed "
          f"{summary.samples_contributed} samples, averaged in {summary.rounds_joined} rounds{trend}", flush=True)
    return 0


def _as_reachable_as_it_is(swarm, peer, restart, stop: threading.Event):
    """A joining peer asks swarm peers to dial it back (collab.swarm.reachability) and runs as what they found: a
    full peer when they reach it, else a client (hivemind's averagers and DHT would otherwise hand others an address
    nobody can dial: their rounds with it fail). --client-mode and --announce-maddrs say it already."""
    if peer.client_mode or peer.announce_maddrs:
        return swarm, peer
    from collab.swarm.reachability import ask_to_dial_back

    found = ask_to_dial_back(swarm, stop=stop)
    if found.verdict != "not reachable":
        print(f"Reachability: {found.reason}", flush=True)
        return swarm, peer
    print(f"Joining as a client (it trains and sends its parts; others reduce them): {found.reason}", flush=True)
    swarm.shutdown()
    client = peer.model_copy(update={"client_mode": True})
    return restart(client), client


def _check_data_flags(args: argparse.Namespace, task: str) -> None:
    """A --dataset or --tokenizer path that does not exist is an error now, before torch is imported."""
    if args.dataset is not None:
        dataset_parts(args.dataset, "image files" if task == "swav" else "text files")
    if args.tokenizer is not None:
        require_tokenizer_file(args.tokenizer)
