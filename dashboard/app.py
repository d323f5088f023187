"""Serve: the page, the JSON API and Prometheus metrics, all read from the collector's cache."""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from collab.dashboard.collector import Collector
from collab.dashboard.snapshot import (DEFAULT_PAGE, MAX_PAGE, SORT_KEYS, BadQuery, DashboardRun, Snapshot,
                                      parse_page_query)

STATIC = Path(__file__).resolve().parent / "static"


class RunMetrics:
    """A prometheus-client collector that renders the current snapshot at scrape time."""

    def __init__(self, collector: Collector):
        self.collector = collector

    def collect(self):
        s: DashboardRun = self.collector.snapshot
        if s is None:
            return
        labels = ["run_id"]
        for name, doc, value in (
            ("collab_global_epoch", "Global epoch (collaborative optimizer steps) of the run", s.global_epoch),
            ("collab_samples_accumulated", "Samples accumulated toward the next step", s.samples_accumulated),
            ("collab_target_batch_size", "Samples per collaborative step", s.target_batch_size or 0),
            ("collab_samples_per_second", "Swarm throughput", s.samples_per_second),
            ("collab_peers_online", "Peers that published recently", s.peers_online),
            ("collab_dashboard_peers_not_listed", "Peers over the dashboard's cap: in its figures, not in its peer "
             "list, its per-peer series or the per-peer metrics below", s.peers_not_listed),
            ("collab_rejected_records", "Other peers' records dropped as untrusted in the last read",
             s.rejected_records),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([s.run_id], float(value))
            yield family
        for name, doc, value in (
            ("collab_goodput", "Samples/s times their statistical efficiency at the target (Pollux)", s.goodput),
            ("collab_statistical_efficiency", "(B_noise + base batch) / (B_noise + target)", s.efficiency),
            ("collab_lr_gain", "AdaScale's learning-rate gain the run follows", s.lr_gain),
            ("collab_progress_steps", "The schedule's position, in scale-invariant steps", s.progress_steps),
            ("collab_eta_to_end_seconds", "Seconds until the schedule's end at the current pace", s.eta_to_end_seconds),
        ):
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=labels)
                family.add_metric([s.run_id], float(value))
                yield family
        if s.noise_scale is not None:
            family = GaugeMetricFamily("collab_gradient_noise_scale", "B_noise in samples: the batch at which a "
                                       "gradient's noise equals its signal (compare collab_target_batch_size)",
                                       labels=labels)
            family.add_metric([s.run_id], float(s.noise_scale))
            yield family
        family = GaugeMetricFamily("collab_rejected_records_by_reason",
                                   "Records dropped in the last read, by why (forged id, future time, ...)",
                                   labels=["run_id", "reason"])
        for reason, count in s.rejected_by_reason.items():
            family.add_metric([s.run_id, reason], float(count))
        yield family
        per_peer = {
            "collab_peer_samples_per_second": ("Peer throughput", lambda p: p.samples_per_second),
            "collab_peer_epoch": ("Peer's local epoch", lambda p: p.epoch),
            "collab_peer_samples_contributed": ("Samples a peer contributed", lambda p: p.samples_contributed),
            "collab_peer_loss": ("Peer's mean loss over its last epoch", lambda p: p.loss),
            "collab_peer_mb_per_round": ("MB a peer sent and received per gradient round (its recent rounds)",
                                         lambda p: p.mb_per_round),
            "collab_peer_fewer_bytes_than_fp32": ("How many times fewer bytes than the same rounds in fp32",
                                                  lambda p: p.fewer_bytes_than_fp32),
            "collab_peer_batches_dropped": ("Micro-batches a peer did not send (non-finite loss or gradients)",
                                            lambda p: p.batches_dropped),
            "collab_peer_contributions_rejected": ("What other peers refused from this peer (parts, averages, "
                                                   "states), summed over them", lambda p: p.contributions_rejected),
            "collab_peer_reported_by": ("How many other peers refused something from this peer",
                                        lambda p: p.reported_by),
            "collab_peer_suspect": ("1 if at least half of the other peers refused something from this peer",
                                    lambda p: p.suspect),
        }
        for name, (doc, get) in per_peer.items():
            family = GaugeMetricFamily(name, doc, labels=["run_id", "peer_id", "client_mode"])
            for p in s.peers:
                value = get(p)
                if value is not None:
                    family.add_metric([s.run_id, p.peer_id, str(p.client_mode).lower()], float(value))
            yield family


def accepts_gzip(headers) -> bool:
    return any(name == b"accept-encoding" and b"gzip" in value.lower() for name, value in headers)


JSON = (b"content-type", b"application/json")


