"""Averaging that survives hostile peers: real collab peers, two of them started through tests/swarm/attacker_peer.py.

benchmarks/robustness.py runs each attack alone, with mean against centered_clip, against a clean run. Measured
there (4 honest + 1 attacker, 5 epochs): a clean run's honest loss fell 7.60 -> 7.45 (mean) and 7.60 -> 7.47
(centered_clip); with a sign-flip x1000 attacker it rose to 7.76 with the mean, and fell to 7.39 with
centered_clip.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


from collab.peers.launcher import LocalSwarm
from tests.conftest import fork_server, peer_env, read_summary, swarm_config, wait_for

ATTACKER = [sys.executable, str(Path(__file__).with_name("attacker_peer.py"))]


def test_nan_and_sign_flip_attackers_are_excluded_and_clipped(tmp_path, run_id,
                                                               no_leftover_processes):
    """Two of five peers attack in every round: one sends NaN, one its gradient times -1000. With hivemind's
    mean, the NaN failed every round (19 of 19) and one sign-flipped round set the honest peers back by 25
    epochs. With centered_clip (an open run's default) the NaN part is left out, and so is the sign-flipped one
    (over 5 clip radii away): the honest peers' rounds succeed, they learn, and each of them names both
    attackers."""
    # three honest peers (four made 6 peers on 2 cores: in one of several runs a round stalled its whole
    # averaging_timeout, the swarm split and too few rounds were left to judge; benchmarks/robustness.py runs more)
    honest, epochs = 3, 5
    attacks = {honest: ["--nan"], honest + 1: ["--sign-flip", "1000"]}
    # 3/8 of the micro config's target batch (the same number of steps, 3/8 of the compute: at 1024 this test took
    # 87-187 s in CI, at 512 129 s in one that ran the whole suite in 19:15). A sender silent mid-round (a peer
    # starved of CPU: five peers and a CPU hog on 2 cores) is left out after next_chunk_timeout, 15 s, while the
    # round has 45 s, as collab advises (over twice that). At the suite's 30 s for both, every groupmate gave the
    # whole round up first: beside a CPU hog, 6 of 15 honest rounds failed ("Unable to run All-Reduce", cancelled
    # at the deadline), where this test wants 3 in 4 to succeed
    config = swarm_config(tmp_path, honest + 2, {"training.target_batch_size": 384,
                                                 "averaging.averaging_timeout": 45.0,
                                                 "averaging.next_chunk_timeout": 15.0})
    with LocalSwarm(honest + 2, run_id, tmp_path, ["--config", str(config), "--max-epochs", str(epochs),
                                                   "--wait-peers", str(honest + 2)],
                    env=peer_env(), forks=fork_server(),
                    per_peer_program={i: [*ATTACKER, *attack] for i, attack in attacks.items()}) as swarm:
        swarm.start()
        codes = [swarm.peers[i].wait(timeout=420) for i in range(honest)]
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        assert codes == [0] * honest, f"the honest peers did not reach epoch {epochs}: exit codes {codes}\n{logs}"
        summaries = [read_summary(p) for p in swarm.peers[:honest]]
        nan_id, flip_id = swarm.peers[honest].peer_id, swarm.peers[honest + 1].peer_id

    for s in summaries:
        assert s["nonfinite_parameters"] == [], s
    # the sign-flipper is named by most honest peers (all that shared a round with it): a suspect on the dashboard.
    # The NaN peer is banned by each peer that reduced its part (hard evidence). (Whether it is then kept out of
    # every group is not asserted: in one run an honest peer's successful round listed it a second time with no
    # finding against it - not understood yet, open in issue 11)
    named_nan = sum("part not finite (gradients)" in s["rejected"].get(nan_id, {}) for s in summaries)
    named_flip = sum(any(r.startswith(("part clipped", "part dropped")) for r in s["rejected"].get(flip_id, {}))
                     for s in summaries)
    assert named_nan >= 1 and named_flip >= 2, [s["rejected"] for s in summaries]
    first = statistics.mean(s["loss_by_epoch"]["0"] for s in summaries)
    # each peer's last epoch with a loss (a peer that took its groupmates' epoch after a state round skips one)
    last = statistics.mean(s["loss_by_epoch"][max(s["loss_by_epoch"], key=int)] for s in summaries)
    # a clean run falls by ~0.13 in these epochs; with the mean, this attack made the loss rise by 0.16.
    # Once (1 of 4 runs, Nov 24) the honest loss rose instead (7.60 -> 7.63, every replica at once between epochs
    # 1 and 2), and this outcome was an expected failure until a cause was found. The likely one, fixed since in
    # collab/modes/tracker.py: epochs ended on a forecast that counted pauses (state rounds, here every epoch) as
    # training, so a round could hold a fraction of its target and LAMB still took a full-size step on it. Four
    # runs each, this test's honest loss fell by 0.09-0.22 before that fix (one round of 120 samples for 384)
    # and by 0.18-0.21 after it
    evidence = [{k: s.get(k) for k in ("loss_by_epoch", "samples_by_epoch", "group_sizes", "rounds_joined",
                                       "rounds_failed", "rejected", "final_replica")} for s in summaries]
    assert last < first - 0.05, f"the honest peers did not learn: {first:.3f} -> {last:.3f}\n{evidence}\n{logs}"
    for s, e in zip(summaries, evidence):
        assert s["rounds_joined"] >= 2, f"{e}\n{s.get('rounds_failed_by_reason')} {s.get('state_rounds')}\n{logs}"
    # a round may fail: hivemind can match an honest peer with the sign-flipper alone, and of two parts no rule
    # can tell which is honest; the peer refuses that average (it is out of bounds) and steps alone
    ok, failed = sum(s["rounds_joined"] for s in summaries), sum(s["rounds_failed"] for s in summaries)
    assert ok / (ok + failed) >= 0.75, f"{ok} rounds ok, {failed} failed\n{logs}"

    # (no check that the replicas agree at the end: with 6 peers on 2 cores hivemind splits a round into groups of
    # 2-4, so peers that leave after one may hold two lineages a step apart - 2.5e-2 in a CI run - attack or
    # not; LAMB bounds a step, so that is no sign of poison either. Agreement is tested where it is the point:
    # test_swarm_training.py, test_faults.py)


def test_a_poisoned_state_is_never_loaded(tmp_path, run_id, no_leftover_processes):
    """An attacker claims the highest state-sharing priority (hivemind picks donors by it) and serves its state
    times 1000. A peer that joins late downloads a state at once: it refuses the attacker's, names it, skips
    it, and catches up from an honest peer."""
    # everyone trains until the late peer has trained an epoch after its catch-up; it joins as soon as there is a
    # state. (With the honest peers leaving at epoch 5, an idle run's attacker reached epoch 1 only as they left: the
    # late peer found the attacker alone, refused its state and had no donor. With the late peer leaving at an
    # epoch, the attacker, one epoch behind, kept it on as its state donor for 31 s, then its last round timed out
    # after 30 s more - 170 s on a loaded machine)
    with LocalSwarm(4, run_id, tmp_path, ["--config", str(swarm_config(tmp_path, 4))],
                    env=peer_env(), forks=fork_server(),
                    per_peer_program={2: [*ATTACKER, "--poison-state"]}) as swarm:
        swarm.start(count=3)
        # peer 0 and the attacker past epoch 0, by their summaries, rewritten each epoch (cheaper than a status
        # process per poll): a peer declares its sharing priority when it takes an epoch, so an attacker still at
        # epoch 0 (CPU-starved: 8 samples/s in one run beside two other swarm tests) has not claimed the highest
        # yet, the late peer downloads from an honest peer at once, and the attack is never tried
        peers = (swarm.peers[0], swarm.peers[2])
        wait_for(lambda: all(p.summary_path.exists() and read_summary(p)["final_epoch"] >= 1 for p in peers),
                 timeout=240, what="epoch 1 on peer 0 and on the attacker")
        swarm.start_peer(3)
        late = swarm.peers[3]
        # its summary is first written when it ends an epoch of its own, after the catch-up
        wait_for(lambda: late.summary_path.exists() or late.popen.poll() is not None, timeout=300,
                 what="the late peer's first epoch")
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        assert late.popen.poll() is None, f"the late peer exited {late.popen.poll()}\n{logs}"
    # (its last summary, written as it left on the swarm's SIGTERM)
    summary, attacker = read_summary(late), swarm.peers[2].peer_id
    assert summary["exit_reason"] == "stopped by signal", f"{summary}\n{logs}"
    assert summary["loaded_state_from_peers"] and summary["start_epoch"] >= 1, summary
    assert summary["nonfinite_parameters"] == [], summary
    refused = summary["rejected"].get(attacker, {})
    assert any(reason.startswith("a state") for reason in refused), summary["rejected"]
    assert summary["batches_dropped"] == {}, summary  # it never trained on the poisoned replica
    # (no loss check: a peer that caught up at the others' last epoch may leave without training an epoch)
