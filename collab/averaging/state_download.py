"""A downloaded state is checked before it is loaded, and the donor is chosen with care.

hivemind picks the donor by the priority each averager declares in the DHT (unsigned: any peer can claim the
highest), and loads whatever that donor sends. Here:
- donors are those whose *signed* progress (hivemind's tracker records) is at most one epoch behind the
  newest one: a peer claiming priority without training is not asked;
- a donor that served a bad state (not finite, the wrong shapes, a norm 10x ours or a tenth of it, or - while
  this peer is not far behind - absurdly far from this replica) is skipped for the rest of the run and
  reported;
- among donors at the same epoch, fast uplinks come first: each declares its epoch plus a fraction that grows
  with its announced upload (--bandwidth), so a 40 MB state is not fetched through a 2 Mbit/s uplink (160 s,
  past load_state_timeout) while a 100 Mbit/s peer (3 s) has it too;
- "caught up" is claimed only when a state was actually loaded (collab.averaging.replica).
The download runs in the averager's process, the check in the trainer's (which holds the optimizer); the
donor's id travels in the state's metadata, and a bad donor goes back to the averager through hivemind's pipe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Optional

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from collab.averaging.members_only import _NoState  # a donor that is not asked: hivemind hears "no state"
from collab.averaging.signed_progress import run_id_of
from collab.hivemind_hooks.averager import AveragerHooks
from collab.hivemind_hooks.patches import donors_reached_through
from collab.records.untrusted import progress_records

FAR_APART = 1.0  # a state further than this (relative to the replica's norm) from ours is not a near-peer's
NOT_FAR_BEHIND = 2  # epochs: within these, an honest donor's parameters are close to ours
NORM_RATIO = 10.0  # a donor's parameters may have at most this many times our norm, or a tenth of it
DONOR_KEY = "collab_donor"
# seconds to open the download stream to one donor. hivemind awaits it unbounded, and p2pd's dial to a peer that is
# not reachable (a network split, a donor behind NAT) gives up only after ~20 s: past the trainer's own
# load_state_timeout, so every retry would ask the same unreachable donor first and never reach the next one (a peer
# would ask its donor across a split again and again and never train again). A dial that works
# takes milliseconds on a LAN and a few round trips across the internet
DIAL_TIMEOUT = 5.0
# a catch-up whose downloads time out (no donor answers within load_state_timeout) gives up after this many and trains
# on with its replica (it tries again at its next step if it is still behind): hivemind retries forever, and a peer
# whose donors cannot be reached would never train again
UNANSWERED_DOWNLOADS = 3
RETRY_PAUSE = 1.0  # seconds between two downloads
logger = get_logger(__name__)


class _TagDonor:
    """hivemind's download future, seen through: what it sets carries the donor's id in its metadata."""

    def __init__(self, future, donor):
        self.future, self.donor = future, donor

    def set_result(self, value):
        if value is not None and isinstance(value[0], dict) and self.donor() is not None:
            value[0][DONOR_KEY] = self.donor()
        self.future.set_result(value)

    def __getattr__(self, name):
        return getattr(self.future, name)


class _BoundedDial:
    """A donor's stub whose download stream must open within DIAL_TIMEOUT: hivemind takes the timeout as that
    donor's failure and asks the next one."""

    def __init__(self, stub):
        self.stub = stub

    async def rpc_download_state(self, request):
        return await asyncio.wait_for(self.stub.rpc_download_state(request), DIAL_TIMEOUT)


UNKNOWN_UPLINK_MBIT = 100.0  # a peer that announced no bandwidth is taken for a typical fast one


def donor_preference(upload_mbit: Optional[float]) -> float:
    """In [0, 0.9): added to a donor's epoch, it orders donors of one epoch by uplink and never lifts one above
    a donor an epoch ahead."""
    mbit = UNKNOWN_UPLINK_MBIT if upload_mbit is None else max(0.0, float(upload_mbit))
    return 0.9 * mbit / (mbit + UNKNOWN_UPLINK_MBIT)


