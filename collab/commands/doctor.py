"""`collab doctor [join-line flags]`: is this machine ready to train with the swarm its join line names?

It takes the join line as it is (the same flags, collab.commands.join) and checks, in this order: the machine (torch,
the GPU, free disk for the data cache, versions), then each initial peer over plain TCP, then, through a DHT node of
its own, the run's manifest, whether swarm peers can dial this peer back, its clock against theirs and its link's
speed (collab.swarm.probe). Every line that fails or warns says what to do; exit 0 when the peer can train, 1 when
it cannot, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from typing import Literal, Optional

from pydantic import BaseModel, Field

from collab.commands import join
from collab.config import check_run_id
from collab.errors import UserError
from collab.swarm.dial import reach_all, tcp_target, what_to_check, why_not_joined

# hivemind and torch are imported inside the checks that need them: a flag mistake is reported at once

logger = logging.getLogger(__name__)
MANIFEST_TIMEOUT = 20.0
MIN_FREE_GB = 1.0  # tokenizer, checkpoints and logs, even for a run without token shards
SLOW_UPLOAD_MBPS = 10.0  # below this an all-reduce part waits on this peer: announce it with --bandwidth
SKEW_WARN = 1.0  # seconds; hivemind's bound is collab.swarm.reachability.MAX_SKEW


class Check(BaseModel):
    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: Optional[str] = None  # what to do, on every warn and fail
    data: dict = Field(default_factory=dict)  # the measurements, for --json readers


class Report(BaseModel):
    run_id: Optional[str]
    ready: bool
    checks: list[Check]


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check that this machine is ready to join a run",
                       description="Check a volunteer's readiness with the same flags as its join line: the initial "
                                   "peers, reachability, clock, bandwidth, torch and the GPU, disk, versions. Exit 0 "
                                   "when the peer can train, 1 when it cannot.")
    join.add_join_flags(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(run=run, hard_exit=True)


def run(args: argparse.Namespace) -> int:
    from collab.process.lifecycle import reap_children

    try:
        report = diagnose(args)
    finally:
        reap_children()
    print(render_json(report) if args.json else render_table(report), flush=True)
    return 0 if report.ready else 1


def diagnose(args: argparse.Namespace) -> Report:
    run_id, manifest, peer = _flags(args)
    checks = [_torch_check(args.device), *_listen_checks(peer.host_maddrs)]
    listens = all(c.status != "fail" for c in checks[1:])  # else a DHT node would only say so less clearly
    if peer.initial_peers:
        reached = _initial_peers(peer.initial_peers)
        checks += reached
        usable = [maddr for check, maddr in zip(reached, peer.initial_peers) if check.status == "ok"]
        if usable and listens:
            found, manifest = _swarm_checks(args, peer.model_copy(update={"initial_peers": usable}), run_id)
            checks += found
    elif args.run_dir is None:
        checks.append(Check(name="swarm", status="warn", detail="no --initial-peers: no swarm to check",
                            fix="pass your join line's --initial-peers to check the swarm too"))
    checks.append(_disk_check(manifest, args.data_cache_gb))
    checks.append(_versions_check(manifest))
    return Report(run_id=run_id, ready=all(c.status != "fail" for c in checks), checks=checks)


def _flags(args: argparse.Namespace):
    """The run id, the organizer's manifest (--run DIR) and the peer config; a bad flag is a UserError (exit 2)."""
    from collab.swarm.node import peer_config_from_flags

    manifest = None
    if args.run_dir is not None:
        from collab.run.folder import load_run_folder

        manifest = load_run_folder(args.run_dir).manifest
    run_id = args.run_id or (manifest.run_id if manifest is not None else None)
    if run_id is None:
        raise UserError("the following arguments are required: --run-id (pass your whole join line)")
    if args.data_cache_gb is not None and not args.data_cache_gb > 0:
        raise UserError(f"--data-cache-gb {args.data_cache_gb} must be a positive number of gigabytes")
    flags = dict(run_id=check_run_id(run_id), initial_peers=args.initial_peers, announce_maddrs=args.announce_maddrs,
                 client_mode=args.client_mode, identity=args.identity)
    if args.host_maddrs:
        flags["host_maddrs"] = args.host_maddrs
    return run_id, manifest, peer_config_from_flags(**flags)


