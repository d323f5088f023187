"""Micro-batches made ahead in a worker process, off the training thread (training.data_workers).

A compiled model on a GPU takes ALBERT-base batches faster than one Python thread makes them beside it (1009
samples/s against 1618 for the pipeline alone on a server CPU, and the training thread needs that CPU too: to
launch kernels). Here the task's own batch generator (Task.batches) runs in a spawned worker, torch's DataLoader
keeps AHEAD batches queued and pins them (so the copies to the GPU are asynchronous: collab.train.precision), and
the training thread only takes them.

The worker runs the same generator, with the same seed, as the training thread would: the batches and their order
are the same. A run with token shards keeps its feed here (collab.data.feed: it fetches from the swarm, through
this process's DHT): a thread sends the feed's windows, in order, to the worker's stand-in feed. The windows a batch
consumed come back with it, so the peer's place in the shards (its record, checkpoints, resume) counts what it
trained on, not what the worker read ahead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from collab.data.feed import FeedStopped
from collab.train.precision import uses_data_workers

AHEAD = 4  # batches queued ahead of the training thread
WINDOWS_AHEAD = 1024  # token windows sent ahead to the worker (8 MB at sequence 1024)
BOUND_SHARE = 0.2  # training waited for batches this share of its time or more: the pipeline bounds this peer
BOUND_AFTER = 30.0  # seconds of training before that is judged


class _FeedInWorker:
    """The worker's stand-in for the peer's ShardFeed: windows sent by the training process, in its order."""

    def __init__(self, lengths, windows, stop):
        self.lengths, self._windows, self._stop, self.taken, self.ended = lengths, windows, stop, 0, False

    def windows(self, length: int):
        self.lengths.put(length)
        while True:
            try:
                window = self._windows.get(timeout=0.2)
            except queue.Empty:
                window = None if self._stop.is_set() else False
            if window is False:
                continue
            if window is None:  # the feed stopped (the peer leaves) or failed (the training process says why)
                self.ended = True
                return
            self.taken += 1
            yield torch.from_numpy(window)


class _Batches(IterableDataset):
    def __init__(self, config: dict, micro_batch_size: int, seed: int, channels=None):
        self.config, self.micro_batch_size, self.seed, self.channels = config, micro_batch_size, seed, channels

    def __iter__(self):
        from collab.config import RunConfig
        from collab.tasks import build_task, task_class

        torch.set_num_threads(1)  # the cores are the training process's: the batch ops here are small
        config = RunConfig.model_validate(self.config)
        # the task's model is never used here: on the meta device it takes no memory and no initialisation
        apart = task_class(config.task.name).batches_apart_from_model
        with torch.device("meta") if apart else contextlib.nullcontext():
            task = build_task(config)
        feed = _FeedInWorker(*self.channels) if self.channels is not None else None
        batches = task.batches(self.micro_batch_size, self.seed, feed)
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except (StopIteration, RuntimeError):
                if feed is not None and feed.ended:  # the stand-in feed ended (the generator's StopIteration): so
                    return  # does the stream
                raise
            yield batch, (feed.taken if feed is not None else 0), time.perf_counter() - started


class BatchPipeline:
    """An endless iterator of micro-batches, like Task.batches, made in a worker process."""

    def __init__(self, config, micro_batch_size: int, seed: int, feed=None, pin: bool = False):
        context = torch.multiprocessing.get_context("spawn")  # a fork of a process that may use CUDA must not
        self.feed, self.micro_batch_size = feed, micro_batch_size
        self.base = feed.position if feed is not None else 0
        self.position = self.base  # windows of the shards trained on (the feed's own runs ahead)
        self.made_seconds = 0.0
        self.batches_taken = 0
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._sender: Optional[threading.Thread] = None
        channels = None
        if feed is not None:
            self._lengths, self._windows = context.Queue(), context.Queue(maxsize=WINDOWS_AHEAD)
            self._worker_stop = context.Event()  # the worker may wait for windows, where torch's shutdown cannot reach
            channels = (self._lengths, self._windows, self._worker_stop)
        dataset = _Batches(config.model_dump(mode="json"), micro_batch_size, seed, channels)
        self._loader = DataLoader(dataset, batch_size=None, num_workers=1, prefetch_factor=AHEAD, pin_memory=pin,
                                  multiprocessing_context=context)
        self._iterator = iter(self._loader)  # starts the worker
        if feed is not None:
            self._sender = threading.Thread(target=self._send_windows, name="windows-to-worker", daemon=True)
            self._sender.start()

    def _send_windows(self) -> None:
        try:
            length = _get(self._lengths, self._stop)
            if length is None:
                return
            for window in self.feed.windows(length):
                # by value through the pipe: a tensor would hold a shared-memory file descriptor while it waits
                if not _put(self._windows, window.numpy(), self._stop):
                    return
        except BaseException as e:  # noqa: BLE001 - FeedStopped, a UserError: the training thread raises it
            self._error = e
        finally:
            _put(self._windows, None, self._stop)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch, taken, seconds = next(self._iterator)
        except StopIteration:
            raise self._error if self._error is not None else FeedStopped("the data pipeline stopped") from None
        self.made_seconds += seconds
        self.batches_taken += 1
        self.position = self.base + taken
        return batch

    def rate(self) -> Optional[float]:
        """Samples a second the worker makes, counting only its own time (not waiting for room in the queue)."""
        return self.batches_taken * self.micro_batch_size / self.made_seconds if self.made_seconds > 0 else None

    def report(self) -> dict:
        rate = self.rate()
        # (the seconds training waited for batches are the trainer's to count: the worker's start is not training's)
        return {"workers": 1, "samples_per_second": round(rate, 1) if rate else None, "batches": self.batches_taken}

    def close(self) -> None:
        self._stop.set()
        if self.feed is not None:
            self._worker_stop.set()
            # windows still queued for a worker that is gone: without this, the process's exit would wait forever
            # for the queue's feeder thread to write them into a pipe nobody reads
            self._windows.cancel_join_thread()
            self._lengths.cancel_join_thread()
        self._iterator = None  # its last reference: torch's iterator ends its worker as it goes
        if self._sender is not None:
            self._sender.join(timeout=10)


def bound_warning(waited: float, trained: float, rate: Optional[float], in_thread: bool) -> Optional[str]:
    """One line when the training thread waited for batches a large share of its time, naming the fix."""
    if trained < BOUND_AFTER or waited < BOUND_SHARE * trained:
        return None
    made = f"{rate:.0f} samples/s" if rate else "batches"
    if in_thread:
        return (f"The data pipeline bounds this peer: training spent {waited / trained:.0%} of its time making "
                "batches; pass --data-workers 1 (in a config file or under collab simulate: training.data_workers: 1) "
                "to make them in a worker process")
    return (f"The data pipeline bounds this peer: its worker makes {made} and training waited for it "
            f"{waited / trained:.0%} of the time; this CPU makes batches slower than the model takes them (close "
            "CPU-heavy programs beside it, or give the peer a larger share of a faster CPU)")


def _get(channel, stop: threading.Event):
    while not stop.is_set():
        try:
            return channel.get(timeout=0.2)
        except queue.Empty:
            continue
    return None


def _put(channel, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            channel.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def peer_batches(config, task, precision, seed: int, data) -> Iterator[dict]:
    """The peer's micro-batches (data: its PeerData, or None): made in a worker process (training.data_workers), or in this thread."""
    micro = config.training.micro_batch_size
    feed = data.feed if data is not None else None
    if not uses_data_workers(config.training, precision.device):
        return task.batches(micro, seed, feed)
    print("Batches are made ahead in a worker process (--data-workers 0: in the training thread)", flush=True)
    pipeline = BatchPipeline(config, micro, seed, feed, pin=precision.device.type == "cuda")
    if data is not None:
        data.position = lambda: pipeline.position
    return pipeline
