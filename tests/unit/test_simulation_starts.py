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
