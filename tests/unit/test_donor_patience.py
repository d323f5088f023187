"""A leaving donor's patience follows the swarm's measured pace and the peer behind's own rate
(collab.averaging.donor_patience)."""

from __future__ import annotations

import pytest

from collab.averaging.donor_patience import MOST_COMPUTE_SECONDS, MOST_SLOWER, Behind, EpochPace, donor_patience

TIMEOUTS = dict(averaging_timeout=30.0, matchmaking_time=5.0, load_state_timeout=30.0)
WAITS = 30.0 + 3 * 5.0 + 30.0  # its last round, its state round's matchmaking, a download


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
    done = Behind(epochs=1, samples=1024, samples_per_second=50.0)  # at the end of its epoch: only the waits
    assert donor_patience([done], 1024, 5.0, **TIMEOUTS) == pytest.approx(2 * 5.0 + WAITS)
    assert donor_patience([done], 1024, 40.0, **TIMEOUTS) == pytest.approx(2 * 40.0 + WAITS)
    two = Behind(epochs=2, samples=1024, samples_per_second=50.0)
    assert donor_patience([done, two], 1024, 40.0, **TIMEOUTS) == pytest.approx(max(4 * 40.0, 1024 / 50) + WAITS)
    # further behind than 2 epochs, the peer catches up by downloading at its next step: no more time
    seven = Behind(epochs=7, samples=0, samples_per_second=50.0)
    assert donor_patience([seven], 1024, 40.0, **TIMEOUTS) == donor_patience([Behind(2, 0, 50.0)], 1024, 40.0,
                                                                             **TIMEOUTS)
    assert donor_patience([], 1024, 40.0, **TIMEOUTS) == pytest.approx(WAITS)


def test_a_peer_that_must_compute_its_epoch_alone_gets_the_time_its_own_rate_needs():
    """The failing CI run's shape: the others finished the epoch without it, so it computes what it lacks alone -
    at 20 samples/s, 900 samples take 45 s, more than twice the swarm's 8-s epochs."""
    alone = Behind(epochs=1, samples=124, samples_per_second=20.0)
    assert donor_patience([alone], 1024, 8.0, **TIMEOUTS) == pytest.approx(900 / 20.0 + WAITS)
    # its rate is its own word: a peer claiming to crawl holds the donor MOST_SLOWER of its epochs at most
    crawling = Behind(epochs=1, samples=0, samples_per_second=1e-6)
    assert donor_patience([crawling], 1024, 8.0, **TIMEOUTS) == pytest.approx(MOST_SLOWER * 8.0 + WAITS)
    assert donor_patience([crawling], 1024, None, **TIMEOUTS) == pytest.approx(MOST_COMPUTE_SECONDS + WAITS)
    # a rate of zero, negative or not a number says nothing: the swarm's pace alone
    for rate in (0.0, -5.0, float("nan")):
        assert donor_patience([Behind(1, 0, rate)], 1024, 8.0, **TIMEOUTS) == pytest.approx(16.0 + WAITS)


def test_a_peer_behind_is_taken_as_gone_only_when_its_record_is_quiet_and_two_pings_apart_find_nobody():
    from collab.averaging.liveness import PING_EVERY, QUIET_SECONDS, GoneWatch, Quiet

    pinged, answers = [], {"dead": False, "alive": True, "client": False}

    def ask(peers):
        pinged.append(sorted(peers))
        return {p: answers[p] for p in peers}

    watch = GoneWatch(ask)
    quiet = QUIET_SECONDS + 1
    records = [Quiet("dead", quiet, False), Quiet("alive", quiet, False), Quiet("client", quiet, True),
               Quiet("computing", 0.5, False)]
    assert watch.update(records, now=0.0) == set()  # one ping that found nobody is not a crash
    assert pinged == [["alive", "dead"]]  # not a client (nobody can dial it), not a peer storing records now
    assert watch.update(records, now=PING_EVERY / 2) == set() and len(pinged) == 1  # not asked again so soon
    assert watch.update(records, now=PING_EVERY) == {"dead"}
    # a peer that stored a record between two missed pings starts counting again
    answers["alive"] = False
    watch.update(records, now=2 * PING_EVERY)
    watch.update([Quiet("alive", 0.1, False)], now=2.5 * PING_EVERY)
    assert watch.update(records, now=3 * PING_EVERY) == {"dead"}
    assert watch.update(records, now=4 * PING_EVERY) == {"dead", "alive"}
