"""A simulated peer whose start failed (its join or its wait for the manifest timed out on a busy machine) is
started once more, with the same --wait-peers; a peer that trained, one stopped by a signal (churn) and one that
finished are left alone."""

from __future__ import annotations

from types import SimpleNamespace

from peers.simulation import Simulation

FAILED_JOIN = ("Waiting for the DHT...\ncollab join: error: could not join the swarm: /ip4/127.0.0.1/tcp/1/p2p/QmX: "
               "no answer within 60 s\n")
TRAINED = "epoch 1 | peers 2 | local 14.1 samples/s | contributed 376 | averaging rounds 5 | loss 9.602\n" + FAILED_JOIN


class Swarm:
    def __init__(self, peers):
        self.peers, self.start_args, self.started = peers, ["--wait-peers", "4"], []

    def start_peer(self, index, extra=()):
        self.started.append((index, list(extra)))
        self.peers[index].code = None  # running again


def peer(index: int, code, log: str = ""):
    process = SimpleNamespace(index=index, code=code, log_text=lambda: log)
    process.popen = SimpleNamespace(poll=lambda: process.code)
    return process


def test_a_failed_start_is_retried_once_with_the_same_wait_and_the_others_are_left_alone():
    said = []
    simulation = Simulation(SimpleNamespace(profile=None, peers=4), say=said.append)
    failed, trained, killed, finished = peer(0, 1, FAILED_JOIN), peer(1, 1, TRAINED), peer(2, -9), peer(3, 0)
    simulation.swarm = Swarm([failed, trained, killed, finished])
    simulation._start_failed_starts_again()
    assert simulation.swarm.started == [(0, ["--wait-peers", "4"])]
    assert "could not join the swarm" in simulation.warnings[0] and "started once more" in simulation.warnings[0]
    assert said and "peer 0" in said[0]
    failed.code = 1  # it failed again: not a third start
    simulation._start_failed_starts_again()
    assert simulation.swarm.started == [(0, ["--wait-peers", "4"])]
    assert len(simulation.warnings) == 1


def test_a_peer_joins_through_the_first_peer_and_a_few_that_others_can_dial_not_every_peer_started(tmp_path,
                                                                                                   monkeypatch):
    """p2pd dials every initial peer and the DHT pings each: the last 6 of 32 peers on 2 cores, given all 26 started
    before them (most still starting), failed to join. A peer is given at most INITIAL_PEERS_MOST running peers, the
    first one first, the rest among those whose logs say others can dial them (this incarnation's log)."""
    import peers.launcher as launcher
    from peers.launcher import INITIAL_PEERS_MOST, LocalSwarm, PeerProcess

    monkeypatch.setattr(launcher, "free_ports", lambda count: list(range(40000, 40000 + count)))  # (no sockets here)
    swarm = LocalSwarm(12, "run", tmp_path, fork_server=False)
    given = {}
    monkeypatch.setattr(PeerProcess, "start", lambda self, extra=(), env=None, forks=None:
                        given.__setitem__(self.index, list(extra)))
    swarm.peers[0].log_path.write_text("Started a new swarm. Others join with:\ncollab join --initial-peers /ip4/x\n")
    for p in swarm.peers[1:9]:
        p.log_path.write_text("Reachability: reachable on TCP 1 from 1 of 1 peers\n")
    swarm.peers[3].log_path.write_text("Reachability: reachable\n\n===== restart 1 =====\n")  # its new start: not yet
    swarm.peers[4].log_path.write_text("Joining as a client (it trains and sends its parts; others reduce them)\n")
    for p in swarm.peers:
        p.popen = SimpleNamespace(poll=lambda: None)
    swarm.peers[5].popen = SimpleNamespace(poll=lambda: 1)  # exited
    dialable = {swarm.peers[i].maddr for i in (1, 2, 6, 7, 8)}
    for index in (9, 10, 11):
        swarm.start_peer(index, ["--wait-peers", "12"])
        initial = given[index][given[index].index("--initial-peers") + 1:given[index].index("--wait-peers")]
        assert len(initial) == INITIAL_PEERS_MOST and initial[0] == swarm.peers[0].maddr, initial
        assert set(initial[1:]) <= dialable, initial
    assert len({tuple(given[i]) for i in (9, 10, 11)}) > 1  # spread over the dialable peers, not all on the same few
    # nobody dialable yet (the others still starting): the running peers, as before
    for p in swarm.peers:
        p._joined = False
        p.log_path.write_text("Waiting for the DHT...\n")
    swarm.start_peer(11)
    assert len(given[11]) == 1 + INITIAL_PEERS_MOST and swarm.peers[5].maddr not in given[11]


