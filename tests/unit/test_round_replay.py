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


class _Asked(BaseException):
    """The guard under test let the replay go on to ask the swarm (not an Exception: the replay swallows those)."""


def _peer_at(epoch: int, downloaded_at):
    """Just what CollabOptimizer._replayed_the_missed_round reads before it asks anyone for the round."""
    from types import SimpleNamespace

    averager = SimpleNamespace(serves_rounds=True)
    return SimpleNamespace(grad_averager=averager, delay_grad_averaging=False, in_sync=lambda: True,
                           local_epoch=epoch, downloaded_at_epoch=downloaded_at, run_id="run",
                           dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")))


def test_a_round_is_not_replayed_onto_a_state_downloaded_in_the_same_epoch(monkeypatch):
    """A download during epoch E may lack a step (a donor's state renumbered to the swarm's epoch): a replay of E's
    round on it would look in step and stay one update behind. The guard must refuse before it reads a record or dials
    a donor; a download one epoch earlier must not stop the replay (it goes on to read the records: the second half
    fails if the guard is too wide)."""
    import collab.modes.sync as sync

    def asked(*args, **kwargs):
        raise _Asked()

    monkeypatch.setattr(sync, "progress_records", asked)
    replay = sync.CollabOptimizer._replayed_the_missed_round
    assert replay(_peer_at(8, downloaded_at=8), "no group found") is False
    for downloaded_at in (7, None):
        try:
            replay(_peer_at(8, downloaded_at=downloaded_at), "no group found")
        except _Asked:
            continue
        raise AssertionError(f"a download at epoch {downloaded_at} stopped epoch 8's replay before it asked the swarm")