def _listen_checks(host_maddrs: list[str]) -> list[Check]:
    """A fixed port in --host-maddrs must be free (a join already running on it holds it)."""
    from collab.process.ports import require_free_port

    checks = []
    for maddr in host_maddrs:
        target = tcp_target(maddr)
        if target is None or target[1] == 0 or not maddr.startswith("/ip4/"):
            continue
        try:
            require_free_port(target[1], "--host-maddrs", target[0])
        except UserError as e:
            checks.append(Check(name="listen", status="fail", detail=str(e).partition("; ")[0], data=dict(maddr=maddr),
                                fix="stop what listens there (a collab join still running?) or pass another port"))
            continue
        checks.append(Check(name="listen", status="ok", detail=f"TCP {target[1]} is free on {target[0]}",
                            data=dict(maddr=maddr)))
    return checks


def initial_peer_check(maddr: str, ms: Optional[float], error: Optional[str]) -> Check:
    target = tcp_target(maddr)
    where = f"{target[0]}:{target[1]}" if target else maddr
    data = dict(address=maddr, reached=error is None, ms=ms, error=error)
    if error is None:
        return Check(name="initial peer", status="ok", detail=f"{maddr}: reached in {ms:g} ms", data=data)
    return Check(name="initial peer", status="fail", detail=f"{maddr}: {error} ({where})",
                 fix=what_to_check(maddr, error), data=data)


def _initial_peers(maddrs: list[str]) -> list[Check]:
    checks = []
    for maddr, (ms, error) in zip(maddrs, reach_all(maddrs)):
        if tcp_target(maddr) is None:  # a relayed or other transport address: the DHT node will try it
            checks.append(Check(name="initial peer", status="ok", detail=f"{maddr}: not a TCP address, not checked",
                                data=dict(address=maddr, reached=None)))
        else:
            checks.append(initial_peer_check(maddr, ms, error))
    return checks


def _swarm_checks(args: argparse.Namespace, peer, run_id: str):
    """Through a DHT node of this peer's own: the manifest, the dial-back, the clocks and the bandwidth."""
    from collab.run.credentials import credentials_from_flags
    from collab.swarm.node import Swarm

    credentials = credentials_from_flags(args, run_id)
    try:
        swarm = Swarm(peer, credentials.identity, authorizer=credentials.authorizer())
    except UserError as e:
        logger.debug("the DHT node did not start: %s", e)  # p2pd's raw text: for the debug log only
        if "is private" in str(e):  # the run refuses this peer: its words say how to get in
            detail, _, fix = str(e).partition(". ")
            return [Check(name="swarm", status="fail", detail=detail, fix=fix or None)], None
        detail, _, fix = why_not_joined(peer.initial_peers).partition(": ")
        return [Check(name="swarm", status="fail", detail=detail, fix=f"{fix} (COLLAB_DEBUG_LOGGERS=collab.commands."
                      "doctor shows p2pd's own words)")], None
    try:
        return _through(swarm, args, run_id, credentials.run_key)
    finally:
        swarm.shutdown()


def _through(swarm, args: argparse.Namespace, run_id: str, run_key: Optional[str]):
    from collab.run.sharing import fetch_manifest
    from collab.swarm import reachability as probes

    checks, manifest = [], None
    try:
        manifest, _, _ = fetch_manifest(swarm.dht, run_id, run_key, timeout=MANIFEST_TIMEOUT)
        checks.append(Check(name="manifest", status="ok", detail=f"run {run_id!r}, key {manifest.fingerprint}",
                            data=dict(fingerprint=manifest.fingerprint, collab_version=manifest.collab_version)))
    except UserError as e:
        checks.append(Check(name="manifest", status="fail", detail=str(e).split(";")[0], fix=str(e)))
    peers = probes.peers_to_ask(swarm)
    checks.append(reachability_check(None if swarm.peer.client_mode else probes.ask_to_dial_back(swarm, peers)))
    samples = probes.measure_clocks(swarm.dht, peers)
    checks.append(clock_check(probes.typical_skew(samples), [s.rtt for s in samples], probes.MAX_SKEW))
    answering = [s.peer for s in samples] or peers[:1]
    bandwidth = probes.measure_bandwidth(swarm.dht, answering[0]) if answering else None
    checks.append(bandwidth_check(bandwidth))
    return checks, manifest


def reachability_check(found) -> Check:
    """`found`: a collab.swarm.reachability.Reachability, or None for a client-mode peer (never dialled)."""
    if found is None:
        return Check(name="reachability", status="ok", detail="client mode: you connect out, nobody needs to reach "
                     "you", data=dict(verdict="client"))
    data = found.model_dump()
    nat = f"; {found.nat}" if found.nat else ""
    if found.verdict == "public":
        return Check(name="reachability", status="ok", detail=found.reason + nat, data=data)
    detail, _, fix = found.reason.partition(": ")
    detail += nat
    if found.verdict == "not reachable":  # it trains all the same: `collab join` then joins as a client by itself
        fix += "; until then collab join runs this peer in client mode (it trains; others reduce its parts)"
    return Check(name="reachability", status="warn", detail=detail, fix=fix or None, data=data)


