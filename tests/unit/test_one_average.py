"""collab.averaging.one_average inside collab's all-reduce runner, in process (no p2p: the runner's parts are
registered by hand as its streams would register them)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import PeerID

from collab.averaging.aggregation import Aggregation
from collab.averaging.grad_averager import CollabGradientAverager
from collab.averaging.robust_rounds import _CheckedRunner


def _runner(own: torch.Tensor) -> _CheckedRunner:
    me, other = PeerID(b"collab-test-peer-0"), PeerID(b"collab-test-peer-1")
    return _CheckedRunner(
        p2p=SimpleNamespace(peer_id=me), servicer_type=CollabGradientAverager, prefix="test", group_id=b"group",
        tensors=[own], ordered_peer_ids=[me, other], peer_fractions=(0.5, 0.5), part_size_bytes=8,
        rule=Aggregation(method="mean"), bound=1e9, on_finding=lambda *args: None, is_banned=lambda peer: False,
        report_clipping=False, weight_caps={}, exchange_averages=True)


def test_a_reducer_that_fails_after_sending_averages_leaves_the_rest_of_its_span_as_it_was():
    """hivemind keeps a peer's own values for the parts a failed reducer never returned by registering zero
    differences; a reducer that had been sending averages must not have those zeros read as averages (0 - own:
    the rest of its span zeroed, within a state round's bound, so nothing would refuse it)."""
    async def run() -> tuple[torch.Tensor, set]:
        own = torch.arange(8, dtype=torch.float32) + 1  # peer 0 reduces values 0-3, peer 1 values 4-7: 2 parts each
        runner = _runner(own)
        container = runner.tensor_part_container
        assert container.num_parts_by_peer == (2, 2)
        for part in range(2):  # this peer's own span: its average is its own values
            container.register_processed_part(0, part, torch.zeros(2))
        runner._averages_from.add(1)  # peer 1's first reply carried the mark: its replies are averages
        container.register_processed_part(1, 0, torch.tensor([10.0, 20.0]))
        container.register_failed_reducer(1)  # then it died before its second part
        deltas = [t async for t in container.iterate_output_tensors()]
        return own + deltas[0], runner.lost_reducers

    result, lost = asyncio.run(run())
    assert lost == {1}
    assert result.tolist() == [1, 2, 3, 4, 10, 20, 7, 8], result.tolist()


def test_this_peers_own_reduction_failing_ends_the_round_now_not_at_its_timeout():
    """hivemind registers a failed reducer for each other peer, not for this peer's own span: when its own reduction
    failed (here, no part it got could be used), the round waited for that span until averaging_timeout. It is
    registered lost at once, with this peer's own values kept, and the round is run again as for any lost reducer."""
    async def run() -> tuple[list, set]:
        runner = _runner(torch.full((8,), float("nan")))
        me = runner.ordered_peer_ids[0]
        local = asyncio.ensure_future(runner.exchange_with_peer(me))
        await asyncio.sleep(0)
        with pytest.raises(AllreduceException):  # the other sender's part of this span is no better
            await asyncio.wait_for(runner.tensor_part_reducer.accumulate_part(1, 0, torch.full((2,), math.nan)), 5)
        with pytest.raises(AllreduceException):
            await asyncio.wait_for(local, 5)
        container = runner.tensor_part_container
        for part in range(2):  # the other reducer's span, as its stream would register it
            container.register_processed_part(1, part, torch.zeros(2))

        async def outputs():
            return [t async for t in container.iterate_output_tensors()]

        return await asyncio.wait_for(outputs(), 5), runner.lost_reducers

    deltas, lost = asyncio.run(run())
    assert lost == {0}
    assert len(deltas) == 1 and torch.equal(deltas[0], torch.zeros(8))  # every value as it was: nothing applied
