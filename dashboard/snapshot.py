"""One collection of the run, ready to serve: summary figures over every peer, the peer list capped, and the bytes.

Built once per collection (every few seconds), read by every request: the full JSON and its gzip, each
peer's JSON and the list's order under every sort key are made here, so a request (all of /api/run, or
one page of its peers) only joins bytes: a page of a run of thousands of peers costs the server what a run
of two does (all of /api/run costs its bytes: ~0.7 MB at 1,000 peers, ~75 kB gzipped).
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from typing import Callable, Mapping, NamedTuple, Optional
from urllib.parse import parse_qsl

from pydantic import BaseModel

from collab.swarm.state import PeerState, RunState

MAX_PEERS = 2000  # peers a snapshot lists (the most recently seen): the dashboard's memory does not follow the swarm
DEFAULT_PAGE = 50
MAX_PAGE = 500
REMEMBERED_BYTES = 4 * 2**20  # answers a snapshot keeps ready (~100 pages of 50 peers): every open page polls the same
LEADERBOARD = 10


def _state(p: PeerState) -> int:
    """The state column's order, the most alarming first."""
    return 0 if p.suspect else 1 if p.straggler else 2 if not p.online else 3


# the page's columns, by the name the API sorts by; a missing value sorts last in either order
SORT_KEYS = {
    "peer_id": lambda p: p.peer_id,
    "mode": lambda p: p.client_mode,
    "samples_per_second": lambda p: p.samples_per_second,
    "contribution": lambda p: p.contribution,
    "loss": lambda p: p.loss,
    "epoch": lambda p: p.epoch,
    "mb_per_round": lambda p: p.mb_per_round,
    "last_seen": lambda p: p.last_seen,
    "contributions_rejected": lambda p: p.contributions_rejected,
    "state": _state,
}
PAGE_PARAMETERS = ("offset", "limit", "sort", "order")


class BadQuery(ValueError):
    """A query parameter the API cannot use; its message is the one line the client gets back."""


class PageQuery(NamedTuple):
    offset: int = 0
    limit: int = DEFAULT_PAGE
    sort: str = "peer_id"
    order: str = "asc"


class LeaderboardEntry(BaseModel):
    peer_id: str
    samples_contributed: int


class PageInfo(BaseModel):
    offset: int
    limit: int
    sort: str
    order: str
    total: int  # peers listed in all (peers_listed); a page past the end is empty


class DashboardRun(RunState):
    """RunState, plus figures over every peer the swarm's records name: the page's cards, however many are listed."""

    peers_total: int = 0  # every peer the records name (trusted ones)
    peers_listed: int = 0  # in `peers` (all of /api/run) or across its pages: the most recently seen, up to the cap
    peers_not_listed: int = 0  # over the dashboard's cap (peers_cap): counted in the figures below, not listed
    peers_cap: int = MAX_PEERS
    peers_online: int = 0
    peers_stale: int = 0
    stragglers: int = 0
    suspects: int = 0
    clients: int = 0
    median_loss: Optional[float] = None  # of the online peers
    leaderboard: list[LeaderboardEntry] = []  # the most samples contributed, over every peer
    page: Optional[PageInfo] = None  # set when ?offset/limit/sort/order asked for one page of the peers


def parse_page_query(query_string: str) -> Optional[PageQuery]:
    """The page a query string asks for; None when it asks for none (all of /api/run). BadQuery: say what to fix."""
    if not query_string:
        return None
    try:
        pairs = parse_qsl(query_string, keep_blank_values=True, strict_parsing=True, max_num_fields=16)
    except ValueError:
        raise BadQuery(f"cannot read the query '{query_string[:80]}': /api/run takes offset, limit, sort and order, "
                       "e.g. ?offset=0&limit=50&sort=loss&order=desc") from None
    given: dict[str, str] = {}
    for name, value in pairs:
        if name not in PAGE_PARAMETERS:
            raise BadQuery(f"unknown query parameter '{name[:40]}'; /api/run takes offset, limit, sort and order")
        if name in given:
            raise BadQuery(f"query parameter '{name}' is given twice; give it once")
        given[name] = value
    offset = _whole_number(given, "offset", 0, 10**9, "offset=0")
    limit = _whole_number(given, "limit", 1, MAX_PAGE, f"limit={DEFAULT_PAGE}")
    sort = given.get("sort", "peer_id")
    if sort not in SORT_KEYS:
        raise BadQuery(f"sort '{sort[:40]}' is not a column; use one of {', '.join(SORT_KEYS)}, e.g. sort=loss")
    order = given.get("order", "asc")
    if order not in ("asc", "desc"):
        raise BadQuery(f"order '{order[:40]}' must be asc or desc, e.g. order=desc")
    return PageQuery(offset if offset is not None else 0, limit if limit is not None else DEFAULT_PAGE, sort, order)


