"""Two attacks on real averagers (real DHT, p2pd, matchmaking and butterfly all-reduce, in this process): a peer
that claims a huge averaging weight, and a reducer that returns noise for the part it averages for the group.
The full scenarios, on whole peers over several epochs, are in benchmarks/robustness.py."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import torch

from collab.averaging.aggregation import Aggregation, RobustPartReducer
from collab.averaging.grad_averager import CollabGradientAverager
from collab.averaging.left_out import LeftOutOfRound
from collab.averaging.robust_rounds import _CheckedRunner
from collab.records.rejections import RejectionLog
from collab.swarm.node import OwnGroupDHT, shut_down_dht

SIZE = 4096  # gradient entries, sent in parts of PART_BYTES: butterfly all-reduce gives each of 4 peers one
PART_BYTES = 4096  # (hivemind's default part, 512 KB, would make one peer the reducer of everything)


def gradients(n: int) -> list[torch.Tensor]:
    """What honest peers send: one signal, each with its own noise."""
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(SIZE, generator=g)
    return [signal + 0.3 * torch.randn(SIZE, generator=g) for _ in range(n)]


class Averagers:
    """`n` peers, each with its own DHT node (and p2pd) and a CollabGradientAverager over one parameter; every
    one started here is shut down on exit, even when the test fails."""

    def __init__(self, stack: ExitStack, n: int, rule: Aggregation, garbage_reducer: int | None = None,
                 clients: tuple[int, ...] = (), late_sender: int | None = None, next_chunk_timeout: float = 5.0,
                 late_to_first: tuple[int, ...] = ()):
        self.prefix = f"hostile-{time.time_ns()}_grad_averager"
        self.logs = [RejectionLog() for _ in range(n)]
        self.params = [torch.nn.Parameter(torch.zeros(SIZE)) for _ in range(n)]
        self.averagers: list[CollabGradientAverager] = []
        first = None
        for i in range(n):
            dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=first.get_visible_maddrs() if first else [])
            stack.callback(shut_down_dht, dht)
            first = first or dht
            honest_combine, punctual = RobustPartReducer.combine, _CheckedRunner.parts_for_peer
            if i == garbage_reducer:  # the averager process is forked at start: only this one keeps the patch
                RobustPartReducer.combine = lambda reducer, received: 1000 * torch.randn(
                    reducer.part_shapes[reducer.current_part_index])
            if i == late_sender or i in late_to_first:
                _CheckedRunner.parts_for_peer = _late_to_one_reducer(
                    punctual, 1.5 * next_chunk_timeout, first.peer_id if i in late_to_first else None)
            try:
                averager = CollabGradientAverager([self.params[i]], dht=dht, prefix=self.prefix, start=True,
                                                  rule=rule, findings=self.logs[i].queue, target_group_size=n,
                                                  min_matchmaking_time=3.0, request_timeout=1.0,
                                                  part_size_bytes=PART_BYTES, client_mode=i in clients,
                                                  next_chunk_timeout=next_chunk_timeout)
            finally:
                RobustPartReducer.combine, _CheckedRunner.parts_for_peer = honest_combine, punctual
            stack.callback(averager.shutdown)
            self.averagers.append(averager)

    def round(self, sent: list[torch.Tensor], weights: list[float], who: list[int], timeout: float = 20.0) -> list:
        """Peers `who` send `sent[i]` with weight `weights[i]` in one round; each one's averaged gradient, or the
        exception its round ended with."""
        controls = {}
        for i in who:
            self.params[i].grad = sent[i].clone()
            self.averagers[i].accumulate_grads_(batch_size=1)
            controls[i] = self.averagers[i].step(weight=weights[i], wait=False, timeout=timeout)
        results = []
        for i in who:
            try:
                controls[i].result(timeout=60)
                with self.averagers[i].get_tensors() as averaged:
                    results.append(averaged[0].clone())
            except Exception as e:
                results.append(e)
        return results

    def findings(self, i: int, reason: str, about: str, within: float = 15.0) -> dict[str, dict[str, int]]:
        """What peer i refused, once `reason` about peer `about` is among it (the averager process reports it
        through a queue, after the round) or `within` seconds passed."""
        deadline = time.monotonic() + within
        while reason not in self.logs[i].drain().get(about, {}) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.logs[i].drain()


def _late_to_one_reducer(parts_for_peer, seconds: float, reducer=None):
    """A sender whose parts reach one reducer (`reducer`, or the first other peer of its group) `seconds` late: a
    starved CPU."""
    async def late(runner, peer_index: int):
        others = [i for i, peer in enumerate(runner.ordered_peer_ids) if peer != runner.peer_id]
        if peer_index == (others[0] if reducer is None else runner.ordered_peer_ids.index(reducer)):
            await asyncio.sleep(seconds)
        async for message in parts_for_peer(runner, peer_index):
            yield message
    return late


def test_a_huge_claimed_weight_is_capped_at_ten_times_the_median(no_leftover_processes):
    """Peer 3 claims 1e9 samples (with hivemind's reducer its gradient would be the whole average). Every
    reducer caps it at 10x the group's median weight, and names it. (Peer 3 is a client, reducing no part: a
    reducer does not cap its own weight, which it counted itself, and a hostile one does what it likes with its
    part anyway - test_a_reducer_returning_noise_is_refused_banned_and_left_out)"""
    sent = gradients(3) + [torch.full((SIZE,), -5.0)]
    weights = [1.0, 1.0, 1.0, 1e9]
    with ExitStack() as stack:
        swarm = Averagers(stack, 4, Aggregation(method="mean", max_weight_ratio=10), clients=(3,))
        results = swarm.round(sent, weights, who=[0, 1, 2, 3])
        attacker = swarm.averagers[3].peer_id.to_base58()
        findings = [swarm.findings(i, "weight above the group's bound (gradients)", attacker) for i in range(3)]
    assert all(isinstance(r, torch.Tensor) for r in results), results
    capped = (sum(sent[:3]) + 10 * sent[3]) / 13  # not 1e9 of 1e9 + 3
    for result in results:
        # every reducer capped its part alike (parts travel uncompressed here)
        assert torch.allclose(result, capped, atol=1e-4), (result - capped).abs().max()
    # each reducer that received the attacker's part reports it (the three reduce a part of everyone's)
    assert all("weight above the group's bound (gradients)" in f.get(attacker, {}) for f in findings), findings


def test_a_reducer_returning_noise_is_refused_banned_and_left_out(no_leftover_processes):
    """Peer 3's reducer returns noise x 1000 for its part. The honest peers refuse the whole round (nothing of
    it applied: the averaged buffers keep what they sent), ban peer 3, and in the next round average without
    it: exactly their own mean."""
    sent = gradients(4)
    with ExitStack() as stack:
        swarm = Averagers(stack, 4, Aggregation(method="centered_clip"), garbage_reducer=3)
        first = swarm.round(sent, [1.0] * 4, who=[0, 1, 2, 3])
        attacker = swarm.averagers[3].peer_id
        findings = [swarm.findings(i, "returned an implausible average of a clipped group (gradients)",
                                   attacker.to_base58()) for i in range(3)]
        # all four look for a group again: the honest ones banned peer 3 (in their averager processes), so they
        # neither take it in nor join it
        second = swarm.round(sent, [1.0] * 4, who=[0, 1, 2, 3])
    for i, outcome in enumerate(first[:3]):
        assert isinstance(outcome, Exception) and "returned bad parts" in str(outcome), (i, outcome)
        assert "returned an implausible average of a clipped group (gradients)" in findings[i].get(
            attacker.to_base58(), {}), findings[i]
    honest_mean = sum(sent[:3]) / 3
    for i, result in enumerate(second[:3]):
        assert isinstance(result, torch.Tensor), (i, result)
        assert torch.allclose(result, honest_mean, atol=1e-4), (i, (result - honest_mean).abs().max())


def test_a_sender_a_reducer_left_out_replays_its_groups_round_from_a_groupmate(no_leftover_processes):
    """Peer 3's parts reach one reducer 1.5 x next_chunk_timeout late (a starved CPU): that reducer leaves it out and
    the group averages without it. Peer 3's round ends at once as left out, naming that reducer (no retry in an
    epoch its group has left), and the round it fetches from its groupmates is exactly theirs: the same step as
    theirs, where it used to step on its own gradients and re-sync. A round that differs from the parts its group
    did send it is refused (tests/unit/test_round_replay.py)."""
    sent = gradients(4)
    with ExitStack() as stack:
        swarm = Averagers(stack, 4, Aggregation(method="mean"), late_sender=3, next_chunk_timeout=2.0)
        started = time.monotonic()
        results = swarm.round(sent, [1.0] * 4, who=[0, 1, 2, 3])
        seconds = time.monotonic() - started
        left_out = results[3]
        assert isinstance(left_out, LeftOutOfRound), results[3]
        ids = [a.peer_id.to_base58() for a in swarm.averagers]
        assert len(left_out.by) == 1 and left_out.by[0] in ids[:3], left_out.by
        assert sorted(left_out.members) == sorted(set(ids[:3]) - set(left_out.by)), left_out.members
        for i in range(3):
            assert isinstance(results[i], torch.Tensor), (i, results[i])
            swarm.averagers[i].keep_round(0, ids)  # as the trainer does before it applies its round
        answers = swarm.averagers[3].fetch_round(0, left_out.members, timeout=10.0)
    assert answers.round is not None and answers.round[0] in left_out.members, answers
    donor = ids.index(answers.round[0])
    assert torch.equal(answers.round[1][0], results[donor]), (answers.round[1][0] - results[donor]).abs().max()
    assert all(torch.allclose(results[0], r, atol=1e-6) for r in results[1:3])  # (one average, float32's rounding)
    assert seconds < 30, seconds  # failed at once, not after hivemind's retries until the step's timeout
    # the reducer's span (a quarter) was averaged without peer 3, the rest with it
    with_it, without = sum(sent) / 4, sum(sent[:3]) / 3
    near = torch.isclose(results[0], with_it, atol=1e-5)
    assert 0.2 < 1 - float(near.float().mean()) < 0.3, float(near.float().mean())
    assert torch.allclose(results[0][~near], without[~near], atol=1e-5)


def test_a_reducer_that_left_out_most_of_its_group_fails_the_round_for_all(no_leftover_processes):
    """Peers 2 and 3 are late to peer 0's reducer: it leaves out half its senders, so it does not say "left out" (they
    retry, as after any lost reducer), and neither it nor peer 1, whose parts it took, may step on a span only they
    have (31 of 32 peers retried so while the one stepped on its own). Nobody applies anything."""
    sent = gradients(4)
    with ExitStack() as stack:
        swarm = Averagers(stack, 4, Aggregation(method="mean"), late_to_first=(2, 3), next_chunk_timeout=1.0)
        results = swarm.round(sent, [1.0] * 4, who=[0, 1, 2, 3], timeout=8.0)
    assert all(isinstance(r, Exception) and not isinstance(r, LeftOutOfRound) for r in results), results
