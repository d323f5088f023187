"""A peer leaving at --max-epochs stays on as the state donor of peers behind it (collab.averaging.donor_patience says
for how long), rather than leave them with nobody to ask. A mixin of collab.modes.sync.CollabOptimizer."""

from __future__ import annotations

import time
from functools import partial

from hivemind.utils.logging import get_logger

from collab.averaging.donor_patience import donor_patience
from collab.averaging.liveness import GoneWatch, Quiet, ping
from collab.averaging.replica import peers_behind

logger = get_logger(__name__)


class StaysAsDonor:
    """Before leaving, serves the peers behind this one (see the module)."""

    def _finish_before_leaving(self) -> None:
        super()._finish_before_leaving()
        # whatever this peer's view of the swarm says (it may be a minute old): the records say who is behind
        self._serve_peers_behind()

    def _serve_peers_behind(self) -> None:
        """A peer behind ours (it missed the last step, its lineage split, or it has not noticed our step yet) will
        want our state to leave in sync with the swarm: stay its donor while it is behind, for as long as it needs at
        the swarm's measured pace (collab.averaging.donor_patience), rather than leave it with nobody to ask."""
        if self.client_mode:
            # it serves no state (nobody can dial it), so it would wait for nothing: a NAT'd peer left alone with
            # its only server's last record cached would wait out that record's 60-s life
            return
        # not for a peer caught sending or returning bad parts (hard evidence): the honest peers would stay on
        # as donors for a NaN sender one epoch behind them
        caught = frozenset(self.rejections.caught_ever())
        # nor for itself: after an own step this peer's record says the epoch before (a peer that could not
        # re-sync would wait for its own record to go stale, and its groupmate for it)
        ignore = caught | {self.dht.peer_id.to_base58()}
        # nor for a peer that crashed: its record stays until it expires (a minute), but its DHT answers no ping
        crashed, said_crashed = GoneWatch(partial(ping, self.dht)), set()
        started, patience, said = time.monotonic(), 0.0, False
        while not self.stop.is_set():
            try:
                behind = peers_behind(self.dht, self.run_id, self.local_epoch, ignore=ignore)
            except Exception:  # a DHT that fails to answer here must not turn a clean leave into a traceback
                return
            gone = crashed.update(Quiet(b.peer, b.record_age, b.client_mode) for b in behind)
            if gone - said_crashed:
                logger.warning(f"Epoch {self.local_epoch}: {len(gone - said_crashed)} peer(s) behind answer no ping "
                               f"(crashed?): not staying on for them")
                said_crashed |= gone
            behind = [b for b in behind if b.peer not in gone]
            waited = time.monotonic() - started
            epochs = [self.local_epoch - b.epochs for b in behind]
            if not behind:
                if said:
                    logger.warning(f"Epoch {self.local_epoch}: no peer is behind any more; leaving after "
                                   f"{waited:.0f} s")
                return
            patience = max(patience, donor_patience(
                behind, self.tracker.target_batch_size, self.pace.seconds(), self.averaging_timeout,
                self.matchmaking_time, self.load_state_timeout))
            if waited > patience:
                logger.warning(f"Epoch {self.local_epoch}: {len(behind)} peer(s) still behind (epochs {epochs}) after "
                               f"{waited:.0f} s as their state donor; leaving")
                return
            if not said:
                said = True
                pace = self.pace.seconds()
                logger.warning(f"Epoch {self.local_epoch}: {len(behind)} peer(s) behind (epochs {epochs}): staying on "
                               f"as their state donor for up to {patience:.0f} s (epochs take "
                               f"{'?' if pace is None else f'{pace:.1f}'} s here)")
            self.stop.wait(0.5)
