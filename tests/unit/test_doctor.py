"""`collab doctor`'s verdicts and rendering (collab.commands.doctor): each check's status and the fix it names, the
table and the JSON."""

from __future__ import annotations

import json

from collab.commands.doctor import (Check, Report, bandwidth_check, clock_check, disk_check, initial_peer_check,
                                    reachability_check, render_json, render_table, torch_check, versions_check)
from collab.swarm.reachability import Bandwidth, Reachability

ADDRESS = "/ip4/203.0.113.7/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_every_warning_and_failure_says_what_to_do():
    checks = [
        initial_peer_check(ADDRESS, None, "refused"), initial_peer_check(ADDRESS, None, "timed out"),
        initial_peer_check(ADDRESS, None, "unreachable (No route to host)"),
        clock_check(None, [], 3.0), clock_check(1.5, [0.1], 3.0), clock_check(-4.0, [0.1], 3.0),
        bandwidth_check(None), bandwidth_check(Bandwidth(peer="QmX", download_mbps=50.0, upload_mbps=2.5)),
        torch_check("2.13.0+cpu", None, None, None), torch_check("2.13.0+cpu", None, None, "cuda"),
        disk_check("/c", 0.5, 0.0, None), disk_check("/c", 5.0, 0.2, 20.0),
        versions_check("0.2.1", "1.1.11", None), versions_check("0.2.1", "1.1.12", "0.3.0"),
        reachability_check(Reachability(verdict="not reachable", reason="not reachable on 31337 from 4 of 5 peers: "
                                        "forward TCP 31337 or pass --announce-maddrs", ports=[31337], asked=5,
                                        answered=5, connected=1, observed=[])),
    ]
    for check in checks:
        assert check.status in ("warn", "fail") and check.fix, check


def test_an_initial_peer_that_refuses_or_times_out_is_named_with_the_checks_to_make():
    refused = initial_peer_check(ADDRESS, None, "refused")
    assert refused.status == "fail" and refused.detail == f"{ADDRESS}: refused (203.0.113.7:31337)"
    assert "nothing listens on 203.0.113.7:31337" in refused.fix
    slow = initial_peer_check(ADDRESS, None, "timed out")
    assert "TCP 31337" in slow.fix and "nc -vz 203.0.113.7 31337" in slow.fix
    reached = initial_peer_check(ADDRESS, 12.5, None)
    assert reached.status == "ok" and reached.data == dict(address=ADDRESS, reached=True, ms=12.5, error=None)


def test_clock_skew_fails_past_hivemind_bound():
    assert clock_check(0.2, [0.05, 0.02], 3.0).status == "ok"
    assert clock_check(0.2, [0.05, 0.02], 3.0).data == dict(skew_s=0.2, peers=2, rtt_ms=20.0)
    assert clock_check(-2.0, [0.05], 3.0).status == "warn"
    late = clock_check(3.5, [0.05], 3.0)
    assert late.status == "fail" and "behind" in late.detail and "at most 3 s" in late.detail


def test_no_gpu_is_a_warning_unless_cuda_was_asked_for():
    cpu = torch_check("2.13.0+cpu", None, None, None)
    assert cpu.status == "warn" and "no GPU: trains on CPU" in cpu.detail
    assert torch_check("2.13.0+cpu", None, None, "cpu").status == "ok"
    assert torch_check("2.13.0", "12.4", None, "cuda").status == "fail"
    gpu = torch_check("2.13.0", "12.4", dict(name="NVIDIA H100", memory_gb=79.6, bf16=True, count=2), None)
    assert gpu.status == "ok" and "NVIDIA H100, 79.6 GiB, bf16 yes (+1 more: --gpus all)" in gpu.detail


def test_disk_against_what_the_run_needs_and_the_cache_budget():
    assert disk_check("/c", 50.0, 0.2, 20.0).status == "ok"
    assert disk_check("/c", 0.1, 0.0, None).status == "fail"  # not even room for the tokenizer and checkpoints
    tight = disk_check("/c", 10.0, 0.2, 20.0)
    assert tight.status == "warn" and "--data-cache-gb 8" in tight.fix
    assert disk_check("/c", 2.0, 3.0, 20.0).status == "fail"


def test_a_slow_uplink_is_told_which_bandwidth_to_announce():
    slow = bandwidth_check(Bandwidth(peer="QmPeer", download_mbps=120.4, upload_mbps=4.26))
    assert slow.status == "warn" and slow.fix.startswith("pass --bandwidth 4.3 ")
    assert "download 120, upload 4.26 Mbit/s" in slow.detail
    assert bandwidth_check(Bandwidth(peer="QmPeer", download_mbps=95.0, upload_mbps=40.0)).status == "ok"
    failed = bandwidth_check(Bandwidth(peer="QmPeer", error="rate-limited"))
    assert failed.status == "warn" and "rate-limited" in failed.detail
    half = bandwidth_check(Bandwidth(peer="QmPeer", upload_mbps=40.0, error="download: IncompleteReadError"))
    assert half.status == "warn" and "download ?, upload 40" in half.detail and "IncompleteReadError" in half.detail


def test_a_client_is_never_dialled_and_public_is_ok():
    assert reachability_check(None).data == {"verdict": "client"}
    public = Reachability(verdict="public", reason="reachable on TCP 31337 from 3 of 3 peers", ports=[31337],
                          asked=3, answered=3, connected=3, observed=[])
    assert reachability_check(public).status == "ok"


def _report() -> Report:
    checks = [Check(name="torch", status="warn", detail="no GPU: trains on CPU", fix="get a GPU"),
              Check(name="initial peer", status="fail", detail=f"{ADDRESS}: refused", fix="ask for a new line"),
              Check(name="disk", status="ok", detail="50 GB free")]
    return Report(run_id="r", ready=False, checks=checks)


def test_the_table_aligns_its_columns_and_ends_with_the_verdict():
    lines = render_table(_report()).splitlines()
    assert lines[0] == "warn  torch         no GPU: trains on CPU"
    assert lines[1] == "                    -> get a GPU"
    assert lines[2] == f"FAIL  initial peer  {ADDRESS}: refused"
    assert lines[4] == "ok    disk          50 GB free"
    assert lines[-1] == f"not ready: {ADDRESS}: refused"
    ok = Report(run_id="r", ready=True, checks=[Check(name="disk", status="ok", detail="fine")])
    assert render_table(ok).splitlines()[-1] == "ready: this peer can train"


def test_the_json_is_the_report():
    data = json.loads(render_json(_report()))
    assert data["ready"] is False and [c["status"] for c in data["checks"]] == ["warn", "fail", "ok"]
    assert Report.model_validate(data) == _report()
