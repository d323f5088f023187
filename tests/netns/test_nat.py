"""NetworkLab's real NAT (`nat: router`): a home peer behind its own masquerading router, next to a public peer.

Plain TCP sockets only (root only): what a home router without port forwarding lets through and what it does not.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from collab.peers.netns import NetworkLab, namespaces_skip_reason
from collab.peers.profiles import LinkSpec, load_profile

pytestmark = pytest.mark.skipif(namespaces_skip_reason() is not None,
                                reason=f"no network namespaces here: {namespaces_skip_reason()}")

PORT = 5555
# accepts for argv[2] seconds, answers each connection with "hi" and prints who connected (ip as seen here)
LISTENER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], %d)); s.listen(); print("listening", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while (left := deadline - time.monotonic()) > 0:
    s.settimeout(left)
    try:
        c, peer = s.accept()
    except OSError:
        break
    c.sendall(b"hi"); c.close(); print("from", peer[0], flush=True)
""" % PORT
# one connection attempt, at most 2 s: "ok" (and the greeting arrived) or why not
CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(2)
try:
    s.connect((sys.argv[1], %d)); print("ok" if s.recv(2) == b"hi" else "no greeting")
except OSError as e:
    print(type(e).__name__, e)
""" % PORT


def _listen(lab: NetworkLab, index: int, seconds: float) -> subprocess.Popen:
    process = subprocess.Popen([*lab.command_prefix(index), sys.executable, "-c", LISTENER, "0.0.0.0", str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "listening"
    return process


def _connect(prefix: list[str], host: str) -> str:
    return subprocess.run([*prefix, sys.executable, "-c", CONNECT, host], capture_output=True, text=True,
                          timeout=20).stdout.strip()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_home_peers_behind_their_own_routers_reach_out_but_cannot_be_reached():
    links = [LinkSpec(), LinkSpec(nat="router"), LinkSpec(nat="router", upload_mbit=10, download_mbit=50)]
    lab = NetworkLab(links)
    listeners: list[subprocess.Popen] = []
    try:
        lab.create()
        assert lab.address(0) == lab.public_address(0) == "10.77.0.2"
        assert lab.address(1) == "192.168.2.2" and lab.public_address(1) == "10.77.0.3"
        assert lab.address(2) == "192.168.3.2" and lab.public_address(2) == "10.77.0.4"
        home_a, home_b = lab.command_prefix(1), lab.command_prefix(2)

        # a home peer opens a connection to the public peer, which sees it come from the router's public address
        public = _listen(lab, 0, seconds=15)
        listeners.append(public)
        assert _connect(home_a, lab.address(0)) == "ok"
        assert _connect(home_b, lab.address(0)) == "ok"

        # nobody opens one to a home peer: not to its private address (no route to it), not to its router's public
        # address (no port forwarding), not even with a route to its LAN through its router (the router forwards
        # inbound only what conntrack knows as a reply)
        for i in (1, 2):
            listeners.append(_listen(lab, i, seconds=15))
        public_side = lab.command_prefix(0)
        assert _connect(public_side, lab.address(1)) != "ok"
        assert _connect(public_side, lab.public_address(1)).startswith("ConnectionRefusedError")
        # ... and the two home peers cannot reach each other directly, either way: a double NAT between them
        for source, target in ((home_a, 2), (home_b, 1)):
            assert _connect(source, lab.address(target)) != "ok"
            assert _connect(source, lab.public_address(target)) != "ok"
        subprocess.run([*public_side, "ip", "route", "add", "192.168.2.0/24", "via", lab.public_address(1)], check=True)
        assert _connect(public_side, lab.address(1)).startswith("TimeoutError")  # dropped by the router

        outputs = []
        for process in listeners:
            process.terminate()
            outputs.append(process.communicate(timeout=10)[0])
        # the public peer saw the two home peers as their routers' public addresses: masqueraded
        assert outputs[0].split().count("from") == 2, outputs[0]
        assert f"from {lab.public_address(1)}" in outputs[0] and f"from {lab.public_address(2)}" in outputs[0]
        assert "from" not in outputs[1] + outputs[2], outputs  # nothing ever reached a home peer
        # the profile's shaping is on the home peer's own link, its counters on its own eth0
        assert lab.counters(2)["bytes_sent"] > 0
    finally:
        for process in listeners:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        lab.destroy()
    assert not any(ns in _namespaces() for ns in [*lab.namespaces, *lab.routers.values(), lab.switch])


def test_home_nat_profile_puts_all_but_peer_0_behind_routers():
    links = load_profile("home-nat").links(3)
    assert links[0].nat is False and all(link.nat == "router" for link in links[1:])
    started = time.monotonic()
    with NetworkLab(links) as lab:
        assert sorted(lab.routers) == [1, 2]
        # nobody listens yet: refused, and the refusal found its way back through the NAT
        assert _connect(lab.command_prefix(1), lab.address(0)).startswith("ConnectionRefusedError")
    assert time.monotonic() - started < 30
