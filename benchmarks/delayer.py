"""The delayer's ceiling: bulk TCP through peers/delayer.py with no tc rate, at several round trips.

Two namespaces joined by the lab's switch, both links given the same one-way delay (so data and ACKs both wait).
Per row: Mbit/s carried by --streams parallel TCP streams for --seconds (the first second, slow start, left out),
the TCP-connect round trip idle and during the bulk transfer against the configured one, and the delayer
process's CPU (% of one core) during the transfer: its own (user) and the kernel's (system, mostly forwarding the
packets it accepts, work that happens anyway without it). netem is ignored even where the kernel has it: this measures
the delayer. Rows: no delay (no delayer at all), the delayer with 0 ms (its per-packet cost alone), then round
trips of 20, 50 and 100 ms.

    sudo python3 benchmarks/delayer.py [--seconds 5] [--streams 4] [--rtts 20,50,100] [--packets gso,mtu] [--rate MBIT]

Two packet sizes: TCP's usual GSO packets (up to 64 KB, what an unshaped or fast link sends) and one 1448-byte
segment per packet (gso_max_segs 1), the per-packet worst case.

A round trip during the transfer that is shorter than configured means the delayer fell behind and the kernel let
packets through undelayed (fail-open); longer means packets waited behind others in the delayer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collab.peers import netns  # noqa: E402
from collab.peers.profiles import LinkSpec  # noqa: E402

SERVER = """
import socket, sys, threading, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5555)); s.listen()
counted, lock = [0], threading.Lock()
def drain(c):
    while chunk := c.recv(1 << 18):
        with lock:
            counted[0] += len(chunk)
def report():  # every 0.1 s: bytes so far, so the client can take the rate over any window
    while True:
        time.sleep(0.1)
        print(time.monotonic(), counted[0], flush=True)
threading.Thread(target=report, daemon=True).start()
while True:
    c, _ = s.accept()
    threading.Thread(target=drain, args=(c,), daemon=True).start()
"""
CONNECTS = """
import socket, sys, time
rtts = []
for _ in range(int(sys.argv[2])):
    started = time.monotonic()
    socket.create_connection((sys.argv[1], 5555), timeout=5).close()
    rtts.append((time.monotonic() - started) * 1000)
    time.sleep(0.05)
print(" ".join(f"{r:.2f}" for r in rtts))
"""
BULK = """
import socket, sys, threading, time
end = time.monotonic() + float(sys.argv[2])
def send():
    s = socket.create_connection((sys.argv[1], 5555), timeout=10)
    block = b"x" * (1 << 18)
    while time.monotonic() < end:
        s.sendall(block)
    s.close()
threads = [threading.Thread(target=send) for _ in range(int(sys.argv[3]))]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds. System time includes the kernel's forwarding of every packet the delayer
    accepts (bridge, shaping, the receiver's TCP), which without the delayer runs in softirq, counted nowhere."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def _rtts(lab: netns.NetworkLab, count: int) -> list[float]:
    out = subprocess.run([*lab.command_prefix(0), sys.executable, "-c", CONNECTS, lab.address(1), str(count)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [float(r) for r in out.split()]


def measure(one_way_ms: float | None, seconds: float, streams: int, mtu_packets: bool,
            rate_mbit: float | None = None) -> dict:
    links = [LinkSpec(delay_ms=one_way_ms or 0.0, upload_mbit=rate_mbit, download_mbit=rate_mbit)] * 2
    with netns.NetworkLab(links) as lab:
        if mtu_packets:  # one TCP segment per packet: the delayer's cost per packet, at rates a shaper allows
            for i in range(2):
                subprocess.run(["ip", "-n", lab.namespaces[i], "link", "set", "dev", "eth0", "gso_max_segs", "1"],
                               check=True)
        server = subprocess.Popen([*lab.command_prefix(1), sys.executable, "-u", "-c", SERVER, lab.address(1)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)  # python's start, then listen
            idle = _rtts(lab, 10)
            delayer = lab._delayer.pid if lab._delayer else None
            cpu_before = _cpu_seconds(delayer) if delayer else (0.0, 0.0)
            bulk = subprocess.Popen([*lab.command_prefix(0), sys.executable, "-c", BULK, lab.address(1),
                                     str(seconds), str(streams)])
            time.sleep(1.0)
            loaded = _rtts(lab, max(3, int(seconds) - 2))
            bulk.wait(timeout=seconds + 30)
            cpu_after = _cpu_seconds(delayer) if delayer else (0.0, 0.0)
            user, system = ((after - before) / seconds * 100 for after, before in zip(cpu_after, cpu_before))
            samples = []
            for line in server.stdout:  # (time, bytes) every 0.1 s since the server started
                samples.append(tuple(map(float, line.split())))
                if len(samples) >= 5 and samples[-1][1] > 0 and len({b for _, b in samples[-5:]}) == 1:
                    break  # the transfer is over
        finally:
            server.kill()
            server.wait()
            server.stdout.close()
    moving = [s for s in samples if s[1] > 0]
    start = next(s for s in moving if s[0] >= moving[0][0] + 1.0)  # past slow start
    end = next(s for s in moving if s[1] == moving[-1][1])  # when the last byte had arrived
    return {"mbit": (end[1] - start[1]) * 8 / 1e6 / (end[0] - start[0]), "idle": statistics.median(idle),
            "loaded": statistics.median(loaded), "user": user, "system": system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--rtts", default="20,50,100", help="configured round trips in ms, comma-separated")
    parser.add_argument("--rate", type=float, default=None, help="shape both links to this many Mbit/s each way, "
                        "as a profile does (default: no rate limit: the delayer's own ceiling)")
    parser.add_argument("--packets", default="gso,mtu",
                        help="gso: TCP's usual up-to-64-KB packets; mtu: one 1448-byte segment per packet")
    args = parser.parse_args()
    reason = netns.namespaces_unavailable_reason()
    if reason:
        raise SystemExit(reason)
    netns.netem_available = lambda: False  # the delayer, even on a kernel with netem
    rows = [("no delayer", None, 0.0), ("delayer, 0 ms", 0.0001, 0.0)]
    rows += [(f"delayer, {rtt} ms RTT", rtt / 2, float(rtt)) for rtt in map(int, args.rtts.split(","))]
    limit = f"links shaped to {args.rate:g} Mbit/s" if args.rate else "no rate limit"
    print(f"bulk TCP, {args.streams} streams, {args.seconds:g} s, {limit}; {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    for packets in args.packets.split(","):
        print(f"\n{packets + ' packets':22} {'Mbit/s':>8} {'RTT set':>8} {'RTT idle':>9} {'RTT bulk':>9} "
              f"{'delayer CPU: user + system':>27}")
        for name, one_way, rtt in rows:
            r = measure(one_way, args.seconds, args.streams, mtu_packets=packets == "mtu", rate_mbit=args.rate)
            print(f"{name:22} {r['mbit']:8.0f} {rtt:7.1f}  {r['idle']:8.1f}  {r['loaded']:8.1f}  "
                  f"{r['user']:13.0f} % + {r['system']:3.0f} %",
                  flush=True)


if __name__ == "__main__":
    main()
