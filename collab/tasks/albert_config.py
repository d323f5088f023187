"""The ALBERT task's typed config (`task:` in a run config). Kept apart from the task itself, which
imports torch and transformers, so that reading and checking a config (every CLI command, `--help`)
costs no second of imports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from collab.sections import Section
from collab.tasks.text_config import TextDataConfig, TextTaskConfig


class AlbertModelConfig(Section):
    embedding_size: int = Field(128, gt=0)
    hidden_size: int = Field(256, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(1024, gt=0)
    max_position_embeddings: int = Field(128, ge=16)
    hidden_dropout_prob: float = Field(0.0, ge=0, lt=1)
    attention_probs_dropout_prob: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); change task.model.num_attention_heads"
            )
        return self


class AlbertDataConfig(TextDataConfig):
    seq_length: int = Field(128, ge=16)
    mlm_probability: float = Field(0.15, gt=0, lt=1)


class AlbertTaskConfig(TextTaskConfig):
    name: Literal["albert"] = "albert"
    model: AlbertModelConfig = Field(default_factory=AlbertModelConfig)
    data: AlbertDataConfig = Field(default_factory=AlbertDataConfig)
