"""`collab status`: read the swarm once and print the run state."""

from __future__ import annotations

import argparse
import json
import time

from collab.run.credentials import add_access_flags, add_identity_flag, credentials_from_flags

# hivemind, torch, psutil and rich are imported inside the functions that need them: 'collab --help' and flag errors
# stay instant


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show a run's progress and peers",
                       description="Connect to a run as a client, read every peer's records once, print the state.")
    p.add_argument("--run-id", required=True)
    p.add_argument("--initial-peers", action="extend", nargs="+", required=True, metavar="MADDR",
                   help="multiaddr of any peer in the run")
    p.add_argument("--json", action="store_true", help="print the run state as one JSON object")
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="at most this many seconds for the run's records to appear (default 10)")
    add_watcher_flags(p)
    p.set_defaults(run=run, hard_exit=True)


def add_watcher_flags(p) -> None:
    """A reader of a run is a peer: it may check the run's key, and needs an invite to read a private run."""
    p.add_argument("--run-key", default=None, metavar="FINGERPRINT",
                   help="the organizer's key (from the join line): read the run only if its manifest is signed by it")
    add_identity_flag(p)
    add_access_flags(p)


def watcher_swarm(args: argparse.Namespace, peer):
    """The reader's client peer, with its invite if it has one; --run-key checked against the run's manifest."""
    from collab.swarm.node import Swarm

    credentials = credentials_from_flags(args, args.run_id)
    swarm = Swarm(peer, credentials.identity, authorizer=credentials.authorizer())
    if credentials.run_key is not None:
        from collab.run.sharing import fetch_manifest

        try:
            fetch_manifest(swarm.dht, args.run_id, credentials.run_key, timeout=30)
        except BaseException:
            swarm.shutdown()
            raise
    return swarm


def run(args: argparse.Namespace) -> int:
    from collab.process.lifecycle import reap_children
    from collab.swarm.node import PeerConfig, peer_config_from_flags
    from collab.swarm.state import read_run_state

    peer: PeerConfig = peer_config_from_flags(run_id=args.run_id, initial_peers=args.initial_peers, client_mode=True,
                                              host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    swarm = watcher_swarm(args, peer)
    try:
        # the DHT is bootstrapped once it is up: read at once, and again only while no peer's record came back
        # (a run that just started, or an initial peer that is not a member of this run)
        deadline = time.monotonic() + max(0.0, args.wait)
        state = read_run_state(swarm.dht, args.run_id)
        while not state.peers and time.monotonic() < deadline:
            time.sleep(0.5)
            state = read_run_state(swarm.dht, args.run_id)
    finally:
        swarm.shutdown()
        reap_children()
    if args.json:
        print(json.dumps(state.model_dump()))
    else:
        print(format_state(state))
    return 0


def format_state(state) -> str:
    from rich.console import Console
    from rich.table import Table

    eta = f"{state.eta_seconds:.0f} s" if state.eta_seconds is not None else "unknown"
    target = state.target_batch_size or "?"
    diloco, gossip = state.mode == "diloco", state.mode == "gossip"
    step = "outer step" if diloco else "epoch"
    spread = f", replicas within {state.replica_spread:.2%} of their mean" if state.replica_spread is not None else ""
    table = Table(title=f"run {state.run_id}{f' ({state.mode})' if state.mode != 'sync' else ''}: {step} "
                        f"{state.global_epoch}{spread}, "
                        f"{state.samples_accumulated}/{target} samples toward the next step, "
                        f"{state.samples_per_second:.1f} samples/s, ETA {eta}")
    columns = ["peer", "client", "samples/s", step, "loss", "contributed", "MB/round", "last seen", "refused by others"]
    if diloco:
        columns[4:4] = ["inner steps", "last pseudo-grad norm"]
    if gossip:
        columns[4:4] = ["merges/min", "last merge |Δ|", "from mean"]
    # a run with token shards: where each peer entered their ring and how many windows it read (collab.data.order
    # lists exactly which text that is)
    shards = any(p.data_start is not None for p in state.peers)
    if shards:
        columns.append("data start+windows")
    for column in columns:
        table.add_column(column)
    for p in state.peers:
        refused = f"{p.contributions_rejected} (by {p.reported_by})" if p.contributions_rejected else "0"
        cells = [p.peer_id[-12:], "yes" if p.client_mode else "no", f"{p.samples_per_second:.1f}", str(p.epoch),
                 f"{p.loss:.3f}" if p.loss is not None else "-", f"{p.samples_contributed} ({p.contribution:.0%})",
                 _traffic(p), f"{p.last_seen:.0f} s ago", refused + (" SUSPECT" if p.suspect else "")]
        if diloco:
            cells[4:4] = [str(p.inner_steps) if p.inner_steps is not None else "-",
                          f"{p.pseudo_gradient_norm:.4g}" if p.pseudo_gradient_norm is not None else "-"]
        if gossip:
            cells[4:4] = [f"{p.merges_per_minute:.0f}" if p.merges_per_minute is not None else "-",
                          f"{p.merge_update_norm:.4g}" if p.merge_update_norm is not None else "-",
                          f"{p.distance_to_mean:.2%}" if p.distance_to_mean is not None else "-"]
        if shards:
            cells.append(f"{p.data_start:.4f}+{p.data_position}" if p.data_start is not None else "-")
        table.add_row(*cells)
    console = Console(width=140, record=True)
    with console.capture() as capture:
        console.print(table)
        for p in state.peers:
            if p.suspect:
                reasons = ", ".join(f"{n} {why}" for why, n in sorted(p.rejected_by_reason.items(), key=lambda r: -r[1]))
                console.print(f"suspect {p.peer_id}: {p.reported_by} peers refused from it: {reasons}")
            if p.online and p.straggler and p.straggler_reason:
                console.print(f"straggler {p.peer_id[-12:]}: {p.straggler_reason}")
            if p.batches_dropped:
                console.print(f"{p.peer_id[-12:]} dropped {p.batches_dropped} of its own micro-batches "
                              "(non-finite loss or gradients; none were sent)")
        if state.noise_scale is not None:
            console.print(noise_scale_line(state.noise_scale, state.target_batch_size, state.noise_scale_peers))
        if state.goodput is not None or state.progress_steps is not None:
            console.print(goodput_line(state))
        if state.rejected_records:
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(state.rejected_by_reason.items()))
            signers = ", ".join(f"{who[-12:]} ({n})" for who, n in state.rejected_by_signer.items())
            console.print(f"ignored {state.rejected_records} untrusted records: {reasons}; from {signers}")
    return capture.get()


