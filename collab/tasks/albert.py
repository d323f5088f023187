"""ALBERT pretraining (masked LM + sentence-order prediction), as in DeDLOC.

The model is built from its config (no hub download); LAMB comes from pytorch-optimizer and
the schedule is linear warm-up then linear decay, both counted in collaborative steps.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator, Optional

import torch
from pytorch_optimizer import Lamb
from transformers import (
    AlbertConfig,
    AlbertForPreTraining,
    DataCollatorForLanguageModeling,
    get_linear_schedule_with_warmup,
)

from collab.data.feed import ShardFeed
from collab.data.text import sentence_order_example, token_windows
from collab.data.tokenizer import load_tokenizer
from collab.tasks import Batch, OptimizerFactory, SchedulerFactory, Task
from collab.tasks.albert_config import AlbertTaskConfig


class AlbertTask(Task):
    def __init__(self, config: AlbertTaskConfig, training):
        self.config, self.training = config, training
        self.tokenizer = load_tokenizer(config.data.tokenizer, config.data.vocab_size, config.data.special_tokens)
        model_config = AlbertConfig(vocab_size=len(self.tokenizer), **config.model.model_dump(),
                                    pad_token_id=self.tokenizer.pad_token_id)
        # the same seed on every peer: all start from identical weights, so averaged gradients apply cleanly
        with torch.random.fork_rng():
            torch.manual_seed(training.seed)
            self.model = AlbertForPreTraining(model_config)

    def batches(self, micro_batch_size: int, seed: int, feed: Optional[ShardFeed] = None) -> Iterator[Batch]:
        collator = DataCollatorForLanguageModeling(self.tokenizer, mlm_probability=self.config.data.mlm_probability,
                                                   return_tensors="pt", seed=seed)
        rng = random.Random(seed)
        windows = token_windows(self.config.data.dataset, self.tokenizer, self.config.data.seq_length - 3, seed, feed)
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        while True:
            examples = [sentence_order_example(next(windows), cls_id, sep_id, rng) for _ in range(micro_batch_size)]
            yield collator(examples)

    def loss(self, batch: Batch) -> torch.Tensor:
        return self.model(**batch).loss

    def parameter_groups(self) -> list[dict]:
        # the usual BERT/ALBERT recipe: no weight decay on biases and LayerNorm
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if name.endswith(("bias", "LayerNorm.weight")) else decay).append(param)
        return [{"params": decay, "weight_decay": self.training.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def optimizer_factory(self) -> OptimizerFactory:
        lr, clip = self.training.learning_rate, self.training.max_grad_norm
        return lambda groups: Lamb(groups, lr=lr, max_grad_norm=clip)

    def without_momentum(self) -> dict:
        return {"betas": (0.0, 0.999)}  # LAMB's first moment is then this step's (averaged) gradient

    def scheduler_factory(self) -> SchedulerFactory:
        warmup, total = self.training.warmup_steps, self.training.total_steps
        return lambda opt: get_linear_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)

    def save_pretrained(self, directory: Path) -> None:
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def load_pretrained(self, directory: Path) -> None:
        loaded = AlbertForPreTraining.from_pretrained(directory)
        self.model.load_state_dict(loaded.state_dict())
