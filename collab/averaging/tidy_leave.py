"""An averager's leave that leaves no socket file in /tmp, however hivemind ends its process."""

from __future__ import annotations

import psutil

from collab.process.reaper import hivemind_sockets, remove_sockets_of


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
        # not waited for: a process that SIGTERM is ending has no use for its file, and a leave has 7 s in all (an
        # 8-peer swarm's leave overran them once it waited here)
        remove_sockets_of(sockets)
