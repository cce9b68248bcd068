"""Prometheus metrics and the /healthz endpoint, served on <[metrics] host>:<port> (127.0.0.1).

/healthz -> {"status": "ok"|"degraded", "version", "uptime_s", "readings", "last_inference_age_s",
             "bundle", "source_connected", "spool", ...}; HTTP 200 when ok, 503 otherwise.

Every series is driven by what the daemon does: counters where it counts, gauges set from its live
state just before each scrape (`refresh`).
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from zeroedge.errors import UserError


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
        self.late = Counter("zeroedge_readings_late", "Readings accepted below their sensor's highest seq "
                            "(reordered delivery; processed in arrival order)", registry=r)
        self.spool_failures = Counter("zeroedge_spool_write_failures", "Spool writes that failed and were "
                                      "retried (locked, disk full, I/O error)", registry=r)
        self.spool_ok = Gauge("zeroedge_spool_writable", "1 while spool writes succeed", registry=r)
        self.pending = Gauge("zeroedge_spool_pending", "Readings in the spool not yet processed", registry=r)
        self.streams = Gauge("zeroedge_streams", "Streams with state", registry=r)
        self.kv_bytes = Gauge("zeroedge_kv_memory_bytes", "Per-stream state memory by KV tier (the sensor "
                              "daemon keeps every window hot)", ["tier"], registry=r)
        self.rss = Gauge("zeroedge_resident_memory_bytes", "Resident set size of the daemon", registry=r)
        self.connected = Gauge("zeroedge_source_connected", "1 when the source is connected", registry=r)
        self.spool_ok.set(1)
        self.kv_bytes.labels("hot")
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


def serve(host: str, port: int, metrics: Metrics, health, refresh=lambda: None) -> ThreadingHTTPServer:
    """Start the HTTP server in a daemon thread. `health()` returns the /healthz dict; `refresh()`
    sets the live gauges before each /metrics answer. A port that cannot be bound -> UserError."""

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
                refresh()
                self._send(200, metrics.text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/healthz":
                h = health()
                self._send(200 if h["status"] == "ok" else 503, json.dumps(h).encode(), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def log_message(self, *a):
            pass

    class Server(ThreadingHTTPServer):
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    try:
        srv = Server((host, port), Handler)
    except OSError as e:
        raise UserError(f"[metrics] cannot listen on {host}:{port}: {e.strerror or e}") from None
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="http", daemon=True).start()
    return srv
