"""What every test shares: the test kinds (one folder each), a micro ALBERT config, an isolated cache, the machine's
pace, and swarms that are always reaped.

A test's folder says what it may do, and its marker comes from the folder (`-m unit`, `-m swarm`...):
- tests/unit: in this process only. A unit test that starts a process or opens a network socket fails, saying
  so (unit_tests_stay_in_process): the whole folder runs in two workers in under two minutes.
- tests/process: processes of their own, no swarm: the CLI's errors, the wheel, the fork server, import contracts.
- tests/swarm: real peers (hivemind's DHT, p2pd, averagers) on 127.0.0.1, one test at a time: their rounds and
  timeouts are measured against a machine that runs nothing else, and scaled by its pace.
- tests/netns: real peers in network namespaces with shaped links (root only; skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

# no test may reach the Hugging Face hub (this machine has no route to it; CI must not depend on one)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MICRO_CONFIG = {
    "task": {
        "name": "albert",
        "model": {"embedding_size": 32, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 128, "max_position_embeddings": 64},
        "data": {"dataset": "embedded", "tokenizer": "embedded", "vocab_size": 1000, "seq_length": 64},
    },
    # 1024 samples: ~2 s of compute per epoch for 3 peers on 2 cores. A swarm test sets averaging.group_size to
    # its number of peers (swarm_config), so a round begins once all are in it, not after matchmaking_time:
    # measured, 3 peers x 5 epochs took 61 s at 2048 samples, 39 s at 1024 with group_size 3 (same loss curve)
    # compile off: a peer's 30 s compile on 2 cores is longer than most tests train (tests/process/test_compiling.py
    # and the volunteer of tests/swarm/test_run_manifest.py compile)
    "training": {"micro_batch_size": 8, "target_batch_size": 1024, "learning_rate": 0.01, "warmup_steps": 1,
                 "total_steps": 1000, "compile": "off"},
    # 3 peers x 5 processes share 2 cores: shorter matchmaking than 5 s misses peers, and a peer starved
    # of CPU for 10 s mid-round is cut out of it (hivemind then returns a partial average as a success).
    # A micro round takes seconds; one that finds no group waits averaging_timeout - at 60 s, in a CI run three
    # tests took 60-80 s longer than usual (a peer one epoch behind at the end, its donors lingering for it)
    "averaging": {"matchmaking_time": 5.0, "averaging_timeout": 30.0, "next_chunk_timeout": 30.0,
                  "load_state_timeout": 30.0, "average_state_every": 1},
    "checkpoint": {"every_epochs": 100, "keep": 1},
}

# MICRO_CONFIG's task as a causal LM (collab.tasks.causal_lm): a Llama-style decoder of the same size
MICRO_LM = {"name": "causal-lm", "data": {**MICRO_CONFIG["task"]["data"]},
            "model": {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "max_position_embeddings": 64}}


# a valid metrics record, for tests that change one field or sign it under another key
METRICS_RECORD = dict(peer_id="12D3KooWTest", role="trainer", epoch=3, loss=5.2, samples_per_second=12.5,
                      samples_contributed=4096, target_batch_size=2048, client_mode=False, bandwidth_mbps=None,
                      rounds_joined=2, rounds_failed=0, last_group_size=3, time=1.7e9)


# The time of a fixed torch workload (1000 small forward/backward passes, one thread) run in as many processes at
# once as the machine has cores, on the developers' idle 2-core machine: 0.26-0.29 s (5 runs; 0.22 s once, which made
# the idle machine itself look 1.2-1.3x slow and stretched its churn, freeze and split). Run side by side, it sees
# both a slower core and a busy machine (a CPU hog on one of 2 cores leaves a swarm half the machine, and slows this
# probe as much), where one thread alone would find the other core idle. A test's bounds are scaled by how much
# slower this machine is when the suite starts (scaled()): longer waits, never shorter ones.
REFERENCE_WORK_SECONDS = 0.27
MOST_PACE = 4.0  # past 4x slower, a swarm test's timings no longer mean what they were written for
_PROBE = """
import sys, time, torch
torch.set_num_threads(1)
w, x = torch.randn(128, 128, requires_grad=True), torch.randn(64, 128)
sys.stdin.readline()  # every probe imported torch: start together
times = []
for _ in range(3):
    started = time.perf_counter()
    for _ in range(1000):
        (x @ w).tanh().sum().backward()
    times.append(time.perf_counter() - started)
