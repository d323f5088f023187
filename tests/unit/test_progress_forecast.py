"""A peer's progress record forecast by at most one micro-batch."""

from __future__ import annotations

from hivemind.utils.timed_storage import ValueWithExpiration

from collab.modes.tracker import forecastable


def test_forecastable_extrapolates_a_record_by_one_micro_batch_at_most():
    now = 1000.0
    record = dict(peer_id=b"x", epoch=3, samples_accumulated=64, client_mode=False)
    metadata = {
        "paused": ValueWithExpiration({**record, "samples_per_second": 50.0, "time": now - 30}, now + 60),
        "computing": ValueWithExpiration({**record, "samples_per_second": 50.0, "time": now - 0.1}, now + 60),
        "slow": ValueWithExpiration({**record, "samples_per_second": 0.5, "time": now - 30}, now + 60),
        "goodbye": ValueWithExpiration(None, now + 60),
    }
    view = forecastable(metadata, now, micro_batch_size=8, at_most=5.0)
    assert view["paused"].value["time"] == now - 8 / 50.0  # one micro-batch of 8 at 50/s: 0.16 s
    assert view["paused"].value["samples_accumulated"] == 64  # what was counted stays
    assert view["computing"] is metadata["computing"] and view["goodbye"] is metadata["goodbye"]
    assert view["slow"].value["time"] == now - 5.0  # 16 s a micro-batch, but never past at_most
    assert metadata["paused"].value["time"] == now - 30  # the records read are not changed
    assert forecastable(metadata, now, micro_batch_size=None, at_most=5.0)["paused"].value["time"] == now - 5.0
