"""Real peers (real DHT, real p2pd, real all-reduce) on 127.0.0.1 train together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import AlbertForPreTraining, AutoTokenizer

from collab.config import load_config
from collab.peers.forkserver import ForkedProcess
from collab.peers.launcher import LocalSwarm
from collab.tasks import build_task
from collab.train.checkpoint import list_checkpoints
from tests.conftest import fork_server, peer_env, read_summary, scaled, swarm_config, swarm_logs, train_swarm_to_epoch


# Peers apply identical LAMB steps to identical averaged gradients: every member of a group applies the one
# average its reducers rounded through the run's codec (collab.averaging.one_average), so replicas that took
# part in the same rounds stay equal up to float32's rounding. Measured, two peers, 3 epochs, state averaging
# off: 3e-8 apart (fp16, powersgd, dgc); before, when each sender kept its own fp16 rounding, 2e-4 to 1.04e-3.
# hivemind also lets a round go partial or a peer step alone when it is starved of CPU (3 peers x 5 processes
# on 2 cores), which is what state averaging and downloads are for. A replica that missed an update or a state
# average differs by ~lr = 1e-2 or more, so 1e-3 separates the two.
PARAM_TOLERANCE = 1e-3
SAME_AVERAGES = 1e-5  # replicas that applied the very same averages, and nothing else, from the same start


def _rounds(summary: dict) -> dict:
    """What a failure message needs of a peer's summary (the whole dict is cut short by pytest)."""
    keys = ("start_epoch", "final_epoch", "rounds_joined", "group_sizes", "rounds_failed", "rounds_failed_by_reason",
            "rounds_replayed", "final_replica")
    return {key: summary.get(key) for key in keys}


def max_difference(model, other) -> float:
    reference = dict(model.named_parameters())
    return max((reference[n] - p).abs().max().item() for n, p in other.named_parameters())


