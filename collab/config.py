"""The run config: YAML file, then CLI flags over it, then defaults; validated in one place.

Every section is a pydantic model with `extra="forbid"`, so a typo is an error that names the
key instead of a silently ignored setting. Task-specific sections live next to their task
(collab/tasks/*_config.py); this module only assembles them.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from collab.errors import UserError
from collab.sections import Section
from collab.tasks.albert_config import AlbertTaskConfig
from collab.tasks.causal_lm_config import CausalLmTaskConfig
from collab.tasks.linreg_config import LinregTaskConfig
from collab.tasks.swav_config import SwavTaskConfig

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
    clone = Path(__file__).resolve().parent.parent / "configs"
    if clone.is_dir():
        return clone
    # collab.configs holds only YAML files, so it is a namespace package: importlib.resources.files() returns a
    # MultiplexedPath there, whose str() is its repr, not a folder (every wheel install found no shipped config)
    return Path(__file__).resolve().parent / "configs"


def shipped_config(name: str) -> Optional[Path]:
    candidate = configs_dir() / f"{name.removesuffix('.yaml')}.yaml"
    return candidate if candidate.is_file() else None


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


class AutoTargetConfig(Section):
    """training.target_batch_size: auto (collab.adaptive.batch_plan): the target follows the swarm's measured noise
    scale."""
    enabled: bool = Field(False, description="set by target_batch_size: auto")
    min: int = Field(64, gt=0, le=10**9, description="the smallest target the run may take")
    max: int = Field(8192, gt=0, le=10**9, description="the largest target the run may take")
    start: Optional[int] = Field(None, gt=0, le=10**9, description="the target until the noise scale is measured "
                                 "(default: min)")
    every_epochs: int = Field(5, ge=1, le=10**6, description="epochs between two changes of the target (each at "
                              "most 2x)")


class TrainingConfig(Section):
    micro_batch_size: Union[int, Literal["auto"]] = Field(
        8, description="samples per local forward/backward; auto: the largest that fits this peer's GPU, found at "
        "start (8 on a CPU)")
    target_batch_size: int = Field(256, gt=0, description="samples the whole swarm accumulates per optimizer step "
                                   "('auto': it follows the measured gradient noise scale, within auto_target)")
    auto_target: AutoTargetConfig = Field(default_factory=AutoTargetConfig)
    lr_scaling: Literal["none", "adascale"] = Field(
        "none", description="adascale: the learning rate times AdaScale's gain for the target (from the measured "
        "noise scale), and the schedule in scale-invariant steps of base_batch_size")
    base_batch_size: Optional[int] = Field(None, gt=0, le=10**9, description="the batch the learning rate and "
                                           "schedule were tuned at (AdaScale's and goodput's baseline; default: "
                                           "the starting target)")
    learning_rate: float = Field(1.76e-3, gt=0)
    warmup_steps: int = Field(50, ge=0, description="linear warm-up, in collaborative steps (epochs)")
    total_steps: int = Field(10_000, gt=0, description="length of the linear decay, in collaborative steps")
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0, description="LAMB's gradient clipping")
    seed: int = Field(0, ge=0, description="model initialisation seed, shared by all peers")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where this peer computes (auto: its GPU "
                                                   "if torch sees one); each peer's own choice")
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="forward and backward passes' precision (autocast; fp16 with loss scaling); auto: "
        "bf16 on a GPU that has it, else fp16; fp32 on a CPU. The optimizer and the averaged gradients stay fp32")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile the model (the first micro-batch compiles it; a failure falls back to "
        "eager with one warning); auto: on a GPU only (on a CPU it made the peer no faster). Each peer's own choice")
    data_workers: Union[Literal["auto"], int] = Field(
        "auto", description="worker processes that make batches ahead of training (0: in the training thread); "
        "auto: 1 on a GPU, 0 on a CPU (whose cores are the model's). Each peer's own choice")

    devices: Union[Literal["all"], list[str]] = Field(
        default_factory=list, description="one peer for several devices (--gpus): a process per device, gradients "
        "summed inside the machine, one peer toward the swarm; 'all' (every GPU torch sees) or names such as "
        "cuda:0, cuda:1 (cpu, cpu: two processes on the CPU, for tests). Empty: one process on training.device. "
        "Each peer's own choice")

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value):
        if isinstance(value, str):
            value = "all" if value == "all" else [part.strip() for part in value.split(",") if part.strip()]
        names = [] if value == "all" else [f"cuda:{v}" if str(v).isdigit() else str(v) for v in value or []]
        if any(not re.match(r"^(cpu|cuda:\d+)$", name) for name in names):
            raise ValueError(f"expected 'all' or device names such as cuda:0, cuda:1 (or GPU indices 0,1), got {value!r}")
        if len({name.split(":")[0] for name in names}) > 1:
            raise ValueError(f"mixes the CPU and GPUs ({', '.join(names)}); name GPUs only, or the CPU only")
        return value if value == "all" else names

    @field_validator("data_workers", mode="before")
    @classmethod
    def _data_workers(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1):
            return value
        raise ValueError(f"must be 0, 1 or 'auto', got {value!r} (one worker process per GPU; more are not "
                         "supported)")

    @model_validator(mode="before")
    @classmethod
    def _auto_target(cls, data: Any) -> Any:
        # target_batch_size: auto is stored as the starting target and auto_target.enabled (the manifest's form)
        if isinstance(data, dict) and data.get("target_batch_size") == "auto":
            auto = dict(data.get("auto_target") or {})
            auto["enabled"] = True
            start = auto.get("start") if auto.get("start") is not None else auto.get("min", AutoTargetConfig().min)
            data = {**data, "auto_target": auto, "target_batch_size": start}
        return data

    @property
    def base_batch(self) -> int:
        return self.base_batch_size or self.target_batch_size

    @field_validator("micro_batch_size", mode="before")  # before the union's own check: one message, not two
    @classmethod
    def _samples_or_auto(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"must be a whole number of samples > 0 or 'auto', got {value!r}")

    @model_validator(mode="after")
    def _target_holds_a_micro_batch(self):
        auto = self.auto_target
        if auto.enabled and not auto.min <= self.target_batch_size <= auto.max:
            raise ValueError(f"auto_target: min ({auto.min}) <= start ({self.target_batch_size}) <= max ({auto.max}) "
                             "must hold; fix the bounds or auto_target.start")
        micro = self.micro_batch_size if self.micro_batch_size != "auto" else 1  # auto never exceeds the target
        if auto.enabled and auto.min < micro:
            raise ValueError(f"auto_target.min ({auto.min}) is smaller than micro_batch_size ({self.micro_batch_size})"
                             "; raise auto_target.min")
        lowest = auto.min if auto.enabled else self.target_batch_size
        if self.lr_scaling == "adascale" and self.base_batch > lowest:
            raise ValueError(f"base_batch_size ({self.base_batch}) is above the smallest target ({lowest}); AdaScale "
                             "scales the learning rate up from the base batch: lower base_batch_size")
        if self.target_batch_size < micro:
            raise ValueError(
                f"target_batch_size ({self.target_batch_size}) is smaller than micro_batch_size "
                f"({self.micro_batch_size}); raise training.target_batch_size or lower training.micro_batch_size"
            )
        return self


# averaging.compression's choices (collab.averaging.compression says what each sends)
COMPRESSIONS = ("none", "fp16", "scaled-fp16", "uniform8bit", "quantile8bit", "size-adaptive", "powersgd", "dgc")


class DiLoCoConfig(Section):
    """averaging.mode diloco (collab.modes.diloco): local steps, then the swarm averages where each replica went."""
    outer_lr: float = Field(0.7, gt=0, le=10, description="the outer Nesterov SGD's learning rate (OpenDiLoCo's)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="the outer Nesterov SGD's momentum")
    inner_lr: Optional[float] = Field(None, gt=0, description="the inner AdamW's learning rate (default: "
                                      "training.learning_rate)")
    inner_warmup_steps: int = Field(0, ge=0, le=10**7, description="linear warm-up of the inner learning rate, in "
                                    "this peer's own micro-batches")


GOSSIP_RULES = ("constant", "clock", "loss", "evolutionary")


class GossipConfig(Section):
    """averaging.mode gossip (collab.modes.gossip): no global step; pairwise merges with random peers."""
    mean_local_steps: float = Field(10.0, ge=1, le=10**6, description="local steps between a peer's merges: "
                                    "drawn from a Poisson distribution with this mean (at least 1)")
    interpolation: Literal[GOSSIP_RULES] = Field(
        "evolutionary", description="how far a merge moves toward the peer: constant (the value below); clock "
        "(peer's samples / both's); loss (the lower-loss model weighs more); evolutionary (a random split of the "
        "unit interval, the better model taking the smaller part)")
    constant: float = Field(0.5, ge=0, le=1, description="interpolation constant's factor")
    divergence_threshold: float = Field(0.0, ge=0, le=1e6, description="below this loss, a merge's factor shrinks "
                                        "by loss / threshold (0: off; dpwa's)")
    lr: Optional[float] = Field(None, gt=0, description="the local AdamW's learning rate (default: "
                                "training.learning_rate)")
    warmup_steps: int = Field(0, ge=0, le=10**7, description="linear warm-up of the local learning rate, in this "
                              "peer's own micro-batches")
    max_distance: float = Field(1.0, gt=0, le=100, description="a peer's parameters further than this (relative to "
                                "this replica's norm) are refused: a sign flip is 2, a replica 10x scaled 9")
    exchange_timeout: float = Field(30.0, gt=0, le=3600, description="seconds for one exchange of parameters; a "
                                    "peer that times out is picked less often")
    settle_seconds: float = Field(20.0, ge=0, le=3600, description="at --max-epochs, a peer stops training and keeps "
                                  "merging with the peers still there for up to this long before it saves and "
                                  "leaves, so that the replicas end close (0: leave at once)")
    settle_distance: float = Field(0.002, gt=0, le=1, description="settling ends early after two merges in a row "
                                   "that found the other replica this close (relative to this one's norm)")


class AveragingConfig(Section):
    mode: Literal["sync", "diloco", "gossip"] = Field(
        "sync", description="sync: the swarm averages gradients once per target batch (DeDLOC); diloco: each peer "
        "takes its own inner steps and the swarm averages where they went once per target batch (samples per "
        "outer step), then every replica takes the same outer step (collab.modes.diloco); gossip: each peer trains on "
        "its own and merges its parameters with a random peer's every few steps (collab.modes.gossip)")
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    gossip: GossipConfig = Field(default_factory=GossipConfig)
    matchmaking_time: float = Field(5.0, gt=0, description="seconds spent forming an averaging group")
    group_size: Optional[int] = Field(
        None, ge=2, le=1024, description="begin a round as soon as this many peers joined its group instead of "
        "waiting out matchmaking_time (hivemind's target_group_size; for a swarm of known size)")
    averaging_timeout: float = Field(60.0, gt=0, description="give up an averaging round after this many seconds")
    load_state_timeout: float = Field(120.0, gt=0, description="seconds to download state from a peer")
    next_chunk_timeout: float = Field(
        10.0, gt=0, description="exclude a peer from a round if its next chunk takes longer (busy CPUs, slow links)")
    compression: Literal[COMPRESSIONS] = Field(
        "fp16", description="how gradients travel; see collab.averaging.compression for each choice's bytes and error")
    powersgd_rank: int = Field(4, ge=1, le=256, description="rank of PowerSGD's factors (compression: powersgd)")
    dgc_sparsity: float = Field(0.999, ge=0, lt=1, description="share of each matrix's values dgc leaves out")
    dgc_warmup_epochs: int = Field(4, ge=0, le=10**6, description="collaborative steps over which dgc's sparsity "
                                   "rises exponentially to dgc_sparsity (0: from the first)")
    dgc_momentum: float = Field(0.9, ge=0, lt=1, description="dgc's momentum (the optimizer's is off for the "
                                "matrices dgc sends)")
    overlap: Literal["none", "optimizer", "full"] = Field(
        "none", description="what runs in the background while the next micro-batches compute: nothing (state "
        "rounds always do); the optimizer step; or the gradient all-reduce too (one step of staleness). The "
        "optimizer step alone takes milliseconds (LAMB on ALBERT-tiny 6 ms, ALBERT-base 38 ms on one CPU core) and "
        "the micro-batch computed meanwhile is one step stale, so 'optimizer' is rarely worth it. diloco ignores "
        "it: its outer step replaces the parameters the inner steps work on, so nothing overlaps")
    average_state_every: int = Field(5, gt=0, description="also average parameters every N epochs (repairs drift)")
    bandwidth: Optional[float] = Field(None, gt=0, le=1e6, description="announced upload bandwidth, Mbit/s")
    aggregation: Literal["auto", "mean", "centered_clip", "adasum"] = Field(
        "auto", description="how each part of a round is combined: mean, or centered_clip (bounds what a few bad "
        "peers can do), or adasum (adds what is new in each peer's gradient: sync mode, lossless or 8-bit "
        "codecs; state rounds then use centered_clip); auto: centered_clip in an open run, mean in a private "
        "one (the manifest records which)")
    clip_tau: float = Field(2.0, gt=0, le=100, description="centered_clip's radius, in median distances of the "
                            "parts from their median (honest parts lie within it)")
    clip_iterations: int = Field(5, ge=1, le=100)
    max_weight_ratio: float = Field(10.0, ge=1, le=1e6, description="a peer's averaging weight (its samples) is "
                                    "capped at this many times its group's median")

    @model_validator(mode="after")
    def _diloco_fits(self):
        if self.aggregation == "adasum" and (self.mode != "sync" or self.compression in ("dgc", "powersgd")):
            raise ValueError("averaging.aggregation adasum combines whole gradients of sync mode; it cannot combine "
                             f"{'PowerSGD factors or DGC selections' if self.mode == 'sync' else self.mode + ' rounds'}"
                             ": use mean or centered_clip there")
        if self.mode == "sync":
            return self
        what = "diloco's pseudo-gradients" if self.mode == "diloco" else "gossip's parameters"
        if self.compression in ("dgc", "powersgd"):
            raise ValueError(f"averaging.compression {self.compression} keeps per-round state for gradients and "
                             f"cannot carry {what}; use fp16, uniform8bit or none")
        return self


def round_timeout_caution(averaging: AveragingConfig) -> Optional[str]:
    """A warning for timeouts under which a peer that dies as a round starts makes the round fail on every peer:
    hivemind leaves a silent sender out after next_chunk_timeout (a silent reducer after twice that), and a round
    still waiting at averaging_timeout is given up whole. Allowed (a swarm that never loses peers mid-round), but
    said: a swarm with both at 30 s can lose a whole round to a peer that dies as it starts."""
    if averaging.averaging_timeout > 2 * averaging.next_chunk_timeout:
        return None
    return (f"averaging.averaging_timeout ({averaging.averaging_timeout:g} s) is not over twice "
            f"averaging.next_chunk_timeout ({averaging.next_chunk_timeout:g} s): a round that a peer falls silent "
            "in can be given up on every peer before that peer is left out (after next_chunk_timeout as a sender, "
            "twice that as a reducer); raise averaging_timeout or lower next_chunk_timeout")


def join_request_timeout(matchmaking_time: float) -> float:
    """How long a peer asking another to lead its group waits for the answer. hivemind wants it under
    matchmaking_time (it breaks a rare deadlock of peers asking each other). Not much under: an asker that gives
    up asks again, with the same result, until its round ends, so a leader slower to answer than this (a peer
    whose CPU is busy training) is never joined and both lose the round (tests/swarm/test_matchmaking.py). Likely
    on a CPU-starved machine: a server and its client-mode peer (which can join no one else) fail a round, the
    client's "could not find a group", under a tighter timeout such as min(3, matchmaking_time / 2)."""
    return 0.8 * matchmaking_time


