"""collab.modes.replica_sync: the replica's sync state and the epoch its record may claim, through every transition a
sync-mode peer makes (without hivemind: the optimizer applies the effects)."""

from __future__ import annotations

from collab.modes.replica_sync import ReplicaSync


def test_an_own_step_holds_the_record_one_epoch_back_until_a_download_repairs_it():
    replica = ReplicaSync()
    assert replica.in_sync and replica.held_epoch is None and not replica.wants_resync
    replica.stepped_alone(epoch=5, peers=3, at=0.0)
    assert not replica.in_sync and replica.held_epoch == 4 and replica.own_step_to(5) and not replica.own_step_to(4)
    assert replica.wants_resync
    replica.start_resync()
    assert not replica.wants_resync, "a re-sync is tried once per own step, not at every step"
    assert replica.back_in_sync() and replica.in_sync and replica.held_epoch is None
    assert not replica.back_in_sync(), "already in sync: nothing to say"


def test_a_resync_with_no_donor_releases_the_hold_but_not_the_own_step():
    replica = ReplicaSync()
    replica.stepped_alone(epoch=7, peers=2, at=0.0)
    replica.start_resync()
    assert replica.stop_holding() and replica.held_epoch is None
    assert not replica.in_sync and not replica.stop_holding()
    # a second own step is a new one: the hold returns, and a re-sync may be tried again
    replica.stepped_alone(epoch=8, peers=2, at=1.0)
    assert replica.held_epoch == 7 and replica.wants_resync


def test_a_healed_lineage_split_renumbers_the_own_step_and_its_hold():
    replica = ReplicaSync()
    replica.renumbered(by=1)  # in sync: nothing to move
    assert replica.in_sync and replica.held_epoch is None
    replica.stepped_alone(epoch=3, peers=2, at=0.0)
    replica.renumbered(by=1)
    assert replica.own_step_to(4) and replica.held_epoch == 3
    replica.stop_holding()
    replica.renumbered(by=1)
    assert replica.own_step_to(5) and replica.held_epoch is None, "a released hold stays released"


def test_a_state_round_of_the_whole_swarm_repairs_an_own_step_only_when_no_peer_could_give_its_state():
    """A state round averages parameters, not the optimizer's moments: while a download may still bring both, it is
    no repair (a CI run's slow peer, "repaired" so, ended 3.8e-2 from the swarm)."""
    replica = ReplicaSync()
    assert not replica.repaired_by(lambda epoch: 99), "in sync: nothing to repair"
    replica.stepped_alone(epoch=6, peers=3, at=0.0)
    assert not replica.repaired_by(lambda epoch: 3), "a download is still to be tried"
    replica.start_resync()
    assert not replica.repaired_by(lambda epoch: 3), "a download is under way"
    replica.stop_holding()  # it found no donor
    asked = []

    def gathered_since(epoch: int) -> int:
        asked.append(epoch)
        return 2

    assert not replica.repaired_by(gathered_since) and asked == [6], "2 of the 3 peers of the own step's time"
    assert replica.repaired_by(lambda epoch: 3)
    # a later own step is a new one: a download is tried for it first
    replica.stepped_alone(epoch=9, peers=3, at=1.0)
    assert not replica.repaired_by(lambda epoch: 3)