def test_three_peers_average_and_learn(tmp_path, run_id, no_leftover_processes):
    """3 peers average and learn, and every final checkpoint is the swarm's model, though two peers are faulty
    (tests/swarm/faulty_peer.py), as peers were in failing CI runs. Peer 2 is starved of CPU at the end of the last
    epoch: it misses the last gradient round and the last state-averaging round, steps on its own gradients,
    and must download the swarm's state before it checkpoints and leaves (before the fix it saved a model
    1.6e-2 away from the rest). Peer 1 stalls at the end of epoch 1 while the others average without it: its round,
    matched among epoch 1's peers only, finds nobody once the swarm is at epoch 2; it steps on its own gradients and
    must re-sync before the end (before rounds were keyed by epoch it joined the others' next round: a lineage
    split, one epoch behind them)."""
    max_epochs = 5
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}-checkpoints")] for i in range(3)}
    faulty = [sys.executable, str(Path(__file__).with_name("faulty_peer.py"))]
    programs = {1: [*faulty, "--late-round-at-epoch", "1", "--stall", "30"],
                2: [*faulty, "--starve-at-epoch", str(max_epochs - 1), "--stall", "15"]}
    # (peer 1's 30-s stall must not outlast its round: averaging_timeout 60)
    config = swarm_config(tmp_path, 3, {"averaging.averaging_timeout": 60.0})
    summaries = train_swarm_to_epoch(3, run_id, tmp_path, ["--config", str(config)], max_epochs, per_peer,
                                     per_peer_program=programs)

    for i, s in enumerate(summaries):
        seen = f"peer {i}: {_rounds(s)}\n{swarm_logs(tmp_path)}"
        # the epoch advanced by at least 3 (hivemind may start a late peer one epoch ahead)
        assert s["final_epoch"] - s["start_epoch"] >= 3, seen
        # hivemind's own round results: group sizes of gradient all-reduces this peer took part in
        assert s["rounds_joined"] >= 2, seen
        assert max(s["group_sizes"]) >= 2, seen
        losses = [v for _, v in sorted((int(k), v) for k, v in s["loss_by_epoch"].items())]
        assert losses[-1] < losses[0], f"loss did not fall on peer {s['peer_id']}: {losses}"
    # the three joined about at once and read different text: peers 1 and 2 both saw peer 0's start, took the same
    # point opposite it, and spread out on a second look (collab.data.order.spread_twins; before, 2 of 3 shared it)
    starts = sorted(s["data"]["start"] for s in summaries)
    gaps = [b - a for a, b in zip(starts, starts[1:])] + [1 + starts[0] - starts[-1]]
    assert min(gaps) >= 0.2, [s["data"] for s in summaries]
    # the starved peer knew its last step was its own and fetched the swarm's state; the others were the swarm
    # (or, its round having found nobody left, it applied that round from a peer that made it: averaging.round_replay)
    assert summaries[2]["rounds_failed"] >= 1, f"{summaries[2]}\n{swarm_logs(tmp_path)}"
    # (a state round of the whole swarm that it joined after its stall - a fresh-clone CI run on a slow day - is no
    # re-sync while a donor is there: it averages the parameters, not LAMB's moments; collab.modes.replica_sync)
    assert summaries[2]["final_replica"] == "downloaded" or summaries[2]["rounds_replayed"] >= 1, \
        f"{summaries[2]}\n{swarm_logs(tmp_path)}"
    every = "\n".join(f"peer {i}: {_rounds(s)}" for i, s in enumerate(summaries)) + "\n" + swarm_logs(tmp_path)
    # the others end as the swarm, or by downloading it: in a fresh-clone run under load, peer 0 received 94.7% of
    # its results in its last round with peer 1, which had its own and left; peer 0 lost that reducer, stepped
    # alone and downloaded the state before leaving (the checkpoints below agree). Cause of the lost part unknown
    assert all(s["final_replica"] in ("swarm", "downloaded") for s in summaries[:2]), every
    assert "swarm" in [s["final_replica"] for s in summaries[:2]], every
    # peer 1's late round at epoch 1 found nobody (the others were past epoch 1) and was given up on at once, not
    # after averaging_timeout; its next round may find nobody too before its download lands (seen in CI), and it
    # fails for no other reason: it re-synced and made the later rounds with them
    assert 1 <= summaries[1]["rounds_failed"] <= 2, every
    # (or, once, hivemind's follower race of benchmarks/lab/ghost_round.py: its groupmates sent BEGIN_ALLREDUCE a
    # moment after it stopped waiting, so it found no group while they waited for its part; seen in one CI run at the
    # swarm's first round, under the load of 2 cores)
    reasons = set(summaries[1]["rounds_failed_by_reason"])
    assert "nobody left to join" in reasons and reasons <= {"nobody left to join", "no group found"}, every

    # every peer's final checkpoint is a standard HF folder; their parameters agree
    models = []
    for i in range(3):
        checkpoints = list_checkpoints(tmp_path / f"peer{i}-checkpoints")
        assert checkpoints, f"peer {i} wrote no checkpoint"
        models.append(AlbertForPreTraining.from_pretrained(checkpoints[-1]))
        assert AutoTokenizer.from_pretrained(checkpoints[-1]).mask_token == "[MASK]"
    epochs = {int(list_checkpoints(tmp_path / f"peer{i}-checkpoints")[-1].name.split("-")[1]) for i in range(3)}
    assert epochs == {max_epochs}, epochs
    for other in models[1:]:
        worst = max_difference(models[0], other)
        assert worst < PARAM_TOLERANCE, f"parameters differ by {worst:.2e} (> {PARAM_TOLERANCE})"
    # against the real initial weights: the task builds them, as every peer does, under the config's seed
    moved = max_difference(models[0], build_task(load_config(config)).model)
    assert moved > 10 * PARAM_TOLERANCE, "training did not change the parameters"


