"""Whole simulated swarms on shaped namespaces: a NAT'd peer trains with the rest; Ctrl-C cleans up."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading

import pytest
from transformers import AlbertForPreTraining

from collab.peers.netns import namespaces_skip_reason
from collab.peers.profiles import load_profile
from collab.peers.simulation import Simulation, SimulationSpec
from collab.train.checkpoint import list_checkpoints
from tests.conftest import fork_server, peer_env, run_cli, swarm_config, swarm_logs, wait_for, write_config
from tests.swarm.test_swarm_training import PARAM_TOLERANCE, max_difference

pytestmark = pytest.mark.skipif(namespaces_skip_reason() is not None,
                                reason=f"no network namespaces: {namespaces_skip_reason()}")
EPOCH_LINE = re.compile(r"  epoch (\d+):")  # simulate's line when the swarm's epoch grew


def _status_from_inside(sim: Simulation) -> dict:
    """`collab status --json`, run where the swarm is reachable: the lab's observer namespace."""
    # forked: a fresh process's imports took ~5 s of the 2 cores that the 4 peers' all-reduces need
    result = run_cli("status", "--run-id", sim.spec.run_id, "--initial-peers", sim.swarm.initial_peer, "--json",
                     "--wait", "10", timeout=60, fork=True, prefix=sim.lab.observer_prefix())
    if result.returncode != 0:
        print(f"collab status exited {result.returncode}: {result.stderr.strip()[-300:]}")
        return {}
    return json.loads(result.stdout)


def _doctor(sim: Simulation, prefix: list[str]) -> dict:
    """`collab doctor --json` with the swarm's join line, run with `prefix` (in a namespace): its checks by name."""
    result = run_cli("doctor", "--run-id", sim.spec.run_id, "--initial-peers", sim.swarm.initial_peer, "--json",
                     timeout=120, fork=True, prefix=prefix)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, (result.returncode, result.stderr[-2000:])
    report = json.loads(result.stdout)
    return {"ready": report["ready"], **{check["name"]: check for check in report["checks"]}}


def test_four_peers_one_behind_nat_train_as_one(tmp_path, run_id, no_leftover_processes):
    # the micro config's 2048 samples per epoch: with 512 a fast peer finished an epoch alone (under a second)
    # before hivemind's progress tracker (refreshed every 0.5-2 s) showed it the others, stepped on its own
    # gradients and ran ahead of the swarm - replicas then ended up to 0.2 apart
    # (no averaging.group_size: with 4, a fresh-clone CI run took 146 s instead of 77-88 s - a peer's last
    # gradient round found no group and waited out the averaging timeout; not understood, open in issue 11)
    config = write_config(tmp_path, {"training.target_batch_size": 2048})
    # the run must outlast the checks made while it trains (a status, then two doctors: 15-20 s after epoch 1).
    # 4 epochs did once rounds stopped waiting out matchmaking_time: now about 3-5 s each, and a doctor on the
    # public side found the initial peer gone (a CI run of 60a9bfe)
    epochs = 10
    profile_path = tmp_path / "nat.yaml"
    # peer 3 behind its own router doing real NAT (masquerade, no port forwarding)
    profile_path.write_text("default: {upload_mbit: 100, download_mbit: 100}\n"
                            "peers:\n  3: {nat: router, upload_mbit: 20}\n")
    spec = SimulationSpec(peers=4, run_id=run_id, workdir=tmp_path / "sim", config_path=config,
                          profile=load_profile(str(profile_path)), max_epochs=epochs, duration=420,
                          require_namespaces=True, env=peer_env(), forks=fork_server(),
                          per_peer_args={i: ["--checkpoint-dir", str(tmp_path / f"ckpt{i}")] for i in range(4)})
    sim = Simulation(spec, say=print)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(report=sim.run()))
    runner.start()
    try:
        # while it trains: the NAT'd peer is in the swarm's progress, as a client, with samples
        # each `collab status` starts a DHT node and p2pd: a CPU hog beside 4 peers on 2 cores, which
        # starves their all-reduces into partial rounds. So ask only once the run is well under way.
        def run_under_way():
            summaries = sim.swarm.workdir.glob("peer*.summary.json") if sim.swarm is not None else []
            return any(json.loads(p.read_text() or "{}").get("final_epoch", 0) >= 1 for p in summaries)
        wait_for(lambda: run_under_way() or not runner.is_alive(), timeout=300, interval=2,
                 what="the swarm to reach epoch 1")
        assert runner.is_alive(), "the simulation ended before the swarm reached epoch 1 (see the report below)"

        def nat_peer_counted():
            state = _status_from_inside(sim)
            nat = [p for p in state.get("peers", []) if p["peer_id"] == sim.swarm.peers[3].peer_id]
            if state.get("num_clients") == 1 and nat and nat[0]["samples_contributed"] > 0 and nat[0]["epoch"] >= 1:
                return state
            print(f"not yet: num_clients {state.get('num_clients')}, NAT'd peer's record {nat}")
            return None
        state = wait_for(nat_peer_counted, timeout=120, interval=3, what="the NAT'd peer's progress in the run state")
        nat = next(p for p in state["peers"] if p["peer_id"] == sim.swarm.peers[3].peer_id)
        assert nat["client_mode"] is True and nat["samples_per_second"] > 0 and nat["contribution"] > 0, nat
        # `collab doctor` with the join line, behind the NAT and on the public side: both can train; only the
        # public side is reachable
        home, public = _doctor(sim, sim.lab.command_prefix(3)), _doctor(sim, sim.lab.observer_prefix())
        assert home["ready"] and public["ready"], (home, public)
        assert home["reachability"]["data"]["verdict"] == "not reachable", home["reachability"]
        assert "forward TCP" in home["reachability"]["fix"], home["reachability"]
        assert public["reachability"]["data"]["verdict"] == "public", public["reachability"]
        # where the swarm saw each: the home peer at its router's public address (masqueraded), the public one as is
        assert home["reachability"]["data"]["nat"].startswith("behind NAT: the swarm sees this peer at 10.77.0.5:")
        assert public["reachability"]["data"]["nat"] is None, public["reachability"]
        assert home["initial peer"]["status"] == "ok" and home["clock"]["status"] == "ok", home
    finally:
        runner.join(timeout=480)
    assert not runner.is_alive(), "the simulation did not finish"
    report = outcome["report"]
    print(report.to_table())
    assert report.network.startswith("namespaces") and report.epochs_reached == epochs
    for peer in report.peers:
        assert peer.exit == f"exit 0 (reached epoch {epochs})", peer
        assert peer.rounds_joined >= 2 and peer.samples_contributed > 0 and not peer.nonfinite_parameters, peer
        assert peer.bytes_sent > 100_000 and peer.bytes_received > 100_000, peer
    nat_report = report.peers[3]
    assert "NAT" in nat_report.link and nat_report.mean_group_size > 2, nat_report
    # nobody told the NAT'd peer (no --client-mode): the swarm could not dial it back, so it joined as a client
    nat_log = (tmp_path / "sim" / "peer3.log").read_text()
    said = (r"Joining as a client \(.*\): not reachable on \d+ from (\d+) of \1 peers \((refused|timed out)\): "
            r"forward TCP")
    assert re.search(said, nat_log), nat_log[:2000]
    assert all("Reachability: reachable on TCP" in (tmp_path / "sim" / f"peer{i}.log").read_text() for i in (1, 2))

    # the NAT'd peer applied the same updates: every final checkpoint holds the same parameters
    models = [AlbertForPreTraining.from_pretrained(list_checkpoints(tmp_path / f"ckpt{i}")[-1]) for i in range(4)]
    worst = max(max_difference(models[0], other) for other in models[1:])
    assert worst < PARAM_TOLERANCE, f"replicas differ by {worst:.2e}: one missed or diverged from the swarm's updates"


