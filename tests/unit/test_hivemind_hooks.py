"""collab.hivemind_hooks against the installed hivemind: every hooked name exists, with the parameters collab was
written against; every override of a hivemind method in collab's classes is listed there; private methods are
overridden, and hivemind patched, only inside that package. A hivemind upgrade that changes one of them fails here,
with the names, instead of somewhere in a swarm."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import hivemind

import collab
import collab.dashboard
import collab.peers
from collab.hivemind_hooks import INSTANCE_ATTRIBUTES, OVERRIDDEN, PATCHED, READ, describe
from collab.hivemind_hooks.allreduce import RunnerHooks
from collab.hivemind_hooks.averager import AveragerHooks
from collab.hivemind_hooks.optimizer import OptimizerHooks, TrackerHooks

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
    for package in (collab, collab.peers, collab.dashboard):  # peers/ and dashboard/ install inside collab
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
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
    # the scan does see the door, the mixins and the optimizers (a scan that found nothing would pass the check above)
    assert found["hivemind.averaging.averager.DecentralizedAverager.rpc_join_group"] == \
        {"collab.hivemind_hooks.averager.AveragerHooks"}
    assert "collab.modes.base.SwarmOptimizer" in found["hivemind.optim.optimizer.Optimizer.step"]
    assert "collab.averaging.compression.SparseParts" in found["hivemind.compression.base.CompressionBase.extract"]


def _private(method: str) -> bool:
    name = method.rsplit(".", 1)[1]
    return name.startswith("rpc_") or name.startswith("_") and not name.startswith("__")


def test_private_hivemind_methods_are_overridden_only_behind_the_door():
    outside = {name: sorted(c for c in by if not c.startswith("collab.hivemind_hooks."))
               for name, by in collab_overrides().items() if _private(name)}
    outside = {name: by for name, by in outside.items() if by}
    assert not outside, f"override the public name collab.hivemind_hooks opens instead: {outside}"


def test_the_doors_public_names_are_collabs_own():
    """Each door's public method (the name collab overrides) is no hivemind name: an upgrade that adds one would
    have hivemind call collab's method, or collab shadow hivemind's."""
    for door in (RunnerHooks, AveragerHooks, OptimizerHooks, TrackerHooks):
        hivemind_base = next(c for c in door.__mro__ if c.__module__.startswith("hivemind"))
        opened = [name for c in door.__mro__ if c.__module__.startswith("collab.hivemind_hooks") for name in vars(c)
                  if not name.startswith("_") and not name.startswith("rpc_")]
        assert opened, door
        clashes = [name for name in opened if hasattr(hivemind_base, name)]
        assert not clashes, f"{door.__qualname__}: hivemind's {hivemind_base.__qualname__} now has {clashes}"


def _source_files():
    for package in (collab, collab.peers, collab.dashboard):  # peers/ and dashboard/ install inside collab
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            if "hivemind_hooks" not in path.parts:
                yield path


def test_hivemind_is_patched_only_behind_the_door():
    """No module outside collab.hivemind_hooks names a patched private hivemind name, or assigns a patched public one
    (calling a public one, a container's register_processed_part, is no patch). collab.peers and collab.dashboard
    live inside the installed package, so they are read too."""
    # a private name as common as SharedBytes._lock (collab's own classes have a `_lock`) is looked for with its class
    names = {".".join(name.split(".")[-2:]) if name.endswith("._lock") else name.rsplit(".", 1)[1]
             for name in PATCHED}
    found = {}
    for path in _source_files():
        text = path.read_text()
        for name in names:
            named = rf"\b{re.escape(name)}\b" if name.split(".")[-1].startswith("_") else \
                rf"\.{re.escape(name)}\s*=[^=]|setattr\([^)]*[\"']{re.escape(name)}[\"']"
            if re.search(named, text):
                found.setdefault(name, []).append(path.name)
    assert not found, f"use collab.hivemind_hooks.patches instead: {found}"
    assert any(p.name == "forkserver.py" for p in _source_files())  # the walk reads collab.peers too
    # the check sees a patch where there is one
    assert re.search(r"\.get_stub\s*=[^=]", "averager.get_stub = stub") and \
        not re.search(r"\.get_stub\s*=[^=]", "stub = averager.get_stub(p2p, peer)")


def test_every_patched_name_and_instance_attribute_exists():
    missing = []
    for name in (*PATCHED, *READ):
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


def test_a_round_cancelled_as_it_ends_leaves_no_traceback_in_the_log():
    # hivemind's _step sets the result of a step the trainer has just cancelled (a round given up, a leave): the
    # InvalidStateError went to a task nobody awaits, "Task exception was never retrieved" in a peer's log (CI, 3 peers)
    import asyncio
    from concurrent.futures import InvalidStateError

    from types import SimpleNamespace

    import pytest

    class Ending(AveragerHooks):
        async def averaging_step(self, *, step, future_for_init):
            raise InvalidStateError(f"Can't set_result to a future that is {'CANCELLED' if step.cancelled() else 'X'}")

    averager = object.__new__(Ending)
    averager._parent_pid = None  # (hivemind's __del__ would shut down the process this one never started)
    cancelled, running = SimpleNamespace(cancelled=lambda: True), SimpleNamespace(cancelled=lambda: False)
    assert asyncio.run(averager._step(step=cancelled, future_for_init=None)) is None
    with pytest.raises(InvalidStateError):  # a step nobody cancelled: hivemind's own error, as before
        asyncio.run(averager._step(step=running, future_for_init=None))


def test_a_cancelled_tasks_way_out_is_not_collected_midway_in_an_averagers_loop():
    """hivemind cancels a round's matchmaking task without awaiting it; its way out awaits an answer that only a weak
    registry holds (an MPFuture). With asyncio's weak hold the chain was collected midway, its cleanup never done;
    held until done (collab.hivemind_hooks.averager.keep_tasks_until_done), it finishes."""
    import gc
    import threading
    import weakref

    from collab.hivemind_hooks.averager import keep_tasks_until_done

    def run(keep: bool) -> bool:
        async def scenario() -> bool:
            loop, cleaned = asyncio.get_running_loop(), []
            if keep:
                keep_tasks_until_done(loop)

            def answered_later() -> asyncio.Future:  # as an MPFuture: set from elsewhere, found by a weak reference
                future, ref = loop.create_future(), None
                ref = weakref.ref(future)
                threading.Timer(0.2, lambda: ref() is not None and loop.call_soon_threadsafe(
                    lambda: ref() is not None and not ref().done() and ref().set_result(None))).start()
                return future

            async def look_for_group():
                try:
                    await loop.create_future()
                finally:
                    await answered_later()  # e.g. telling the DHT this peer no longer looks for a group
                    cleaned.append(True)

            task = asyncio.ensure_future(look_for_group())
            await asyncio.sleep(0.01)
            task.cancel()  # and never awaited, as hivemind's _step does
            del task
            for _ in range(50):
                gc.collect()
                await asyncio.sleep(0.01)
            return bool(cleaned)

        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(scenario())
        finally:
            loop.close()

    assert run(keep=True)
    assert not run(keep=False)  # (asyncio's own hold: the premise of the fix)


def test_every_averaging_step_holds_its_loops_tasks_until_done():
    """The hold above is installed by the averager's step, in the averager's own process and loop."""
    import asyncio

    class Stepping(AveragerHooks):
        async def averaging_step(self, *, step, future_for_init):
            return asyncio.get_running_loop().get_task_factory()

    averager = object.__new__(Stepping)
    averager._parent_pid = None  # (hivemind's __del__ would shut down the process this one never started)
    from collab.hivemind_hooks import averager as hooks

    assert asyncio.run(averager._step(step=None, future_for_init=None)) is hooks._kept_task
