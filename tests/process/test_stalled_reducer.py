"""A peer with no share of the reduce (client mode: a peer behind NAT) whose reducer stops reading its parts ends its
round within its reducer_timeout, not at allreduce_timeout (collab.averaging.reply_streams._ended_when_stalled).

Such a sender reads its replies only once it has sent its last part, and hivemind's stream writer, blocked on a
reducer that no longer reads (or failed by one that is gone), never says the parts ended: the round waited until
allreduce_timeout, holding the averaged tensors' lock (without one, forever: likely a lab process past 300 s in CI).

benchmarks/lab/stalled_reducer.py: three real averagers, the third in client mode; once their group is formed, the
second's averager process is frozen (SIGSTOP). It compares hivemind's own averager (90.0 s here, its
allreduce_timeout) with collab's."""

from __future__ import annotations

from benchmarks.lab.averager_pair import StateRounds
from benchmarks.lab.stalled_reducer import REDUCER_TIMEOUT, client_round_seconds

ALLREDUCE_TIMEOUT = 90.0


def test_a_client_whose_reducer_stopped_reading_ends_its_round_by_reducer_timeout(no_leftover_processes):
    took = client_round_seconds(StateRounds, ALLREDUCE_TIMEOUT)
    print(f"the client's round ended {took:.1f} s after the trigger (allreduce_timeout {ALLREDUCE_TIMEOUT:g} s)")
    # a reducer_timeout for its stalled send, one for the replies that never come, and the transfer
    assert took < 6 * REDUCER_TIMEOUT, f"the client's round took {took:.1f} s"
