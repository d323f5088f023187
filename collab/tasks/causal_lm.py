"""Causal language modelling: a Llama-style decoder (transformers' LlamaForCausalLM, built from its config) trained
on packed sequences. Each sequence is `seq_length` consecutive tokens of the run's corpus; the corpus's documents
follow one another with the tokenizer's end-of-text token between them (collab init --dataset puts it there), so
no token is padding. AdamW with the usual decoder recipe (betas 0.9/0.95, no decay on norms and biases), linear
warm-up then cosine decay, both counted in collaborative steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from collab.data.feed import ShardFeed
from collab.data.text import token_windows
from collab.data.tokenizer import load_tokenizer
from collab.tasks import Batch, OptimizerFactory, SchedulerFactory, Task
from collab.tasks.causal_lm_config import CausalLmTaskConfig

BETAS = (0.9, 0.95)


class CausalLmTask(Task):
    def __init__(self, config: CausalLmTaskConfig, training):
        self.config, self.training = config, training
        self.tokenizer = load_tokenizer(config.data.tokenizer, config.data.vocab_size, config.data.special_tokens,
                                        needs=("pad_token",))
        model_config = LlamaConfig(vocab_size=len(self.tokenizer), **config.model.model_dump(),
                                   pad_token_id=self.tokenizer.pad_token_id, eos_token_id=end_of_text(self.tokenizer))
        # the same seed on every peer: all start from identical weights, so averaged gradients apply cleanly
        with torch.random.fork_rng():
            torch.manual_seed(training.seed)
            self.model = LlamaForCausalLM(model_config)

    def batches(self, micro_batch_size: int, seed: int, feed: Optional[ShardFeed] = None) -> Iterator[Batch]:
        windows = token_windows(self.config.data.dataset, self.tokenizer, self.config.data.seq_length, seed, feed)
        while True:
            input_ids = torch.stack([next(windows) for _ in range(micro_batch_size)])
            yield {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}

    def loss(self, batch: Batch) -> torch.Tensor:
        return self.model(**batch).loss  # transformers shifts the labels: each token predicts the next

    def parameter_groups(self) -> list[dict]:
        decay, no_decay = [], []
        for param in self.model.parameters():
            (decay if param.dim() >= 2 else no_decay).append(param)  # matrices decay; norms (1-D) do not
        return [{"params": decay, "weight_decay": self.training.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def optimizer_factory(self) -> OptimizerFactory:
        lr, clip = self.training.learning_rate, self.training.max_grad_norm
        return lambda groups: ClippedAdamW(groups, lr=lr, betas=BETAS, max_grad_norm=clip)

    def without_momentum(self) -> dict:
        return {"betas": (0.0, BETAS[1])}

    def scheduler_factory(self) -> SchedulerFactory:
        warmup, total = self.training.warmup_steps, self.training.total_steps
        return lambda opt: get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)

    def save_pretrained(self, directory: Path) -> None:
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def load_pretrained(self, directory: Path) -> None:
        loaded = LlamaForCausalLM.from_pretrained(directory)
        self.model.load_state_dict(loaded.state_dict())


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the (averaged) gradient's global norm first, as LAMB does for ALBERT: hivemind calls the
    optimizer's step on the swarm's gradient, so the clipping must live in the optimizer."""

    def __init__(self, params, max_grad_norm: Optional[float] = None, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        if self.max_grad_norm:
            grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        return super().step(closure)


def end_of_text(tokenizer) -> int:
    """The id that ends a document: the tokenizer's eos token, else its [SEP] (the embedded tokenizer has no eos)."""
    for name in ("eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return value
    raise AssertionError("unreachable: load_tokenizer refuses a tokenizer with neither")
