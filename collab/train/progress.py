"""What a volunteer sees in the terminal: their own speed, the swarm's progress toward the target
batch, the epoch and the number of peers. A live bar on a terminal; one plain line per epoch when
the output goes to a file, a pipe or `docker logs` (a redrawn bar would fill them with noise).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional


@dataclass
class Snapshot:
    epoch: int
    swarm_samples: int
    target_batch_size: int
    num_peers: int
    local_samples_per_second: float
    loss: Optional[float]
    samples_contributed: int
    rounds_joined: int


class ProgressDisplay:
    def __init__(self, live: Optional[bool] = None):
        self.live = sys.stdout.isatty() if live is None else live
        self._progress = None
        self._task = None
        self._last_epoch: Optional[int] = None

    def __enter__(self):
        if self.live:
            # rich takes tens of ms to import: only the live bar on a terminal needs it
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples toward the target · {task.fields[peers]} peers · "
                           "you: {task.fields[speed]:.1f} samples/s, {task.fields[mine]} contributed · "
                           "loss {task.fields[loss]}"),
                refresh_per_second=2,
            )
            self._progress.start()
            self._task = self._progress.add_task("swarm", total=1, epoch=0, peers=0, speed=0.0, mine=0, loss="-")
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def update(self, s: Snapshot) -> None:
        loss = f"{s.loss:.3f}" if s.loss is not None else "-"
        if self._progress is not None:
            self._progress.update(
                self._task, completed=min(s.swarm_samples, s.target_batch_size), total=s.target_batch_size,
                epoch=s.epoch, peers=s.num_peers, speed=s.local_samples_per_second, mine=s.samples_contributed,
                loss=loss,
            )
        elif s.epoch != self._last_epoch:
            print(f"epoch {s.epoch} | peers {s.num_peers} | local {s.local_samples_per_second:.1f} samples/s | "
                  f"contributed {s.samples_contributed} | averaging rounds {s.rounds_joined} | loss {loss}", flush=True)
        self._last_epoch = s.epoch
