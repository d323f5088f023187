"""The base of every run-config section: an unknown key is an error (a typo must not be silently
ignored), and a value set after loading (a CLI flag) is validated like one from the file.

Its own module, free of heavy imports, so that collab.config and the task configs it assembles
(collab/tasks/*_config.py) share it without importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # inf and nan are never a sensible setting (a bandwidth of inf, a learning rate of nan)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
