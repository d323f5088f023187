"""A private network for a simulated swarm: one namespace per peer, joined by a switch namespace.

    peer0 [eth0 10.77.0.2] ──veth── p0 ┐
    peer1 [eth0 10.77.0.3] ──veth── p1 ├─ br0   (switch namespace; no link to the root namespace)
    ...                                ┘

Each peer's upload is shaped on its own eth0 (egress), its download on the switch's end of its
veth (egress towards the peer), with tc htb. TCP ACKs get a priority class on both, so a saturated
upload does not starve the downloads whose ACKs queue behind it. A NAT'd peer's namespace drops its
own SYN-ACKs: nobody can open a connection to it, while its outbound connections work, which is
what a home router does to a peer without port forwarding. Delay and loss need netem; a kernel
without it (like this project's CI machine) gets a warning naming what was skipped.

The addresses live only inside these namespaces, and the names carry the creating process's id
and a random tag, so two simulations never collide and a crashed one's leftovers can be swept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from typing import Optional

from collab.peers.profiles import LinkSpec

SUBNET = "10.77.0"  # private to the lab's namespaces; the root namespace never sees it
NS_PREFIX = "collab-"
UNLIMITED_MBIT = 10_000  # the rate of a class that exists only for the NAT filter


class NetworkError(RuntimeError):
    pass


def namespaces_unavailable_reason() -> Optional[str]:
    """Why this machine cannot host a NetworkLab, or None if it can."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or inside a container with CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found; install iproute2"
    probe = f"{NS_PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:4]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def namespaces_skip_reason() -> Optional[str]:
    """Why namespace tests may be skipped here: only off Linux or without root. As root (CI) they must run, and
    fail with NetworkLab's error if namespaces do not work, rather than pass by skipping."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, loss): tried on the loopback of a throw-away namespace."""
    probe = f"{NS_PREFIX}{os.getpid()}-netem{uuid.uuid4().hex[:4]}"
    _run("ip", "netns", "add", probe)
    try:
        return _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False).returncode == 0
    finally:
        _run("ip", "netns", "del", probe, check=False)


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


class NetworkLab:
    """Namespaces, veths and shaping for `len(links)` peers; a context manager that always cleans up."""

    def __init__(self, links: list[LinkSpec], tag: Optional[str] = None, observer: bool = False):
        self.links, self.with_observer = links, observer
        self.tag = tag or uuid.uuid4().hex[:6]
        base = f"{NS_PREFIX}{os.getpid()}-{self.tag}"
        self.switch = f"{base}-sw"
        self.namespaces = [f"{base}-p{i}" for i in range(len(links))]
        self.observer = f"{base}-obs"  # an unshaped host for the dashboard and `collab status`
        self.warnings: list[str] = []
        self._created: list[str] = []

    def __enter__(self) -> "NetworkLab":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # -- what peers need ------------------------------------------------------------------------

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 2}"

    def command_prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index]]

    def observer_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.observer]

    def counters(self, index: int) -> Optional[dict[str, int]]:
        """Bytes the peer's interface sent and received, or None once its namespace is gone."""
        result = _run("ip", "-n", self.namespaces[index], "-s", "-j", "link", "show", "eth0", check=False)
        if result.returncode != 0:
            return None
        stats = json.loads(result.stdout)[0]["stats64"]
        return {"bytes_sent": stats["tx"]["bytes"], "bytes_received": stats["rx"]["bytes"]}

    def partition(self, side: list[int]) -> None:
        """Cut the peers in `side` off from the others (they still reach each other): their switch ports move to
        a second bridge. Packets across the cut are lost, as in a real outage; nothing is refused."""
        _run("ip", "-n", self.switch, "link", "add", "br1", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br1", "up")
        for i in side:
            _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br1")

    def heal(self) -> None:
        result = _run("ip", "-n", self.switch, "-j", "link", "show", "master", "br1", check=False)
        ports = [link["ifname"] for link in json.loads(result.stdout or "[]")] if result.returncode == 0 else []
        for port in ports:
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.switch, "link", "del", "br1", check=False)

    # -- building and tearing down --------------------------------------------------------------

    def create(self) -> None:
        sweep_stale_namespaces()
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        netem_missing: list[str] = []
        if self.with_observer:
            self._plug(self.observer, "obs", f"{SUBNET}.254")
        for i, (ns, link) in enumerate(zip(self.namespaces, self.links)):
            port = f"p{i}"
            self._plug(ns, port, self.address(i))
            # upload: what the peer sends; delay and loss apply to it, so a round trip gets both ends' delay
            if not shape(ns, "eth0", link.upload_mbit, link.delay_ms, link.loss_percent, drop_syn_ack=link.nat):
                netem_missing.append(f"peer {i}")
            shape(self.switch, port, link.download_mbit, 0.0, 0.0, drop_syn_ack=False)
        if netem_missing:
            self.warnings.append(
                f"this kernel has no netem qdisc: the profile's delay/loss is NOT applied for "
                f"{', '.join(netem_missing)} (rates and NAT are); load sch_netem to simulate latency")

    def _plug(self, ns: str, port: str, address: str) -> None:
        """A host namespace `ns` with eth0 at `address`, cabled to switch port `port`."""
        self._add_namespace(ns)
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def destroy(self) -> None:
        """Kill whatever still runs inside the lab's namespaces (they are ours), then delete them."""
        for ns in reversed(self._created):
            remove_namespace(ns)
        self._created.clear()