class CheckpointConfig(Section):
    dir: Optional[Path] = None
    every_epochs: int = Field(10, gt=0)
    keep: int = Field(2, ge=1, description="how many checkpoints to keep")


# task.name -> that task's config section; `name` may be left out for the default task, albert
TASK_CONFIGS: dict[str, type[BaseModel]] = {"albert": AlbertTaskConfig, "causal-lm": CausalLmTaskConfig,
                                             "swav": SwavTaskConfig, "linreg": LinregTaskConfig}


def _task_name(value: Any) -> Any:
    return value.get("name", "albert") if isinstance(value, dict) else getattr(value, "name", None)


TaskConfig = Annotated[
    Union[tuple(Annotated[model, Tag(name)] for name, model in TASK_CONFIGS.items())],
    Discriminator(_task_name),
]


class RunConfig(Section):
    task: TaskConfig = Field(default_factory=AlbertTaskConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _noise_scale_is_measured(self):
        # both follow the noise scale, measured on whole gradients of the sync mode's weighted mean
        training, avg = self.training, self.averaging
        wants = ("training.target_batch_size auto" if training.auto_target.enabled else
                 "training.lr_scaling adascale" if training.lr_scaling == "adascale" else None)
        if wants is None:
            return self
        if avg.mode != "sync":
            raise ValueError(f"{wants} follows the gradient noise scale, measured in sync mode only; use a fixed "
                             f"target and lr_scaling none with averaging.mode {avg.mode}")
        if avg.compression in ("dgc", "powersgd") or avg.aggregation == "adasum":
            what = f"averaging.compression {avg.compression}" if avg.aggregation != "adasum" else "adasum"
            raise ValueError(f"{wants} needs the gradient noise scale, which {what} rounds do not measure (no whole "
                             "gradients, or no weighted mean); use fp16 or none and mean or centered_clip")
        return self


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
            raise UserError(f"{flag} does not apply to the {_task_name(raw.get('task', {}))} task of {path}; "
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
        raise UserError(f"config file {path} must hold a mapping of sections (task, training, ...), not {type(raw).__name__}")
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
