"""An averager's process, tidy at both ends: it reads its requests whole, and its leave leaves no socket file in
/tmp, however hivemind ends the process."""

from __future__ import annotations

import psutil

from collab.hivemind_hooks.patches import pipe_reads_take_whole_messages
from collab.process.reaper import hivemind_sockets, remove_sockets_of


class ReadsWholeRequests:
    """A DecentralizedAverager mixin: its process reads the trainer's requests from a pipe that uvloop made
    non-blocking, as hivemind's DHT process does, where a request still being written was read half and the pipe
    lost its framing for good (a lone peer's forced exit, tests/process/test_dht_pipe.py). It reads whole ones."""

    def run(self) -> None:  # in the averager's process
        pipe_reads_take_whole_messages(self)
        super().run()


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
        # not waited for: a process that SIGTERM is ending has no use for its file, and a leave has 7 s on an idle
        # machine (an 8-peer swarm's leave overran them once it waited here)
        remove_sockets_of(sockets)
