"""A private run on real DHT, p2pd and averaging: invited peers train, strangers and revoked peers are shut out."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from hivemind.utils.crypto import RSAPrivateKey

from collab.peers.launcher import LocalSwarm, free_ports
from collab.records.identity import peer_id_of
from collab.run.access import make_invite
from collab.run.folder import load_run_folder
from tests.conftest import fork_server, peer_env, read_summary, run_cli, wait_for, write_config



def _invite(folder, identity, tmp_path, name: str) -> str:
    """What an invited volunteer does: 'collab id', and the organizer's 'collab invite', saved to a file."""
    peer_id = run_cli("id", "--identity", str(identity), fork=True).stdout.strip()
    made = run_cli("invite", "--run", str(folder), "--peer", peer_id, "--expires", "1h", fork=True)
    assert made.returncode == 0, made.stderr
    path = tmp_path / f"{name}.invite"
    path.write_text(made.stdout)
    return str(path)


def _last_line(result) -> str:
    return (result.stderr.strip().splitlines() or [""])[-1]


def test_invited_peers_train_strangers_are_refused_and_a_revoked_peer_is_dropped(tmp_path, run_id,
                                                                                 no_leftover_processes):
    folder = tmp_path / "run"
    # (no averaging.group_size: with it set to 3, the honest peers' two epochs after the revoked peer left took
    # ~80 s instead of ~17 s - not understood yet, open in issue 11)
    # half the micro config's target batch: each epoch waited for below (a round of all three, two more after the
    # revocation) is half as long; that they learned is still checked, over 4-5 epochs
    config = write_config(tmp_path, {"training.target_batch_size": 512})
    init = run_cli("init", run_id, "--config", str(config), "--dir", str(folder), "--private")
    assert init.returncode == 0, init.stderr
    watcher = tmp_path / "watcher.key"
    with LocalSwarm(3, run_id, tmp_path / "peers", env=peer_env(), forks=fork_server(),
                    join_args=["--max-epochs", "1000"], per_peer_args={0: ["--run", str(folder)]}) as swarm:
        organizer, invited, revoked = swarm.peers
        # the watcher's invite as a volunteer and the organizer make it ('collab id', 'collab invite'); the two
        # peers' through the same function in-process (each CLI process is a few s of imports on 2 busy cores)
        organizer_key = load_run_folder(folder).organizer_key
        tokens = []
        for peer in (invited, revoked):
            path = tmp_path / f"peer{peer.index}.invite"
            path.write_text(make_invite(run_id, peer.peer_id, organizer_key, lifetime=3600).to_text())
            tokens.append(str(path))
        for peer, token in zip((invited, revoked), tokens):
            peer.args += ["--token-file", token]
        # the organizer alone first, waiting for its two peers: the refused processes below then share the 2 cores
        # with nobody's training. The watcher's two CLI processes run while it starts (it waits for the join line)
        with ThreadPoolExecutor(1) as pool:
            watcher_invite = pool.submit(_invite, folder, watcher, tmp_path, "watcher")
            swarm.start(count=1, wait_peers=3)
            tokens.append(watcher_invite.result(timeout=300))
        assert "--token-file INVITE" in organizer.log_text()

        # at once (each is a process of its own): a stranger with the join line but no invite, a peer whose invite
        # expired, an uninvited dashboard; then, with the invited peers in, an invited watcher reading the run
        joining = ["join", "--run-id", run_id, "--initial-peers", swarm.initial_peer,
                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--max-epochs", "1"]
        late_key = RSAPrivateKey()
        expired = make_invite(run_id, peer_id_of(late_key.get_public_key()), organizer_key, lifetime=-3600)
        (tmp_path / "expired.invite").write_text(expired.to_text())
        token = tokens[2]
        reading = ["status", "--run-id", run_id, "--initial-peers", swarm.initial_peer, "--json", "--wait", "10",
                   "--identity", str(watcher), "--token-file", token, "--run-key", load_run_folder(folder).fingerprint]

        def members_seen():
            status = run_cli(*reading, timeout=120, fork=True)
            assert status.returncode == 0, status.stderr
            seen = {peer["peer_id"] for peer in json.loads(status.stdout)["peers"]}
            return seen if len(seen) >= 3 else None

        with ThreadPoolExecutor(3) as pool:
            stranger = pool.submit(run_cli, *joining, "--identity", str(tmp_path / "stranger.key"), timeout=120,
                                   fork=True)
            uninvited_dashboard = pool.submit(run_cli, "dashboard", "--run-id", run_id, "--initial-peers",
                                              swarm.initial_peer, "--port", str(free_ports(1)[0]), timeout=120,
                                              fork=True)
            refused = pool.submit(run_cli, *joining, "--token-file", str(tmp_path / "expired.invite"), timeout=60,
                                  fork=True)
            stranger, refused, dashboard = stranger.result(), refused.result(), uninvited_dashboard.result()
        for peer in (invited, revoked):
            swarm.start_peer(peer.index, ["--wait-peers", "3"])
        seen = wait_for(members_seen, 150, what="all three members in the watcher's status")
        assert stranger.returncode == 2 and "Traceback" not in stranger.stderr, stranger.stderr
        assert f"run {run_id!r} is private" in _last_line(stranger) and "collab id" in _last_line(stranger)
        assert refused.returncode == 2 and "expired" in _last_line(refused), refused.stderr
        assert dashboard.returncode == 2 and f"run {run_id!r} is private" in _last_line(dashboard), dashboard.stderr
        assert seen == {organizer.peer_id, invited.peer_id, revoked.peer_id}, seen  # the stranger is nowhere

        # the revoked peer has averaged with the others; after 'collab revoke' it is out within 60 s
        wait_for(lambda: revoked.summary_path.exists() and any(
            len(g["peers"]) == 3 for g in read_summary(revoked)["groups"]), 180, what="a round of all three peers")
        revoke = run_cli("revoke", "--run", str(folder), "--peer", revoked.peer_id, fork=True)
        assert revoke.returncode == 0, revoke.stderr
        revoked_at = time.monotonic()
        assert revoked.wait(75) == 2, revoked.log_text()[-3000:]
        print(f"the revoked peer left {time.monotonic() - revoked_at:.1f} s after 'collab revoke'")
        assert time.monotonic() - revoked_at < 60
        assert "revoked" in revoked.log_text().strip().splitlines()[-1], revoked.log_text()[-2000:]
        # by now every honest peer applied the revocation; each peer's own epoch numbering (a late start can shift it)
        epoch_after = {peer.index: read_summary(peer)["final_epoch"] for peer in (organizer, invited)}
        wait_for(lambda: all(read_summary(peer)["final_epoch"] >= epoch_after[peer.index] + 2
                             for peer in (organizer, invited)), 150, what="two more epochs of the two honest peers")
        swarm.stop()
    assert "Applied the organizer's revocation list: 1 peer(s) shut out" in invited.log_text()

    for peer in (organizer, invited):
        summary = read_summary(peer)
        groups = summary["groups"]
        assert any(revoked.peer_id in g["peers"] for g in groups), "the revoked peer never averaged: no test"
        late = [g for g in groups if g["epoch"] > epoch_after[peer.index]]
        assert late and all(revoked.peer_id not in g["peers"] for g in late), groups
        # the stranger never was in a group (nor anyone else who was not invited)
        assert all(set(g["peers"]) <= {organizer.peer_id, invited.peer_id, revoked.peer_id} for g in groups), groups
        losses = [loss for _, loss in sorted((int(e), v) for e, v in summary["loss_by_epoch"].items())]
        assert losses[-1] < losses[0], losses  # they trained