def test_a_waiting_peer_announces_itself_again_so_the_first_stays_online_until_the_last_comes(monkeypatch):
    """Published once, a waiting peer's record went stale (read_run_state: 120 s) before the last of 32 peers, started
    again after a failed join, came: none of them saw all 32, and the run went by waiting."""
    import threading

    import collab.train.catch_up as catch_up

    announced, looks = [], []

    def state(dht, run_id, stale_after):
        looks.append(stale_after)
        online = 4 if len(announced) >= 3 else 3  # the 4th comes once the first have announced themselves 3 times
        return SimpleNamespace(peers=[SimpleNamespace(online=i < online) for i in range(4)])

    monkeypatch.setattr(catch_up, "read_run_state", state)
    monkeypatch.setattr(catch_up, "ANNOUNCE_EVERY", 0.02)
    monkeypatch.setattr(catch_up, "LOOK_EVERY", 0.005)
    messages = []
    swarm = SimpleNamespace(dht=None, peer=SimpleNamespace(run_id="run"))
    seen = catch_up.wait_for_peers(swarm, 4, 10.0, SimpleNamespace(message=messages.append), threading.Event(),
                                   announce=lambda: announced.append(1))
    assert seen == 4 and len(announced) == 3 and messages == ["Waiting for 4 peers to join..."]
    assert set(looks) == {catch_up.STALE_AFTER} and catch_up.ANNOUNCE_EVERY * 2 < catch_up.STALE_AFTER


def test_the_wait_for_peers_goes_on_while_peers_still_come_and_ends_when_none_came_for_its_timeout(monkeypatch):
    """64 peers started together on 2 cores took 3.5 minutes to all publish: the first, waiting a fixed 180 s, trained
    without the last 6. The timeout now counts from the last new peer, within WAIT_AT_MOST x timeout in all."""
    import collab.train.catch_up as catch_up

    clock = [0.0]
    arrivals = [0.0, 0.0, 9.0, 18.0, 27.0]  # when each of 5 peers publishes; then nobody for longer than the timeout
    monkeypatch.setattr(catch_up, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(catch_up, "read_run_state", lambda dht, run_id, stale_after: SimpleNamespace(
        peers=[SimpleNamespace(online=when <= clock[0]) for when in arrivals]))
    stop = SimpleNamespace(is_set=lambda: False, wait=lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    swarm, messages = SimpleNamespace(dht=None, peer=SimpleNamespace(run_id="run")), []
    seen = catch_up.wait_for_peers(swarm, 6, 10.0, SimpleNamespace(message=messages.append), stop,
                                   announce=lambda: None)
    assert seen == 5  # the first step waits for the 5 that came (start_together), not for a 6th that never comes
    assert 37.0 <= clock[0] <= 38.0, clock  # 10 s after the last new peer, not 10 s after its start
    assert messages[-1] == "Only 5 of 6 peers after 37 s (none new for 10 s); training anyway", messages

    clock[0], arrivals[:] = 0.0, [0.0] + [9.0 * i for i in range(1, 20)]  # one new peer every 9 s, 20 wanted of 21
    catch_up.wait_for_peers(swarm, 21, 10.0, SimpleNamespace(message=messages.append), stop, announce=lambda: None)
    assert catch_up.WAIT_AT_MOST * 10.0 <= clock[0] <= catch_up.WAIT_AT_MOST * 10.0 + 1.0, clock
    assert messages[-1] == "Only 5 of 21 peers after 40 s (the longest wait, 4 x 10 s); training anyway", messages

    # more records than wanted (one of a peer that has just left counts STALE_AFTER s): the first step waits for the
    # peers it was told to, not for that one (a volunteer joining after the organizer left waited 180 s for it)
    clock[0], arrivals[:] = 0.0, [0.0, 0.0, 0.0]
    assert catch_up.wait_for_peers(swarm, 2, 10.0, SimpleNamespace(message=messages.append), stop,
                                   announce=lambda: None) == 2