def run_response(view: Snapshot, query_string: str, gzip_ok: bool) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """GET /api/run from the snapshot's bytes: all of it (gzipped when the client takes it), one page of its peers
    (?offset=&limit=&sort=&order=), or a 422 that says which parameter to fix."""
    if not query_string:
        body = view.full_gzip if gzip_ok else view.full_json
        encoding = [(b"content-encoding", b"gzip")] if gzip_ok else []
        return 200, [JSON, *encoding, (b"vary", b"accept-encoding"), (b"content-length", str(len(body)).encode())], body
    return view.remembered(query_string, lambda: page_response(view, query_string))


def page_response(view: Snapshot, query_string: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    try:
        body, status = view.page_json(parse_page_query(query_string)), 200
    except BadQuery as e:
        body, status = json.dumps({"detail": str(e)}).encode(), 422
    return status, [JSON, (b"content-length", str(len(body)).encode())], body


class CachedRunStateFastPath:
    """GET /api/run answered from the cached bytes before FastAPI's routing and response objects.

    It is the route every open page polls; under load those per-request layers were most of the
    server's CPU. The FastAPI route below stays for /docs and answers 503 before the first snapshot.
    """

    def __init__(self, app, collector: Collector):
        self.app, self.collector = app, collector

    async def __call__(self, scope, receive, send):
        view = self.collector.view
        if (view is None or scope["type"] != "http" or scope["path"] != "/api/run"
                or scope["method"] not in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        status, headers, body = run_response(view, scope["query_string"].decode("latin-1"),
                                             accepts_gzip(scope["headers"]))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})


def create_app(collector: Collector, manage_collector: bool = True) -> FastAPI:
    """The dashboard app. With manage_collector, the app starts and stops the collector with itself."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_collector:
            collector.start()
        try:
            yield
        finally:
            if manage_collector:
                collector.stop()

    app = FastAPI(title="collab dashboard", description="Who trains, how fast, and how far the run has come.",
                  lifespan=lifespan)
    app.add_middleware(CachedRunStateFastPath, collector=collector)
    registry = CollectorRegistry()
    registry.register(RunMetrics(collector))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def not_ready() -> JSONResponse:
        detail = "no snapshot of the run yet: the collector is still reading the swarm; retry in a few seconds"
        if collector.last_error:
            detail += f" (last error: {collector.last_error})"
        return JSONResponse({"detail": detail}, status_code=503)

    @app.get("/", include_in_schema=False)
    def page():
        return FileResponse(STATIC / "index.html")

    @app.exception_handler(RequestValidationError)
    async def one_line_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is a list of error objects; a person (or a script's log) needs one line
        problems = "; ".join(f"{' '.join(str(part) for part in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
                             for e in exc.errors())
        return JSONResponse({"detail": f"{problems} (see /docs for {request.url.path})".replace("\n", " ")},
                            status_code=422)

    @app.get("/api/run", response_model=DashboardRun, summary="The run state (as `collab status --json`, and figures "
             "over every peer); with offset, limit, sort or order, one page of its peers")
    async def run_state(
        request: Request,
        offset: Optional[str] = Query(None, description="first peer of the page, from 0"),
        limit: Optional[str] = Query(None, description=f"peers in the page, 1 to {MAX_PAGE} (default {DEFAULT_PAGE})"),
        sort: Optional[str] = Query(None, description=f"one of {', '.join(SORT_KEYS)} (default peer_id)"),
        order: Optional[str] = Query(None, description="asc (default) or desc; missing values sort last"),
    ):
        # normally answered by CachedRunStateFastPath; here before the first snapshot, with the same parsing
        view = collector.view
        if view is None:
            try:
                parse_page_query(request.url.query)
            except BadQuery as e:
                return JSONResponse({"detail": str(e)}, status_code=422)
            return not_ready()
        status, headers, body = run_response(view, request.url.query, accepts_gzip(request.scope["headers"]))
        return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})

    @app.get("/api/history", summary="The run over time: epoch, samples/s, peers online, median loss")
    def history():
        return {"run_id": collector.run_id, "interval_seconds": collector.interval, "points": collector.history_json()}

    @app.get("/api/peers/{peer_id}", summary="One peer over time")
    def peer(peer_id: str):
        points = collector.peer_json(peer_id)
        if points is None:
            return JSONResponse({"detail": f"unknown peer id '{peer_id[:80]}'; GET /api/run lists the run's peers"},
                                status_code=404)
        view = collector.view
        current = view.by_id.get(peer_id) if view is not None else None
        return {"peer_id": peer_id, "current": current.model_dump() if current else None, "points": points}

    @app.get("/metrics", summary="Prometheus exposition format")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness, and how old the snapshot is")
    def healthz():
        age = None if collector.snapshot_time is None else time.time() - collector.snapshot_time
        return {"status": "ok", "snapshot_age_seconds": age, "collections": collector.collections,
                "last_error": collector.last_error, "peer_histories": len(collector.peer_history),
                "peer_histories_dropped": collector.peer_histories_dropped, "max_peers": collector.max_peers}

    return app
