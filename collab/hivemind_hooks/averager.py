"""hivemind's DecentralizedAverager with the private steps and RPC handlers collab extends opened under public
names.

Each hivemind method here hands over to a public method whose default is hivemind's own behaviour (whichever
hivemind class comes next: PowerSGD's aggregation, the training-state averager's download). collab's averager
mixins (collab.averaging: checked rounds, members only, checked downloads) override the public names and call
`super()`. The RPC handlers keep hivemind's annotations: hivemind registers handlers by reading them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import InvalidStateError
from typing import AsyncIterator, Optional

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from collab.hivemind_hooks.allreduce import AggregatePartHooks
from collab.hivemind_hooks.patches import close_p2p_client


_KEPT_TASKS: set = set()  # (each averager process) its event loop's tasks, each until it is done


def _kept_task(loop, coro, **kwargs) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _KEPT_TASKS.add(task)
    task.add_done_callback(_KEPT_TASKS.discard)
    return task


def keep_tasks_until_done(loop) -> None:
    """Hold every task of the averager's event loop until it is done. asyncio holds a task only weakly, and
    hivemind's step cancels its matchmaking task without awaiting it: that task's way out (leaving the search, under
    the matchmaker's lock) awaits the DHT process's answer, an MPFuture that only a registry of weak references
    holds, so the whole chain could be collected mid-way ("Task was destroyed but it is pending!", "aclose():
    asynchronous generator is already running" in a peer's log, right after a round it gave up; its later rounds then
    found no group for averaging_timeout, in 2 of 22 runs of the three-peer test)."""
    factory = loop.get_task_factory()
    if factory is None:
        loop.set_task_factory(_kept_task)


class AveragerHooks(AggregatePartHooks, DecentralizedAverager):
    """DecentralizedAverager, its private steps handed to collab's public ones (see the module)."""

    # one averaging step in the averager's process: a refused round ends it; banned leaders are never followed
    async def _step(self, *, step, future_for_init):
        keep_tasks_until_done(asyncio.get_running_loop())
        try:
            return await self.averaging_step(step=step, future_for_init=future_for_init)
        except InvalidStateError:
            # the trainer cancelled the round as it ended (a round given up, a leave): hivemind's set_result then
            # raises in a task nobody awaits, a traceback in the peer's log ("Task exception was never retrieved")
            if not step.cancelled():
                raise

    async def averaging_step(self, *, step, future_for_init):
        return await super()._step(step=step, future_for_init=future_for_init)

    # a matched group's all-reduce: re-implemented with collab's runner, reducer and checks
    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None,
                                      **kwargs):
        return await self.run_allreduce(tensors, group_info, group_id, **kwargs)

    async def run_allreduce(self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs):
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)

    # a matched group, before its all-reduce: in a private run every member must be on the member list
    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        return await self.aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    # a state download: donors filtered and checked before anything is loaded
    async def _load_state_from_peers(self, future, timeout: Optional[float] = None):
        return await self.download_state(future, timeout=timeout)

    async def download_state(self, future, timeout: Optional[float] = None):
        return await super()._load_state_from_peers(future, timeout=timeout)

    # the averager process shutting down: collab's background reads end first
    async def _shutdown(self, timeout: Optional[float]) -> None:
        try:
            await self.shut_down_in_process(timeout)
        finally:
            # hivemind's shutdown leaves this process's client of p2pd open: its socket file stayed in /tmp after
            # every averager's leave (1,868 on this machine from four hours of test runs)
            if getattr(self, "_p2p", None) is not None:
                close_p2p_client(self._p2p)

    async def shut_down_in_process(self, timeout: Optional[float]) -> None:
        await super()._shutdown(timeout)

    # the RPC handlers (rpc_aggregate_part from AggregatePartHooks): banned peers and non-members are refused
    # before hivemind sees the request
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in self.serve_join_request(request, context):
            yield message

    async def serve_join_request(self, request: averaging_pb2.JoinRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self.serve_state_download(request, context):
            yield message

    async def serve_state_download(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            yield message


def end_step_unstarted(step, future_for_init: MPFuture, error: BaseException) -> None:
    """(the averager's process) End an averaging step with `error` before it looks for a group. The process that
    asked for the step first waits for the step's trigger and cancel futures (hivemind's _step hands them over
    before it matches), then for the step itself: both are answered here."""
    trigger, cancel = MPFuture(), MPFuture()
    step.attach(trigger, cancel)
    future_for_init.set_result((trigger, cancel))
    step.stage = AveragingStage.FINISHED
    try:
        step.set_exception(error)
    except InvalidStateError:
        pass  # the trainer cancelled the step meanwhile (a signal's abort_rounds): it ended already
