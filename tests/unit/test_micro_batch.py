"""training.micro_batch_size auto (collab.train.micro_batch): the largest micro-batch that fits, found by doubling
then halving the gap; the probe batch keeps the real shapes; on a CPU it is 8. The GPU's memory is a GPU's to test
(benchmarks/overhead.py --micro-batch-size auto); here `fits` stands for it."""

from __future__ import annotations

import pytest
import torch

from collab.config import RunConfig, load_config
from collab.errors import UserError
from collab.tasks import build_task
from collab.train.micro_batch import largest_that_fits, repeat_batch, with_micro_batch
from collab.train.precision import Precision
from tests.conftest import MICRO_CONFIG


@pytest.mark.parametrize("capacity, limit, expected", [(1000, 4096, 1000), (37, 4096, 37), (8, 4096, 8),
                                                      (5000, 256, 256), (3, 4096, 3), (1, 4096, 1), (0, 4096, 0)])
def test_the_largest_size_that_fits_is_found_in_few_probes(capacity, limit, expected):
    asked = []

    def fits(size):
        asked.append(size)
        return size <= capacity

    assert largest_that_fits(fits, limit) == expected
    assert len(asked) <= 2 * max(1, limit).bit_length() and max(asked) <= limit, asked


def test_a_probe_batch_has_the_real_shapes_at_any_size():
    task = build_task(RunConfig.model_validate(MICRO_CONFIG))
    sample = next(task.batches(1, seed=1))
    grown = repeat_batch(sample, 5)
    for key, value in sample.items():
        assert grown[key].shape == (5, *value.shape[1:]) and torch.equal(grown[key][3], value[0]), key
    assert float(task.loss(grown)) > 0


def test_auto_on_a_cpu_is_8_and_a_number_is_kept(tmp_path, capsys):
    config = RunConfig.model_validate({**MICRO_CONFIG, "training": {**MICRO_CONFIG["training"],
                                                                    "micro_batch_size": "auto"}})
    task = build_task(config)
    precision = Precision.from_config(config.training)
    decided = with_micro_batch(config, task, precision, seed=1, feed=None)
    assert decided.training.micro_batch_size == 8 and config.training.micro_batch_size == "auto"
    assert "Micro-batch size: 8 (auto: on a CPU)" in capsys.readouterr().out
    fixed = RunConfig.model_validate(MICRO_CONFIG)
    assert with_micro_batch(fixed, task, precision, seed=1, feed=None) is fixed
    with pytest.raises(UserError, match="micro_batch_size"):
        path = tmp_path / "bad.yaml"
        path.write_text("training:\n  micro_batch_size: lots\n")
        load_config(path)
