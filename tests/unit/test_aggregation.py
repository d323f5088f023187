"""collab.averaging.aggregation's reducer on its own: what one bad sender can and cannot do to a part's average."""

from __future__ import annotations

import asyncio

import pytest
import torch

from collab.averaging.aggregation import Aggregation, RobustPartReducer, centered_clip
from collab.records.untrusted import LATE_PART
from collab.swarm.state import _flag_suspects


def reduce(parts: list[torch.Tensor], weights: list[float], rule: Aggregation, caps: dict | None = None,
           own: int | None = None) -> tuple[torch.Tensor, dict]:
    """One part, sent by every sender at once, through the real reducer (hivemind's waiting and all)."""
    found: dict[int, list[str]] = {}

    async def run():
        reducer = RobustPartReducer([parts[0].shape], len(parts), rule, caps=caps, own=own,
                                    report=lambda sender, why: found.setdefault(sender, []).append(why))
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, part, weight)
                                         for i, (part, weight) in enumerate(zip(parts, weights))))
        assert all(torch.equal(r, results[0]) for r in results)  # every sender gets the same average
        reducer.finalize()
        return results[0]

    return asyncio.run(run()), found


def honest(n: int, d: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(d, generator=g)
    return [signal + 0.5 * torch.randn(d, generator=g) for _ in range(n)]


@pytest.mark.parametrize("method", ["mean", "centered_clip"])
def test_honest_parts_give_their_exact_weighted_mean(method):
    parts, weights = honest(4), [8.0, 16.0, 8.0, 32.0]
    result, found = reduce(parts, weights, Aggregation(method=method))
    expected = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    assert torch.allclose(result, expected, atol=1e-5), (result - expected).abs().max()
    assert found == {}


def test_a_nonfinite_part_is_excluded_and_the_others_mean_is_exact():
    parts = honest(4)
    poisoned = parts[:3] + [torch.full_like(parts[0], float("nan"))]
    result, found = reduce(poisoned, [1.0] * 4, Aggregation(method="mean"))
    assert torch.allclose(result, sum(parts[:3]) / 3, atol=1e-6)
    assert found == {3: ["part not finite"]}


def test_a_huge_claimed_weight_is_capped_and_reported():
    parts = honest(4)
    attacker = parts[:3] + [torch.full_like(parts[0], 100.0)]
    result, found = reduce(attacker, [8.0, 8.0, 8.0, 1e9], Aggregation(method="mean", max_weight_ratio=10))
    # capped at 10 x the median weight (8): 80 of 104, not 1e9 of 1e9
    expected = (8 * sum(parts[:3]) + 80 * attacker[3]) / 104
    assert torch.allclose(result, expected, atol=1e-4)
    assert "weight above the group's bound" in found[3]
    assert list(found) == [3]


def test_a_weight_above_the_senders_signed_progress_is_capped_there():
    """A sender claiming 5x the samples its own signed progress record makes plausible counts for the plausible amount
    (collab.averaging.signed_progress computes the caps from the run's records); within its cap, a weight stands."""
    parts = honest(4)
    result, found = reduce(parts, [8.0, 8.0, 8.0, 40.0], Aggregation(method="mean"), caps={2: 16.0, 3: 16.0})
    expected = (8 * (parts[0] + parts[1] + parts[2]) + 16 * parts[3]) / 40
    assert torch.allclose(result, expected, atol=1e-5)
    assert found == {3: ["weight above its signed progress"]}
    # the reducer's own part: its weight is what it counted itself, and stands above any bound
    result, found = reduce(parts, [8.0, 8.0, 8.0, 400.0], Aggregation(method="mean"), caps={3: 16.0}, own=3)
    assert torch.allclose(result, (8 * (parts[0] + parts[1] + parts[2]) + 400 * parts[3]) / 424, atol=1e-5)
    assert found == {}


def test_centered_clip_bounds_a_sign_flipped_x1000_part():
    parts = honest(5)
    clean = sum(parts[:4]) / 4
    attacked = parts[:4] + [-1000 * parts[4]]
    mean, _ = reduce(attacked, [1.0] * 5, Aggregation(method="mean"))
    clipped, found = reduce(attacked, [1.0] * 5, Aggregation(method="centered_clip"))
    spread = torch.stack([(p - clean).norm() for p in parts[:4]]).mean()
    assert (mean - clean).norm() > 100 * spread  # the mean is the attacker's
    # that far beyond the honest spread, the part is left out: the honest parts' exact mean, not a pull of
    # tau / n in the attacker's direction at every round
    assert torch.allclose(clipped, clean, atol=1e-5), (clipped - clean).norm()
    assert found == {4: ["part dropped (over 5 clip radii from the others')"]}


def test_a_part_somewhat_beyond_the_spread_is_clipped_not_dropped():
    parts = torch.stack(honest(5))
    center = parts[:4].median(dim=0).values
    radius = 2.0 * (parts[:4] - center).norm(dim=1).median()
    direction = torch.randn(parts.shape[1], generator=torch.Generator().manual_seed(1))
    parts[4] = parts[:4].mean(dim=0) + 3 * radius * direction / direction.norm()  # 3 radii out: odd, not absurd
    result, coefficients = centered_clip(parts, torch.ones(5), tau=2.0, iterations=5)
    assert 0.2 < float(coefficients[4]) < 1.0 and bool((coefficients[:4] == 1).all()), coefficients
    pull = (result - parts[:4].mean(dim=0)).norm()
    # at the fixed point its pull is radius / (honest parts); from the median, 5 iterations get near it
    assert 0 < pull <= radius / 3, (pull, radius)


def test_centered_clip_is_the_mean_when_nothing_is_far():
    parts = torch.stack(honest(6))
    weights = torch.ones(6)
    result, coefficients = centered_clip(parts, weights, tau=2.0, iterations=5)
    assert torch.allclose(result, parts.mean(dim=0), atol=1e-5) and bool((coefficients == 1).all())


def test_every_part_bad_fails_the_part_for_everyone():
    from hivemind.averaging.partition import AllreduceException

    nan = torch.full((10,), float("nan"))
    with pytest.raises(AllreduceException, match="no sender's part"):
        reduce([nan, nan, nan], [1.0] * 3, Aggregation())


def rounds_reading(records: dict):
    """A gradient averager's round logic (no averager process) whose last read of the progress records was
    `records`, by peer id."""
    import time

    from hivemind.p2p import PeerID

    from collab.averaging.robust_rounds import CheckedRounds

    class Rounds(CheckedRounds):
        peer_id = PeerID(b"collab-test-peer")  # a property in hivemind's averager (its id from the DHT)

    rounds = object.__new__(Rounds)
    rounds._parent_pid = -1  # (what hivemind's __del__ reads: not this process's averager)
    rounds._progress_cache = {"read_at": time.monotonic(), "task": None, "records": records}
    return rounds


def progress_record(samples, rate, age, epoch=None):
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    return SimpleNamespace(samples_accumulated=samples, samples_per_second=rate, time=get_dht_time() - age,
                           epoch=epoch)


def test_weight_caps_follow_each_senders_signed_progress():
    """What a sender's signed progress makes plausible now: its samples plus its rate (at least the run's median
    rate: a peer's first rates are underestimates) times the record's age (records lag the round), times a slack of
    2; a peer that reported nothing yet gets the floor of 1 sample, one with no rate yet (just started) no cap.
    (This peer's own record counts toward the median rate; the reducer never caps its own part: below)"""
    from collab.averaging.signed_progress import PROGRESS_SLACK

    own = "own-peer-id"
    rounds = rounds_reading({"fast": progress_record(100, 10.0, 2.0), "idle": progress_record(0, 0.1, 0.0),
                             "ramping": progress_record(0, 1.0, 3.0), "new": progress_record(0, 1e-30, 30.0),
                             own: progress_record(0, 10.0, 60.0)})
    caps = rounds._weight_caps()
    median_rate = (1.0 + 10.0) / 2  # of 0.1, 1, 10, 10
    assert abs(caps["fast"] - PROGRESS_SLACK * (100 + 10.0 * 2.0)) < 1.0, caps
    assert abs(caps["ramping"] - PROGRESS_SLACK * median_rate * 3.0) < 1.0, caps
    assert caps["idle"] == 1.0 and set(caps) == {"fast", "idle", "ramping", own}, caps


def test_a_peer_holding_its_record_after_an_own_step_is_not_capped_by_it():
    """A peer that stepped on its own gradients to epoch 7 publishes epoch 6 with no samples, freshly timed, while
    it computes toward 7 (collab.modes.replica_sync). In the round of epoch 7 that record bounds nothing: its 64
    honest samples count in full beside the other's 32 and nobody is reported (read as a bound, it cut them to the
    group's median, 32, and reported the peer)."""
    rounds = rounds_reading({"held": progress_record(0, 40.0, 0.2, epoch=6),
                             "in-sync": progress_record(60, 40.0, 0.2, epoch=7)})
    caps = rounds._weight_caps(epoch=7)
    assert set(caps) == {"in-sync"}, caps
    parts = honest(2)
    result, found = reduce(parts, [64.0, 32.0], Aggregation(method="mean"), caps={0: caps.get("held"),
                                                                                  1: caps["in-sync"]})
    assert found == {} and torch.allclose(result, (2 * parts[0] + parts[1]) / 3), found
    # the same round with the held record read as a bound: what a dashboard test's 2-peer run reported
    unfiltered = rounds._weight_caps()
    _, found = reduce(parts, [64.0, 32.0], Aggregation(method="mean"), caps={0: unfiltered["held"]})
    assert found == {0: ["weight above its signed progress"]}, (unfiltered, found)


def test_a_part_from_few_samples_is_noisy_not_an_outlier():
    """An honest peer that brought 2 samples where the others brought 512 strays ~16x further (noise ~ 1/sqrt(w)):
    it is clipped by its distance but neither dropped nor reported; a sign-flipped part of full weight is."""
    g = torch.Generator().manual_seed(3)
    signal = torch.randn(1000, generator=g)
    full = [signal + 0.5 * torch.randn(1000, generator=g) for _ in range(4)]
    few = signal + 0.5 * 16 * torch.randn(1000, generator=g)
    result, found = reduce(full + [few], [512.0] * 4 + [2.0], Aggregation(method="centered_clip"))
    assert found == {}, found
    flipped, found = reduce(full + [few, -1000 * full[0]], [512.0] * 4 + [2.0, 512.0], Aggregation())
    assert found == {5: ["part dropped (over 5 clip radii from the others')"]}, found


def test_a_sender_whose_parts_never_came_is_named_and_a_called_off_round_blames_nobody():
    """Two parts per sender; sender 2 sends none (a slow uplink past next_chunk_timeout): hivemind's reducer is
    finalized with the round, and only sender 2 is reported late. A reducer finalized before anyone's parts came
    (the round was called off) names nobody."""
    shape = torch.Size([4])

    async def run(senders_that_send):
        found: dict[int, list[str]] = {}
        reducer = RobustPartReducer([shape, shape], 3, Aggregation(method="mean"),
                                    report=lambda sender, why: found.setdefault(sender, []).append(why))
        tasks = [asyncio.ensure_future(reducer.accumulate_part(i, part, torch.ones(shape)))
                 for i in senders_that_send for part in (0, 1)]
        await asyncio.sleep(0.05)  # the first part waits for sender 2, which never comes
        reducer.finalize()
        await asyncio.gather(*tasks, return_exceptions=True)
        return found

    assert asyncio.run(run([0, 1])) == {2: [LATE_PART]}
    assert asyncio.run(run([])) == {}


def test_a_late_peer_is_shown_but_not_suspect():
    from tests.unit.test_guard import peer_state, record

    late = {f"{LATE_PART} (gradients)": 5}
    records = {"a": record("a", {"x": late}), "b": record("b", {"x": late}), "x": record("x", {})}
    peers = [peer_state(p) for p in "abx"]
    _flag_suspects(peers, records)
    x = next(p for p in peers if p.peer_id == "x")
    assert not x.suspect and x.reported_by == 0 and x.rejected_by_reason == {f"{LATE_PART} (gradients)": 10}


def test_a_sender_cancelled_while_its_part_waits_leaves_the_others_their_average():
    """A sender's stream handler is cancelled when its peer drops (a kill -9 as a round starts) while it awaits the
    part's average, which every sender of the part awaits too. That must not cancel the average itself: it did, and
    every other sender's stream of the part failed at once (its peers saw this reducer as failed), while this peer's
    own part never came (its round sat until averaging_timeout: test_diloco, in CI and here)."""
    parts = [torch.full((4,), float(i)) for i in range(3)]

    async def run():
        reducer = RobustPartReducer([parts[0].shape], 3, Aggregation(method="mean"))
        dying = asyncio.ensure_future(reducer.accumulate_part(0, 0, parts[0], 1.0))
        staying = asyncio.ensure_future(reducer.accumulate_part(1, 0, parts[1], 1.0))
        await asyncio.sleep(0)  # both parts are in; the third sender's is not
        dying.cancel()
        await asyncio.sleep(0)
        own = await asyncio.wait_for(reducer.accumulate_part(2, 0, parts[2], 1.0), 5)
        return own, await asyncio.wait_for(staying, 5)

    own, staying = asyncio.run(run())
    assert torch.equal(own, staying) and torch.allclose(own, torch.full((4,), 1.0))  # the dying sender's part counts


def test_a_sender_cancelled_while_waiting_for_an_earlier_part_is_not_awaited_for_its_next_one():
    """A sender whose part k+1 came while part k was still being reduced, cancelled then banned: part k+1 must not
    wait for it (its count of parts received included the part it never handed over, and part k+1 waited for that
    sender forever)."""
    shapes = [torch.Size([2]), torch.Size([2])]
    one = [torch.ones(2), torch.ones(2)]

    async def run():
        reducer = RobustPartReducer(shapes, 3, Aggregation(method="mean"))
        first = asyncio.ensure_future(reducer.accumulate_part(0, 0, one[0] * 3, 1.0))  # sender 0: part 0 in
        await asyncio.sleep(0)
        early = asyncio.ensure_future(reducer.accumulate_part(0, 1, one[1] * 3, 1.0))  # its part 1 waits for part 0
        await asyncio.sleep(0)
        early.cancel()  # its stream dropped
        await asyncio.sleep(0)
        reducer.on_sender_failed(0)  # hivemind's ban, as collab's reducer loop makes it when a stream stops short
        part0 = await asyncio.wait_for(asyncio.gather(reducer.accumulate_part(1, 0, one[0], 1.0),
                                                      reducer.accumulate_part(2, 0, one[0], 1.0)), 5)
        part1 = await asyncio.wait_for(asyncio.gather(reducer.accumulate_part(1, 1, one[1], 1.0),
                                                      reducer.accumulate_part(2, 1, one[1], 1.0)), 5)
        first.cancel()
        return part0, part1

    part0, part1 = asyncio.run(run())
    assert torch.allclose(part0[0], torch.full((2,), 5 / 3))  # sender 0's part 0 came: it is in the average
    assert torch.allclose(part1[0], torch.ones(2))  # its part 1 never did: the others' mean, without waiting for it