def test_a_peer_left_behind_in_the_last_round_does_not_wait_out_its_timeout(tmp_path, run_id,
                                                                               no_leftover_processes):
    """Peer 2 starts its last gradient round only after the others have made that epoch's step (it was slow):
    nobody will ever join it. It used to look for a group for the whole averaging_timeout (60 s here) while the
    others lingered as its state donors - the slow end of many CI tests. Now it sees that every other peer has
    finished the epoch and gives the round up within seconds; then, rather than step on its own gradients and
    download the whole state, it applies the round it missed from a peer that made it (collab.averaging.round_replay):
    the very same step, so its replica is the swarm's exactly."""
    max_epochs, timeout = 3, 60.0
    faulty = [sys.executable, str(Path(__file__).with_name("faulty_peer.py"))]
    config = swarm_config(tmp_path, 3, {"averaging.averaging_timeout": timeout})
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}-checkpoints")] for i in range(3)}
    with LocalSwarm(3, run_id, tmp_path, ["--config", str(config), "--max-epochs", str(max_epochs)],
                    per_peer_args=per_peer, env=peer_env(), forks=fork_server(),
                    per_peer_program={2: [*faulty, "--late-round-at-epoch", str(max_epochs - 1),
                                          "--stall", "120"]}) as swarm:
        swarm.start()
        late = swarm.peers[2]
        assert late.wait(timeout=scaled(240)) == 0, late.log_text()[-3000:]
        log = late.log_text()
        # the others wait (as donors) for the late peer only: they leave soon after it
        assert swarm.wait(timeout=scaled(30)), "\n".join(p.log_text()[-2000:] for p in swarm.peers)
        summaries = [read_summary(p) for p in swarm.peers]
    assert "the others to leave it" in log, log[-3000:]  # the fault fired
    # the round ended by this check (before it, after averaging_timeout: a TimeoutError)
    after = log[log.index("the others to leave it"):]
    assert "failed (NobodyLeftToJoin" in after and "failed (TimeoutError" not in after, after[-3000:]
    # the missed round replayed: no own step, no download, and its last step the swarm's
    assert "applied that round's average from" in after, after[-3000:]
    assert summaries[2]["rounds_replayed"] == 1 and summaries[2]["rounds_failed"] == 1, \
        f"{summaries[2]}\n{swarm_logs(tmp_path)}"
    assert summaries[2]["final_replica"] == "swarm", f"{summaries[2]}\n{swarm_logs(tmp_path)}"
    assert [s["final_epoch"] for s in summaries] == [max_epochs] * 3, summaries
    models = [AlbertForPreTraining.from_pretrained(list_checkpoints(tmp_path / f"peer{i}-checkpoints")[-1])
              for i in range(3)]
    apart = {(i, j): max_difference(models[i], models[j]) for i, j in ((0, 1), (0, 2), (1, 2))}
    # the same average on the same replica: equal as replicas that made every round together (a step on its own
    # gradients would leave it ~lr = 1e-2 away)
    assert max(apart.values()) < SAME_AVERAGES, \
        f"replicas apart by {apart}\n{summaries}\n{swarm_logs(tmp_path, tail=12000)}"


# x fewer bytes than fp32 on the micro model, measured (each peer, 4 rounds; 3 now): fp16 1.989, powersgd 6.53 (its factors in
# fp32; the micro model's matrices are small), dgc 54.5 (0.1% of each matrix; its vectors, in fp16, dominate; 31.9
# when they went in fp32)
FEWER_BYTES = {"fp16": (1.95, 2.0), "powersgd": (6.0, 7.0), "dgc": (40.0, 80.0)}


def _averaging(compression: str) -> dict:
    """dgc as the shipped config for home links sets it (configs/albert-tiny-home.yaml), so the test follows it.
    fp16 with the optimizer step in the background (overlap: optimizer, no longer the default): that path stays
    tested, and its stale micro-batches are local gradients, averaged like any other in the next round."""
    if compression == "fp16":
        return {"averaging.compression": compression, "averaging.overlap": "optimizer"}
    if compression != "dgc":
        return {"averaging.compression": compression}
    home = load_config("albert-tiny-home").averaging
    assert home.compression == "dgc", home
    return {f"averaging.{name}": getattr(home, name)
            for name in ("compression", "dgc_sparsity", "dgc_warmup_epochs", "dgc_momentum", "overlap")}


