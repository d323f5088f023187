"""Data for collab's tasks: the embedded offline corpus and images, tokenizers, token windows, crops."""

from __future__ import annotations

from collab.errors import UserError


def stream_hf_dataset(name: str):
    """The train split of a Hugging Face dataset (a hub name or a local folder), streamed: a real run's
    data does not fit in memory. Any failure is a UserError that names the dataset."""
    try:
        import datasets  # optional (collab[hf]): a missing one is this one-line error
    except ImportError:
        raise UserError("hf: datasets need the 'datasets' package; pip install 'collab[hf]'") from None
    try:
        return datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:  # datasets raises many types: missing, private, offline, bad config
        raise UserError(f"cannot load dataset '{name}' ({str(e).splitlines()[0]}); check --dataset hf:NAME") from None
