"""A missed round's average comes from another peer: untrusted input, checked before it is applied
(collab.averaging.round_replay)."""

from __future__ import annotations

import torch

from collab.averaging.round_replay import NORM_RATIO, what_is_wrong


def _like():
    return [torch.zeros(4, 3), torch.zeros(5)]


def test_an_honest_average_is_applied_and_a_bad_one_is_refused_with_the_reason():
    own = [torch.ones(4, 3), torch.ones(5)]
    honest = [0.5 * t for t in own]  # averaging with others shrinks the noise: a smaller norm than one's own
    assert what_is_wrong(honest, _like(), own) is None
    assert what_is_wrong(honest, _like(), None) is None  # own gradients already used: the other checks still hold
    assert what_is_wrong(honest[:1], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong([torch.ones(3, 4), torch.ones(5)], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong(["not a tensor", torch.ones(5)], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong([torch.full((4, 3), float("nan")), torch.ones(5)], _like(), own) == \
        "an average that is not finite"
    assert what_is_wrong([torch.zeros(4, 3), torch.zeros(5)], _like(), own) == "an average of zeros"
    huge = [2 * NORM_RATIO * t for t in own]
    assert what_is_wrong(huge, _like(), own) == f"an average {2 * NORM_RATIO:.3g}x the norm of this peer's own gradients"
