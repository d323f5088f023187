"""collab.hivemind_hooks against the installed hivemind: every hooked name exists, with the parameters collab was
written against, and every override of a hivemind method in collab's classes is listed there. A hivemind upgrade
that changes one of them fails here, with the names, instead of somewhere in a swarm."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import hivemind

import collab
from collab.hivemind_hooks import INSTANCE_ATTRIBUTES, OVERRIDDEN, PATCHED, describe

UPGRADE = f"(installed hivemind {hivemind.__version__}: check collab's hook against it, then update the list)"


def resolve(name: str):
    """The object a dotted name names: the longest importable module, then attributes, looked up statically (a
    property or staticmethod as defined, not as called)."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    for part in parts[split:]:
        found = inspect.getattr_static(found, part)
    return found


def _function(hooked):
    hooked = hooked.fget if isinstance(hooked, property) else hooked
    return getattr(hooked, "__func__", hooked)


def collab_overrides() -> dict[str, set[str]]:
    """hivemind method -> the collab classes (and mixins) that define it, found in every collab module."""
    classes = set()
    for module in pkgutil.walk_packages(collab.__path__, "collab."):
        if module.name != "collab.__main__":  # running it would run the CLI
            classes.update(c for c in vars(importlib.import_module(module.name)).values()
                           if inspect.isclass(c) and c.__module__.startswith("collab."))
    overrides: dict[str, set[str]] = {}
    for cls in classes:
        bases = [b for b in cls.__mro__ if b.__module__.startswith("hivemind")]
        for own in (b for b in cls.__mro__ if b.__module__.startswith("collab.")):
            for name in vars(own):
                if name in ("__init__",) or not name.startswith("__") and name != "_abc_impl":
                    base = next((b for b in bases if name in vars(b)), None)
                    if base is not None:
                        overrides.setdefault(f"{base.__module__}.{base.__qualname__}.{name}", set()).add(
                            f"{own.__module__}.{own.__qualname__}")
    return overrides


def test_every_hooked_hivemind_method_has_the_parameters_collab_was_written_against():
    changed = {name: describe(_function(resolve(name))) for name in OVERRIDDEN}
    changed = {name: now for name, now in changed.items() if now != OVERRIDDEN[name]}
    assert not changed, f"{UPGRADE}: {changed}"


def test_every_override_in_collab_is_listed():
    found = collab_overrides()
    unlisted = {name: sorted(by) for name, by in found.items() if name not in OVERRIDDEN}
    assert not unlisted, f"collab overrides hivemind methods that collab.hivemind_hooks does not list: {unlisted}"
    # and the list holds nothing collab no longer overrides (a stale entry would hide nothing, but says too much)
    assert set(OVERRIDDEN) <= set(found), sorted(set(OVERRIDDEN) - set(found))
    # the scan does see the mixins and the optimizer (a scan that found nothing would pass the check above)
    assert {"collab.averaging.robust_rounds.CheckedRounds", "collab.averaging.members_only.MembersOnly"} <= \
        found["hivemind.averaging.averager.DecentralizedAverager.rpc_join_group"]
    assert "collab.modes.base.SwarmOptimizer" in found["hivemind.optim.optimizer.Optimizer._update_global_epoch"]
    assert "collab.modes.sync.CollabOptimizer" in found["hivemind.optim.optimizer.Optimizer._begin_averaging_gradients"]


def test_every_patched_name_and_instance_attribute_exists():
    missing = []
    for name in PATCHED:
        try:
            resolve(name)
        except AttributeError:
            missing.append(name)
    for owner, attributes in INSTANCE_ATTRIBUTES.items():
        source = inspect.getsource(inspect.getmodule(resolve(owner)))
        # assigned somewhere in hivemind: `self.NAME = `, `self.NAME: T = ` or `self.a, self.NAME = `
        missing += [f"{owner}: self.{a}" for a in attributes
                    if not re.search(rf"^[^=#\n]*\bself\.{a}\b[^=\n]*=(?!=)", source, re.MULTILINE)]
    assert not missing, f"{UPGRADE}: {missing}"


def test_a_changed_signature_is_told_apart():
    """describe() sees what an override must match: a renamed, added or re-defaulted parameter."""
    def hooked(self, stream, sender_index, *, weight=1.0, **kwargs):
        pass

    def renamed(self, stream, index, *, weight=1.0, **kwargs):
        pass

    def redefaulted(self, stream, sender_index, *, weight=2.0, **kwargs):
        pass

    assert describe(hooked) == "self, stream, sender_index, *, weight=1.0, **kwargs"
    assert len({describe(f) for f in (hooked, renamed, redefaulted)}) == 3
