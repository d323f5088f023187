"""Metrics records on the wire: the schema bounds, signatures, and reading the run state from a real DHT."""

from __future__ import annotations

import math

import pytest
from pydantic import v1

from collab.records.metrics import PeerMetricsRecord
from tests.conftest import METRICS_RECORD



@pytest.mark.parametrize("field, value", [
    ("loss", math.nan), ("loss", math.inf), ("loss", -1.0), ("samples_per_second", 1e30),
    ("samples_contributed", -5), ("epoch", "3"), ("role", "boss"), ("client_mode", "yes"),
    ("unexpected", 1), ("data_start", 1.0), ("data_start", -0.1), ("data_start", math.nan), ("data_position", -1),
    ("data_position", 10**16), ("data_position", 1.5),
])
def test_schema_rejects_absurd_values(field, value):
    with pytest.raises(v1.ValidationError):
        PeerMetricsRecord(**{**METRICS_RECORD, field: value})
    assert PeerMetricsRecord(**METRICS_RECORD).epoch == 3


def test_a_loss_outside_the_records_bounds_is_published_as_missing_and_said_once(capsys):
    from collab.records import metrics

    metrics._said_out_of_bounds.clear()
    assert metrics.loss_for_record(5.25) == 5.25 and metrics.loss_for_record(None) is None
    for diverged in (2e6, -0.5, math.nan, math.inf):
        assert metrics.loss_for_record(diverged) is None
        PeerMetricsRecord(**{**METRICS_RECORD, "loss": metrics.loss_for_record(diverged)})  # a valid record, not a crash
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "loss 2000000.0 is outside what a metrics record carries" in said[0], said
    assert metrics.rate_for_record(math.inf) == 0.0 and metrics.rate_for_record(12.5) == 12.5

