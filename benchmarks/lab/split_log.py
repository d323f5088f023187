"""How each gradient round of a swarm went, read from its peers' logs: which groups formed, and what the few did.

    python3 benchmarks/lab/split_log.py REPORTS/logs-32-rtt0-none.tar.gz   (or a folder of peer logs)

`benchmarks/scale.py --reports DIR` keeps the logs; run it with
COLLAB_DEBUG_LOGGERS=collab.averaging.round_plans so that each peer logs the size of its group each round (without
it, only what the few did is counted). Per epoch: the group sizes (peers that logged a group of n, grouped n at a
time: an estimate when two groups have one size), how many of the few replayed the many's round, stepped on their
own average, stopped waiting because no group won; and, over the run, the re-syncs by a state download. With
collab.hivemind_hooks.matchmaking logging too, also how late the planned leader began (its search against the first of
its followers'; negative: before them) and how many followers heard it say it was coming (NOT_DECLARED) and asked on
past their plan: whether a split round's leader was late, and whether its followers knew. With collab.modes.sync
logging, how many peers began as a round's leader woken by an ask.
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

# (a state round's lines say "state round of epoch": not counted)
GROUP = re.compile(r"(?<!state )round of epoch (\d+): group of (\d+|None) for a target")
ASKS = re.compile(r"^(\w{3} \d+ [\d:.]+) round of epoch (\d+): asks (\S+) first")  # its time, epoch, leader
# (not a state round's: its lines say "state round: ..."; before Dec 7 they did not say which, and counted here)
ASKED_ON = re.compile(r"(?<!state round: )planned leader \.\.\.\S+ has yet to begin its search")
FEW = re.compile(r"Epoch (\d+): its gradient round gathered (\d+) of the (\d+) peers training; (.*)")
NO_MAJORITY = re.compile(r"Epoch (\d+): its round split into groups of .* none of them a majority")
RESYNC = re.compile(r"in sync with the swarm again \((\w+)")
WOKEN = re.compile(r"Epoch (\d+): asked to lead its round by a peer already searching")


def peer_logs(source: Path, suffix: str = ".log") -> dict[str, str]:
    """Each peer log's name and text (or, with suffix ".summary.json", each summary's, under its log's name), from a
    scale.py logs tarball or a folder."""
    if source.is_dir():
        return {str(path)[:-len(suffix)] + ".log": path.read_text(errors="replace")
                for path in sorted(source.rglob("*" + suffix))}
    with tarfile.open(source) as tar:
        return {member.name[:-len(suffix)] + ".log": tar.extractfile(member).read().decode(errors="replace")
                for member in tar.getmembers() if member.isfile() and member.name.endswith(suffix)}


def peer_ids(source: Path) -> dict[str, str]:
    """Each peer log's peer id (base58), from the summary beside it; logs without one are left out."""
    ids = {}
    for name, text in peer_logs(source, ".summary.json").items():
        try:
            ids[name] = str(json.loads(text)["peer_id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def read_rounds(logs: dict[str, str]) -> tuple[dict, Counter]:
    """Per epoch: group sizes as each peer saw them, and what the few did; over the run: re-syncs by how."""
    epochs: dict[int, dict] = defaultdict(lambda: dict(sizes=Counter(), replayed=0, own=0, no_majority=0, began={},
                                                       leaders=Counter(), asked_on=set(), woken=0))
    resyncs: Counter = Counter()
    for name, text in logs.items():
        searching = None  # the epoch of this peer's gradient round under way (its last "asks ... first")
        for line in text.splitlines():
            if match := ASKS.search(line):
                searching = int(match[2])
                row = epochs[searching]
                row["began"].setdefault(name, (_seconds(match[1]), match[3]))
                row["leaders"][match[3]] += 1
            elif ASKED_ON.search(line) and searching is not None:
                epochs[searching]["asked_on"].add(name)
            elif (match := GROUP.search(line)) and match[2] != "None":
                epochs[int(match[1])]["sizes"][int(match[2])] += 1
            elif match := FEW.search(line):
                epochs[int(match[1])]["replayed" if "applied that round's average" in match[4] else "own"] += 1
            elif match := NO_MAJORITY.search(line):
                epochs[int(match[1])]["no_majority"] += 1
            elif match := RESYNC.search(line):
                resyncs[match[1]] += 1
            elif match := WOKEN.search(line):
                epochs[int(match[1])]["woken"] += 1
    return dict(epochs), resyncs


def _seconds(stamp: str) -> float:
    """Seconds into the day of a log line's time ("Dec 07 09:51:17.252")."""
    hours, minutes, seconds = stamp.split()[-1].split(":")
    return 3600 * int(hours) + 60 * int(minutes) + float(seconds)


def leader_lag(row: dict, ids: dict[str, str]) -> str:
    """How long after the first of its followers the most named planned leader began its own search (negative: before
    them; from the peers' "asks ... first" lines: a planned leader names itself; `ids`: each log's peer id, from its
    summary), or '-'."""
    if not row["leaders"]:
        return "-"
    leader = row["leaders"].most_common(1)[0][0]
    own = [when for name, (when, _) in row["began"].items() if ids.get(name, "").endswith(leader)]
    followers = [when for name, (when, _) in row["began"].items() if not ids.get(name, "").endswith(leader)]
    return "-" if not own or not followers else f"{own[0] - min(followers):.1f} s"


def groups(sizes: Counter) -> list[int]:
    """Group sizes, largest first, from how many peers logged each size (n peers of size n: one group)."""
    return sorted((size for size, peers in sizes.items() for _ in range(max(1, round(peers / size)))), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a logs-*.tar.gz from scale.py --reports, or a folder of logs")
    args = parser.parse_args()
    epochs, resyncs = read_rounds(peer_logs(args.source))
    ids = peer_ids(args.source)
    print("| epoch | groups | split | few replayed | few own step | few stopped: no majority | planned leader began "
          "after the first | asked on past the plan | leaders woken by an ask |")
    print("|---|---|---|---|---|---|---|---|---|")
    split = 0
    for epoch in sorted(epochs):
        row = epochs[epoch]
        formed = groups(row["sizes"])
        split += len(formed) > 1
        print(f"| {epoch} | {' + '.join(map(str, formed)) or '-'} | {'yes' if len(formed) > 1 else ''} | "
              f"{row['replayed']} | {row['own']} | {row['no_majority']} | {leader_lag(row, ids)} | "
              f"{len(row['asked_on'])} of {len(row['began'])} | {row['woken']} |")
    print(f"\n{split} of {len(epochs)} rounds split; the few replayed {sum(r['replayed'] for r in epochs.values())}, "
          f"stepped on their own {sum(r['own'] for r in epochs.values())} times "
          f"({sum(r['no_majority'] for r in epochs.values())} of them stopping early: no majority); re-syncs: "
          f"{dict(resyncs) or 'none'}")


if __name__ == "__main__":
    main()
