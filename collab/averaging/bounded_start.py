"""An averager whose process's start is waited for a bounded time.

hivemind's averagers start their process in the constructor and wait for it to say it is ready, for good. A peer
whose averager's process never started (a fork that caught another thread mid-share: collab.hivemind_hooks.patches.
torch_shares_after_fork) sat at start-up until it was stopped, and a `collab simulate` swarm waiting for all its
peers waited with it (a 12-peer scale run trained nothing in its 180 s). Now the peer exits with one line naming
the averager, and `collab simulate` starts such a peer again.
"""

from __future__ import annotations

from typing import Optional

from hivemind.averaging import DecentralizedAverager

from collab.process.child_stacks import stacks_file

START_WITHIN = 300.0  # seconds an averager's process has to say it is ready (1-2 s alone; minutes at 64 peers on 2 cores)


class AveragerDidNotStart(RuntimeError):
    """An averager's process that never said it was ready."""


class StartsWithin(DecentralizedAverager):
    """A DecentralizedAverager mixin (first among an averager's bases): its start waits START_WITHIN at most."""

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        bound = timeout if timeout is not None else START_WITHIN
        try:
            super().run_in_background(await_ready=await_ready, timeout=bound)
        except TimeoutError:
            # where its process waits is what a bug report needs (the peer's own stacks show only the wait for it)
            try:
                path = stacks_file([self.pid], prefix="collab-stuck-") if self.pid is not None else None
            except OSError:  # (a full disk: the error itself still says what happened)
                path = None
            where = f" (its stacks in {path})" if path else ""
            raise AveragerDidNotStart(f"the averager's process ({self.prefix}) did not say it was ready within "
                                      f"{bound:g} s{where}; start the peer again") from None