def _whole_number(given: Mapping[str, str], name: str, low: int, high: int, example: str) -> Optional[int]:
    if name not in given:
        return None
    text = given[name]
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and low <= int(text) <= high):
        raise BadQuery(f"{name} '{text[:40]}' must be a whole number from {low} to {high}, e.g. {example}")
    return int(text)


def summarize(peers: list[PeerState]) -> dict:
    """The cards' figures over every peer (before the cap), as DashboardRun fields."""
    online = [p for p in peers if p.online]
    losses = [p.loss for p in online if p.loss is not None and math.isfinite(p.loss)]
    top = sorted(peers, key=lambda p: p.samples_contributed, reverse=True)[:LEADERBOARD]
    return dict(peers_total=len(peers), peers_online=len(online), peers_stale=len(peers) - len(online),
                stragglers=sum(p.straggler for p in peers), suspects=sum(p.suspect for p in peers),
                clients=sum(p.client_mode for p in peers), median_loss=statistics.median(losses) if losses else None,
                leaderboard=[LeaderboardEntry(peer_id=p.peer_id, samples_contributed=p.samples_contributed)
                             for p in top])


def most_recent(peers: list[PeerState], cap: int) -> list[PeerState]:
    """Up to `cap` peers, the most recently seen, in peer id order (as read_run_state lists them)."""
    if len(peers) <= cap:
        return peers
    return sorted(sorted(peers, key=lambda p: p.last_seen)[:cap], key=lambda p: p.peer_id)


class Snapshot:
    """A RunState as the dashboard serves it. Read-only once built (requests on any thread share it), but for the
    answers it remembers."""

    def __init__(self, state: RunState, cap: int = MAX_PEERS):
        listed = most_recent(state.peers, cap)
        self.run = DashboardRun(**{name: getattr(state, name) for name in RunState.model_fields if name != "peers"},
                                peers=listed, peers_listed=len(listed), peers_not_listed=len(state.peers) - len(listed),
                                peers_cap=cap, **summarize(state.peers))
        self.by_id = {p.peer_id: p for p in listed}
        peer_json = [p.model_dump_json().encode() for p in listed]
        summary = self.run.model_dump_json(exclude={"peers", "page"}).encode()
        self._head = summary[:-1] + b',"peers":['  # the summary object, reopened for a list of peers
        self.full_json = self._head + b",".join(peer_json) + b'],"page":null}'
        self.full_gzip = gzip.compress(self.full_json, compresslevel=5)  # ~10x smaller; once, not per request
        self._answers: dict = {}
        self._answers_bytes = 0
        self._orders = {}
        for name, key in SORT_KEYS.items():
            known = [i for i, p in enumerate(listed) if key(p) is not None]
            missing = [peer_json[i] for i, p in enumerate(listed) if key(p) is None]
            known.sort(key=lambda i: key(listed[i]))  # stable: ties stay in peer id order
            ascending = [peer_json[i] for i in known]
            self._orders[name] = {"asc": ascending + missing, "desc": ascending[::-1] + missing}

    def remembered(self, key, make: Callable[[], tuple]):
        """make()'s answer (its last item: the body), made once for this snapshot while the answers kept fit in
        REMEMBERED_BYTES (a client asking for ever new pages gets them made each time)."""
        answer = self._answers.get(key)
        if answer is None:
            answer = make()
            if self._answers_bytes + len(answer[-1]) <= REMEMBERED_BYTES:
                self._answers[key] = answer
                self._answers_bytes += len(answer[-1])
        return answer

    def page_json(self, query: PageQuery) -> bytes:
        ordered = self._orders[query.sort][query.order]
        page = json.dumps(dict(query._asdict(), total=len(ordered)), separators=(",", ":")).encode()
        return (self._head + b",".join(ordered[query.offset:query.offset + query.limit])
                + b'],"page":' + page + b"}")
