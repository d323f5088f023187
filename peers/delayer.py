"""Constant one-way delay without netem: packets wait in an NFQUEUE until their release time.

For kernels without the netem qdisc (this project's CI machine) but with nfnetlink_queue. An iptables rule
sends a link's packets to a queue number; this process, bound to that queue, notes when each packet arrived and
accepts it `delay_ms` later. It speaks nfnetlink_queue over a raw AF_NETLINK socket (struct only, no
libnetfilter_queue), and keeps the cost per packet small:
  - copy mode META: the kernel sends ~80 bytes of metadata per packet, never the payload;
  - F_GSO: a TSO/GSO super-packet (up to 64 KB) is queued whole, not cut into 1500-byte packets first;
  - NFQNL_MSG_VERDICT_BATCH: one message accepts every packet up to an id. A constant delay keeps a queue's
    packets in arrival order, so all that are due leave with one verdict;
  - F_FAIL_OPEN and a long queue: if the delayer falls behind, the kernel lets packets through undelayed
    rather than dropping them.
One process can serve several queues (one per link), each with its own delay.

Where the packets wait matters. A packet held on its sender's own output path still belongs to the sending
socket, and TCP small queues let a socket keep only ~1 ms of its rate queued in its own host, so a delay there
throttles bulk TCP to its window over the delay: 25 ms on a peer's own eth0 carried 1.3 Mbit/s here (and likely
explains the 7 Mbit/s of the issue's first Python delayer). netem escapes this by orphaning the packet; we
cannot, so netns.NetworkLab holds packets in the switch namespace, where the bridge has already released them
from the socket (br_netfilter, `iptables -m physdev --physdev-in pN -j NFQUEUE`).

Ceiling, measured with benchmarks/delayer.py on the 2-core CI machine (both sides delayed, 5 s per row; "CPU" is
the delayer process's, % of one core, much of it system time: the kernel forwarding each accepted packet in its
context, work that runs in softirq without a delayer):
  - no tc rate, 4 TCP streams of TCP's usual GSO packets (up to 64 KB): 13.5-15.9 Gbit/s at 0 ms (21-26 without
    the delayer; 70-80% CPU); 4.4 / 1.8 / 0.9 Gbit/s at 20 / 50 / 100 ms round trip, where the streams' TCP
    windows are the limit, not the delayer (55 / 32 / 22% CPU), and the round trip under load stays on target;
  - the worst case, one 1448-byte segment per packet (gso_max_segs 1): ~80,000-110,000 packets/s (data and ACKs,
    from the rate) at 90-96% CPU, 640-850 Mbit/s (950-1130 without the delayer: the machine's own limit),
    550-610 at 50-100 ms. At that load packets wait longer than asked (20 ms round trip read 39-46 ms);
  - links shaped as profiles shape them: 50-100 Mbit/s costs 9-15% CPU with GSO packets, and 100 Mbit/s of
    1448-byte packets ~20% user + 30-50% system; 1000 Mbit/s (datacenter) carries 880-920 Mbit/s at 0-100 ms
    round trip (927 undelayed) at 20-37% CPU. Round trips under load stay within ~1-5 ms of the shaped link's own.
  Round trip accuracy, idle: +0.4 to +1.4 ms over the configured 1-100 ms, of which ~0.4 ms is the TCP connect
  itself (0.3-0.4 ms undelayed); never early. Once the kernel's queue or our socket buffer is full, the excess
  passes undelayed (fail-open) instead of being dropped.

    python3 peers/delayer.py --queue 3:25 --queue 4:10   # queue 3's packets wait 25 ms, queue 4's 10 ms

prints "ready" once every queue is bound, and stops on SIGTERM/SIGINT, accepting whatever it still holds. It asks
for a real-time priority (see _wake_on_time).
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5  # an overflowing receive buffer must not turn into an error on our socket
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x1, 0x4
NF_ACCEPT = 1

QUEUE_MAXLEN = 65536  # packets held at once: 50 ms of 10 Gbit/s in 1-KB packets
RECEIVE_BUFFER = 64 << 20  # a packet's message takes ~1 KB of it: ~60,000 packets may wait to be read
READ_BATCH = 64  # messages read per clock reading: at the ceiling, 64 take ~0.5 ms
EARLY_S = 0.0001  # release what is due within 0.1 ms now: one wake-up less, and a wake-up is late by about that

HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, port id
NFGEN = struct.Struct("!BBH")  # nfgenmsg: family, version, queue number (big-endian)
ATTR = struct.Struct("=HH")  # nlattr: length, type
# a packet's message up to its id: the three above, then NFQA_PACKET_HDR's id. All native byte order (one format
# cannot mix orders): the queue number and the id are big-endian, and are swapped once per read batch, not per packet
PACKET = struct.Struct("=IHHIIBBHHHI")
PACKET_MESSAGE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET


class DelayerError(RuntimeError):
    pass


def _attr(kind: int, payload: bytes) -> bytes:
    size = ATTR.size + len(payload)
    return ATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = NFGEN.pack(socket.AF_UNSPEC, 0, queue) + attrs
    return HEADER.pack(HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


class Delayer:
    """Holds the packets of each bound queue for that queue's delay; `serve()` until `stop()`."""

    def __init__(self, delays_ms: dict[int, float]):
        self.delays = {queue: ms / 1000 for queue, ms in delays_ms.items()}
        self.held = {queue: collections.deque() for queue in delays_ms}  # (release time, packet id), in order
        self._wake_read, self._wake_write = os.pipe()  # stop() from a signal handler wakes the poll
        os.set_blocking(self._wake_write, False)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, RECEIVE_BUFFER)  # SO_RCVBUFFORCE: root may exceed rmem_max
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        for seq, queue in enumerate(self.delays, start=1):
            self._bind(queue, seq)

    def _bind(self, queue: int, seq: int) -> None:
        flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
        attrs = (_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_UNSPEC))
                 + _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                 + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                 + _attr(NFQA_CFG_MASK, struct.pack("!I", flags)) + _attr(NFQA_CFG_FLAGS, struct.pack("!I", flags)))
        self.sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        self.sock.settimeout(5)
        try:
            while True:  # the ACK (an error message with code 0) for this request
                reply = self.sock.recv(65536)
                _, kind, _, reply_seq, _ = HEADER.unpack_from(reply)
                if kind == NLMSG_ERROR and reply_seq == seq:
                    code = -struct.unpack_from("=i", reply, HEADER.size)[0]
                    if code:
                        raise DelayerError(f"binding NFQUEUE {queue} failed: {os.strerror(code)} (is "
                                           f"nfnetlink_queue in this kernel, and is the queue free?)")
                    return
        except socket.timeout:
            raise DelayerError(f"the kernel did not answer binding NFQUEUE {queue}: no nfnetlink_queue?") from None
        finally:
            self.sock.settimeout(None)

    def stop(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass

    def serve(self) -> None:
        self.sock.setblocking(False)
        buffer = bytearray(65536)
        held, delays = self.held, self.delays
        recv_into, unpack_packet = self.sock.recv_into, PACKET.unpack_from
        try:
            while True:
                due = [queue[0][0] for queue in held.values() if queue]
                # select, not poll: its timeout has microseconds where poll's has whole milliseconds, which
                # added up to 2 ms to every hop
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                if self._wake_read in select.select([self.sock, self._wake_read], [], [], timeout)[0]:
                    return
                drained = False
                while not drained:
                    # A packet's delay starts when we read it. Up to READ_BATCH messages share one clock reading
                    # and, per queue, one held entry (the newest id: a batch verdict releases those before it).
                    now, newest = time.monotonic(), {}
                    for _ in range(READ_BATCH):
                        try:
                            size = recv_into(buffer)
                        except BlockingIOError:
                            drained = True
                            break
                        # the kernel sends one packet per message, NFQA_PACKET_HDR first: one unpack reads it
                        if size >= PACKET.size:
                            length, kind, _, _, _, _, _, queue, _, attr, packet_id = unpack_packet(buffer)
                            if kind == PACKET_MESSAGE and attr & 0x3FFF == NFQA_PACKET_HDR and length == size:
                                newest[queue] = packet_id
                                continue
                        self._parse_slowly(buffer, size, newest)
                    for queue, packet_id in newest.items():
                        queue = socket.ntohs(queue)
                        if queue in held:
                            held[queue].append((now + delays[queue], socket.ntohl(packet_id)))
                    self._release(time.monotonic() + EARLY_S)
        finally:
            self._release(float("inf"))  # whatever is still held leaves now rather than being dropped

    @staticmethod
    def _parse_slowly(buffer: bytearray, size: int, newest: dict[int, int]) -> None:
        """Any other layout: several messages in one read, attributes in another order."""
        offset = 0
        while offset + HEADER.size + NFGEN.size <= size:
            length, kind, _, _, _ = HEADER.unpack_from(buffer, offset)
            if kind == PACKET_MESSAGE:
                queue = socket.htons(NFGEN.unpack_from(buffer, offset + HEADER.size)[2])  # raw, as serve() keeps it
                at, end = offset + HEADER.size + NFGEN.size, min(offset + length, size)
                while at + ATTR.size + 4 <= end:
                    attr_size, attr = ATTR.unpack_from(buffer, at)
                    if attr & 0x3FFF == NFQA_PACKET_HDR:
                        newest[queue] = struct.unpack_from("=I", buffer, at + ATTR.size)[0]  # raw, too
                        break
                    at += (attr_size + 3) & ~3 or end
            offset += (length + 3) & ~3 or size

    def _release(self, now: float) -> None:
        for queue, packets in self.held.items():
            last = None
            while packets and packets[0][0] <= now:
                last = packets.popleft()[1]
            if last is not None:  # accepts every packet of this queue with an id up to `last`
                attrs = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
                self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, attrs))

    def close(self) -> None:
        self.sock.close()
        os.close(self._wake_read)
        os.close(self._wake_write)


def _wake_on_time() -> None:
    """A real-time priority: on a busy machine (the peers' training takes every core) a normal process wakes
    milliseconds late, and each late wake-up adds to the delay. The delayer's own CPU use is small, and the
    kernel caps real-time tasks at 95% of a core (sched_rt_runtime_us), so it cannot starve the machine."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        try:
            os.nice(-10)
        except OSError:
            pass


def _queue_and_delay(text: str) -> tuple[int, float]:
    queue, _, delay = text.partition(":")
    return int(queue), float(delay)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queue", action="append", type=_queue_and_delay, required=True, metavar="NUM:DELAY_MS",
                        help="an NFQUEUE number and the one-way delay in ms for its packets; repeatable")
    args = parser.parse_args(argv)
    try:
        delayer = Delayer(dict(args.queue))
    except (DelayerError, OSError) as e:
        print(f"delayer: {e}", file=sys.stderr)
        return 2
    _wake_on_time()
    signal.signal(signal.SIGTERM, lambda *_: delayer.stop())
    signal.signal(signal.SIGINT, lambda *_: delayer.stop())
    print("ready", flush=True)
    try:
        delayer.serve()
    finally:
        delayer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