print(sorted(times)[1], flush=True)
"""


def _work_seconds() -> float:
    """The slowest probe's median of 3 runs."""
    probes = [subprocess.Popen([sys.executable, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
              for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.1)
        for probe in probes:
            probe.stdin.write("go\n")
            probe.stdin.flush()
        return max(float(probe.communicate(timeout=120)[0]) for probe in probes)
    finally:
        for probe in probes:
            if probe.poll() is None:
                probe.kill()
                probe.wait()


PACE_VARIABLE = "COLLAB_TEST_PACE"  # set it to skip the measurement (e.g. 1.0 on a machine known to be as fast)


def machine_pace() -> float:
    """How many times slower than the developers' idle machine this one is (at least 1), measured once per session,
    before any peer starts (measure_the_pace_first): measured beside a starting swarm it read 4x on the idle
    machine and stretched every bound by it. Kept in the environment: pytest loads this file twice (as its conftest
    and as tests.conftest, which the tests import), and both must read the same measurement."""
    if PACE_VARIABLE not in os.environ:
        measured = _work_seconds()
        os.environ[PACE_VARIABLE] = f"{min(MOST_PACE, max(1.0, measured / REFERENCE_WORK_SECONDS)):.2f}"
    return float(os.environ[PACE_VARIABLE])


def scaled(seconds: float) -> float:
    """A bound written for the developers' machine, on this one."""
    return seconds * machine_pace()


def pytest_terminal_summary(terminalreporter) -> None:
    # (-q hides the header; a run's log should say how its bounds were scaled)
    if PACE_VARIABLE in os.environ:
        terminalreporter.write_line(f"machine pace: {os.environ[PACE_VARIABLE]}x the developers' idle machine "
                                    "(swarm tests' bounds are scaled by it)")


KINDS = ("unit", "process", "swarm", "netns")  # the folders under tests/, and their markers
TIMED_KINDS = ("swarm", "netns")  # run one at a time, bounds scaled by the machine's pace


def kind_of(item) -> str:
    return Path(str(item.fspath)).parent.name


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        kind = kind_of(item)
        assert kind in KINDS, f"{item.nodeid}: a test lives in one of tests/{{{','.join(KINDS)}}}/, by what it starts"
        item.add_marker(kind)
    # the long ones first: xdist hands tests out in this order, and a 90-s test handed out last kept one worker busy
    # for a minute after the other had finished (the unit stage: 158 s, for 168 s of tests on two workers)
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: tests/unit stays in this process; move the test to "
                             "tests/process (processes of its own) or tests/swarm (real peers)")
    return refused


@pytest.fixture(autouse=True)
def unit_tests_stay_in_process(request, monkeypatch) -> None:
    if kind_of(request.node) != "unit":
        return
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("started a process"))  # every Popen path
    monkeypatch.setattr(os, "fork", _refuse("forked a process"))  # multiprocessing's fork start method
    for method in ("bind", "connect", "connect_ex"):
        original = getattr(socket.socket, method)

        def network_only(self, *args, _original=original, _method=method, **kwargs):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                _refuse(f"opened a network socket ({_method})")()
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(socket.socket, method, network_only)


@pytest.fixture(scope="session", autouse=True)
def measure_the_pace_first(request) -> None:
    """A session with swarm or netns tests measures the machine's pace before its first peer starts."""
    if any(kind_of(item) in TIMED_KINDS for item in request.session.items):
        machine_pace()


SHARED_BUILDS_VARIABLE = "COLLAB_TEST_SHARED_BUILDS"  # a folder: the embedded corpus and tokenizer built there once


