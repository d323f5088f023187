"""How each gradient round of a swarm went, read from its peers' logs: which groups formed, and what the few did.

    python3 benchmarks/lab/split_log.py REPORTS/logs-32-rtt0-none.tar.gz   (or a folder of peer logs)

`benchmarks/scale.py --reports DIR` keeps the logs; run it with
COLLAB_DEBUG_LOGGERS=collab.averaging.round_plans so that each peer logs the size of its group each round (without
it, only what the few did is counted). Per epoch: the group sizes (peers that logged a group of n, grouped n at a
time: an estimate when two groups have one size), how many of the few replayed the many's round, stepped on their
own average, stopped waiting because no group won; and, over the run, the re-syncs by a state download.
"""

from __future__ import annotations

import argparse
import re
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

GROUP = re.compile(r"round of epoch (\d+): group of (\d+|None) for a target")
FEW = re.compile(r"Epoch (\d+): its gradient round gathered (\d+) of the (\d+) peers training; (.*)")
NO_MAJORITY = re.compile(r"Epoch (\d+): its round split into groups of .* none of them a majority")
RESYNC = re.compile(r"in sync with the swarm again \((\w+)")


def peer_logs(source: Path) -> dict[str, str]:
    """Each peer log's name and text, from a scale.py logs tarball or a folder."""
    if source.is_dir():
        return {path.name: path.read_text(errors="replace") for path in sorted(source.rglob("*.log"))}
    with tarfile.open(source) as tar:
        return {member.name: tar.extractfile(member).read().decode(errors="replace")
                for member in tar.getmembers() if member.isfile() and member.name.endswith(".log")}


def read_rounds(logs: dict[str, str]) -> tuple[dict, Counter]:
    """Per epoch: group sizes as each peer saw them, and what the few did; over the run: re-syncs by how."""
    epochs: dict[int, dict] = defaultdict(lambda: dict(sizes=Counter(), replayed=0, own=0, no_majority=0))
    resyncs: Counter = Counter()
    for text in logs.values():
        for line in text.splitlines():
            if (match := GROUP.search(line)) and match[2] != "None":
                epochs[int(match[1])]["sizes"][int(match[2])] += 1
            elif match := FEW.search(line):
                epochs[int(match[1])]["replayed" if "applied that round's average" in match[4] else "own"] += 1
            elif match := NO_MAJORITY.search(line):
                epochs[int(match[1])]["no_majority"] += 1
            elif match := RESYNC.search(line):
                resyncs[match[1]] += 1
    return dict(epochs), resyncs


def groups(sizes: Counter) -> list[int]:
    """Group sizes, largest first, from how many peers logged each size (n peers of size n: one group)."""
    return sorted((size for size, peers in sizes.items() for _ in range(max(1, round(peers / size)))), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a logs-*.tar.gz from scale.py --reports, or a folder of logs")
    args = parser.parse_args()
    epochs, resyncs = read_rounds(peer_logs(args.source))
    print("| epoch | groups | split | few replayed | few own step | few stopped: no majority |")
    print("|---|---|---|---|---|---|")
    split = 0
    for epoch in sorted(epochs):
        row = epochs[epoch]
        formed = groups(row["sizes"])
        split += len(formed) > 1
        print(f"| {epoch} | {' + '.join(map(str, formed)) or '-'} | {'yes' if len(formed) > 1 else ''} | "
              f"{row['replayed']} | {row['own']} | {row['no_majority']} |")
    print(f"\n{split} of {len(epochs)} rounds split; the few replayed {sum(r['replayed'] for r in epochs.values())}, "
          f"stepped on their own {sum(r['own'] for r in epochs.values())} times "
          f"({sum(r['no_majority'] for r in epochs.values())} of them stopping early: no majority); re-syncs: "
          f"{dict(resyncs) or 'none'}")


if __name__ == "__main__":
    main()
