"""Checkpoints: a Hugging Face model folder plus the optimizer and scheduler state, written atomically.

Layout: CHECKPOINT_DIR/epoch-000042/{config.json, model.safetensors, tokenizer files, training_state.pt}.
Each checkpoint is written into a hidden temporary folder and renamed into place, so a peer killed
mid-write leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from collab.errors import UserError
from collab.tasks import Task

TRAINING_STATE = "training_state.pt"
_NAME = re.compile(r"^epoch-(\d+)$")


def save_checkpoint(directory: Path, epoch: int, task: Task, optimizer, keep: int, extra: Optional[dict] = None) -> Path:
    """`extra`: more of the peer's training state (its place in the run's data), saved beside the optimizer's."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"epoch-{epoch:06d}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging  # heavy, and a linreg run needs no transformers

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint would break the live display
    task.save_pretrained(tmp)
    torch.save(
        {
            "epoch": epoch,
            "optimizer": optimizer.state_averager.optimizer.state_dict(),
            "scheduler": optimizer.state_averager.scheduler.state_dict() if optimizer.state_averager.scheduler else None,
            **(extra or {}),
        },
        tmp / TRAINING_STATE,
    )
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and (p / TRAINING_STATE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def load_model_weights(directory: Path, task: Task) -> Optional[dict]:
    """Load the newest checkpoint's weights into task.model; return its training state (or None if none)."""
    checkpoints = list_checkpoints(directory)
    if not checkpoints:
        return None
    latest = checkpoints[-1]
    try:
        task.load_pretrained(latest)
        return torch.load(latest / TRAINING_STATE, weights_only=False)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise UserError(
            f"checkpoint {latest} cannot be loaded ({str(e).splitlines()[0]}); it was made for another "
            "config: pass another --checkpoint-dir or delete that folder"
        ) from None


def restore_training_state(optimizer, state: dict) -> None:
    """Optimizer moments, schedule and epoch from a checkpoint, after the optimizer was built."""
    averager = optimizer.state_averager
    averager.optimizer.load_state_dict(state["optimizer"])
    if state.get("scheduler") and averager.scheduler is not None:
        averager.scheduler.load_state_dict(state["scheduler"])
    averager.local_epoch = int(state["epoch"])
    optimizer.tracker.report_local_progress(local_epoch=averager.local_epoch, samples_accumulated=0)
