"""Prometheus metrics and the /healthz endpoint, served on 127.0.0.1:<[metrics] port>.

/healthz -> {"status": "ok"|"degraded", "version", "uptime_s", "readings", "last_inference_age_s",
             "bundle", ...}; HTTP 200 when ok, 503 otherwise.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.readings = Counter("zeroedge_readings", "Readings committed to the spool", registry=r)
        self.processed = Counter("zeroedge_readings_processed", "Readings processed by inference", registry=r)
        self.dead = Counter("zeroedge_dead_letters", "Readings rejected to the dead-letter table",
                            ["reason"], registry=r)
        self.alerts = Counter("zeroedge_alerts", "Fault alarms raised (rising edges)", registry=r)
        self.inferences = Counter("zeroedge_inferences", "Windows run through the model", registry=r)
        buckets = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5)
        self.window_latency = Histogram("zeroedge_window_latency_seconds",
                                        "Reading committed -> its result written", buckets=buckets, registry=r)
        self.infer_latency = Histogram("zeroedge_inference_latency_seconds",
                                       "One model call (a batch of windows)", buckets=buckets, registry=r)
        self.pending = Gauge("zeroedge_spool_pending", "Readings in the spool not yet processed", registry=r)
        self.streams = Gauge("zeroedge_streams", "Streams with state", registry=r)
        self.kv_bytes = Gauge("zeroedge_kv_memory_bytes", "Per-stream state memory by KV tier", ["tier"], registry=r)
        self.migrations = Counter("zeroedge_kv_migrations", "KV page migrations between tiers", registry=r)
        self.rss = Gauge("zeroedge_resident_memory_bytes", "Resident set size of the daemon", registry=r)
        self.connected = Gauge("zeroedge_source_connected", "1 when the source is connected", registry=r)
        for t in ("hot", "compressed", "cold"):
            self.kv_bytes.labels(t).set(0)
        from zeroedge.daemon.spool import REASONS
        for reason in REASONS:
            self.dead.labels(reason)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def serve(host: str, port: int, metrics: Metrics, health) -> ThreadingHTTPServer:
    """Start the HTTP server in a daemon thread. `health()` returns the /healthz dict."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, body: bytes, ctype):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/metrics":
                metrics.rss.set(rss_bytes())
                self._send(200, metrics.text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/healthz":
                h = health()
                self._send(200 if h["status"] == "ok" else 503, json.dumps(h).encode(), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def log_message(self, *a):
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="http", daemon=True).start()
    return srv