def test_simulate_cli_with_profile_stops_on_ctrl_c_and_cleans_up(tmp_path, no_leftover_processes):
    command = [sys.executable, "-m", "collab", "simulate", "--peers", "2", "--profile", "home-broadband",
               "--config", str(swarm_config(tmp_path, 2)), "--duration", "400", "--workdir", str(tmp_path), "--json"]
    sim = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=peer_env())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(sim.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # simulate prints the swarm's epoch when it grew since its last look: epochs can pass between two looks
        wait_for(lambda: any(int(m.group(1)) >= 2 for m in map(EPOCH_LINE.match, lines) if m), timeout=300, interval=1,
                 what="the simulated swarm to reach epoch 2",
                 explain=lambda: "".join(lines)[-3000:] + swarm_logs(tmp_path / "sim", tail=6000))
        pid_prefix = f"collab-{sim.pid}-"
        assert pid_prefix in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        sim.send_signal(signal.SIGINT)
        assert sim.wait(timeout=60) == 0, "".join(lines)[-3000:]
    finally:
        if sim.poll() is None:
            sim.kill()
    reader.join(timeout=10)
    text = "".join(lines)
    assert "Traceback" not in text
    assert "up 10 Mbit/s, down 50 Mbit/s, delay 20 ms" in text  # the profile, as applied to each peer
    # the profile's 20 ms of delay is applied with netem or, on a kernel without it, by peers/delayer.py: no
    # warning either way (the profile asks for no loss, the one thing only netem does)
    assert "WARNING: this kernel has no netem" not in text, text[-3000:]
    report = json.loads(text[text.index("{\n"):])
    assert report["network"].startswith("namespaces") and not report["any_nonfinite"]
    assert report["epochs_reached"] >= 2
    for peer in report["peers"]:
        assert peer["final_epoch"] >= 1 and peer["bytes_sent"] > 0, peer
        # simulate's Ctrl-C became each peer's SIGTERM: a graceful leave, even from inside a round
        assert peer["exit"] == "exit 0 (stopped by signal)", peer
    assert pid_prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
