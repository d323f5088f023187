"""An averager's leave that leaves no socket file in /tmp, however hivemind ends its process."""

from __future__ import annotations

import psutil

from collab.process.reaper import hivemind_sockets, remove_sockets_of

HARD_WAY_WAIT = 1.0  # seconds for a process hivemind sent SIGTERM (which it does not wait for) to end


class LeavesNoSocketFile:
    """A DecentralizedAverager mixin, on the trainer's side: hivemind ends an averager process that does not shut down
    within its shutdown_timeout "the hard way" (SIGTERM), and nothing then removed the file of its client of p2pd
    (hivemind removes it in the averager's own shutdown, which never ran)."""

    def shutdown(self) -> None:
        running = self.is_alive()
        try:
            sockets = hivemind_sockets([psutil.Process(self.pid)]) if running else {}
        except psutil.Error:
            sockets = {}
        super().shutdown()
        if running:
            self.join(HARD_WAY_WAIT)
            remove_sockets_of(sockets, still_running=[self] if self.is_alive() else [])
