"""collab's averagers are hivemind averagers with collab's mixins on top. The mixins that add only collab's own
names (collab.averaging.round_plans, signed_progress) must not share one with any class of an averager's MRO: a
hivemind upgrade that adds such a name would have one of the two silently take the other's place."""

from __future__ import annotations

import inspect

from collab.averaging import grad_averager, replica
from collab.averaging.round_plans import PlansRounds
from collab.averaging.signed_progress import ReadsSignedProgress
from collab.modes import diloco

OWN_NAMES_ONLY = (PlansRounds, ReadsSignedProgress)


def test_the_mixins_of_collabs_own_names_share_none_with_hivemind_or_another_mixin():
    averagers = {cls for module in (grad_averager, replica, diloco)
                 for _, cls in inspect.getmembers(module, inspect.isclass)
                 if issubclass(cls, OWN_NAMES_ONLY) and cls not in OWN_NAMES_ONLY}
    # the scan finds the gradient, state, PowerSGD, DGC and diloco averagers (none found would pass below)
    assert {"CollabGradientAverager", "RecordingStateAverager", "CollabPowerSGDAverager", "CollabDGCAverager",
            "PseudoGradientAverager"} <= {cls.__name__ for cls in averagers}
    clashes = sorted(f"{averager.__name__}: {mixin.__name__}.{name} and {other.__module__}.{other.__qualname__}"
                     for averager in averagers for mixin in OWN_NAMES_ONLY for name in vars(mixin)
                     if not name.startswith("__")
                     for other in averager.__mro__ if other is not mixin and name in vars(other))
    assert not clashes, clashes


def test_every_gradient_averager_is_no_donor_of_state_and_every_state_averager_is():
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.state_averager import TrainingStateAverager

    averagers = {cls for module in (grad_averager, replica, diloco)
                 for _, cls in inspect.getmembers(module, inspect.isclass) if issubclass(cls, PlansRounds)}
    gradients = {cls.__name__ for cls in averagers if issubclass(cls, GradientAverager)}
    assert gradients >= {"CollabGradientAverager", "CollabPowerSGDAverager", "CollabDGCAverager",
                         "PseudoGradientAverager"}
    # SharesNoState forces allow_state_sharing=False into hivemind's constructor (tests/process/
    # test_gradient_averager_donor.py); a state averager must stay a donor: a joining peer downloads from it
    assert sorted(cls.__name__ for cls in averagers
                  if issubclass(cls, GradientAverager) != issubclass(cls, grad_averager.SharesNoState)) == []
    assert any(issubclass(cls, TrainingStateAverager) for cls in averagers)