class CheckedDownloads(AveragerHooks):
    """A mixin for TrainingStateAverager (both processes); set `findings` (and `upload_mbit`) before the averager
    process starts."""

    findings = None
    upload_mbit: Optional[float] = None
    near_epochs = NOT_FAR_BEHIND  # the distance check's window; diloco's outer steps move too far for it (0)

    @property
    def state_sharing_priority(self) -> float:
        return super().state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, epoch: float) -> None:
        # hivemind and collab.modes.sync set the epoch; a client-mode peer serves nothing (and must declare 0)
        bonus = donor_preference(self.upload_mbit) if epoch and not self.client_mode else 0.0
        super(CheckedDownloads, type(self)).state_sharing_priority.fset(self, epoch + bonus)

    # -- in the averager's process ------------------------------------------------------------------------

    async def download_state(self, future, timeout=None):
        plausible = await self._plausible_donors()
        asked: list[str] = []

        def stub(inner, p2p, peer: PeerID, namespace):  # inner: members only, in a private run
            name = peer.to_base58()
            if name in self._skipped_donors() or (plausible is not None and name not in plausible):
                return _NoState()  # hivemind hears "no state" and asks the next donor
            asked.append(name)
            return _BoundedDial(inner(p2p, peer, namespace=namespace))

        with donors_reached_through(self, stub):
            return await super().download_state(_TagDonor(future, lambda: asked[-1] if asked else None),
                                                timeout=timeout)

    async def _plausible_donors(self) -> Optional[set]:
        """Peers whose signed progress is at most one epoch behind the newest (None: no records could be read,
        and hivemind's own choice stands)."""
        try:
            records = await asyncio.get_event_loop().run_in_executor(None, progress_records, self.dht,
                                                                     run_id_of(self.prefix))
        except Exception:
            return None
        if not records:
            return None
        newest = max(p.epoch for p in records.values())
        return {peer for peer, p in records.items() if p.epoch >= newest - 1}

    def _skipped_donors(self) -> set:
        if not hasattr(self, "_bad_donors"):
            self._bad_donors = set()
        return self._bad_donors

    async def _skip_donor(self, donor: str) -> None:
        self._skipped_donors().add(donor)

    # -- in the trainer's process -------------------------------------------------------------------------

    def check_download(self, loaded, own_epoch: int) -> bool:
        """Whether a downloaded (metadata, tensors) may be loaded; if not, its donor is reported and skipped."""
        metadata, tensors = loaded
        donor = metadata.pop(DONOR_KEY, None) if isinstance(metadata, dict) else None
        why = self._what_is_wrong(metadata, tensors, own_epoch)
        if why is None:
            return True
        if self.findings is not None:
            self.findings.put((donor or "(unknown donor)", why, "state"))
        if donor is not None and self.is_alive():
            self._outer_pipe.send(("_skip_donor", [donor], {}))
        print(f"Refused the state downloaded from {donor}: {why}; asking another peer", flush=True)
        return False

    @torch.no_grad()
    def _what_is_wrong(self, metadata, tensors, own_epoch: int) -> Optional[str]:
        own = [p for group in self.optimizer.param_groups for p in group["params"]] + list(self.extra_tensors)
        if len(tensors) < len(own) or any(t.shape != o.shape for t, o in zip(tensors, own)):
            return "a state of the wrong shape"
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return "a state that is not finite"
        norm = torch.stack([o.float().norm() for o in own]).norm()
        theirs = torch.stack([t.float().norm() for t in tensors[:len(own)]]).norm()
        if not 1 / NORM_RATIO <= float(theirs / norm.clamp_min(1e-30)) <= NORM_RATIO:
            # however far behind: training moves a model's norm by a small factor (LAMB, weight decay), not 10x
            return f"a state whose norm is {float(theirs / norm.clamp_min(1e-30)):.3g}x this replica's"
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if isinstance(epoch, int) and epoch - own_epoch <= self.near_epochs:
            distance = torch.stack([(t.float() - o.float()).norm() for t, o in zip(tensors, own)]).norm()
            if distance > FAR_APART * norm:
                return f"a state {float(distance / norm):.1f}x this replica's norm away from it, {epoch - own_epoch} " \
                       "epochs ahead"
        return None




def download_with_retries(load: Callable[[], bool], alone: Callable[[], bool], stop: threading.Event,
                          deadline: Optional[float] = None) -> bool:
    """Whether `load` (one download: True when a state was loaded, False when no donor had one, an exception when
    the donors did not answer) loaded a state. Without a `deadline` it stops at the first answer or after
    UNANSWERED_DOWNLOADS unanswered tries; with one, it asks until then (a peer leaving at its last epoch waits for
    a donor to appear). It stops at once when `stop` is set or the peer is `alone` (asked before each try)."""
    unanswered = 0
    while not stop.is_set():
        if alone():  # before a try too: a donor that left is still listed, and one try at it waits out its timeout
            return False
        failure = None
        try:
            if load():
                return True
        except BaseException as e:  # a donor that left mid-download, a timeout: try the next one
            unanswered += 1
            failure = f"{type(e).__name__}: {e}"
        give_up = (deadline is not None and time.monotonic() > deadline) or \
            (deadline is None and (failure is None or unanswered >= UNANSWERED_DOWNLOADS))
        if failure is not None and not stop.is_set():
            logger.warning(f"Failed to load state from peers ({failure}); "
                           + ("giving up for now" if give_up else "retrying"))
        if give_up:
            return False
        stop.wait(RETRY_PAUSE)
    return False
