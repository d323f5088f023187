"""The causal-LM task's typed config (`task:` in a run config): a Llama-style decoder, as nearly every current open
pretraining run trains (INTELLECT-1, Psyche, OpenDiLoCo). Kept apart from the task, which imports transformers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from collab.sections import Section
from collab.tasks.text_config import TextDataConfig, TextTaskConfig


class CausalLmModelConfig(Section):
    """transformers' LlamaConfig fields: the model is built from them, not downloaded."""

    hidden_size: int = Field(256, gt=0)
    intermediate_size: int = Field(688, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(4, gt=0, description="fewer than the attention heads: grouped-query attention")
    max_position_embeddings: int = Field(256, ge=16)
    rope_theta: float = Field(10000.0, gt=0)
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _heads_fit(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                             f"({self.num_attention_heads}); change task.model.num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads}); change task.model.num_key_value_heads")
        return self


class CausalLmDataConfig(TextDataConfig):
    seq_length: int = Field(256, ge=16, description="tokens per packed sequence (documents end with the eos token)")


class CausalLmTaskConfig(TextTaskConfig):
    name: Literal["causal-lm"] = "causal-lm"
    model: CausalLmModelConfig = Field(default_factory=CausalLmModelConfig)
    data: CausalLmDataConfig = Field(default_factory=CausalLmDataConfig)
