"""training.micro_batch_size auto: the largest micro-batch that fits this peer's GPU, found at start.

A volunteer's GPU is whatever they have: an ALBERT-base micro-batch that fills an H100 does not fit a 12 GB card, and
one that fits the small card leaves most of the big one idle. The micro-batch is each peer's own (the swarm counts
samples, not micro-batches), so each finds its own: it doubles a probe micro-batch (the first real one, repeated)
until a forward and backward pass in the peer's precision no longer fits in FILL of the GPU's memory, then keeps the
largest that did, never above the run's target. On a CPU memory is not what bounds it: CPU_MICRO_BATCH.
"""

from __future__ import annotations

from typing import Callable

import torch

from collab.errors import UserError

CPU_MICRO_BATCH = 8
FILL = 0.85  # of the GPU's memory a probe may peak at: the rest is headroom (allocator fragments, other processes)
MAX_MICRO_BATCH = 1024


def largest_that_fits(fits: Callable[[int], bool], limit: int, start: int = 8) -> int:
    """The largest size in [1, limit] for which `fits` holds, assuming it holds for every size below one that does:
    doubling from `start`, then halving the gap. 0 if not even 1 fits."""
    start = max(1, min(start, limit))
    if not fits(start):
        good, bad = 0, start
    else:
        good, bad = start, None
        while good < limit:
            trial = min(good * 2, limit)
            if not fits(trial):
                bad = trial
                break
            good = trial
        if bad is None:
            return good
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def repeat_batch(batch: dict, size: int) -> dict:
    """`batch` grown (or cut) to `size` rows by repeating it: the real shapes, any micro-batch size."""
    def grow(value):
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        times = -(-size // value.shape[0])
        return value.repeat(times, *([1] * (value.dim() - 1)))[:size]

    return {key: grow(value) for key, value in batch.items()}


def fits_on_gpu(task, precision, sample: dict) -> Callable[[int], bool]:
    """Whether a micro-batch of a given size trains within FILL of the GPU's memory."""
    device = precision.device
    total = torch.cuda.get_device_properties(device).total_memory

    def fits(size: int) -> bool:
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            batch = precision.to_device(repeat_batch(sample, size))
            with precision.autocast():
                loss = task.loss(batch)
            precision.backward(loss)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) <= FILL * total
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            task.model.zero_grad(set_to_none=True)
            batch = loss = None
            torch.cuda.empty_cache()

    return fits


def with_micro_batch(config, task, precision, seed: int, feed):
    """`config` with training.micro_batch_size decided if it is auto (the model is on its device, not compiled)."""
    if config.training.micro_batch_size != "auto":
        return config
    sample = next(task.batches(1, seed, feed))  # one real sample (from the run's shards, if it has them)
    micro = choose_micro_batch(task, precision, sample, config.training.target_batch_size)
    where = "on a CPU" if precision.device.type != "cuda" else f"the largest that fits {FILL:.0%} of this GPU"
    print(f"Micro-batch size: {micro} (auto: {where})", flush=True)
    training = config.training.model_copy(update={"micro_batch_size": micro})
    return config.model_copy(update={"training": training})


def choose_micro_batch(task, precision, sample: dict, target: int) -> int:
    """training.micro_batch_size auto decided for this peer (see the module's docstring)."""
    if precision.device.type != "cuda":
        return min(CPU_MICRO_BATCH, target)
    found = largest_that_fits(fits_on_gpu(task, precision, sample), min(target, MAX_MICRO_BATCH))
    if found == 0:
        raise UserError(f"the model does not fit this GPU ({torch.cuda.get_device_name(precision.device)}) even one "
                        "sample at a time; train on the CPU (--device cpu) or join a run of a smaller model")
    return found
