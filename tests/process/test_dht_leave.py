"""A leave never blocks on a DHT process that stopped reading its pipe, and leaves no socket file behind.

Every hivemind DHT call sends a request down one pipe to the DHT's process, whose loop reads it. A loop that stops
reading (blocked, or ended) lets that pipe fill, and the next send blocks for good: a leave that overran its grace
had its main thread there, asking for the exit figures, and its DHT shutdown would have sent "_shutdown" the same way.
Here a real DHT's loop is blocked and its pipe filled; the exit figures are skipped and the DHT's process and its
p2pd are ended, each within a few seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

import hivemind
import psutil
import pytest
import torch

from collab.swarm.dht_traffic import ask_for_counts
from collab.swarm.node import shut_down_dht

BLOCKED_FOR = 60.0  # seconds the DHT's loop is held: longer than anything here may take


async def _hold_the_loop(_dht, _node) -> None:
    time.sleep(BLOCKED_FOR)  # (on purpose: a synchronous wait inside the DHT's event loop, which then reads nothing)


def _fill(pipe) -> int:
    """Write to the pipe until it is full; the bytes written."""
    fd, written = pipe.fileno(), 0
    os.set_blocking(fd, False)
    try:
        while True:
            written += os.write(fd, b"\0" * 4096)
    except BlockingIOError:
        return written
    finally:
        os.set_blocking(fd, True)


def _returns_within(seconds: float, call) -> tuple[bool, object]:
    """Whether `call()` returned within `seconds` (in a daemon thread: a blocked send stays blocked), and what."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), (answer[0] if answer else None)


def _socket_files(processes) -> list[str]:
    from collab.process.reaper import hivemind_sockets

    return [path for paths in hivemind_sockets(processes).values() for path in paths]


def test_a_dht_that_stopped_reading_its_pipe_neither_answers_nor_blocks_the_leave(dht):
    daemons = psutil.Process(dht.pid).children(recursive=True)
    assert any("p2pd" in p.name() for p in daemons), [p.name() for p in daemons]
    sockets = _socket_files([psutil.Process(dht.pid), *daemons])
    assert len(sockets) == 2 and all(os.path.exists(path) for path in sockets), sockets  # p2pd's, its client's
    try:
        dht.run_coroutine(_hold_the_loop, return_future=True)
        time.sleep(1.0)  # the loop has read that request and is inside it
        assert _fill(dht._outer_pipe) > 0

        returned, asked = _returns_within(3.0, lambda: ask_for_counts(dht, "run", last_epoch=3))
        assert returned, "asking a DHT process that reads nothing for its figures blocked"
        assert asked is None

        began = time.monotonic()
        returned, _ = _returns_within(10.0, lambda: shut_down_dht(dht))
        assert returned, "the DHT's shutdown blocked on its full pipe"
        assert time.monotonic() - began < 5.0
        assert not dht.is_alive()
        assert not [p for p in daemons if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], \
            "the DHT's p2pd outlived it"
        # ended from outside, neither removed its file: the leave did
        assert not [path for path in sockets if os.path.exists(path)], "a socket file stayed in /tmp"
    finally:
        if dht.is_alive():
            dht.kill()
            dht.join(5)
        for daemon in daemons:
            if daemon.is_running():
                daemon.kill()


def test_an_averagers_leave_removes_its_p2pd_client_socket(dht):
    """Each averager process talks to the DHT's p2pd through a client socket of its own (a file in /tmp); hivemind's
    averager shutdown left it behind, one file per averager per leave."""
    averager = _averager(dht)
    try:
        sockets = [c.laddr for c in psutil.Process(averager.pid).net_connections(kind="unix")
                   if "hivemind-p2pclient-" in str(c.laddr)]
        assert sockets and all(os.path.exists(path) for path in sockets), sockets
        averager.shutdown()
        assert not averager.is_alive()
        assert not [path for path in sockets if os.path.exists(path)], "the averager's p2pd client socket stayed"
    finally:
        if averager.is_alive():
            averager.shutdown()


def test_an_averager_ended_the_hard_way_for_overrunning_its_shutdown_leaves_no_socket_file(dht):
    """hivemind ends an averager that does not shut down within shutdown_timeout with SIGTERM: hivemind's own removal
    of its client's file never runs then."""
    averager = _averager(dht)
    try:
        sockets = _socket_files([psutil.Process(averager.pid)])
        assert sockets and all(os.path.exists(path) for path in sockets), sockets
        # stopped (a process starved of CPU, or stuck), it cannot leave within shutdown_timeout nor close its own
        # client: hivemind takes the hard way
        os.kill(averager.pid, signal.SIGSTOP)
        averager.shutdown_timeout = 0.5
        averager.shutdown()
        assert not [path for path in sockets if os.path.exists(path)], "the averager's p2pd client socket stayed"
        os.kill(averager.pid, signal.SIGCONT)  # the SIGTERM hivemind sent then ends it
        averager.join(5)  # (the leave does not wait for it)
        assert not averager.is_alive()
    finally:
        if averager.is_alive():
            os.kill(averager.pid, signal.SIGCONT)
            averager.kill()


