"""Network profiles: each simulated peer's link (upload, download, one-way delay, loss, NAT).

A profile is a YAML file in configs/networks/ (or any path): `default` describes every peer's
link, `peers` overrides it for some peer indices. Validated like the run config: one line that
names the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from collab.config import configs_dir
from collab.errors import UserError


class LinkSpec(BaseModel):
    """One peer's access link. None means unlimited (no shaping in that direction)."""

    model_config = ConfigDict(extra="forbid")

    upload_mbit: Optional[float] = Field(None, gt=0, le=100_000)
    download_mbit: Optional[float] = Field(None, gt=0, le=100_000)
    delay_ms: float = Field(0.0, ge=0, le=10_000, description="one-way delay added to what this peer sends")
    loss_percent: float = Field(0.0, ge=0, lt=100)
    # true: the peer's own namespace drops the SYN-ACKs it would send (a stand-in for NAT);
    # "router": the peer sits behind its own router namespace that masquerades (a real NAT, no port forwarding).
    # Either way nobody can dial it, and it runs in client mode.
    nat: Union[bool, Literal["router"]] = Field(
        False, description="behind NAT: true (inbound SYN-ACKs dropped) or 'router' (its own masquerading router)")

    def describe(self) -> str:
        rate = lambda v: "unlimited" if v is None else f"{v:g} Mbit/s"  # noqa: E731
        parts = [f"up {rate(self.upload_mbit)}", f"down {rate(self.download_mbit)}"]
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g} ms")
        if self.loss_percent:
            parts.append(f"loss {self.loss_percent:g}%")
        if self.nat == "router":
            parts.append("NAT (own router, masquerade)")
        elif self.nat:
            parts.append("NAT")
        return ", ".join(parts)


class NetworkProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    default: LinkSpec = Field(default_factory=LinkSpec)
    peers: dict[int, dict] = Field(default_factory=dict, description="peer index -> fields that differ from default")

    def link(self, index: int) -> LinkSpec:
        return LinkSpec.model_validate({**self.default.model_dump(), **self.peers.get(index, {})})

    def links(self, num_peers: int) -> list[LinkSpec]:
        return [self.link(i) for i in range(num_peers)]


def profiles_dir() -> Path:
    return configs_dir() / "networks"


def profile_names() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def load_profile(name_or_path: str) -> NetworkProfile:
    """A shipped profile by name (datacenter, home-broadband, mixed, ...) or a YAML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = profiles_dir() / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise UserError(f"--profile {name_or_path!r} is neither a file nor a shipped profile; "
                        f"use one of: {', '.join(profile_names())}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"network profile {path} is not valid YAML; fix the syntax") from None
    if not isinstance(raw, dict):
        raise UserError(f"network profile {path} must be a mapping with 'default' and 'peers'")
    try:
        profile = NetworkProfile.model_validate(raw)
    except ValidationError as e:
        raise UserError(_describe(path, e)) from None
    for index in profile.peers:  # check each override now, not when its peer starts
        if index < 0:
            raise UserError(f"network profile {path}: peers.{index}: a peer index must be >= 0")
        try:
            profile.link(index)
        except ValidationError as e:
            raise UserError(_describe(path, e, prefix=f"peers.{index}.")) from None
    return profile


def _describe(path: Path, error: ValidationError, prefix: str = "") -> str:
    err = error.errors()[0]
    field = prefix + ".".join(str(p) for p in err["loc"])
    return f"network profile {path}: {field}: {err['msg'].lower()}, got {err.get('input')!r}; fix it in the profile"