def clock_check(skew: Optional[float], rtts: list[float], max_skew: float) -> Check:
    if skew is None:
        return Check(name="clock", status="warn", detail="no swarm peer answered the clock probe",
                     fix="cannot compare clocks: make sure this machine syncs its clock (NTP)", data={})
    data = dict(skew_s=round(skew, 3), peers=len(rtts), rtt_ms=round(min(rtts) * 1000, 1))
    detail = f"{abs(skew):.2f} s {'behind' if skew > 0 else 'ahead of'} the swarm (median of {len(rtts)} peer{'s' * (len(rtts) > 1)})"
    fix = ("sync this machine's clock: 'timedatectl set-ntp true' (Linux), 'sntp -sS time.apple.com' (macOS), or "
           "Settings > Time > Sync now (Windows)")
    if abs(skew) > max_skew:
        return Check(name="clock", status="fail", detail=f"{detail}: hivemind assumes at most {max_skew:g} s",
                     fix=fix, data=data)
    if abs(skew) > SKEW_WARN:
        return Check(name="clock", status="warn", detail=detail, fix=fix, data=data)
    return Check(name="clock", status="ok", detail=detail, data=data)


def bandwidth_check(found) -> Check:
    """`found`: a collab.swarm.reachability.Bandwidth, or None when no peer could be asked."""
    if found is None or (found.download_mbps is None and found.upload_mbps is None):
        why = found.error if found is not None and found.error else "no swarm peer to measure against"
        return Check(name="bandwidth", status="warn", detail=f"not measured: {why}",
                     fix="run 'collab doctor' again later; without a measure, pass --bandwidth with your uplink's "
                         "Mbit/s", data={})
    data = found.model_dump()
    detail = (f"download {_mbit(found.download_mbps)}, upload {_mbit(found.upload_mbps)} Mbit/s to "
              f"{found.peer[:12]}...")
    if found.download_mbps is None or found.upload_mbps is None:
        return Check(name="bandwidth", status="warn", detail=f"{detail}: {found.error or 'not measured'}", data=data,
                     fix="run 'collab doctor' again later to measure both directions")
    if found.upload_mbps < SLOW_UPLOAD_MBPS:
        return Check(name="bandwidth", status="warn", detail=detail, data=data,
                     fix=f"pass --bandwidth {max(found.upload_mbps, 0.1):.2g} so that your part of each average is "
                         "smaller and the swarm does not wait on your uplink")
    return Check(name="bandwidth", status="ok", detail=detail, data=data)


def _mbit(value: Optional[float]) -> str:
    return "?" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _torch_check(device: Optional[str]) -> Check:
    try:
        import torch
    except ImportError:
        return Check(name="torch", status="fail", detail="torch is not installed",
                     fix="python3 -m pip install torch (the CUDA build on a machine with an NVIDIA GPU)")
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = dict(name=props.name, memory_gb=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                   count=torch.cuda.device_count())
    return torch_check(torch.__version__, torch.version.cuda, gpu, device)


def torch_check(version: str, cuda: Optional[str], gpu: Optional[dict], device: Optional[str]) -> Check:
    """`gpu`: the first GPU torch sees ({name, memory_gb, bf16, count}), or None."""
    data = dict(torch=version, cuda=cuda, gpu=gpu, device=device or "auto")
    if gpu is not None:
        more = f" (+{gpu['count'] - 1} more: --gpus all)" if gpu.get("count", 1) > 1 else ""
        detail = (f"torch {version}, GPU {gpu['name']}, {gpu['memory_gb']:g} GiB, bf16 "
                  f"{'yes' if gpu['bf16'] else 'no (fp16 with loss scaling)'}{more}")
        if device == "cpu":
            return Check(name="torch", status="warn", detail=f"{detail}; --device cpu leaves it idle",
                         fix="drop --device cpu to train on the GPU", data=data)
        return Check(name="torch", status="ok", detail=detail, data=data)
    build = "a CPU build of torch" if cuda is None else f"torch built for CUDA {cuda}, but no GPU is visible"
    if device == "cuda":
        return Check(name="torch", status="fail", detail=f"--device cuda, and torch {version} sees no GPU ({build})",
                     fix="install torch's CUDA build and the NVIDIA driver (nvidia-smi must list the GPU), or drop "
                         "--device cuda", data=data)
    if device == "cpu":
        return Check(name="torch", status="ok", detail=f"torch {version}: trains on CPU (--device cpu)", data=data)
    return Check(name="torch", status="warn", detail=f"torch {version}, no GPU: trains on CPU ({build})",
                 fix="a GPU trains many times faster: on a machine with an NVIDIA GPU install torch's CUDA build "
                     "(https://pytorch.org/get-started)", data=data)