@pytest.mark.parametrize("compression", ["fp16", "powersgd", "dgc"])
def test_gradient_averaging_alone_keeps_replicas_equal_with_a_client_mode_peer(tmp_path, run_id, compression,
                                                                                no_leftover_processes):
    """A volunteer behind NAT (--client-mode accepts no connections) takes part in every round, and with state
    averaging off (it would make the replicas equal whether gradients were averaged or not) the two replicas end
    equal: each drew its own data, so only identical averaged gradients can keep them together. Stepping on
    its own gradients once moves a replica ~lr = 1e-2 away from the other. With powersgd both must apply the
    same rank-4 approximation P Q^T (two all-reduces per round, a client-mode peer in both). dgc: with the
    settings of the shipped config for home links."""
    # next_chunk_timeout well under averaging_timeout, as collab advises (config.round_timeout_caution): a group
    # that held a peer which missed its start (beside a CPU hog, the client at the run's first round) is given up
    # after next_chunk_timeout and matched again within the round (collab.averaging.robust_rounds.nobody_else_sent)
    config = swarm_config(tmp_path, 2, {"averaging.average_state_every": 1000, "averaging.averaging_timeout": 45.0,
                                        "averaging.next_chunk_timeout": 15.0, **_averaging(compression)})
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}")] for i in range(2)}
    per_peer[1].append("--client-mode")
    # matchmaking at DEBUG in both peers' logs (printed if the test fails): a rare failure beside a CPU hog, a group
    # the server assembled with the client while the client looked for one until its round ran out, is read there
    matchmaking_log = {"COLLAB_DEBUG_LOGGERS": "hivemind.averaging.matchmaking"}
    with LocalSwarm(2, run_id, tmp_path, ["--config", str(config), "--max-epochs", "3"],
                    per_peer_args=per_peer, env=peer_env(), forks=fork_server(),
                    per_peer_env={0: matchmaking_log, 1: matchmaking_log}) as swarm:
        swarm.start()
        # forked from the session's server, not started afresh (~8 s of the 2 cores each: a suite-wide cost when the
        # peers' environment stopped matching the server's)
        assert all(isinstance(p.popen, ForkedProcess) for p in swarm.peers), [type(p.popen) for p in swarm.peers]
        assert swarm.wait(timeout=scaled(240)), "\n".join(p.log_text()[-2000:] for p in swarm.peers)
        server, client = read_summary(swarm.peers[0]), read_summary(swarm.peers[1])
        # a client-mode peer serves no state: it never stays on as anyone's donor
        assert "state donor" not in swarm.peers[1].log_text(), swarm.peers[1].log_text()[-2000:]
    for s in (server, client):
        assert s["final_epoch"] == 3 and s["rounds_joined"] >= 2 and set(s["group_sizes"]) == {2}, s
        assert s["loss_by_epoch"]["2"] < s["loss_by_epoch"]["0"] - 0.05, s["loss_by_epoch"]
        assert s["rounds_failed"] == 0 and s["final_replica"] == "swarm", f"{s}\n{swarm_logs(tmp_path, 40000)}"
        # the bytes its all-reduce counted, against the same rounds in fp32 (less the messages' own fields)
        moved = s["allreduce_bytes_sent"] + s["allreduce_bytes_received"]
        low, high = FEWER_BYTES[compression]
        assert moved > 0 and low <= s["allreduce_fp32_bytes"] / moved <= high, s

    models = [AlbertForPreTraining.from_pretrained(list_checkpoints(tmp_path / f"peer{i}")[-1]) for i in range(2)]
    worst = max_difference(models[0], models[1])
    assert worst < SAME_AVERAGES, f"without state averaging the replicas differ by {worst:.2e}: not the same averages"
    moved = max_difference(models[0], build_task(load_config(config)).model)
    assert moved > 10 * PARAM_TOLERANCE, "training did not change the parameters"
