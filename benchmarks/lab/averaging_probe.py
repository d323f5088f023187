"""One process of an averaging measurement: hivemind's all-reduce or torch.distributed gloo's.

Run as `python -m benchmarks.lab.averaging_probe ...` inside a peer's namespace (benchmarks.lab.averaging_rounds
starts them). Every process holds a vector filled with `index + 1`, so the exact average is known
and a partial round (hivemind reports those as success) shows up as a wrong value, not a flag.
With `--wire dgc` it holds what a DGC peer sends instead: `index + 1` at 0.1% of the positions (its own,
drawn from its index, so every process knows everyone's) and zeros elsewhere, on dgc's lossless sparse codec.
Each round's timing starts when the all-reduce is triggered (matchmaking is not counted: it is
done before, in the background, in real training too). Results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def interface_bytes() -> tuple[int, int]:
    """(sent, received) on this namespace's eth0 (0, 0 on a machine without one)."""
    base = Path("/sys/class/net/eth0/statistics")
    if not base.is_dir():
        return 0, 0
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


DGC_DENSITY = 0.001  # dgc's default: 99.9% of each matrix left out


def _dgc_positions(index: int, size: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randperm(size, generator=generator)[: max(1, int(size * DGC_DENSITY))]


def _fill(tensor, args) -> None:
    """This process's contribution to a round."""
    if args.wire != "dgc":
        tensor.fill_(args.index + 1)
        return
    tensor.zero_()
    tensor[_dgc_positions(args.index, tensor.numel())] = float(args.index + 1)


def _expected(args):
    """The exact average of every process's contribution."""
    if args.wire != "dgc":
        return (args.world + 1) / 2  # the mean of 1..world
    import torch

    total = torch.zeros(args.size)
    for i in range(args.world):
        total[_dgc_positions(i, args.size)] += i + 1
    return total / args.world


def _round_record(started: float, finished: float, before: tuple[int, int], tensor, expected,
                  group_size: int, error: str = "") -> dict:
    after = interface_bytes()
    return dict(started=started, finished=finished, group_size=group_size, error=error,
                max_error=float((tensor.float() - expected).abs().max()),
                bytes_sent=after[0] - before[0], bytes_received=after[1] - before[1])


def run_hivemind(args, vector) -> list[dict]:
    import hivemind
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression, NoCompression

    initial = []
    if args.index > 0:
        initial = [_wait_for_file(args.rendezvous, 120)]
    private = _private_member(args.organizer_key) if args.organizer_key else {}
    with private.pop("identity_file", _no_file()) as identity_file:
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"], initial_peers=initial, start=True,
                           startup_timeout=60, authorizer=private.get("authorizer"),
                           **(dict(identity_path=str(identity_file)) if identity_file else {}))
    if private:  # every member stores its invite; the gates read them (before the first round, as in a run)
        from collab.run.gate import MEMBERS_SUFFIX
        from collab.run.watch import publish

        publish(dht, "probe" + MEMBERS_SUFFIX, private["subkey"], private["invite"].to_text())
        _barrier(args.rendezvous, "invited", args.index, args.world, timeout=60)
    if args.index == 0:
        maddr = next(str(a) for a in dht.get_visible_maddrs() if args.host in str(a))
        Path(args.rendezvous).write_text(maddr)
    if args.wire == "dgc":
        from collab.averaging.compression import wire_codec

        compression = wire_codec("dgc")
    else:
        compression = Float16Compression() if args.wire == "fp16" else NoCompression()
    if args.aggregation:
        private["averager_class"] = _checked_averager(args.aggregation)
    averager = private.get("averager_class", hivemind.DecentralizedAverager)(
        [vector], dht, prefix="probe", target_group_size=args.world, min_group_size=args.world,
        min_matchmaking_time=args.matchmaking, request_timeout=2.0, bandwidth=args.bandwidth,
        compression=compression, part_size_bytes=args.part_size, next_chunk_timeout=1.2 * args.stall_timeout,
        sender_timeout=args.stall_timeout, reducer_timeout=1.2 * args.stall_timeout,  # hivemind: sender < reducer
        # as a run's peers have one (hivemind.Optimizer: averaging_timeout): hivemind's part timeouts do not bound a
        # round. Its sender with no share of the reduce (here the slow uplink) waits forever for a send its reducer
        # no longer reads, holding the tensors' lock (likely a CI run's process past 300 s). collab's rounds
        # (--aggregation) end that wait themselves (collab.averaging.reply_streams); hivemind's own need this
        allreduce_timeout=3 * args.stall_timeout, start=True)
    records = []
    try:
        for r in range(args.rounds):
            with averager.get_tensors() as tensors:
                _fill(tensors[0], args)
            looking = 60 + 2 * args.stall_timeout
            control = averager.step(require_trigger=True, wait=False, timeout=looking, allow_retries=True)
            # bounded: a step that never leaves matchmaking despite its timeout (a process in a CI run never came
            # to round 3's barrier, and the test ran out its 600 s) is given up, and its round counted as failed
            given_up_at = time.monotonic() + looking + 30
            while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not control.done():
                if time.monotonic() > given_up_at:
                    print(f"round {r}: still looking for a group after {looking + 30:.0f} s: given up", flush=True)
                    control.cancel()
                    break
                time.sleep(0.001)
            # the group is formed (its last member may learn so a moment after the first); as gloo's barrier
            # does, start every process's clock together, so that only the all-reduce itself is timed
            _barrier(args.rendezvous, f"ready{r}", args.index, args.world, timeout=60)
            before, started = interface_bytes(), time.time()
            control.allow_allreduce()
            error = ""
            try:
                gathered = control.result(timeout=300)
            except Exception as e:  # no group, a broken round: recorded as such (group 0, values unaveraged)
                error = f"{type(e).__name__}: {e}"[:300]
                print(f"round {r} failed: {error}", flush=True)
                gathered = None
            finished = time.time()
            with averager.get_tensors() as tensors:
                records.append(_round_record(started, finished, before, tensors[0], args.expected,
                                             len(gathered) if gathered else 0, error))
            _save(args.out, records)
            time.sleep(1.0)  # let every peer read its result before the next round's matchmaking
        # a reducer finishes its own part before it has streamed a share-0 peer's results (hivemind sends
        # those after the peer's whole input): leaving now would cut that stream. Wait for everyone.
        _barrier(args.rendezvous, "done", args.index, args.world, timeout=300)
    finally:
        averager.shutdown()
        dht.shutdown()
    return records