def _disk_check(manifest, data_cache_gb: Optional[float]) -> Check:
    from collab.data.cache import cache_dir
    from collab.run.joining import DATA_CACHE_GB

    need = 0
    if manifest is not None and manifest.data is not None:
        from collab.data.feed import AHEAD
        from collab.run.shard_fetch import max_shard_bytes, shard_infos

        need = (AHEAD + 2) * max(max_shard_bytes(info.tokens) for info in shard_infos(manifest.data))
    folder = cache_dir()
    budget = data_cache_gb if data_cache_gb is not None else DATA_CACHE_GB
    return disk_check(str(folder), shutil.disk_usage(folder).free / 1e9, need / 1e9,
                      budget if need else None)


def disk_check(folder: str, free_gb: float, need_gb: float, budget_gb: Optional[float]) -> Check:
    """`need_gb`: what the run's shards need at the least (the one read and those fetched ahead); `budget_gb`: what
    the shard cache may grow to (None: the run has no shards to cache)."""
    data = dict(cache=folder, free_gb=round(free_gb, 2), need_gb=round(need_gb, 3), budget_gb=budget_gb)
    least = max(need_gb, MIN_FREE_GB)
    detail = f"{free_gb:.1f} GB free for the data cache ({folder})"
    if free_gb < least:
        return Check(name="disk", status="fail", detail=f"{detail}; the run needs at least {least:.2g} GB",
                     fix="free disk space there, or set COLLAB_CACHE_DIR to a folder on a larger disk", data=data)
    if budget_gb is not None and free_gb < budget_gb:
        return Check(name="disk", status="warn", detail=f"{detail}, less than the {budget_gb:g} GB the shard cache "
                     "may take", fix=f"pass --data-cache-gb {max(least, free_gb * 0.8):.2g} (or set COLLAB_CACHE_DIR "
                     "to a larger disk)", data=data)
    return Check(name="disk", status="ok", detail=detail, data=data)


def _versions_check(manifest) -> Check:
    import hivemind

    import collab

    return versions_check(collab.__version__, hivemind.__version__,
                          manifest.collab_version if manifest is not None else None)


PINNED_HIVEMIND = "1.1.12"  # pyproject.toml's pin: collab's hooks into hivemind are written against it


def versions_check(ours: str, hivemind_version: str, run_version: Optional[str]) -> Check:
    data = dict(collab=ours, hivemind=hivemind_version, run=run_version)
    detail = f"collab {ours}, hivemind {hivemind_version}" + (f"; the run's manifest: collab {run_version}"
                                                               if run_version else "")
    if hivemind_version != PINNED_HIVEMIND:
        return Check(name="versions", status="warn", detail=detail, data=data,
                     fix=f"collab is made for hivemind {PINNED_HIVEMIND}: python3 -m pip install "
                         f"hivemind=={PINNED_HIVEMIND}")
    if run_version and run_version.split(".")[:2] != ours.split(".")[:2]:
        return Check(name="versions", status="warn", detail=detail, data=data,
                     fix=f"install the run's collab version ({run_version}) if joining fails")
    return Check(name="versions", status="ok", detail=detail, data=data)


def render_json(report: Report) -> str:
    return json.dumps(report.model_dump(mode="json"), indent=2)


MARKS = {"ok": "ok", "warn": "warn", "fail": "FAIL"}


def render_table(report: Report) -> str:
    """One aligned line per check, its fix under it; the last line is the verdict and, if not ready, why."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = []
    for check in report.checks:
        lines.append(f"{MARKS[check.status]:<5} {check.name:<{width}}  {check.detail}")
        if check.fix:
            lines.append(f"{'':<5} {'':<{width}}  -> {check.fix}")
    failed = [c for c in report.checks if c.status == "fail"]
    warned = sum(c.status == "warn" for c in report.checks)
    if failed:
        lines.append(f"not ready: {failed[0].detail}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
    else:
        lines.append("ready: this peer can train" + (f" ({warned} warning{'s' * (warned > 1)} above)" if warned else ""))
    return "\n".join(lines)