def noise_scale_line(b_noise: float, target, peers: int) -> str:
    """B_noise against the target, and what it means (collab.adaptive.noise_scale)."""
    if target:
        ratio = b_noise / target
        advice = ("the target is well below it: a larger one would need fewer steps for nearly the same samples" if ratio > 2 else "the target is well above it: a smaller one would reach "
                  "the same loss with fewer samples" if ratio < 0.5 else "the target is near it: a good size")
        vs = f" against a target of {target} ({ratio:.2g}x): {advice}"
    else:
        vs = ""
    return (f"gradient noise scale B_noise ~ {b_noise:.0f} samples (the batch at which a gradient's noise equals "
            f"its signal; from {peers} peer(s)){vs}")


def goodput_line(state) -> str:
    """Goodput and the schedule's progress in scale-invariant steps (collab.adaptive.batch_plan)."""
    parts = []
    if state.goodput is not None:
        parts.append(f"goodput {state.goodput:.1f} samples/s ({state.samples_per_second:.1f} samples/s x "
                     f"statistical efficiency {state.efficiency:.2f} at target {state.target_batch_size} against "
                     f"base batch {state.base_batch_size})")
    if state.progress_steps is not None:
        gain = f", learning-rate gain {state.lr_gain:.3g}" if state.lr_gain is not None else ""
        end = (f", ETA {state.eta_to_end_seconds:.0f} s to the schedule's end" if state.eta_to_end_seconds is not None
               else "")
        parts.append(f"schedule at {state.progress_steps:.1f}/{state.total_steps} scale-invariant steps{gain}{end}")
    return "; ".join(parts)


def _traffic(peer) -> str:
    """'12.3 (4.0x)': MB sent and received per gradient round, and how many times fewer than fp32."""
    if peer.mb_per_round is None:
        return "-"
    ratio = f" ({peer.fewer_bytes_than_fp32:.1f}x)" if peer.fewer_bytes_than_fp32 is not None else ""
    return f"{peer.mb_per_round:.3g}{ratio}"
