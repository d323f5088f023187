"""The probe's pure parts: what an asker may send (collab.swarm.probe), the budgets that bound each asker and all of
them, and the verdicts and arithmetic the asker draws from the answers (collab.swarm.reachability)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from collab.swarm.probe import (ASKER_BUDGETS, MAX_TRANSFER, Budget, Dial, Limits, ProbeReply, ProbeRequest,
                                observed_host, ports_to_dial, tcp_port)
from collab.swarm.reachability import (FIRST_TRANSFER, ClockSample, judge, next_size, one_per_port, skew_and_rtt,
                                       typical_skew)


@pytest.mark.parametrize("raw", [
    '{"kind": "scan"}',
    '{"kind": "download", "size": %d}' % (MAX_TRANSFER + 1),
    '{"kind": "upload", "size": -1}',
    '{"kind": "dial", "maddrs": ["/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.4/tcp/2", "/ip4/1.2.3.4/tcp/3", '
    '"/ip4/1.2.3.4/tcp/4", "/ip4/1.2.3.4/tcp/5"]}',
    '{"kind": "dial", "maddrs": ["/ip4/1.2.3.4/tcp/1/%s"]}' % ("x" * 300),
    '{"kind": "clock", "extra": 1}',
])
def test_a_request_out_of_bounds_is_refused(raw):
    with pytest.raises(ValidationError):
        ProbeRequest.model_validate_json(raw)


def test_a_reply_out_of_bounds_is_refused():
    dials = [{"port": 1, "ok": True}] * 5
    for raw in ('{"ok": true, "dials": %s}' % str(dials).replace("'", '"').replace("True", "true"),
                '{"ok": true, "received": %d}' % (MAX_TRANSFER + 1),
                '{"ok": true, "dials": [{"port": 70000, "ok": true}]}',
                '{"ok": false, "error": "%s"}' % ("x" * 500)):
        with pytest.raises(ValidationError):
            ProbeReply.model_validate_json(raw)


def test_only_direct_tcp_addresses_are_dialled_and_only_at_the_observed_host():
    assert tcp_port("/ip4/1.2.3.4/tcp/31337/p2p/QmX") == 31337
    assert tcp_port("/ip6/::1/tcp/8/p2p/QmX") == 8
    assert tcp_port("/ip4/1.2.3.4/udp/31337/quic") is None
    assert tcp_port("/ip4/1.2.3.4/tcp/0") is None and tcp_port("/ip4/1.2.3.4/tcp/99999") is None
    assert tcp_port("/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmX") is None
    assert observed_host("/ip4/203.0.113.9/tcp/50123") == "203.0.113.9"
    assert observed_host("/ip6/2001:db8::1/tcp/50123") == "2001:db8::1"
    assert observed_host("/dns4/example.org/tcp/1") is None  # a name could point anywhere
    assert observed_host("/ip4/203.0.113.9/tcp/4001/p2p/QmRelay/p2p-circuit") is None
    assert ports_to_dial(["/ip4/a/tcp/1", "/ip4/b/tcp/1", "/ip4/c/tcp/2", "/ip4/d/tcp/3", "/ip4/e/tcp/4",
                          "/ip4/f/tcp/5"]) == [1, 2, 3, 4]
    assert one_per_port(["/ip4/127.0.0.1/tcp/5/p2p/QmX", "/ip4/10.0.0.2/tcp/5/p2p/QmX", "/ip4/1.2.3.4/udp/6"]) == \
        ["/ip4/127.0.0.1/tcp/5"]


def test_budgets_bound_each_asker_and_all_of_them():
    bucket = Budget(3, 1.0, now=0.0)
    assert [bucket.take(1, now=0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(1, now=1.0) and not bucket.take(1, now=1.0)  # one more a second

    limits = Limits(max_askers=2, now=0.0)
    burst = int(ASKER_BUDGETS["dial"][0])
    assert all(limits.allow("a", "dial", now=0.0) for _ in range(burst))
    assert not limits.allow("a", "dial", now=0.0)
    assert limits.allow("b", "dial", now=0.0)  # another asker has its own
    assert not limits.allow("a", "bytes", 10 * MAX_TRANSFER, now=0.0)  # more than a burst: never
    limits.allow("c", "clock", now=0.0)
    assert list(limits.askers) == ["a", "c"]  # the longest silent ("b") forgotten: memory stays bounded

    crowd = Limits(now=0.0)
    total = int(crowd.total["dial"].burst)
    granted = sum(crowd.allow(f"sybil{i}", "dial", now=0.0) for i in range(total + 10))
    assert granted == total  # fresh peer ids do not get past the total
    assert crowd.askers[f"sybil{total + 1}"]["dial"].level == ASKER_BUDGETS["dial"][0]  # refused, not charged


def _dial(ok: bool, error=None) -> ProbeReply:
    return ProbeReply(ok=True, observed="/ip4/203.0.113.9/tcp/50000", dials=[Dial(port=31337, ok=ok, error=error)])


def test_public_when_at_least_half_of_those_that_answered_connected():
    found = judge([31337], [_dial(True), _dial(False, "timed out"), None])
    assert (found.verdict, found.asked, found.answered, found.connected) == ("public", 3, 2, 1)
    assert found.reason == "reachable on TCP 31337 from 1 of 2 peers"


def test_not_reachable_says_from_how_many_and_the_fix():
    found = judge([31337], [_dial(False, "timed out")] * 4 + [_dial(True)])
    assert found.verdict == "not reachable"
    assert found.reason.startswith("not reachable on 31337 from 4 of 5 peers (timed out): forward TCP 31337 ")
    assert "--announce-maddrs" in found.reason
    assert found.observed == ["/ip4/203.0.113.9/tcp/50000"]


def test_no_answer_is_no_evidence():
    refused = ProbeReply(ok=False, error="rate-limited: ask for dial later")
    relayed = ProbeReply(ok=False, observed="/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit", error="reached through a relay")
    assert judge([31337], [None, refused, relayed]).verdict == "unknown"
    assert judge([31337], []).verdict == "unknown"
    assert "--host-maddrs" in judge([], [_dial(True)]).reason


def test_skew_is_their_clock_against_the_middle_of_the_round_trip():
    skew, rtt = skew_and_rtt(t_send=100.0, theirs=105.1, t_recv=100.2)
    assert skew == pytest.approx(5.0) and rtt == pytest.approx(0.2)
    assert skew_and_rtt(100.0, 99.0, 100.0) == (-1.0, 0.0)
    samples = [ClockSample(peer=p, skew=s, rtt=0.01) for p, s in (("a", 0.1), ("b", 40.0), ("c", -0.2))]
    assert typical_skew(samples) == pytest.approx(0.1)  # one wrong clock does not make ours look wrong
    assert typical_skew([]) is None


def test_the_second_transfer_is_sized_for_two_seconds_within_bounds():
    assert next_size(0.001) == FIRST_TRANSFER
    assert next_size(10.0) == int(10e6 / 8 * 2)
    assert next_size(10_000.0) == MAX_TRANSFER


def test_nat_behaviour_from_where_the_swarm_sees_this_peer():
    from collab.swarm.reachability import nat_behaviour

    own = ["/ip4/192.168.4.2/tcp/31337", "/ip4/127.0.0.1/tcp/31337"]
    assert nat_behaviour(own, ["/ip4/192.168.4.2/tcp/31337"]) is None  # seen where it listens: no NAT
    assert nat_behaviour(own, []) is None
    kept = nat_behaviour(own, ["/ip4/10.77.0.5/tcp/31337"])
    assert kept == "behind NAT: the swarm sees this peer at 10.77.0.5:31337, its listening port kept"
    rewritten = nat_behaviour(own, ["/ip4/203.0.113.9/tcp/50000", "/ip4/203.0.113.9/tcp/50002"])
    assert rewritten.endswith("its port rewritten (a port-changing NAT)") and "203.0.113.9:50000" in rewritten


def test_a_peer_nobody_answered_asks_again_and_a_stop_ends_the_wait(monkeypatch):
    """Peers that start with this one may not serve the question yet: a joining peer (and collab doctor) asks once
    more after ASK_AGAIN_AFTER, and only when nobody answered; a stop (Ctrl-C) ends that wait at once."""
    import threading
    import time
    from types import SimpleNamespace

    from collab.swarm import reachability

    asked = []
    answers = {"none": [None, None], "public": [_dial(True)]}

    def check(dht, peers, own):
        asked.append(time.monotonic())
        return judge([31337], answers[script[len(asked) - 1]])

    monkeypatch.setattr(reachability, "check_reachability", check)
    monkeypatch.setattr(reachability, "ASK_AGAIN_AFTER", 0.2)
    swarm = SimpleNamespace(dht=SimpleNamespace(get_visible_maddrs=lambda: ["/ip4/1.2.3.4/tcp/31337"]))
    assert judge([31337], [None]).unanswered and not judge([31337], [_dial(False, "timed out")]).unanswered
    assert not judge([], [None]).unanswered  # listening nowhere: asking again cannot help

    script = ["none", "public"]
    assert reachability.ask_to_dial_back(swarm, ["QmA", "QmB"]).verdict == "public"
    assert len(asked) == 2 and asked[1] - asked[0] >= 0.2

    asked.clear()
    script = ["public"]
    assert reachability.ask_to_dial_back(swarm, ["QmA"]).verdict == "public" and len(asked) == 1

    asked.clear()
    script = ["none"]
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    assert reachability.ask_to_dial_back(swarm, ["QmA"], stop=stop).unanswered
    assert len(asked) == 1 and time.monotonic() - started < 0.2
