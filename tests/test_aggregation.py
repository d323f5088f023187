"""collab.aggregation's reducer on its own: what one bad sender can and cannot do to a part's average."""

from __future__ import annotations

import asyncio

import pytest
import torch

from collab.aggregation import Aggregation, RobustPartReducer, centered_clip


def reduce(parts: list[torch.Tensor], weights: list[float], rule: Aggregation) -> tuple[torch.Tensor, dict]:
    """One part, sent by every sender at once, through the real reducer (hivemind's waiting and all)."""
    found: dict[int, list[str]] = {}

    async def run():
        reducer = RobustPartReducer([parts[0].shape], len(parts), rule,
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
