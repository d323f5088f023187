"""What the text tasks' configs (ALBERT, causal LM) share: where the text and the tokenizer come from, and that a
sequence fits the model's positions."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from collab.sections import Section


class TextDataConfig(Section):
    dataset: str = Field("embedded", min_length=1, description="embedded | text files/folders | hf:NAME | shards:FOLDER (token shards)")
    tokenizer: str = Field("embedded", min_length=1, description="embedded | tokenizer.json | folder | hub name")
    vocab_size: int = Field(8000, ge=100, description="vocabulary of the embedded tokenizer")
    # set from the run's manifest for a tokenizer exported from a folder or the hub (its own special tokens)
    special_tokens: Optional[dict[str, str]] = None


class TextTaskConfig(Section):
    """A task section with `model.max_position_embeddings` and `data.seq_length`."""

    @model_validator(mode="after")
    def _sequence_fits_positions(self):
        if self.data.seq_length > self.model.max_position_embeddings:
            raise ValueError(f"data.seq_length ({self.data.seq_length}) exceeds model.max_position_embeddings "
                             f"({self.model.max_position_embeddings}); lower task.data.seq_length")
        return self
