"""A gradient averager declares itself no donor of state: nobody downloads it (collab.averaging.grad_averager.
SharesNoState), and hivemind's declaration under `{prefix}.all_averagers` cost a DHT store per peer and round.

A real DHT; a plain hivemind averager beside it shows how soon a donor's declaration is in the DHT, so the gradient
averager's absence is read after a wait that would have found it."""

from __future__ import annotations

import time

import hivemind
import torch

from collab.averaging.aggregation import Aggregation
from collab.averaging.compression import wire_codec
from collab.averaging.grad_averager import CollabGradientAverager
from collab.averaging.tidy_leave import LeavesNoSocketFile

DECLARED_WITHIN = 15.0  # seconds: hivemind declares a donor as its averager starts (~1 s here)


class _Donor(LeavesNoSocketFile, hivemind.averaging.DecentralizedAverager):
    """hivemind's plain averager, a donor as hivemind makes every averager one (its client's socket file removed
    on shutdown, as collab's averagers do)."""


def _donors(dht, prefix: str) -> dict:
    found = dht.get(f"{prefix}.all_averagers", latest=True)
    return dict(found.value) if found is not None and isinstance(found.value, dict) else {}


def test_a_gradient_averager_is_not_declared_a_donor(dht):
    model = torch.nn.Linear(8, 4)
    gradients = CollabGradientAverager(model.parameters(), rule=Aggregation(method="mean"), dht=dht,
                                       prefix="donor_test_grad_averager", compression=wire_codec("none"),
                                       target_group_size=2, min_matchmaking_time=1.0, start=True)
    control = _Donor([torch.zeros(4)], dht=dht, prefix="donor_test_control", target_group_size=2,
                      min_matchmaking_time=1.0, start=True)
    try:
        # a priority change is what re-declares a donor in hivemind (collab's trainer sets it every epoch)
        gradients.state_sharing_priority = 3.0
        control.state_sharing_priority = 3.0
        deadline = time.monotonic() + DECLARED_WITHIN
        while not _donors(dht, "donor_test_control") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _donors(dht, "donor_test_control"), "the control averager was never declared: the wait proves nothing"
        time.sleep(1.0)  # the gradient averager's start and its priority change came first; a second more
        assert _donors(dht, "donor_test_grad_averager") == {}
        assert not gradients.allow_state_sharing  # (hivemind's rpc_download_state then serves nothing)
    finally:
        gradients.shutdown()
        control.shutdown()
