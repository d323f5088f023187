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


def _unknown_group_asked(matchmaking, found=(), registered_after=None, asked=b"group-1") -> tuple[bool, float]:
    """collab.averaging.known_groups: whether a part for group `asked` (not running) is let through, and after how
    many seconds. `registered_after`: the group registers then."""
    import asyncio
    import time

    from collab.averaging.known_groups import KnownGroupsOnly

    averager = object.__new__(KnownGroupsOnly)  # (no averager process: only the state the check reads)
    averager._running_groups, averager._matchmaking = {}, matchmaking
    averager.allreduce_kwargs = {"reducer_timeout": 0.8}
    for group_id in found:
        averager.group_found(SimpleNamespace(group_id=group_id))

    async def ask():
        if registered_after is not None:
            asyncio.get_running_loop().call_later(registered_after, averager._running_groups.__setitem__, asked, 1)
        started = time.monotonic()
        return await averager._group_came(asked), time.monotonic() - started
    return asyncio.run(ask())


def test_a_part_for_a_group_that_cannot_come_is_refused_within_the_grace_and_one_on_its_way_waits(monkeypatch):
    import asyncio

    from collab.averaging import known_groups

    # (shorter than collab's, for a short test: each group below that may come registers after the grace)
    monkeypatch.setattr(known_groups, "UNKNOWN_GROUP_GRACE", 0.2)
    monkeypatch.setattr(known_groups, "LOOK_EVERY", 0.02)
    grace = known_groups.UNKNOWN_GROUP_GRACE

    def matchmaking(leader=None, assembled=None):
        future = asyncio.Future(loop=asyncio.new_event_loop())
        if assembled is not None:
            future.set_result(SimpleNamespace(group_id=assembled))
        return SimpleNamespace(current_leader=leader, assembled_group=future)

    # looking for another group, following nobody: the ghost's groupmate hears BAD_GROUP_ID after the grace
    came, seconds = _unknown_group_asked(matchmaking())
    assert not came and grace <= seconds < grace + 0.15, seconds
    # a group this peer found (waiting for the trainer's trigger) registers later: let through, not refused
    came, seconds = _unknown_group_asked(matchmaking(), found=[b"group-1"], registered_after=0.4)
    assert came and 0.4 <= seconds < 0.55, seconds
    # ... PowerSGD's phases run under the group's id and a suffix
    assert _unknown_group_asked(matchmaking(), found=[b"group-1"], registered_after=0.4, asked=b"group-1P")[0]
    # accepted by a leader whose start is on its way
    assert _unknown_group_asked(matchmaking(leader="a"), registered_after=0.4)[0]
    # the follower's BEGIN_ALLREDUCE came, the search not yet returned
    assert _unknown_group_asked(matchmaking(assembled=b"group-1"), registered_after=0.4)[0]
    # another group assembled: this one will not come
    assert not _unknown_group_asked(matchmaking(assembled=b"group-2"))[0]
    # on its way, but for longer than the sender listens (reducer_timeout): refused then
    came, seconds = _unknown_group_asked(matchmaking(leader="a"))
    assert not came and 0.8 <= seconds < 0.95, seconds


def test_a_part_for_a_round_that_ended_here_with_most_of_its_senders_hears_left_out_at_once():
    """A sender too late for a group whose all-reduce ended here (this peer's reducer left it out) is told at once,
    not after its whole patience: it then replays its group's round (collab.averaging.left_out). Not when the round
    here ended with most senders left out (nobody has a round to replay: the retry is right), nor for a group found
    but not yet run here, which still waits for its start."""
    import asyncio
    import time

    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter

    from collab.averaging.known_groups import KnownGroupsOnly
    from collab.averaging.left_out import LEFT_OUT

    averager = object.__new__(KnownGroupsOnly)
    averager._running_groups, averager._matchmaking = {}, SimpleNamespace(current_leader=None,
                                                                          assembled_group=None)
    averager.allreduce_kwargs = {"reducer_timeout": 0.5}
    for group in (b"group-1", b"group-2", b"group-3"):
        averager.group_found(SimpleNamespace(group_id=group))
    averager.group_ended(b"group-1", tell_late=True)
    averager.group_ended(b"group-2", tell_late=False)

    async def answers(group_id: bytes):
        started = time.monotonic()
        stream = as_aiter(averaging_pb2.AveragingData(group_id=group_id))
        got = [(m.code, m.peer_id) async for m in averager.serve_aggregate_part(stream, None)]
        return got, time.monotonic() - started

    got, seconds = asyncio.run(answers(b"group-1"))
    assert got == [(averaging_pb2.INTERNAL_ERROR, LEFT_OUT)] and seconds < 0.1, (got, seconds)
    for waits in (b"group-2", b"group-3", b"group-1P"):  # (PowerSGD's second phase has not run here)
        got, seconds = asyncio.run(answers(waits))
        assert got == [(averaging_pb2.BAD_GROUP_ID, b"")] and seconds >= 0.5, (waits, got, seconds)