@pytest.fixture(scope="session", autouse=True)
def collab_cache(tmp_path_factory) -> Path:
    """One cache per test session: the corpus and tokenizer are built here once, before any peer starts."""
    cache = tmp_path_factory.mktemp("collab-cache")
    from collab.data.tokenizer import embedded_tokenizer_file

    shared = os.environ.get(SHARED_BUILDS_VARIABLE)
    if shared:
        # built once for every session of a CI run (.ci/run: its two pytest runs and their workers, ~9 s of the 2
        # cores each), then copied: the session's cache starts with the same two files it would have built
        import fcntl
        import shutil

        os.environ["COLLAB_CACHE_DIR"] = shared
        with open(Path(shared) / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (xdist's workers start together: one builds, the other waits)
            built = embedded_tokenizer_file(MICRO_CONFIG["task"]["data"]["vocab_size"])
        for path in (*Path(shared).glob("corpus-*.txt"), built):
            shutil.copyfile(path, cache / path.name)
    os.environ["COLLAB_CACHE_DIR"] = str(cache)
    embedded_tokenizer_file(MICRO_CONFIG["task"]["data"]["vocab_size"])
    return cache


@pytest.fixture()
def micro_config(tmp_path) -> Path:
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(MICRO_CONFIG))
    return path


def write_config(tmp_path: Path, changes: dict, name: str = "custom.yaml") -> Path:
    """MICRO_CONFIG with `changes` (dotted keys) applied."""
    import copy

    data = copy.deepcopy(MICRO_CONFIG)
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def swarm_config(tmp_path: Path, peers: int, changes: dict | None = None, name: str = "swarm.yaml") -> Path:
    """MICRO_CONFIG for a swarm of `peers`: a round begins as soon as all of them joined it."""
    return write_config(tmp_path, {"averaging.group_size": peers, **(changes or {})}, name)


@pytest.fixture()
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session", autouse=True)
def children_keep_temp_files_in_the_session(tmp_path_factory) -> Path:
    """Every process a test starts keeps its temporary files in this session's folder, which pytest prunes: a peer a
    test kills (churn, a crash) cannot remove its multiprocessing folder (pymp-*) or its torch_shm_manager's
    (torch-shm-dir-*), and a CI run left ten of them in /tmp. hivemind's sockets keep their fixed /tmp path
    (no_leftover_processes checks those)."""
    folder = tmp_path_factory.mktemp("tmp")
    os.environ["TMPDIR"] = str(folder)  # (this process's own tempfile.gettempdir() is already fixed: pytest used it)
    return folder


@pytest.fixture(autouse=True, scope="session")
def hivemind_locks_a_killed_holder_releases():
    """This test process's hivemind locks as a peer's (collab.hivemind_hooks.locks): a test that kills a DHT or an
    averager process while it held hivemind's MPFuture lock otherwise hung every later DHT of the worker (CI)."""
    from collab.hivemind_hooks.patches import death_safe_locks

    death_safe_locks()


@pytest.fixture()
def no_leftover_processes():
    """Fails the test if any process started during it (p2pd included) outlives it, or left the file of a hivemind
    socket nobody listens on in /tmp (a CI run left 23; a volunteer's machine would gather them run after run)."""
    from collab.peers.forkserver import shared_server_pids
    from collab.process.reaper import bound_unix_paths

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sockets_before = set(_hivemind_socket_files())
    yield
    before |= shared_server_pids()  # the session's fork server (fork_server()) may have started in this test
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        # torch_shm_manager serves this pytest process's own shared tensors for the whole session
        left = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and _alive(p) and p.name() != "torch_shm_manager"]
        # (a process leaving gracefully closes its socket a moment before it removes the file: asked again)
        stale = set(_hivemind_socket_files()) - sockets_before - bound_unix_paths()
        if not left and not stale:
            return
        time.sleep(0.5)
    names = [f"{p.pid}:{p.name()}" for p in left if _alive(p)]
    for p in left:
        p.kill()
    for path in stale:
        Path(path).unlink(missing_ok=True)
    pytest.fail(f"processes outlived the test: {names}" if names else
                f"{len(stale)} hivemind socket file(s) left in /tmp with no process listening: {sorted(stale)}")


