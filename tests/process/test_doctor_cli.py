"""`collab doctor` in a process of its own, with no swarm: an initial peer nobody listens at is one line naming it, exit
1, no traceback; a bad flag is exit 2 as for every command."""

from __future__ import annotations

import socket

from tests.conftest import run_cli

SOME_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_initial_peer_is_named_with_what_to_check():
    address = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{SOME_ID}"
    result = run_cli("doctor", "--run-id", "r", "--initial-peers", address, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out and "Daemon failed to start" not in out, out
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("not ready: ") and address in last and "refused" in last, out
    assert "ask the organizer for a current join line" in result.stdout


def test_a_bad_flag_is_exit_2():
    result = run_cli("doctor", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("collab doctor: error: --initial-peers '/ip4/127.0.0.1/tcp/1' lacks the peer id; "
                                     "copy the full /ip4/…/tcp/…/p2p/… address")


def test_a_listen_port_in_use_is_named_and_the_initial_peers_still_checked():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        address = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/{SOME_ID}"
        result = run_cli("doctor", "--run-id", "r", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--initial-peers",
                         address, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FAIL  listen        --host-maddrs {port}: the port is already in use on 127.0.0.1" in result.stdout
    assert "a collab join still running?" in result.stdout and f"{address}: refused" in result.stdout