def test_processes_ended_by_signal_leave_no_hivemind_socket_behind(dht):
    """A forced exit, or the watcher after a kill -9, ends the peer's hivemind processes by signal: hivemind's shutdown,
    which removes a p2pd client's socket file, never runs in them (p2pd removes its own)."""
    from collab.process.reaper import HIVEMIND_SOCKETS, end_processes

    process = psutil.Process(_averager(dht).pid)
    try:
        sockets = [c.laddr for c in process.net_connections(kind="unix") if str(c.laddr).startswith(HIVEMIND_SOCKETS)]
        assert sockets and all(os.path.exists(path) for path in sockets), sockets
        end_processes([process], timeout=3.0)
        # (reaped by psutil, or by collab.process.reaper: multiprocessing's is_alive cannot tell any more)
        assert not process.is_running(), f"still there after end_processes: {_status(process)}"
        assert not [path for path in sockets if os.path.exists(path)], "the socket file stayed in /tmp"
    finally:
        if process.is_running():
            process.kill()


def test_a_collab_dht_whose_processes_died_first_still_leaves_no_socket_file(no_leftover_processes):
    """A DHT's process can die before its shutdown (hivemind's loop ends on a pipe error), its p2pd with it: then
    neither can be asked which files they listened on. collab's DHT read them as it started, and its shutdown removes
    them without being told (tests that ran hivemind's own DHT left p2pd's file in /tmp this way)."""
    from collab.swarm.node import OwnGroupDHT

    node = OwnGroupDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, shutdown_timeout=1.0)
    processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    try:
        sockets = _socket_files(processes)
        assert len(sockets) == 2 and all(os.path.exists(path) for path in sockets), sockets  # p2pd's, its client's
        node.kill()  # (by multiprocessing, which then knows it ended; psutil would reap it behind its back)
        node.join(5)
        for daemon in processes[1:]:
            daemon.kill()
        psutil.wait_procs(processes[1:], timeout=10)
        assert not node.is_alive()
        shut_down_dht(node)
        assert not [path for path in sockets if os.path.exists(path)], "a socket file stayed in /tmp"
    finally:
        node.kill()
        node.join(5)
        for daemon in processes[1:]:
            if daemon.is_running():
                daemon.kill()


def _status(process) -> str:
    try:
        return process.status()
    except psutil.Error as e:
        return type(e).__name__


def _averager(dht):
    from collab.averaging.aggregation import Aggregation
    from collab.averaging.compression import wire_codec
    from collab.averaging.grad_averager import CollabGradientAverager

    return CollabGradientAverager(torch.nn.Linear(8, 4).parameters(), rule=Aggregation(method="mean"), dht=dht,
                                  prefix="leave_test_grad_averager", compression=wire_codec("none"),
                                  target_group_size=2, min_matchmaking_time=1.0, start=True)


def test_a_dht_node_that_fails_to_bootstrap_leaves_no_p2pd_or_socket_file(no_leftover_processes):
    """A stranger to a private run starts p2pd, then finds that no initial peer answers its DHT pings ("bootstrap
    failed"): hivemind left that p2pd to outlive the DHT's process and its file in /tmp (a CI run's private-run test).
    Staged with an initial peer that runs p2pd but no DHT."""
    import asyncio

    from hivemind.p2p import P2P

    from collab.hivemind_hooks.patches import failed_p2pd_starts_leave_no_file
    from collab.process.reaper import HIVEMIND_SOCKETS

    failed_p2pd_starts_leave_no_file()  # as collab.swarm.node.Swarm does before its DHT
    loop = asyncio.new_event_loop()
    bare = loop.run_until_complete(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        maddrs = loop.run_until_complete(bare.get_visible_maddrs())
        folder, prefix = os.path.split(HIVEMIND_SOCKETS)
        before = {name for name in os.listdir(folder) if name.startswith(prefix)}
        with pytest.raises(Exception, match="bootstrap failed"):
            hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        new = {name for name in os.listdir(folder) if name.startswith(prefix)} - before
        left = new - _listened_on_by_other_tests({os.path.join(folder, name) for name in new})
        assert not left, left
    finally:
        loop.run_until_complete(bare.shutdown())
        loop.close()


def _listened_on_by_other_tests(paths: set) -> set:
    """The file names among `paths` that a live process of another test listens on: the other pytest worker runs
    DHT nodes too, and one of theirs started during this test (a CI run counted another test's p2pd socket as this
    one's leak). Not a p2pd this test started, alive (its parents include this process) or orphaned (init's child)."""
    listeners = {}
    for proc in psutil.process_iter():
        try:
            for connection in proc.net_connections(kind="unix"):
                if connection.laddr in paths:
                    listeners[connection.laddr] = proc
        except psutil.Error:
            continue
    foreign = set()
    for path, proc in listeners.items():
        try:
            parents = proc.parents()
        except psutil.Error:
            continue
        if parents and parents[0].pid != 1 and all(parent.pid != os.getpid() for parent in parents):
            foreign.add(os.path.basename(path))
    return foreign
