"""A leaving donor's patience follows the swarm's measured pace (collab.donor_patience)."""

from __future__ import annotations

import pytest

from collab.donor_patience import EpochPace, donor_patience


def test_the_pace_is_the_median_of_epochs_that_moved_by_one():
    pace = EpochPace()
    assert pace.seconds() is None
    for epoch, at in [(0, 0.0), (0, 3.0), (1, 10.0), (2, 20.0), (3, 50.0), (4, 62.0)]:
        pace.observe(epoch, now=at)
    assert pace.seconds() == pytest.approx(11.0)  # 10, 10, 30, 12: one stalled epoch does not set it
    pace.observe(9, now=70.0)  # a download jumped five epochs: not an epoch's work
    pace.observe(10, now=71.0)
    assert pace.seconds() == pytest.approx(10.0)  # 10, 10, 30, 12, 1


def test_a_slower_swarm_gets_a_longer_wait_and_a_peer_further_behind_too():
    timeouts = dict(averaging_timeout=30.0, matchmaking_time=5.0, load_state_timeout=30.0)
    fast = donor_patience(1, 5.0, **timeouts)
    slow = donor_patience(1, 40.0, **timeouts)
    assert fast == pytest.approx(5.0 * 2 + 30 + 15 + 30)
    assert slow - fast == pytest.approx(2 * (40.0 - 5.0))
    assert donor_patience(2, 40.0, **timeouts) - slow == pytest.approx(80.0)
    # further behind than 2 epochs, the peer catches up by downloading at its next step: no more time
    assert donor_patience(7, 40.0, **timeouts) == donor_patience(2, 40.0, **timeouts)
    # no epoch timed yet: the waits the peer behind has left at most
    assert donor_patience(1, None, **timeouts) == pytest.approx(75.0)