def _hivemind_socket_files() -> list[str]:
    from collab.process.reaper import HIVEMIND_SOCKETS

    folder, prefix = os.path.split(HIVEMIND_SOCKETS)
    return [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith(prefix)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def peer_env() -> dict:
    """The environment a test's peers run in. Less what pytest changes from test to test (PYTEST_CURRENT_TEST):
    a peer is forked from the session's fork server only when its environment is the server's, and with it none
    was - every peer of every test imported torch, hivemind and collab afresh (~8 s of the 2 cores before a peer
    could join, while its swarm was already training)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # several peers share 2 cores: one torch thread each avoids oversubscription
    return dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def fork_server():
    """The session's fork server for peer_env(): each swarm test's peers are forked from one process that imported
    collab once. A server of its own took each test 8.4 s of the 2-core machine (6.8 s to start, 1.6 s to close)
    before its first peer could start."""
    from collab.peers.forkserver import shared_server

    # (peer_env() is without PYTEST_CURRENT_TEST: with it, every test started a server of its own, ~11 s of the 2
    # cores each, and each stayed up to the end of the session, ~400 MB each)
    return shared_server(dict(peer_env(), PYTHONUNBUFFERED="1"))


def run_cli(*args: str, timeout: float = 120, fork: bool = False,
            prefix: list[str] = ()) -> subprocess.CompletedProcess:
    """`collab ARGS` in a process of its own; `fork`: forked from the session's fork server (swarm tests: a fresh
    process spends ~5 s of a 2-core machine on imports, which a live swarm beside it then lacks). `prefix`: e.g.
    `ip netns exec NS`, to run it in a network namespace."""
    command = [*prefix, sys.executable, "-m", "collab", *args]
    if not fork:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=peer_env(),
                              stdin=subprocess.DEVNULL)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="collab-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = fork_server().spawn(command, dict(peer_env(), PYTHONUNBUFFERED="1"), out, err_path=err)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            raise
        return subprocess.CompletedProcess(command, code, *(path.read_text(errors="replace") if path.exists() else ""
                                                            for path in (out, err)))


def read_summary(peer) -> dict:
    assert peer.summary_path.exists(), f"peer {peer.index} wrote no summary; log:\n{peer.log_text()[-3000:]}"
    return json.loads(peer.summary_path.read_text())


def train_swarm_to_epoch(peers: int, run_id: str, tmp_path: Path, args: list[str], max_epochs: int,
                         per_peer_args: dict | None = None, timeout: float = 300,
                         per_peer_program: dict | None = None) -> list[dict]:
    """Run `peers` local peers with `args` until each reaches `max_epochs` and exits 0; their summaries."""
    from collab.peers.launcher import LocalSwarm

    timeout = scaled(timeout)
    with LocalSwarm(peers, run_id, tmp_path, [*args, "--max-epochs", str(max_epochs)],
                    per_peer_args=per_peer_args or {},
                    env=peer_env(), forks=fork_server(), per_peer_program=per_peer_program) as swarm:
        swarm.start()
        finished = swarm.wait(timeout=timeout)
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        assert finished, f"peers did not reach epoch {max_epochs} within {timeout:.0f} s\n{logs}"
        summaries = [read_summary(p) for p in swarm.peers]
        codes = [p.popen.returncode for p in swarm.peers]
    assert codes == [0] * peers, f"exit codes {codes}\n{logs}"
    return summaries


def swarm_logs(workdir: Path, tail: int = 4000) -> str:
    """The tails of the peers' logs a LocalSwarm left in `workdir`, for a failure message."""
    logs = [*sorted(workdir.glob("peer*.log")), *workdir.glob("forkserver.log")]
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}" for log in logs)


def status_json(run_id: str, initial_peer: str) -> dict:
    result = run_cli("status", "--run-id", run_id, "--initial-peers", initial_peer, "--json", "--wait", "10",
                     fork=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for(predicate, timeout: float, interval: float = 1.0, what: str = "condition", explain=None):
    """Polls `predicate` until it is true, for `timeout` seconds on the developers' machine (scaled here);
    on a timeout, `explain()` (the peers' logs, say) follows the failure message."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    detail = f"\n{explain()}" if explain else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


def filled_state_averager(dht, prefix: str, value: float, cls=None, **kwargs):
    """A collab state averager (collab.averaging.replica) of a small model whose parameters all hold `value`, with
    a real averager process on `dht`: a round's mean is then one number to check."""
    import torch

    from collab.averaging.replica import RecordingStateAverager

    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return (cls or RecordingStateAverager)(dht=dht, prefix=prefix, params=model.parameters(),
                                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1), start=True,
                                           **kwargs)


def held_values(averager) -> set[float]:
    """The distinct values in a state averager's parameters (one, for filled_state_averager's, until a round)."""
    return {float(v) for p in averager.main_parameters for v in p.detach().flatten()}
