"""The daemon: sources -> spool writer (commit, then ack) -> inference loop (per-stream windows,
batched model calls, alarm filter) -> JSONL + MQTT results/alerts; metrics and /healthz; sd_notify.

Exactly-once output: the inference loop appends a batch's result lines to the JSONL file and fsyncs
it, then commits "processed" for the batch's readings, the per-stream state and the JSONL byte offset
in one SQLite transaction. On start the JSONL file is truncated back to the committed offset (a batch
whose commit did not happen is processed again), and the per-stream windows are rebuilt from the
spool. MQTT result/alert publishing happens after the commit (at most once across a crash).

A spool that cannot be written (locked by another process, disk full, I/O error) is retried in place
with backoff, the same batch and nothing behind it: /healthz says "degraded" with the error and
zeroedge_spool_writable reads 0. Unwritable for [daemon] spool_give_up_s, the daemon logs one line
and exits 1 (systemd restarts it); readings not yet committed were not acknowledged, so the broker
redelivers them, and a processed batch whose commit never happened is processed again.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import sqlite3
import threading
import time
from pathlib import Path

from zeroedge import __version__
from zeroedge.daemon import logs, notify
from zeroedge.daemon.config import Config
from zeroedge.daemon.spool import DeadLetter, Reading, Spool, SpoolUnavailable, finite_float32, parse, raw_payload

STALL_S = 30.0      # the inference loop not ticking for this long -> degraded (and no WATCHDOG=1)
DEAD_LETTER_LOG_PER_MIN = 60    # dead letters logged one by one per minute; the rest are summed up


class SpoolGaveUp(Exception):
    """The spool stayed unwritable for spool_give_up_s: the daemon exits 1."""


class SpoolRetry:
    """Failure state of spool writes, shared by the writer and the inference thread: backoff between
    retries of the same work, the error for /healthz, and the give-up deadline."""

    def __init__(self, give_up_s: float, metrics, log):
        self.give_up_s, self.metrics, self.log = give_up_s, metrics, log
        self.error = None
        self.since = None
        self.attempts = 0
        self.lock = threading.Lock()

    def failed(self, what: str, e: Exception) -> float:
        """Record a failure; returns the seconds to wait before retrying, or raises SpoolGaveUp."""
        now = time.monotonic()
        with self.lock:
            self.since = self.since or now
            self.attempts += 1
            self.error = f"{what}: {e}"
            failing = now - self.since
        self.metrics.spool_failures.inc()
        self.metrics.spool_ok.set(0)
        if failing >= self.give_up_s:
            raise SpoolGaveUp(f"the spool has not been writable for {failing:.0f} s ({self.error}); exiting so "
                              "that the service manager restarts the daemon; nothing acknowledged is lost")
        if self.attempts == 1 or self.attempts % 10 == 0:
            self.log.warning(f"spool write failed ({self.error}); retrying the same batch "
                             f"(failing for {failing:.1f} s, giving up after {self.give_up_s:g} s)")
        return min(2.0, 0.05 * 2 ** min(self.attempts, 6))

    def ok(self):
        if self.since is None:
            return
        with self.lock:
            failing = time.monotonic() - self.since
            self.error, self.since, self.attempts = None, None, 0
        self.metrics.spool_ok.set(1)
        self.log.info(f"spool writable again after {failing:.1f} s")

    def state(self) -> dict:
        with self.lock:
            return {"writable": self.since is None, "error": self.error,
                    "failing_s": None if self.since is None else round(time.monotonic() - self.since, 3)}


class Daemon:
    def __init__(self, cfg: Config, exit_at_end: bool = False):
        from zeroedge.daemon.metrics import Metrics
        from zeroedge.sensor.runtime import Engine, load_bundle

        self.cfg = cfg
        self.exit_at_end = exit_at_end or cfg.source["kind"] == "stdin"   # stdin EOF ends the run
        self.log = logs.setup(cfg.daemon["log_level"])
        self.metrics = Metrics()
        self.t_start = time.time()
        d = cfg.daemon
        self.detector = load_bundle(cfg.bundle, backend=d["backend"], threads=d["threads"])
        self.engine = Engine(self.detector, d["infer_every"], d["infer_interval_s"])
        self.spool = Spool(cfg.state_dir, keep=max(d["keep_per_stream"], self.detector.window),
                           sensors=d["sensors"], max_sensors=d["max_sensors"])
        self.retry = SpoolRetry(float(d["spool_give_up_s"]), self.metrics, self.log)
        self.fatal = None               # why the daemon gave up (exit 1)
        self.dl_logged = collections.deque()      # times of dead letters logged one by one
        self.dl_quiet = 0                         # dead letters not logged one by one since the last summary
        self.rconn = self.spool.reader()
        Spool.restore_streams(self.rconn, self.engine)
        self.q: queue.Queue = queue.Queue(maxsize=4 * d["batch_max"])
        self.stop_evt = threading.Event()
        self.writer_idle = threading.Event()
        self.work_evt = threading.Event()
        self.heartbeat = time.monotonic()
        self.watchdog_s, self.last_watchdog = notify.watchdog_interval_s(), 0.0
        self.ready_unsent = None            # READY=1 that found systemd's queue full
        self.last_inference = None
        self.processed_total = 0
        self.publisher = None
        self.source = None
        self.recent_latency = collections.deque(maxlen=100000)   # reading committed -> result, s
        for w in cfg.warnings:
            self.log.warning(w)
        self._open_jsonl()

    # ---- output file ----------------------------------------------------------------------------
    def _open_jsonl(self):
        p = Path(self.cfg.output["jsonl"])
        p.parent.mkdir(parents=True, exist_ok=True)
        committed = Spool.jsonl_offset(self.rconn)
        self.jsonl = open(p, "ab")
        size = self.jsonl.seek(0, os.SEEK_END)
        if committed is None:
            committed = size
        if size > committed:
            self.log.warning(f"{p}: dropping {size - committed} bytes of uncommitted results "
                             f"(they are processed again)")
            self.jsonl.truncate(committed)
            self.jsonl.seek(committed)
        elif size < committed:
            self.log.warning(f"{p}: shorter than the committed offset ({size} < {committed}); "
                             f"was it rotated? appending from its end")
        self.jsonl_offset = self.jsonl.seek(0, os.SEEK_END)

    # ---- health ---------------------------------------------------------------------------------
    def health(self) -> dict:
        now = time.monotonic()
        stalled = now - self.heartbeat > STALL_S
        src_ok = self.source is not None and self.source.connected     # degraded while starting
        spool = self.retry.state()
        status = "ok" if (not stalled and src_ok and spool["writable"]) else "degraded"
        return {"status": status, "version": __version__, "uptime_s": round(time.time() - self.t_start, 3),
                "readings": self.processed_total,
                "last_inference_age_s": None if self.last_inference is None
                else round(now - self.last_inference, 3),
                "bundle": str(self.cfg.bundle), "source": self.cfg.source["kind"],
                "source_connected": bool(src_ok), "inference_loop_stalled": stalled,
                "spool": spool, "streams": len(self.engine.streams)}

    # ---- spool writer ---------------------------------------------------------------------------
    def _put(self, item):
        while True:
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                if self.stop_evt.is_set() and self.source and self.source.stopping.is_set():
                    return

    def _writer(self):
        d = self.cfg.daemon
        while True:
            try:
                first = self.q.get(timeout=0.1)
            except queue.Empty:
                self.writer_idle.set()
                if self.stop_evt.is_set() and (self.source is None or self.source.stopping.is_set()):
                    return
                continue
            self.writer_idle.clear()
            batch = [first]
            while len(batch) < d["batch_max"]:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            items = [self._validate(inc) for inc in batch]
            done = self._commit(items)
            if done is None:             # stopping or giving up: nothing of this batch is acked
                return
            accepted, dead, late = done
            for inc in batch:          # acknowledge only what is committed
                if inc.ack is not None:
                    try:
                        inc.ack()
                    except Exception as e:  # a lost ack means a redelivery, which dedup absorbs
                        self.log.warning(f"mqtt ack failed: {e!r}")
            self.metrics.readings.inc(len(accepted))
            self.metrics.late.inc(late)
            for dl in dead:
                self.metrics.dead.labels(dl.reason).inc()
                self._log_dead_letter(dl)
            if accepted:
                self.work_evt.set()

    def _validate(self, inc):
        """A source's item -> Reading or DeadLetter (never raises: one payload cannot stop the writer)."""
        ch, maxb = self.detector.channels, self.cfg.daemon["max_payload_bytes"]
        p = inc.payload
        if isinstance(p, Reading):
            if len(p.values) != ch:
                return DeadLetter("wrong-channel-count", f"{len(p.values)} values, expected {ch}", raw_payload(p),
                                  p.sensor, p.seq, inc.source)
            values = finite_float32(p.values)
            if values is None:
                return DeadLetter("non-finite", "NaN, inf or beyond float32 range in values", raw_payload(p),
                                  p.sensor, p.seq, inc.source)
            p.values = values
            return p
        try:
            return parse(p, ch, maxb, inc.source)
        except Exception as e:
            return DeadLetter("malformed-json", f"unparseable: {e!r}"[:200],
                              bytes(p) if isinstance(p, (bytes, bytearray)) else repr(p).encode(), source=inc.source)

    def _commit(self, items):
        """spool.commit, retried in place while the spool is unwritable; None when the daemon is
        stopping (or gives up) before it went through."""
        while True:
            try:
                done = self.spool.commit(items)
                self.retry.ok()
                return done
            except SpoolUnavailable as e:
                try:
                    delay = self.retry.failed("commit readings", e)
                except SpoolGaveUp as g:
                    self._give_up(g)
                    return None
            if self.stop_evt.wait(delay):
                return None

    def _give_up(self, e: SpoolGaveUp):
        if self.fatal is None:
            self.fatal = str(e)
            self.log.error(self.fatal)
        self.request_stop()

    def _log_dead_letter(self, dl):
        now = time.monotonic()
        while self.dl_logged and now - self.dl_logged[0] > 60:
            self.dl_logged.popleft()
        if len(self.dl_logged) >= DEAD_LETTER_LOG_PER_MIN:
            self.dl_quiet += 1
            return
        if self.dl_quiet:
            self.log.warning(f"{self.dl_quiet} more dead letters were not logged one by one "
                             "(zeroedge_dead_letters_total counts them; the spool keeps them all)")
            self.dl_quiet = 0
        self.dl_logged.append(now)
        self.log.warning(f"dead letter: reason={dl.reason} sensor={_printable(dl.sensor)} seq={dl.seq} "
                         f"source={_printable(dl.source)} detail={_printable(dl.detail)}")

    # ---- inference loop -------------------------------------------------------------------------
    def _process_pending(self) -> int:
        import numpy as np

        rows = Spool.pending(self.rconn, self.cfg.daemon["batch_max"])
        if not rows:
            res = self.engine.tick()
            return 0 if not res else self._emit([], res, {})
        readings = [(s, q, np.frombuffer(v, np.float32), ts) for _r, s, q, ts, _rec, v in rows]
        received = {(s, q): rec for _r, s, q, _ts, rec, _v in rows}
        t0 = time.perf_counter()
        results = self.engine.process(readings)
        dt = time.perf_counter() - t0
        for sensor, w in self.engine.pop_warnings():      # a stream unlike the bundle's fit data
            self.log.warning(f"sensor={_printable(sensor)}: {w}")
        if results:
            self.metrics.infer_latency.observe(dt)
        return self._emit([r[0] for r in rows], results, received, touched={s for s, *_ in readings})

    def _emit(self, rowids, results, received, touched=()):
        now = time.time()
        lines = []
        for r in results:
            r["t"] = round(now, 3)
            lines.append(json.dumps(r, separators=(",", ":")).encode() + b"\n")
        if lines:
            self.jsonl.write(b"".join(lines))
            self.jsonl.flush()
            os.fsync(self.jsonl.fileno())
            self.jsonl_offset = self.jsonl.tell()
        streams = [self.engine.streams[s] for s in set(touched) | {r["sensor"] for r in results}]
        while True:        # the engine has moved on: this commit must happen before anything else
            try:
                self.spool.mark_processed(rowids, streams, self.jsonl_offset)
                self.retry.ok()
                break
            except SpoolUnavailable as e:
                delay = self.retry.failed("commit processed results", e)         # SpoolGaveUp -> run()
                if self.stop_evt.wait(delay):
                    raise SpoolGaveUp(f"stop requested while the spool is not writable ({e}); the results "
                                      "not committed are produced again at the next start") from None
                self._beat()         # alive and retrying on purpose: the watchdog keeps quiet
        self.processed_total += len(rowids)
        self.metrics.processed.inc(len(rowids))
        self.metrics.inferences.inc(len(results))
        if results:
            self.last_inference = time.monotonic()
        for r in results:
            rec = received.get((r["sensor"], r["seq"]))
            if rec is not None:
                self.metrics.window_latency.observe(max(0.0, now - rec))
                self.recent_latency.append(max(0.0, now - rec))
            if r["rising"]:
                self.metrics.alerts.inc()
                self.log.warning(f"ALERT sensor={r['sensor']} seq={r['seq']} fault={r['fault']} "
                                 f"score={r['ema']}")
        self._publish(results)
        return len(rowids)

    def _publish(self, results):
        out = self.cfg.output
        pub = self.publisher
        if pub is None or not results:
            return
        try:
            for r in results:
                if out["mqtt_results_topic"]:
                    pub.publish(out["mqtt_results_topic"], json.dumps(r).encode(), qos=1)
                if r["rising"] and out["mqtt_alerts_topic"]:
                    pub.publish(out["mqtt_alerts_topic"], json.dumps(r).encode(), qos=1)
        except Exception as e:
            self.log.warning(f"publishing results failed: {e!r}")

    def _update_gauges(self):
        """Gauges that need the inference thread's state (the spool reader, the streams)."""
        try:
            self.metrics.pending.set(Spool.count_pending(self.rconn))
        except sqlite3.Error:                       # the next round tries again
            pass
        self.metrics.streams.set(len(self.engine.streams))
        self.metrics.kv_bytes.labels("hot").set(sum(s.memory_bytes() for s in list(self.engine.streams.values())))
        self._refresh_live()

    def _refresh_live(self):
        """Gauges read from live state at every scrape."""
        from zeroedge.daemon.metrics import rss_bytes

        self.metrics.connected.set(1 if self.source is not None and self.source.connected else 0)
        self.metrics.spool_ok.set(1 if self.retry.state()["writable"] else 0)
        self.metrics.rss.set(rss_bytes())

    # ---- lifecycle ------------------------------------------------------------------------------
    def _beat(self) -> float:
        """The inference loop is alive: heartbeat for /healthz, WATCHDOG=1 when one is due."""
        self.heartbeat = now = time.monotonic()
        if self.ready_unsent and notify.notify(self.ready_unsent):
            self.ready_unsent = None
        if self.watchdog_s and now - self.last_watchdog >= self.watchdog_s:
            # a ping the full queue dropped is tried again a quarter interval later, not a whole one
            self.last_watchdog = now if notify.notify("WATCHDOG=1") else now - 0.75 * self.watchdog_s
        return now

    def request_stop(self, *_):
        if not self.stop_evt.is_set():
            self.log.info("stop requested: draining")
            notify.notify("STOPPING=1")
            self.stop_evt.set()
            self.work_evt.set()

    def run(self) -> int:
        writer = self._start()
        self._loop(writer)
        return self._shutdown()

    def _start(self) -> threading.Thread:
        """Signals, the metrics server, the spool writer, the source (and a results publisher), then
        READY to systemd."""
        from zeroedge.daemon.metrics import serve
        from zeroedge.daemon.sources import SOURCES, make_client

        c = self.cfg
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        self.http = serve(c.metrics["host"], c.metrics["port"], self.metrics, self.health, self._refresh_live)
        writer = threading.Thread(target=self._writer, name="spool-writer", daemon=True)
        writer.start()
        self.source = SOURCES[c.source["kind"]](c.source, self._put, self.log, self.spool)
        if c.source["kind"] == "mqtt":
            self.publisher = self.source
        elif c.output.get("host") and (c.output["mqtt_results_topic"] or c.output["mqtt_alerts_topic"]):
            broker = {k: c.output[k] for k in ("username", "password", "tls_ca", "tls_cert", "tls_key")}
            self.publisher = _Publisher(make_client({**c.source, **broker, "host": c.output["host"],
                                                     "port": c.output.get("port") or 1883},
                                                    f"{c.source['client_id']}-pub", self.log))
        self.source.start()
        ready = f"READY=1\nSTATUS=processing {c.source['kind']} readings\nMAINPID={os.getpid()}"
        if not notify.notify(ready, wait_s=2.0) and os.environ.get("NOTIFY_SOCKET"):
            self.ready_unsent = ready           # the queue stayed full: sent again from the loop's beats
        self.log.info(f"zeroedge daemon {__version__} ready: bundle={c.bundle} source={c.source['kind']} "
                      f"backend={self.detector.backend.name} metrics=http://{c.metrics['host']}:"
                      f"{self.http.server_address[1]}/metrics")
        return writer

    def _prune_dead_letters(self):
        try:
            dropped = self.spool.prune()
            if dropped:
                self.log.warning(f"dropped the {dropped} oldest dead letters (the spool keeps the newest "
                                 "100,000 and 256 MiB of them)")
        except SpoolUnavailable as e:       # pruning waits for the next round
            self.log.warning(f"spool prune skipped: {e}")

    def _loop(self, writer: threading.Thread):
        """Process what the spool holds until a stop (drained first), the end of a finite source, or a
        spool that cannot be read for good."""
        last_gauges = 0.0
        last_prune = time.monotonic()
        while True:
            now = self._beat()
            if now - last_gauges > 1.0:
                self._update_gauges()
                last_gauges = now
            if now - last_prune > 30.0:
                self._prune_dead_letters()
                last_prune = now
            try:
                n = self._process_pending()
            except sqlite3.OperationalError as e:      # reading the spool failed: nothing changed yet
                try:
                    delay = self.retry.failed("read the spool", e)
                except SpoolGaveUp as g:
                    return self._give_up(g)
                if self.stop_evt.wait(delay):
                    return self._give_up(SpoolGaveUp(f"stop requested while the spool cannot be read ({e})"))
                continue
            except SpoolGaveUp as e:
                return self._give_up(e)
            if self.fatal:
                return
            if n:
                continue
            if self.exit_at_end and self.source.done.is_set() and self.q.empty() and self.writer_idle.is_set():
                if Spool.count_pending(self.rconn) == 0:
                    self.request_stop()
            if self.stop_evt.is_set():
                if not self.source.stopping.is_set():
                    self.source.stop()
                writer.join(timeout=30)
                try:
                    while self._process_pending():
                        pass
                except SpoolGaveUp as e:
                    self._give_up(e)
                return
            self.work_evt.wait(0.05)
            self.work_evt.clear()

    def _shutdown(self) -> int:
        """Close the source, publisher, results file and metrics server; 1 after a fatal error."""
        try:
            self.source.close()
            if self.publisher is not None and self.publisher is not self.source:
                self.publisher.close()
        except Exception:
            pass
        self.jsonl.close()
        self.http.shutdown()
        if self.fatal:
            self.log.error("stopped with exit status 1 (see the error above)")
            return 1
        self._update_gauges()
        if self.recent_latency:
            import numpy as np

            lat = np.array(self.recent_latency) * 1000
            self.log.info(f"window latency (reading committed -> result written) over the last {len(lat)} "
                          f"results: p50={np.percentile(lat, 50):.2f} ms p99={np.percentile(lat, 99):.2f} ms "
                          f"max={lat.max():.2f} ms")
        self.log.info(f"stopped cleanly: {self.processed_total} readings processed this run")
        return 0


class _Publisher:
    def __init__(self, client):
        self.client = client
        client.loop_start()

    def publish(self, topic, payload, qos=1):
        self.client.publish(topic, payload, qos=qos)

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


def _printable(text) -> str:
    """Hostile input (sensor ids, topics, details) as one log line: control characters escaped."""
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