def remove_namespace(ns: str) -> None:
    for _ in range(20):  # a process entering the namespace right now shows up on the next look
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    _run("ip", "netns", "del", ns, check=False)


def sweep_stale_namespaces() -> list[str]:
    """Delete namespaces left by a simulation whose process died without cleaning up (kill -9)."""
    listing = _run("ip", "netns", "list", check=False).stdout
    removed = []
    for name in re.findall(rf"^({re.escape(NS_PREFIX)}(\d+)-\S+)", listing, flags=re.M):
        ns, owner = name[0], int(name[1])
        if owner != os.getpid() and not os.path.exists(f"/proc/{owner}"):
            remove_namespace(ns)
            removed.append(ns)
    return removed


def shape(ns: str, dev: str, rate_mbit: Optional[float], delay_ms: float, loss_percent: float,
          drop_syn_ack: bool) -> bool:
    """Shape egress of `dev`: htb at `rate_mbit`, ACKs first, netem for delay/loss, SYN-ACKs dropped for NAT.

    Returns False if delay or loss was asked for and the kernel has no netem (nothing else is skipped).
    """
    wants_netem = delay_ms > 0 or loss_percent > 0
    if rate_mbit is None and not wants_netem and not drop_syn_ack:
        return True
    rate = rate_mbit or UNLIMITED_MBIT
    tc = ("tc", "-n", ns)
    _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *_rate(rate, rate))
    _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", *_rate(rate * 0.2, rate), "prio", "0")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", *_rate(rate * 0.8, rate), "prio", "1")
    ipv4_tcp = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0"]  # no IP options
    if drop_syn_ack:
        # a class whose queue holds nothing: every SYN-ACK this peer sends is dropped
        _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", "1:30", "htb", *_rate(0.01, 0.01), "prio", "2")
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:30", "handle", "30:", "pfifo", "limit", "0")
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", *ipv4_tcp,
             "match", "u8", "0x12", "0x12", "at", "33", "flowid", "1:30")
    # bare ACKs (total length < 64 bytes, ACK flag): the wondershaper rule
    _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32", *ipv4_tcp,
         "match", "u16", "0x0000", "0xffc0", "at", "2", "match", "u8", "0x10", "0xff", "at", "33", "flowid", "1:10")
    if not wants_netem:
        return True
    netem = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%"]
    for leaf in ("10", "20"):
        result = _run(*tc, "qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "handle", f"{leaf}:", *netem, check=False)
        if result.returncode != 0:
            return False
    return True


def _rate(rate_mbit: float, ceil_mbit: float) -> list[str]:
    # quantum: bytes a class may send per round; the default (rate/10) is out of range at both ends
    quantum = int(min(max(rate_mbit * 1e6 / 8 / 10, 1514), 200_000))
    return ["rate", f"{rate_mbit:.3f}mbit", "ceil", f"{ceil_mbit:.3f}mbit", "quantum", str(quantum)]
