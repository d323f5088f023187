"""A private network for a simulated swarm: one namespace per peer, joined by a switch namespace.

    peer0 [eth0 10.77.0.2] ──veth── p0 ┐
    peer1 [eth0 10.77.0.3] ──veth── p1 ├─ br0   (switch namespace; no link to the root namespace)
    ...                                ┘

Each peer's upload is shaped on its own eth0 (egress), its download on the switch's end of its
veth (egress towards the peer), with tc htb. TCP ACKs get a priority class on both, so a saturated
upload does not starve the downloads whose ACKs queue behind it. A NAT'd peer's namespace drops its
own SYN-ACKs: nobody can open a connection to it, while its outbound connections work, which is
what a home router does to a peer without port forwarding.

A peer whose link says `nat: router` is behind a real NAT instead: its own router namespace masquerades
(iptables MASQUERADE, no port forwarding) what it sends out to its public address, the one it would have
had on the switch, and forwards inbound only what conntrack knows as a reply:

    peer3 [eth0 192.168.4.2] ──veth── [lan0 192.168.4.1] router3 [eth0 10.77.0.5] ──veth── p3 ─ br0

Two such peers are two routers apart: a double NAT between them, which only a relay or hole punching crosses.

Delay and loss use netem where the kernel has it. A kernel without netem (like this project's CI machine) gets
its delay from peers/delayer.py instead: the switch namespace sends what enters it from port pN to NFQUEUE N+1
(br_netfilter, iptables physdev), and one delayer process there holds each queue's packets for peer N's
delay_ms. Loss without netem is skipped, with a warning that says so.

The addresses live only inside these namespaces, and the names carry the creating process's id
and a random tag, so two simulations never collide and a crashed one's leftovers can be swept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from collab.peers.profiles import LinkSpec

SUBNET = "10.77.0"  # private to the lab's namespaces; the root namespace never sees it
HOME_SUBNET = "192.168.{}"  # a home peer i's LAN behind its router: 192.168.(i+1).0/24
NS_PREFIX = "collab-"
UNLIMITED_MBIT = 10_000  # the rate of a class that exists only for the NAT filter
DELAYER = Path(__file__).with_name("delayer.py")  # run by path: standalone, and importing collab costs a second


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
        self.routers = {i: f"{base}-r{i}" for i, link in enumerate(links) if link.nat == "router"}
        self.observer = f"{base}-obs"  # an unshaped host for the dashboard and `collab status`
        self.warnings: list[str] = []
        self._created: list[str] = []
        self._delayer: Optional[subprocess.Popen] = None
        self._delayer_stderr = None

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
        """Where peer `index` listens: its switch address, or for a home peer its address on its router's LAN."""
        if index in self.routers:
            return f"{HOME_SUBNET.format(index + 1)}.2"
        return self.public_address(index)

    def public_address(self, index: int) -> str:
        """The address others see peer `index` connect from: its own, or its router's (the NAT's public side)."""
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
        if self.with_observer:
            self._plug(self.observer, "obs", f"{SUBNET}.254")
        wants_netem = any(link.delay_ms > 0 or link.loss_percent > 0 for link in self.links)
        netem = wants_netem and netem_available()
        for i, (ns, link) in enumerate(zip(self.namespaces, self.links)):
            port = f"p{i}"
            if i in self.routers:
                self._plug(self.routers[i], port, self.public_address(i))
                self._home(i)
            else:
                self._plug(ns, port, self.address(i))
            # upload: what the peer sends; delay and loss apply to it, so a round trip gets both ends' delay
            shape(ns, "eth0", link.upload_mbit, link.delay_ms if netem else 0.0, link.loss_percent if netem else 0.0,
                  drop_syn_ack=link.nat is True)
            shape(self.switch, port, link.download_mbit, 0.0, 0.0, drop_syn_ack=False)
        if netem:
            return
        delays = {i: link.delay_ms for i, link in enumerate(self.links) if link.delay_ms > 0}
        if delays:
            self._start_delayer(delays)
        lossy = [f"peer {i}" for i, link in enumerate(self.links) if link.loss_percent > 0]
        if lossy:
            self.warnings.append(f"this kernel has no netem qdisc: the profile's loss is NOT applied for "
                                 f"{', '.join(lossy)} (rates, delay and NAT are); load sch_netem to simulate loss")

    def _start_delayer(self, delays: dict[int, float]) -> None:
        """Peer i's packets wait delays[i] ms in the switch (queue i + 1), after the peer's own upload shaping and
        before the receiver's download shaping. Not on the peer's own eth0: see peers/delayer.py for why."""
        if shutil.which("iptables") is None:
            raise NetworkError("delay_ms on a kernel without netem needs iptables (apt-get install iptables)")
        # bridged packets pass iptables only with this on (br_netfilter; per namespace)
        _run("ip", "netns", "exec", self.switch, "sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables")
        self._delayer, self._delayer_stderr = start_delayer(self.switch, {i + 1: ms for i, ms in delays.items()})
        for i in delays:
            _run("ip", "netns", "exec", self.switch, "iptables", "-A", "FORWARD", "-m", "physdev",
                 "--physdev-in", f"p{i}", "-j", "NFQUEUE", "--queue-num", str(i + 1))

    def _plug(self, ns: str, port: str, address: str) -> None:
        """A host namespace `ns` with eth0 at `address`, cabled to switch port `port`."""
        self._add_namespace(ns)
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _home(self, index: int) -> None:
        """Peer `index`'s namespace on its router's LAN; the router masquerades to its public side and lets in
        only replies (conntrack), as a home router without port forwarding does."""
        if shutil.which("iptables") is None:
            raise NetworkError("a peer with 'nat: router' needs iptables (apt-get install iptables)")
        router, ns, lan = self.routers[index], self.namespaces[index], HOME_SUBNET.format(index + 1)
        self._add_namespace(ns)
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1")
        inside = ("ip", "netns", "exec", router)
        _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        _run(*inside, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT")
        _run(*inside, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack",
             "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*inside, "iptables", "-P", "FORWARD", "DROP")

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def destroy(self) -> None:
        """Stop the delayer (it lets go of what it holds), kill whatever else still runs inside the lab's
        namespaces (they are ours), then delete them."""
        if self._delayer is not None:
            stop_delayer(self._delayer)
            if self._delayer.returncode not in (0, -signal.SIGTERM):
                self._delayer_stderr.seek(0)
                self.warnings.append(f"the delayer exited with {self._delayer.returncode}: "
                                     f"{self._delayer_stderr.read().decode(errors='replace')[-500:]}")
            self._delayer_stderr.close()
            self._delayer = None
        for ns in reversed(self._created):
            remove_namespace(ns)
        self._created.clear()


def start_delayer(ns: str, delays_ms: dict[int, float], timeout: float = 20) -> tuple[subprocess.Popen, object]:
    """peers/delayer.py inside `ns`, holding NFQUEUE q's packets delays_ms[q] ms; returns once every queue is bound.
    Its stderr goes to a temporary file (returned with it): a pipe nobody reads could fill and stall it."""
    stderr = tempfile.TemporaryFile()
    queues = [f"--queue={queue}:{ms}" for queue, ms in delays_ms.items()]
    # its own session: a Ctrl-C meant for `collab simulate` must not stop it before the peers have left, or their
    # goodbyes would wait in a queue nobody serves
    process = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(DELAYER), *queues],
                               stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    ready = select.select([process.stdout], [], [], timeout)[0] and process.stdout.readline() == b"ready\n"
    if not ready:
        stop_delayer(process)
        stderr.seek(0)
        reason = stderr.read().decode(errors="replace").strip().splitlines() or [f"not ready after {timeout:g} s"]
        stderr.close()
        raise NetworkError(f"cannot simulate delay without netem: {reason[-1]}")
    process.stdout.close()  # nothing more is printed: a closed pipe costs nothing to keep
    return process, stderr


def stop_delayer(process: subprocess.Popen) -> None:
    """SIGTERM (it accepts what it holds and exits), SIGKILL if it does not within 5 s; always reaped."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout and not process.stdout.closed:
        process.stdout.close()


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