def _no_file():
    from contextlib import nullcontext

    return nullcontext(None)


def _checked_averager(method: str):
    """What an open run's peers average with: collab's reducer and checks (collab.averaging.robust_rounds)."""
    import hivemind

    from collab.averaging.aggregation import Aggregation
    from collab.averaging.robust_rounds import CheckedRounds

    class CheckedAverager(CheckedRounds, hivemind.DecentralizedAverager):
        rule = Aggregation(method=method)

    return CheckedAverager


def _private_member(organizer_key_path: str) -> dict:
    """What a private run's member runs with: its identity, its invite as the DHT token, a gated averager."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from collab.averaging.members_only import MembersOnly
    from collab.hivemind_hooks.patches import sign_progress_with
    from collab.records.identity import hivemind_reads_ed25519, load_or_create_identity, rsa_key_from_der
    from collab.run.access import make_invite
    from collab.run.gate import MemberGate, RunAuthorizer

    organizer = rsa_key_from_der(Path(organizer_key_path).read_bytes())
    identity = load_or_create_identity(None)
    sign_progress_with(identity.key)
    hivemind_reads_ed25519()  # the other probes' access tokens name Ed25519 keys
    invite = make_invite("probe", identity.peer_id, organizer, lifetime=3600)
    gate = MemberGate("probe", invite.organizer_key)

    class GatedAverager(MembersOnly, hivemind.DecentralizedAverager):
        def __init__(self, *a, **kw):
            self.gate = gate
            super().__init__(*a, **kw)

    return dict(identity_file=identity.file_for_p2pd(), authorizer=RunAuthorizer(identity.key, invite),
                averager_class=GatedAverager, invite=invite,
                subkey=RSASignatureValidator(identity.key).local_public_key)


def run_gloo(args, vector) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.index, world_size=args.world)
    if args.wire == "fp16":
        vector = vector.half()
    records = []
    try:
        for _ in range(args.rounds):
            vector.fill_(args.index + 1)
            dist.barrier()
            before, started = interface_bytes(), time.time()
            dist.all_reduce(vector, op=dist.ReduceOp.SUM)
            vector.div_(args.world)
            finished = time.time()
            records.append(_round_record(started, finished, before, vector, args.expected, args.world))
            _save(args.out, records)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return records


def _save(out: str, records: list[dict]) -> None:
    """The rounds so far, after each one: a process that hangs in a later round (a CI run's slow-uplink process, 300 s
    in one all-reduce) still leaves the rounds it finished to count. Replaced whole, never half written."""
    Path(f"{out}.part").write_text(json.dumps(records))
    os.replace(f"{out}.part", out)


def _barrier(rendezvous: str, tag: str, index: int, world: int, timeout: float) -> None:
    Path(f"{rendezvous}.{tag}-{index}").touch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(Path(f"{rendezvous}.{tag}-{i}").exists() for i in range(world)):
        time.sleep(0.002)


def _wait_for_file(path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = Path(path).read_text().strip() if Path(path).exists() else ""
        if text:
            return text
        time.sleep(0.1)
    raise TimeoutError(f"no rendezvous address in {path} after {timeout:.0f} s")


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["hivemind", "gloo"], required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--size", type=int, required=True, help="elements of the fp32 vector")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--wire", choices=["fp32", "fp16", "dgc"], default="fp32",
                   help="precision on the wire; dgc: a 0.1%%-sparse vector on dgc's sparse codec (hivemind only)")
    p.add_argument("--host", required=True, help="this process's address")
    p.add_argument("--port", type=int, default=31337)
    p.add_argument("--bandwidth", type=float, default=None, help="hivemind: announced bandwidth")
    p.add_argument("--part-size", type=int, default=2**19, help="hivemind: bytes per streamed part")
    p.add_argument("--matchmaking", type=float, default=3.0)
    p.add_argument("--stall-timeout", type=float, default=100.0,
                   help="hivemind: give up on a peer's next part after this long (a broken round ends then)")
    p.add_argument("--rendezvous", default="", help="hivemind: file where process 0 writes its multiaddr")
    p.add_argument("--master", default="", help="gloo: HOST:PORT of rank 0")
    p.add_argument("--organizer-key", default=None, metavar="PATH",
                   help="hivemind: run as a private run's member, invited by this key (DHT authorizer + member gate)")
    p.add_argument("--aggregation", choices=["mean", "centered_clip"], default=None,
                   help="hivemind: collab's checked rounds with this rule (default: hivemind's own reducer)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.expected = _expected(args)
    torch.set_num_threads(1)
    vector = torch.empty(args.size, dtype=torch.float32)
    records = (run_hivemind if args.backend == "hivemind" else run_gloo)(args, vector)
    _save(args.out, records)


if __name__ == "__main__":
    main()
