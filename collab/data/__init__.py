"""Data for collab's tasks: the embedded offline corpus, tokenizers, and token windows."""
