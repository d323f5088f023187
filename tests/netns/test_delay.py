"""A profile's delay_ms on real namespaces: netem where the kernel has it, else peers/delayer.py (root only).

Round trips are TCP connects (SYN there, SYN-ACK back: one trip each way); no ping on this machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest

from collab.peers.netns import NetworkError, NetworkLab, namespaces_skip_reason, start_delayer, stop_delayer
from collab.peers.profiles import LinkSpec

pytestmark = pytest.mark.skipif(namespaces_skip_reason() is not None,
                                reason=f"no network namespaces here: {namespaces_skip_reason()}")

# accepts until killed; each connection is read to its end, so a bulk sender can report what arrived
SERVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5555)); s.listen()
while True:
    c, _ = s.accept()
    first = late_start = None
    late = 0
    while chunk := c.recv(1 << 16):
        now = time.monotonic()
        first = first or now
        if now - first > 1.0:  # past slow start: what the link carries, not how fast TCP ramps up
            if late_start is None:
                late_start = now
            else:
                late += len(chunk)
    if late:
        print(late * 8 / 1e6 / (now - late_start), flush=True)
    c.close()
"""
CONNECTS = """
import socket, sys, time
rtts = []
for _ in range(int(sys.argv[2])):
    started = time.monotonic()
    s = socket.create_connection((sys.argv[1], 5555), timeout=5)
    rtts.append((time.monotonic() - started) * 1000)
    s.close()
    time.sleep(0.02)
print(" ".join(f"{r:.2f}" for r in rtts))
"""
# Reno, not the default cubic: cubic's HyStart here sometimes leaves slow start well below the path's 312-KB
# bandwidth-delay product and then takes ~10 s to fill it (a CI run read 32 Mbit/s, 1 in 5 runs here under 40;
# no retransmits in any): the sender's congestion control, not the delay, which is what this measures
BULK = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5555), timeout=5)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
block, end = b"x" * (1 << 18), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.sendall(block)
s.close()
"""


def _connect_rtts_ms(lab: NetworkLab, count: int = 15) -> list[float]:
    out = subprocess.run([*lab.command_prefix(0), sys.executable, "-c", CONNECTS, lab.address(1), str(count)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [float(r) for r in out.split()]


def _with_server(lab: NetworkLab, body):
    server = subprocess.Popen([*lab.command_prefix(1), sys.executable, "-c", SERVER, lab.address(1)],
                              stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(50):  # until it listens
            if subprocess.run([*lab.command_prefix(1), "ss", "-ltnH", "sport = :5555"], capture_output=True,
                              text=True).stdout.strip():
                break
            time.sleep(0.1)
        return body(server)
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def test_delay_ms_is_each_ways_delay_and_no_delay_adds_nothing(no_leftover_processes):
    with NetworkLab([LinkSpec(delay_ms=25), LinkSpec(delay_ms=25)]) as lab:
        rtts = _with_server(lab, lambda _: _connect_rtts_ms(lab))
        delayer = lab._delayer
    print(f"25 ms each way: connect round trips {sorted(rtts)} ms")
    assert 40 <= statistics.median(rtts) <= 60, rtts  # 50 ms +-20%
    assert min(rtts) >= 49, rtts  # never early: a constant delay is a floor
    assert delayer is None or delayer.returncode == 0  # stopped by the lab, after letting go of what it held
    with NetworkLab([LinkSpec(), LinkSpec()]) as lab:
        rtts = _with_server(lab, lambda _: _connect_rtts_ms(lab))
        assert lab._delayer is None
    print(f"no delay: connect round trips {sorted(rtts)} ms")
    assert statistics.median(rtts) < 5, rtts


def test_one_sided_delay_and_bulk_tcp_keeps_the_shaped_rate(no_leftover_processes):
    """50 ms on one side only: round trip 50 ms. Bulk at 50 Mbit/s through it: the delayer is no bottleneck."""
    with NetworkLab([LinkSpec(upload_mbit=50, delay_ms=50), LinkSpec()]) as lab:
        def measure(server):
            rtts = _connect_rtts_ms(lab, count=10)
            subprocess.run([*lab.command_prefix(0), sys.executable, "-c", BULK, lab.address(1), "5"],
                           timeout=30, check=True)
            return rtts, float(server.stdout.readline())
        rtts, mbit = _with_server(lab, measure)
    print(f"50 ms one way: connect round trips {sorted(rtts)} ms; bulk {mbit:.1f} Mbit/s through a 50 Mbit/s link")
    assert 40 <= statistics.median(rtts) <= 60, rtts
    assert mbit >= 40, f"{mbit:.1f} Mbit/s through a 50 Mbit/s link delayed 50 ms"


def test_delayer_is_reaped_when_the_body_fails_and_a_taken_queue_is_one_clear_error(no_leftover_processes):
    with pytest.raises(RuntimeError, match="a failing test"):
        with NetworkLab([LinkSpec(delay_ms=10)]) as lab:
            delayer = lab._delayer
            raise RuntimeError("a failing test")
    assert delayer is None or delayer.returncode is not None
    with NetworkLab([LinkSpec()]) as lab:  # a namespace of our own to hold two delayers
        first, stderr = start_delayer(lab.namespaces[0], {7: 5.0})
        try:
            with pytest.raises(NetworkError) as refused:
                start_delayer(lab.namespaces[0], {7: 5.0})  # queue 7 is bound already
        finally:
            stop_delayer(first)
            stderr.close()
    message = str(refused.value)
    print(message)
    assert "\n" not in message and "NFQUEUE 7" in message, message
