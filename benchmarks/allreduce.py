"""One averaging round of an ALBERT-base-sized gradient: collab's (hivemind) all-reduce against gloo's.

k processes, each in its own network namespace on a tc-shaped link (collab.peers.netns), average a
vector of --size fp32 values (default 12M, ALBERT-base). Scenarios:
  symmetric   every link 100 Mbit/s up and down
  asymmetric  the same, but one peer has 10 Mbit/s up
Methods: torch.distributed gloo `all_reduce`, and hivemind's butterfly all-reduce with each peer's
upload announced (as `collab join --bandwidth`, which `collab simulate --profile` passes), on the
wire in fp32 and fp16, and what dgc (0.1% of the values, exactly) and powersgd (rank-4 factors of
ALBERT-base's matrices, fp32) send. Each process holds index+1, so the exact mean is known; the averaged values
are checked, not hivemind's success flag (it reports partial rounds as success).

    sudo python3 benchmarks/allreduce.py [--size 12000000] [--peers 4] [--rounds 1] [--repeats 1]

Prints, per scenario and method: best round time (and the median of its exact rounds), the bandwidth bound
2(k-1)/k * S / B (S the vector's bytes on the wire, B the slowest uplink), time/bound, and time relative to gloo
fp32 and to gloo at the same wire precision.
Goals: symmetric <= 1.0x gloo at equal wire precision; asymmetric <= 0.6x gloo; a private run's round
(auth on: DHT authorizer and members-only averaging RPCs) <= 1.02x the same round with auth off: settle
it with --repeats 8 --rounds 5 (the methods interleaved; medians and per-swarm ratios printed).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path
from statistics import mean, median, stdev

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.lab.averaging_rounds import ProbeFailed, best_of, lower_bound_seconds, measure_rounds  # noqa: E402
from collab.peers.netns import namespaces_unavailable_reason  # noqa: E402
from collab.peers.profiles import LinkSpec  # noqa: E402
from collab.peers.report import aligned  # noqa: E402

# (backend, wire, private): the last row is a private run's members (every DHT request signed and checked,
# every averaging RPC gated on the caller's peer id); goal: <= 1.02x the same round with auth off
# The "checked" rows are an open run's rounds (collab.averaging.robust_rounds: collab's reducer, every returned part
# checked, the result applied at once) with the mean and with centered_clip; goal: centered_clip <= 1.1x the
# same round through hivemind's own reducer
# The "dgc" and "powersgd" rows are what those codecs put on the wire for this gradient: dgc, 0.1% of the
# values with their positions on its lossless sparse codec; powersgd, its rank-4 factors P and Q of ALBERT-base's
# matrices (and its vectors whole) in fp32 - as one all-reduce, where hivemind runs P's and then Q's (one more
# round trip, and the local factorisation, are not in its time)
METHODS = [("gloo", "fp32", False, None), ("gloo", "fp16", False, None), ("hivemind", "fp32", False, None),
           ("hivemind", "fp16", False, None), ("hivemind", "fp16", True, None), ("hivemind", "fp16", False, "mean"),
           ("hivemind", "fp16", False, "centered_clip"), ("hivemind", "dgc", False, None),
           ("hivemind", "powersgd", False, None)]
DGC_DENSITY = 0.001
POWERSGD_RANK = 4


@functools.lru_cache(maxsize=None)  # builds ALBERT-base: once, for every swarm and the table
def powersgd_values(rank: int = POWERSGD_RANK) -> int:
    """Values PowerSGD sends per round for ALBERT-base's gradient (hivemind's rule for which tensors it factorises)."""
    import yaml
    from hivemind.utils.math import get_flatten_greedy_dims
    from transformers import AlbertConfig, AlbertForPreTraining

    model_config = yaml.safe_load((ROOT / "configs" / "albert-base.yaml").read_text())["task"]
    model = AlbertForPreTraining(AlbertConfig(vocab_size=model_config["data"]["vocab_size"], **model_config["model"]))
    total = 0
    for param in model.parameters():
        dims = get_flatten_greedy_dims(param)
        factors = rank * sum(dims)
        total += factors if param.ndim > 1 and 1 - factors / param.numel() >= 0.5 else param.numel()
    return total


def scenarios(peers: int) -> dict[str, list[LinkSpec]]:
    fast = LinkSpec(upload_mbit=100, download_mbit=100)
    return {"symmetric": [fast] * peers,
            "asymmetric": [fast] * (peers - 1) + [LinkSpec(upload_mbit=10, download_mbit=100)]}


def method_key(backend, wire, private, aggregation) -> str:
    return f"{backend}-{wire}{'-private' if private else ''}{'-' + aggregation if aggregation else ''}"


def method_label(backend, wire, private, aggregation) -> str:
    label = f"{'collab (hivemind)' if backend == 'hivemind' else 'gloo'} {wire}{' private' if private else ''}"
    return label + (f" checked {aggregation}" if aggregation else "")


def scenario_rows(name, links, args, chosen, pooled, failed) -> list[tuple]:
    """One row per method: its best round (and, over several repeats, the median of its exact rounds); a private
    or checked row also against hivemind's own open round at the same wire (best/best, and median/median with
    the range of the per-repeat ratios)."""
    slowest = min(link.upload_mbit for link in links)
    gloo = {}  # wire -> seconds
    open_run = {}  # wire -> (best seconds, median seconds, {repeat: median seconds})
    rows = []
    for method in chosen:
        backend, wire, private, aggregation = method
        label = method_label(*method)
        if not pooled[method]:
            rows.append((name, label, "failed", "-", "-", "-", "-", failed[method]))
            continue
        size = powersgd_values() if wire == "powersgd" else args.size
        wire_bytes = {"fp16": 2 * size, "dgc": 8 * DGC_DENSITY * size}.get(wire, 4 * size)
        bound = lower_bound_seconds(wire_bytes, args.peers, slowest)
        tolerance = 1e-2 if wire == "fp16" else 1e-5
        outcomes = [o for _, o in pooled[method]]
        exact = [(r, o) for r, o in pooled[method]
                 if o.group_sizes == [args.peers] * args.peers and o.max_error < tolerance]
        best = best_of([o for _, o in exact]) or best_of(outcomes)
        typical = median([o.seconds for _, o in exact]) if exact else None
        by_repeat = {r: median([o.seconds for q, o in exact if q == r]) for r in {q for q, _ in exact}}
        values = f"exact mean in {len(exact)} of {len(outcomes)} rounds" if exact else "WRONG VALUES"
        if method in failed:  # a later swarm of it failed: the rows show what the earlier ones measured
            values += f" (then a swarm failed: {failed[method]})"
        if backend == "gloo":
            gloo[wire] = best.seconds
        vs_gloo = " / ".join(f"{best.seconds / gloo[w]:.2f}x" if w in gloo else "-" for w in ("fp32", wire))
        traffic = f"slowest peer sent {best.bytes_sent[-1] / wire_bytes:.2f} S"
        if backend == "hivemind" and not private and not aggregation:
            open_run[wire] = (best.seconds, typical, by_repeat)
        elif (private or aggregation) and wire in open_run:
            open_best, open_median, open_by_repeat = open_run[wire]
            traffic += f"; {best.seconds / open_best:.3f}x hivemind's own round"
            ratios = [by_repeat[r] / open_by_repeat[r] for r in by_repeat if r in open_by_repeat]
            if typical and open_median and len(ratios) > 1:
                traffic += (f" (medians: {typical / open_median:.3f}x; per repeat {min(ratios):.3f}-"
                            f"{max(ratios):.3f}x, median {median(ratios):.3f}x, mean {mean(ratios):.3f}x +- "
                            f"{stdev(ratios) / len(ratios) ** 0.5:.3f} s.e.)")
        rows.append((name, label, f"{best.seconds:.2f}", f"{typical:.2f}" if typical else "-", f"{bound:.2f}",
                     f"{best.seconds / bound:.2f}x", vs_gloo, f"{values}; {traffic}"))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=12_000_000, help="fp32 elements (default 12M: ALBERT-base)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="rounds per swarm (one start of the processes)")
    p.add_argument("--repeats", type=int, default=1, help="swarms per method, the methods interleaved")
    p.add_argument("--only", choices=["symmetric", "asymmetric"], default=None)
    p.add_argument("--methods", default=None, metavar="LIST",
                   help="comma-separated subset, e.g. hivemind-fp16,hivemind-fp16-private,hivemind-fp16-centered_clip "
                   "(default: all)")
    args = p.parse_args()
    reason = namespaces_unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, links in scenarios(args.peers).items():
            if args.only and name != args.only:
                continue
            chosen = [m for m in METHODS if not args.methods or method_key(*m) in args.methods.split(",")]
            # repeats interleave the methods (A B A B ...), so a slow spell of the host lands on all of them alike
            pooled: dict[tuple, list] = {m: [] for m in chosen}  # method -> [(repeat, outcome)]
            failed: dict[tuple, str] = {}
            for repeat in range(args.repeats):
                for method in chosen:
                    if method in failed:
                        continue
                    backend, wire, private, aggregation = method
                    print(f"{name}: {method_label(*method)} (repeat {repeat + 1}/{args.repeats}) ...", file=sys.stderr,
                          flush=True)
                    # what the probe averages, and each peer's own contribution in bytes on the wire
                    size, probe_wire = (powersgd_values(), "fp32") if wire == "powersgd" else (args.size, wire)
                    try:
                        outcomes = measure_rounds(links, backend, size,
                                                  Path(tmp) / f"{name}-{method_key(*method)}-{repeat}",
                                                  rounds=args.rounds, wire=probe_wire, timeout=900, private=private,
                                                  aggregation=aggregation)
                    except ProbeFailed as e:
                        failed[method] = str(e).splitlines()[0][:60]
                        continue
                    pooled[method] += [(repeat, o) for o in outcomes]
            rows += scenario_rows(name, links, args, chosen, pooled, failed)
    header = ("scenario", "method", "best s", "median s", "bound s", "vs bound", "vs gloo fp32 / same wire",
              "values; traffic")
    print(f"{args.peers} peers, {args.size / 1e6:.0f}M fp32 values ({args.size * 4 / 1e6:.0f} MB); "
          f"bound = 2(k-1)/k * S_wire / slowest uplink")
    print("\n".join(aligned([header, *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
