"""collab.averaging.robust_rounds.nobody_else_sent: when a round's average would be this peer's own gradient counted
as a
group's (a groupmate that never joined the group), and when hearing from nobody is normal."""

from __future__ import annotations

from types import SimpleNamespace

from collab.averaging.robust_rounds import nobody_else_sent

ME, A, B, CLIENT = "me", "a", "b", "client"


def _runner(order, parts, active):
    return SimpleNamespace(ordered_peer_ids=order, sender_peer_ids=order,
                           tensor_part_container=SimpleNamespace(num_parts_by_peer=parts), active_senders=set(active))


def test_a_reducer_that_heard_from_no_groupmate_is_told_apart_from_one_with_nothing_to_reduce():
    # the ghost: this peer reduces the only part and its one groupmate never began sending it
    assert nobody_else_sent(_runner([ME, CLIENT], (1, 0), {ME}), ME)
    # the groupmate sent: an ordinary round
    assert not nobody_else_sent(_runner([ME, CLIENT], (1, 0), {ME, CLIENT}), ME)
    # one of two others sent: hivemind's partial average of those present stands
    assert not nobody_else_sent(_runner([ME, A, B], (1, 1, 1), {ME, B}), ME)
    # a tiny tensor (one part, reduced by A): this peer has nothing to reduce and hears from nobody, normally
    # (the batch-plan test's linreg peers refused every round until this case was told apart)
    assert not nobody_else_sent(_runner([A, ME, B], (1, 0, 0), {ME}), ME)
    # a client-mode peer reduces nothing
    assert not nobody_else_sent(_runner([A, CLIENT], (1, 0), {CLIENT}), CLIENT)
