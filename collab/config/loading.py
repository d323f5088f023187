"""Where a run config comes from: a shipped config by name or a YAML file, then CLI flags over it, then the
defaults; a run id checked; every error one line that names the key or flag and the fix."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from collab.config.run import TASK_CONFIGS, RunConfig, task_name
from collab.tasks.albert_config import AlbertTaskConfig
from collab.errors import UserError

DEFAULT_CONFIG_NAME = "albert-tiny"
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"  # hivemind forbids dots in its key prefixes


def check_run_id(run_id: str, flag: str = "--run-id") -> str:
    """A run id hivemind can use as a DHT key prefix, or a UserError naming `flag` (checked before heavy imports)."""
    if not re.match(RUN_ID_PATTERN, run_id):
        raise UserError(f"{flag} {run_id!r} is invalid; use 1-64 letters, digits, '_' or '-' "
                        "(no dots: hivemind's DHT keys forbid them)")
    return run_id


def configs_dir() -> Path:
    """configs/ of a clone (editable install), else the copy a wheel installs as the collab.configs package."""
    package = Path(__file__).resolve().parent.parent  # collab/ (this file is collab/config/loading.py)
    clone = package.parent / "configs"
    if clone.is_dir():
        return clone
    # collab.configs holds only YAML files, so it is a namespace package: importlib.resources.files() returns a
    # MultiplexedPath there, whose str() is its repr, not a folder (every wheel install found no shipped config)
    return package / "configs"


def shipped_config(name: str) -> Optional[Path]:
    candidate = configs_dir() / f"{name.removesuffix('.yaml')}.yaml"
    return candidate if candidate.is_file() else None


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


# CLI flag -> dotted config path. The flag wins over the file, the file over the defaults.
FLAG_TO_FIELD = {
    "micro_batch_size": "training.micro_batch_size",
    "target_batch_size": "training.target_batch_size",
    "learning_rate": "training.learning_rate",
    "dataset": "task.data.dataset",
    "tokenizer": "task.data.tokenizer",
    "compression": "averaging.compression",
    "mode": "averaging.mode",
    "matchmaking_time": "averaging.matchmaking_time",
    "group_size": "averaging.group_size",
    "bandwidth": "averaging.bandwidth",
    "device": "training.device",
    "precision": "training.precision",
    "compile": "training.compile",
    "data_workers": "training.data_workers",
    "gpus": "training.devices",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every_epochs",
}
FIELD_TO_FLAG = {field: "--" + flag.replace("_", "-") for flag, field in FLAG_TO_FIELD.items()}


def load_config(path: Optional[Path] = None, overrides: Optional[dict[str, Any]] = None) -> RunConfig:
    """Read `path` (a file, or the name of a shipped config; default albert-tiny), apply `overrides`."""
    path = resolve_config_path(path)
    raw = _read_yaml(path)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, dotted, value)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        flag = _inapplicable_flag(e, overrides or {})
        if flag:
            raise UserError(f"{flag} does not apply to the {task_name(raw.get('task', {}))} task of {path}; "
                            "remove the flag") from None
        described = describe_validation_error(e)
        field = ".".join(str(part) for part in _without_task_tag(e.errors()[0]["loc"]))
        if (overrides or {}).get(field) is not None and described.startswith(field + ": "):  # a flag's value
            flag = FIELD_TO_FLAG.get(field, field)
            message = described[len(field) + 2:].replace(f"; fix it in the file or with {flag}", "")
            raise UserError(f"{flag} {overrides[field]}: {message}; pass another value") from None
        raise UserError(f"config error in {path}: {described}") from None


def user_settings(path: Optional[Path], overrides: Optional[dict[str, Any]] = None) -> dict:
    """Only what the user set: their config file's keys (none without --config) with the flags applied."""
    raw = _read_yaml(resolve_config_path(path)) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, dotted, value)
    return raw


def _inapplicable_flag(error: ValidationError, overrides: dict[str, Any]) -> Optional[str]:
    """The flag behind an unknown key, e.g. --tokenizer for a task that has no tokenizer."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in _without_task_tag(first["loc"]))
    if first["type"] == "extra_forbidden" and overrides.get(field) is not None:
        return FIELD_TO_FLAG.get(field)
    return None


def resolve_config_path(path: Optional[Path]) -> Path:
    if path is None:
        default = shipped_config(DEFAULT_CONFIG_NAME)
        if default is None:
            raise UserError(f"collab's shipped configs are missing from this install (looked in {configs_dir()}); "
                            "reinstall collab, or pass a YAML file with --config")
        return default
    path = Path(path)
    if path.is_file():
        return path
    shipped = shipped_config(path.name) if path.parent == Path(".") else None
    if shipped is not None:
        return shipped
    raise UserError(f"config file {path} does not exist; pass a YAML file or a shipped config name with --config "
                    f"({', '.join(shipped_config_names())})")


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 YAML") from None
    except OSError as e:
        raise UserError(f"config file {path} cannot be read ({e.strerror}); check its permissions, or pass "
                        "another file with --config") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file {path} is not valid YAML{where}; fix the syntax") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (task, training, ...), "
                        f"not {type(raw).__name__}")
    return raw


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[leaf] = str(value) if isinstance(value, Path) else value


def describe_validation_error(error: ValidationError) -> str:
    """The first problem of a pydantic error, as one line that names the field and the fix."""
    first = error.errors()[0]
    loc = _without_task_tag(first["loc"])
    field = ".".join(str(part) for part in loc)
    flag = FIELD_TO_FLAG.get(field)
    fix = f"fix it in the file or with {flag}" if flag else "fix it in the file"
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the task's name picks its section
        tasks = ", ".join(f"'{name}'" for name in TASK_CONFIGS)
        if first["type"] == "union_tag_not_found":
            return f"{field}: must be a section whose name is one of {tasks}"
        return f"{field}.name: '{first['ctx']['tag']}' is not a task; use one of {tasks}"
    if first["type"] == "extra_forbidden":
        parent, _, key = field.rpartition(".")
        known = _known_keys(first["loc"][:-1])
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return f"unknown key '{field}'; remove it or correct it ({hint})"
    if first["type"] == "value_error":
        return f"{field or 'config'}: {first['msg'].removeprefix('Value error, ')}"
    more = f" (and {len(error.errors()) - 1} more)" if len(error.errors()) > 1 else ""
    return f"{field}: {first['msg'].lower()}, got {first.get('input')!r}; {fix}{more}"


def _without_task_tag(loc: tuple) -> tuple:
    """pydantic puts the union's tag in the location (task.swav.data.dataset); users write task.data.dataset."""
    if len(loc) > 1 and loc[0] == "task" and loc[1] in TASK_CONFIGS:
        return loc[:1] + loc[2:]
    return loc


def _known_keys(loc: tuple) -> list[str]:
    """The keys the section at `loc` (as pydantic reports it, tag included) accepts."""
    model: Any = RunConfig
    parts = list(loc)
    while parts:
        key = parts.pop(0)
        if model is RunConfig and key == "task":
            model = TASK_CONFIGS[parts.pop(0)] if parts and parts[0] in TASK_CONFIGS else AlbertTaskConfig
        else:
            model = model.model_fields[key].annotation
    return list(model.model_fields)
