"""Config and flag validation: every mistake is one line that names the field and the fix, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from collab.config import RunConfig, load_config, shipped_config, shipped_config_names
from collab.errors import UserError
from tests.conftest import run_cli, write_config


def test_shipped_configs_are_valid():
    for name in ("albert-tiny", "albert-base", "albert-large", "swav-tiny", "swav-resnet50"):
        config = load_config(name)
        assert config.training.target_batch_size >= config.training.micro_batch_size


def test_cli_flags_override_the_file(micro_config):
    config = load_config(micro_config, {"training.target_batch_size": 4096, "task.data.dataset": "/data"})
    assert config.training.target_batch_size == 4096
    assert config.task.data.dataset == "/data"
    assert config.training.micro_batch_size == 8  # from the file, not the default


@pytest.mark.parametrize("changes, expected", [
    ({"training.micro_batch_sise": 4}, "unknown key 'training.micro_batch_sise'; remove it or correct it "
                                       "(did you mean 'micro_batch_size'?)"),
    ({"training.target_batch_size": 4}, "target_batch_size (4) is smaller than micro_batch_size (8)"),
    ({"training.learning_rate": "fast"}, "training.learning_rate: input should be a valid number"),
    ({"training.learning_rate": -1.0}, "training.learning_rate: input should be greater than 0, got -1.0; "
                                       "fix it in the file or with --learning-rate"),
    ({"averaging.compression": "zip"}, "averaging.compression: input should be 'none', 'fp16'"),
    ({"task.model.num_attention_heads": 3}, "hidden_size (64) is not divisible by num_attention_heads (3)"),
    ({"task.data.seq_length": 512}, "data.seq_length (512) exceeds model.max_position_embeddings (64)"),
    ({"task.name": "gpt"}, "task.name: 'gpt' is not a task; use one of 'albert', 'swav'"),
    ({"averaging.mode": "diloco", "averaging.compression": "dgc"},
     "averaging.compression dgc keeps per-round state for gradients and cannot carry diloco's pseudo-gradients; "
     "use fp16, uniform8bit or none"),
    ({"averaging.mode": "dpwa"}, "averaging.mode: input should be 'sync', 'diloco' or 'gossip'"),
    ({"averaging.mode": "gossip", "averaging.compression": "powersgd"},
     "averaging.compression powersgd keeps per-round state for gradients and cannot carry gossip's parameters"),
    ({"averaging.gossip": {"interpolation": "average"}},
     "averaging.gossip.interpolation: input should be 'constant', 'clock', 'loss' or 'evolutionary'"),
    ({"averaging.gossip": {"mean_local_steps": 0}}, "averaging.gossip.mean_local_steps: input should be greater "
                                                    "than or equal to 1"),
    ({"averaging.diloco": {"outer_lr": 0}}, "averaging.diloco.outer_lr: input should be greater than 0"),
    ({"training.precision": "fp8"}, "training.precision: input should be 'auto', 'fp32', 'fp16' or 'bf16'"),
])
def test_bad_config_names_the_field(tmp_path, changes, expected):
    path = write_config(tmp_path, changes)
    with pytest.raises(UserError) as error:
        load_config(path)
    message = str(error.value)
    assert expected in message, message
    assert "\n" not in message


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(UserError, match=r"not valid YAML at line \d+; fix the syntax"):
        load_config(bad)
    with pytest.raises(UserError, match="does not exist; pass a YAML file or a shipped config name"):
        load_config(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="must hold a mapping of sections"):
        load_config(listy)


def test_defaults_are_a_complete_config():
    assert RunConfig().task.name == "albert"


@pytest.mark.parametrize("args, expected", [
    (["join", "--run-id", "r", "--config", "{bad}"], "collab join: error: config error in {bad}: "
                                                     "training: target_batch_size (4) is smaller"),
    (["join", "--run-id", "bad id!"], "--run-id 'bad id!' is invalid; use 1-64 letters"),
    (["join", "--run-id", "r", "--initial-peers", "not-an-addr"], "--initial-peers 'not-an-addr' is not a multiaddr"),
    (["join", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks the peer id"),
    (["join", "--run-id", "r", "--micro-batch-size", "lots"], "argument --micro-batch-size: invalid int value"),
    (["join"], "the following arguments are required: --run-id"),
    (["join", "--run-id", "r", "--target-batch-size", "2"], "target_batch_size (2) is smaller than micro_batch_size"),
    (["join", "--run-id", "r", "--max-epochs", "-1"], "--max-epochs -1 is negative"),
    (["join", "--run-id", "r", "--dataset", "/nonexistent/corpus"], "dataset path /nonexistent/corpus does not exist"),
    (["join", "--run-id", "r", "--tokenizer", "/nonexistent/tok.json"], "tokenizer file /nonexistent/tok.json"),
    (["simulate", "--peers", "0"], "--peers 0 must be at least 1"),
    (["join", "--run-id", "r", "--run-key", "ab" * 16], "--run-key checks the manifest of a run you join: add"),
    (["join", "--run", "/nonexistent/run"], "/nonexistent/run is not a run folder (no manifest.json or organizer.key)"),
    (["join", "--run-id", "my.run"], "--run-id 'my.run' is invalid; use 1-64 letters, digits, '_' or '-' (no dots"),
    (["join", "--run-id", "r", "--bandwidth", "inf"], "averaging.bandwidth: input should be a finite number"),
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
])
def test_bad_flags_exit_2_with_one_line(tmp_path, args, expected):
    import socket

    bad = write_config(tmp_path, {"training.target_batch_size": 4}, "bad.yaml")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# caf\xe9\ntraining: {learning_rate: 0.01}\n".encode("latin-1"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    values = {"{bad}": str(bad), "{latin1}": str(latin1), "{taken}": port}
    args = [values.get(a, a) for a in args]
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


def test_timeouts_that_give_up_a_round_before_a_silent_peer_is_left_out_are_said():
    from collab.config import AveragingConfig, round_timeout_caution

    assert round_timeout_caution(AveragingConfig()) is None  # the defaults: 60 s against 10 s
    said = round_timeout_caution(AveragingConfig(averaging_timeout=30, next_chunk_timeout=30))
    assert said is not None and "averaging.averaging_timeout (30 s)" in said and "next_chunk_timeout" in said
    assert round_timeout_caution(AveragingConfig(averaging_timeout=30, next_chunk_timeout=10)) is None
    for name in shipped_config_names():
        assert round_timeout_caution(load_config(shipped_config(name)).averaging) is None, name
