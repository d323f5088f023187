"""averaging.mode gossip's arithmetic (collab.modes.gossip_rules): each interpolation rule gives the factor it defines,
K follows its Poisson law, flow control avoids peers that time out, and bad parameters are refused."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from collab.modes.gossip_rules import (FlowControl, Side, check_peer_model, claims_ok, interpolation, local_steps, sketch,
                                 spread_from_mean)


def test_constant_is_the_configured_value():
    assert interpolation("constant", Side(10, 2.0), Side(99, 0.1), constant=0.3) == 0.3


def test_clock_weighs_the_older_model_more():
    assert interpolation("clock", Side(100, None), Side(300, None)) == pytest.approx(0.75)
    assert interpolation("clock", Side(300, None), Side(100, None)) == pytest.approx(0.25)
    assert interpolation("clock", Side(0, None), Side(500, None)) == 1.0  # a fresh replica takes the peer's
    assert interpolation("clock", Side(0, None), Side(0, None)) == 0.5


def test_loss_weighs_the_lower_loss_model_more():
    worse, better = Side(0, 3.0), Side(0, 1.0)
    assert interpolation("loss", worse, better) == pytest.approx(0.75)  # the worse moves 3/4 of the way
    assert interpolation("loss", better, worse) == pytest.approx(0.25)
    # both sides' factors add up to one: they land on the same point
    assert interpolation("loss", worse, better) + interpolation("loss", better, worse) == pytest.approx(1.0)
    assert interpolation("loss", Side(0, None), better) == 0.5  # no loss yet: halfway


def test_evolutionary_moves_the_better_model_less_with_the_shared_draw():
    worse, better = Side(0, 3.0), Side(0, 1.0)
    for u in (0.0, 0.1, 0.37, 0.5, 0.8, 1.0):
        a_better = interpolation("evolutionary", better, worse, u=u)
        a_worse = interpolation("evolutionary", worse, better, u=u)
        assert a_better == pytest.approx(min(u, 1 - u)) and a_worse == pytest.approx(max(u, 1 - u))
        assert a_better <= 0.5 <= a_worse and a_better + a_worse == pytest.approx(1.0)


def test_divergence_threshold_shrinks_the_factor_below_it():
    assert interpolation("constant", Side(0, 0.1), Side(0, 0.1), constant=0.5, divergence_threshold=0.2) == \
        pytest.approx(0.25)
    assert interpolation("constant", Side(0, 0.3), Side(0, 0.1), constant=0.5, divergence_threshold=0.2) == 0.5


def test_local_steps_are_poisson_with_the_configured_mean():
    rng = random.Random(0)
    for mean in (3.0, 10.0, 200.0):
        draws = [local_steps(mean, rng) for _ in range(4000)]
        assert min(draws) >= 1
        assert statistics.fmean(draws) == pytest.approx(mean, rel=0.05)
        assert statistics.variance(draws) == pytest.approx(mean, rel=0.15)  # Poisson: variance = mean


def test_flow_control_picks_a_peer_that_timed_out_less_often_and_never_a_banned_one():
    flow = FlowControl(random.Random(0))
    for _ in range(3):
        flow.failed("slow")
    picks = [flow.pick(["slow", "fast"]) for _ in range(2000)]
    assert picks.count("slow") / len(picks) == pytest.approx(1 / 9, abs=0.03)  # score 1/8 against 1
    flow.succeeded("slow")
    assert flow.scores["slow"] == 0.25
    flow.ban("fast")
    assert {flow.pick(["slow", "fast"]) for _ in range(100)} == {"slow"}
    flow.ban("slow")
    assert flow.pick(["slow", "fast"]) is None


def test_bad_parameters_are_refused_with_the_reason():
    own = [torch.ones(4, 3), torch.ones(5)]
    near = [t + 0.01 for t in own]
    assert check_peer_model(own, near, 0.5) == (None, pytest.approx(0.01))
    assert check_peer_model(own, [torch.ones(3, 4), torch.ones(5)], 0.5)[0] == "parameters of the wrong shapes"
    assert check_peer_model(own, own[:1], 0.5)[0] == "parameters of the wrong shapes"
    assert check_peer_model(own, [own[0], torch.full((5,), math.nan)], 0.5)[0] == "parameters not finite"
    assert check_peer_model(own, [-t for t in own], 0.5)[0].startswith("parameters too far")  # a sign flip
    assert claims_ok(10, 2.5) and claims_ok(0, None)
    assert not claims_ok(-1, 2.5) and not claims_ok(10, math.nan) and not claims_ok(1.5, 2.0)
    assert not claims_ok(10**16, 1.0) and not claims_ok(10, -1.0)


def test_the_sketch_estimates_distances_between_replicas():
    generator = torch.Generator().manual_seed(1)
    base = [torch.randn(300, 200, generator=generator), torch.randn(1000, generator=generator)]
    a = [t + 0.02 * torch.randn(t.shape, generator=generator) for t in base]
    b = [t + 0.02 * torch.randn(t.shape, generator=generator) for t in base]
    true = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))
    sa, sb = sketch(a, seed=7), sketch(b, seed=7)
    estimate = math.sqrt(sum((x - y) ** 2 for x, y in zip(sa, sb)))
    assert estimate == pytest.approx(true, rel=0.5)  # a 32-bucket sketch: ~25% error
    assert sketch(a, seed=7) == sa  # the same buckets on every peer
    spread = spread_from_mean({"a": sa, "b": sb})
    assert spread["a"] == pytest.approx(spread["b"]) and 0 < spread["a"] < 0.05
    assert spread_from_mean({"a": sa, "c": sa}) == {"a": 0.0, "c": 0.0}


def test_a_peer_that_stopped_publishing_leaves_the_spread():
    """kill -9 leaves a peer's last record 'online' for 2 minutes; its stale replica must not widen the spread of
    the replicas still merging (a CI gossip run showed one)."""
    from types import SimpleNamespace

    from collab.swarm.state import PeerState, _estimate_spread

    generator = torch.Generator().manual_seed(2)
    base = [torch.randn(400, generator=generator)]
    near = [sketch([t + 0.001 * torch.randn(t.shape, generator=generator) for t in base], seed=3) for _ in range(2)]
    far = sketch([t + 1.0 * torch.randn(t.shape, generator=generator) for t in base], seed=3)

    def peer(name, last_seen):
        return PeerState(peer_id=name, role="trainer", client_mode=False, samples_per_second=1.0, epoch=1, loss=1.0,
                         samples_contributed=1, contribution=0.3, samples_accumulated=0, bandwidth_mbps=None,
                         rounds_joined=0, rounds_failed=0, last_seen=last_seen, online=last_seen < 120,
                         straggler=False)

    records = {name: SimpleNamespace(param_sketch=s) for name, s in (("a", near[0]), ("b", near[1]), ("dead", far))}
    peers = [peer("a", 2.0), peer("b", 5.0), peer("dead", 60.0)]
    _estimate_spread(peers, records)
    assert peers[2].distance_to_mean is None
    assert max(p.distance_to_mean for p in peers[:2]) < 0.01
    peers[2] = peer("dead", 5.0)  # while it still published, it counted
    _estimate_spread(peers, records)
    assert peers[2].distance_to_mean > 0.1
