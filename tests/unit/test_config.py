"""Config and flag validation: every mistake is one line that names the field and the fix, exit code 2."""

from __future__ import annotations


import pytest

from collab.config import RunConfig, load_config, shipped_config, shipped_config_names
from collab.errors import UserError
from tests.conftest import write_config


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
    ({"task.name": "gpt"}, "task.name: 'gpt' is not a task; use one of 'albert', 'causal-lm', 'swav'"),
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


def test_timeouts_that_give_up_a_round_before_a_silent_peer_is_left_out_are_said():
    from collab.config import AveragingConfig, round_timeout_caution

    assert round_timeout_caution(AveragingConfig()) is None  # the defaults: 60 s against 10 s
    said = round_timeout_caution(AveragingConfig(averaging_timeout=30, next_chunk_timeout=30))
    assert said is not None and "averaging.averaging_timeout (30 s)" in said and "next_chunk_timeout" in said
    assert round_timeout_caution(AveragingConfig(averaging_timeout=30, next_chunk_timeout=10)) is None
    for name in shipped_config_names():
        assert round_timeout_caution(load_config(shipped_config(name)).averaging) is None, name
