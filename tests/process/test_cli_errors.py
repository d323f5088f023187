"""The collab command in a process of its own: bad flags and configs get one line and exit 2, --help does not wait for
torch, and impossible choices name the flag."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys

import pytest
import torch

from collab.config import load_config
from collab.errors import UserError
from collab.run.folder import load_run_folder
from collab.train.precision import Precision
from tests.conftest import run_cli, write_config

SOME_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize("args, expected", [
    (["join", "--run-id", "r", "--config", "{bad}"], "collab join: error: config error in {bad}: "
                                                     "training: target_batch_size (4) is smaller"),
    (["join", "--run-id", "bad id!"], "--run-id 'bad id!' is invalid; use 1-64 letters"),
    (["join", "--run-id", "r", "--initial-peers", "not-an-addr"], "--initial-peers 'not-an-addr' is not a multiaddr"),
    (["join", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks the peer id"),
    (["join", "--run-id", "r", "--micro-batch-size", "lots"], "argument --micro-batch-size: 'lots' is neither a whole number nor 'auto'"),
    (["join", "--run-id", "r", "--data-workers", "4"], "--data-workers 4: must be 0, 1 or 'auto', got 4"),
    (["join"], "the following arguments are required: --run-id"),
    (["join", "--run-id", "r", "--target-batch-size", "2"], "target_batch_size (2) is smaller than micro_batch_size"),
    (["join", "--run-id", "r", "--max-epochs", "-1"], "--max-epochs -1 is negative"),
    (["join", "--run-id", "r", "--micro-batch-size", "0"], "--micro-batch-size 0: must be a whole number of samples > 0 "
                                                            "or 'auto', got 0"),
    (["join", "--run-id", "r", "--dataset", "/nonexistent/corpus"], "dataset path /nonexistent/corpus does not exist"),
    (["join", "--run-id", "r", "--tokenizer", "/nonexistent/tok.json"], "tokenizer file /nonexistent/tok.json"),
    (["simulate", "--peers", "0"], "--peers 0 must be at least 1"),
    (["join", "--run-id", "r", "--run-key", "ab" * 16], "--run-key checks the manifest of a run you join: add"),
    (["join", "--run", "/nonexistent/run"], "/nonexistent/run is not a run folder (no manifest.json or organizer.key)"),
    (["join", "--run-id", "my.run"], "--run-id 'my.run' is invalid; use 1-64 letters, digits, '_' or '-' (no dots"),
    (["join", "--run-id", "r", "--bandwidth", "inf"], "--bandwidth inf: input should be a finite number"),
    (["join", "--run-id", "r", "--config", "{latin1}"], "is not UTF-8 text (byte 5); save it as UTF-8 YAML"),
    (["dashboard", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--interval", "nan"],
     "--interval nan must be a positive number of seconds"),
    (["dashboard", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--interval", "0"],
     "--interval 0.0 must be a positive number of seconds"),
    (["simulate", "--dashboard-port", "{taken}"], "--dashboard-port {taken}: the port is already in use"),
    (["dashboard", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--port", "{taken}"],
     "--port {taken}: the port is already in use on 127.0.0.1"),
    (["join", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "--token", "hello"],
     "--token is not a collab invite (it starts with 'collab-invite:')"),
    (["join", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "--token-file", "/nonexistent/i"],
     "cannot read --token-file /nonexistent/i (No such file or directory)"),
    (["join", "--run-id", "r", "--token", "collab-invite:x"], "--token is an invite to a private run you join: add"),
    (["invite", "--run", "/nonexistent/run", "--peer", "QmNotAPeer!"], "--peer 'QmNotAPeer!' is not a peer id"),
    (["invite", "--run", "/nonexistent/run", "--peer", "QmX", "--expires", "1w"], "--expires '1w' is not a duration"),
    (["revoke", "--run", "/nonexistent/run", "--peer", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"],
     "/nonexistent/run is not a run folder"),
    (["init", "r", "--dir", "{dir}", "--dataset", "/nonexistent/corpus"], "dataset path /nonexistent/corpus does not exist"),
    (["init", "r", "--dir", "{dir}", "--shard-tokens", "0"], "--shard-tokens must be at least 1"),
    (["init", "r", "--dir", "{dir}", "--shards-url", "ftp://host/x"], "--shards-url 'ftp://host/x' is neither an "
                                                                       "http(s):// URL prefix nor hf:REPO"),
    (["init", "r", "--dir", "{dir}", "--shards-url", "hf:me/corpus"], "--shards-url says where the run's token "
                                                                       "shards live: add the --dataset"),
    # p2pd's "Daemon failed to start: <timestamp> ..." names nothing to do: a TCP connect says how the peer failed
    (["join", "--run-id", "r", "--initial-peers", f"/ip4/127.0.0.1/tcp/{{closed}}/p2p/{SOME_PEER}"],
     f"could not join the swarm: /ip4/127.0.0.1/tcp/{{closed}}/p2p/{SOME_PEER}: refused (127.0.0.1:{{closed}}); nothing "
     "listens on 127.0.0.1:{closed}: that peer is down or restarted on another port; ask the organizer for a current "
     "join line"),
    (["join", "--run-id", "r", "--data-cache-gb", "0"], "--data-cache-gb 0.0 must be a positive number of gigabytes"),
    (["join", "--run-id", "r", "--data-cache-gb", "5"], "--data-cache-gb bounds the shards a volunteer fetches; the "
                                                        "organizer's peer reads its run folder: drop it"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, expected, no_leftover_processes):
    import socket

    bad = write_config(tmp_path, {"training.target_batch_size": 4}, "bad.yaml")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# caf\xe9\ntraining: {learning_rate: 0.01}\n".encode("latin-1"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    with socket.socket() as was_open:  # a port nothing listens on (bound a moment ago, so free)
        was_open.bind(("127.0.0.1", 0))
        closed = str(was_open.getsockname()[1])
    values = {"{bad}": str(bad), "{latin1}": str(latin1), "{taken}": port, "{dir}": str(tmp_path / "run"),
              "{closed}": closed}
    for placeholder, value in values.items():
        args = [a.replace(placeholder, value) for a in args]
    for placeholder, value in values.items():
        expected = expected.replace(placeholder, value)
    try:
        result = run_cli(*args, timeout=180, fork=True)
    finally:
        taken.close()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]


def test_help_and_config_errors_do_not_wait_for_torch(tmp_path):
    # importing torch, transformers and hivemind takes 3-4 s on a laptop CPU: `--help` and a config
    # mistake must answer without them, so the task configs live apart from the tasks
    probe = ("import sys; from collab.cli import build_parser; build_parser().format_help(); "
             "from collab.config import load_config; [load_config(n) for n in ('albert-tiny', 'swav-tiny')]; "
             "print(sorted(m for m in ('torch', 'transformers', 'hivemind', 'kornia') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"imported on the way to --help: {result.stdout.strip()}"
    bad = write_config(tmp_path, {"training.target_batch_size": -1})
    result = run_cli("join", "--run-id", "x", "--config", str(bad), fork=True)
    assert result.returncode == 2 and "training.target_batch_size" in result.stderr
    # nor a --dataset or --tokenizer path that does not exist (a typo is the usual first mistake)
    probe = ("import sys; from collab.commands.join import _check_data_flags; from argparse import Namespace\n"
             "for flags in [dict(dataset='/nonexistent/corpus', tokenizer=None), dict(dataset=None, tokenizer='/no/t.json')]:\n"
             "    try: _check_data_flags(Namespace(**flags), 'albert')\n"
             "    except Exception as e: print(type(e).__name__, e)\n"
             "print(sorted(m for m in ('torch', 'transformers', 'hivemind') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [
        "UserError dataset path /nonexistent/corpus does not exist; pass --dataset embedded, text files or folders, "
        "or hf:NAME",
        "UserError tokenizer file /no/t.json does not exist; pass an existing tokenizer.json with --tokenizer",
        "[]"], result.stdout + result.stderr


@pytest.mark.parametrize("flags, expected", [
    (["--tokenizer", "tok.json"], "--tokenizer does not apply to the swav task"),
    (["--dataset", "/nonexistent/images"], "dataset path /nonexistent/images does not exist"),
])
def test_bad_swav_flags_exit_2_with_one_line(flags, expected):
    result = run_cli("join", "--run-id", "r", "--config", "swav-tiny", *flags, timeout=180, fork=True)
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_auto_is_fp32_on_a_cpu_and_impossible_choices_say_which_flag():
    config = load_config(None, {"training.device": "cpu"})
    assert Precision.from_config(config.training).precision == "fp32"
    with pytest.raises(UserError, match="training.precision fp16 needs a GPU.*--precision bf16"):
        Precision.from_config(load_config(None, {"training.device": "cpu", "training.precision": "fp16"}).training)
    if not torch.cuda.is_available():
        result = run_cli("join", "--run-id", "gpu-less", "--device", "cuda", timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "training.device is 'cuda' but torch sees no GPU" in result.stderr and "--device cpu" in result.stderr


def test_init_makes_a_signed_run_folder_and_says_how_to_start(tmp_path, micro_config):
    folder = tmp_path / "demo"
    result = run_cli("init", "demo-run", "--config", str(micro_config), "--dir", str(folder), timeout=120, fork=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"collab join --run {folder}" in out and "Keep" in out
    assert stat.S_IMODE((folder / "organizer.key").stat().st_mode) == 0o600
    run = load_run_folder(folder)
    manifest = run.manifest
    assert manifest.run_id == "demo-run" and manifest.private is False and manifest.seed == 0
    assert manifest.tokenizer_sha256 == hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest.fingerprint in out and len(manifest.fingerprint) == 32
    assert manifest.config["training"]["target_batch_size"] == 1024  # the whole config, from the file
    assert "dir" not in manifest.config["checkpoint"]  # a path on the organizer's machine is not shared
    again = run_cli("init", "demo-run", "--dir", str(folder), timeout=60, fork=True)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--churn", "kill-30-20"], "--churn 'kill-30-20' is not ACTION:EVERY:DOWNTIME"),
    (["--churn", "stop:0:5"], "EVERY must be more than 0"),
    (["--churn", "kill:30:20", "--peers", "1"], "--churn needs --peers 2 or more"),
    (["--profile", "moon-base"], "--profile 'moon-base' is neither a file nor a shipped profile; use one of: datacenter"),
    (["--duration", "-5"], "--duration -5.0 must be positive"),
])
def test_simulate_flag_errors_are_one_line(args, message):
    result = run_cli("simulate", *args, timeout=60, fork=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
