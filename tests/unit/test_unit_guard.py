"""tests/unit stays in the test's own process (tests/conftest.py, unit_tests_stay_in_process): a unit test that
starts a process or opens a network socket fails and says where the test belongs."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys

import pytest


def test_a_process_or_a_network_socket_fails_a_unit_test_and_says_where_it_belongs():
    with pytest.raises(AssertionError, match="a unit test started a process: .*tests/process"):
        subprocess.run([sys.executable, "-c", "pass"], timeout=10)
    with pytest.raises(AssertionError, match="a unit test forked a process"):
        multiprocessing.get_context("fork").Process(target=print).start()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        with pytest.raises(AssertionError, match=r"opened a network socket \(bind\)"):
            tcp.bind(("127.0.0.1", 0))
        with pytest.raises(AssertionError, match=r"opened a network socket \(connect\)"):
            tcp.connect(("127.0.0.1", 9))
    first, second = socket.socketpair()  # what asyncio's event loop uses: in-process, allowed
    first.sendall(b"x")
    assert second.recv(1) == b"x"
    first.close()
    second.close()
