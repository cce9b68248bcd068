"""The local SQLite spool (WAL, synchronous=FULL): every reading is committed here before its MQTT
message is acknowledged, deduplicated on (sensor, seq); bad input lands in `dead_letters` with its
reason and its whole payload (nothing is unrecoverable); per-stream alarm state and the JSONL output
offset are committed together with the readings they cover, so a restart resumes exactly where the
last commit left off.

Dedup: a reading is a duplicate when its (sensor, seq) is in `readings`. The spool keeps the last
`keep` readings of each sensor in arrival order (`prune`), so a redelivery is recognised while its
original is among its sensor's last `keep` arrivals, whatever the seq values. Late readings (seq below
the sensor's highest) that were never seen are accepted and processed in arrival order.

Tables:
  readings(id = arrival order, sensor, seq, ts, received, vals BLOB float32[channels], processed 0|1),
           UNIQUE (sensor, seq)
  streams(sensor PK, last_seq, n, ema, alarm, since_infer)    -- state after the last processed reading
  dead_letters(id, at, source, sensor, seq, reason, detail, payload)
  meta(key PK, value)                                          -- jsonl_offset
"""
from __future__ import annotations

import fnmatch
import json
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

SCHEMA = """
CREATE TABLE IF NOT EXISTS readings (
  id INTEGER PRIMARY KEY, sensor TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL, received REAL NOT NULL,
  vals BLOB NOT NULL, processed INTEGER NOT NULL DEFAULT 0, UNIQUE (sensor, seq));
CREATE INDEX IF NOT EXISTS readings_pending ON readings(processed, id);
CREATE INDEX IF NOT EXISTS readings_arrival ON readings(sensor, id);
CREATE TABLE IF NOT EXISTS streams (
  sensor TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, n INTEGER NOT NULL, ema REAL NOT NULL,
  alarm INTEGER NOT NULL, since_infer INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS dead_letters (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, source TEXT, sensor TEXT, seq INTEGER,
  reason TEXT NOT NULL, detail TEXT, payload BLOB);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""

REASONS = ("oversized", "malformed-json", "bad-schema", "wrong-channel-count", "non-finite",
           "duplicate-seq", "unknown-sensor", "too-many-sensors", "spool-refused")
SEQ_MAX = 2 ** 63 - 1                  # SQLite's INTEGER range
SENSOR_MAX_CHARS = 200
DEAD_LETTER_MAX_BYTES = 1 << 20        # an oversized payload is kept up to this many bytes
DEAD_LETTERS_KEPT = 100_000            # prune keeps the newest dead letters up to this many ...
DEAD_LETTERS_KEPT_BYTES = 256 << 20    # ... and this many payload bytes (a flood cannot fill the disk)
BUSY_TIMEOUT_S = 5.0                   # a locked spool fails a commit after this; the daemon retries


class SpoolUnavailable(Exception):
    """The spool cannot be written right now (locked, disk full, I/O error): retry the same batch."""


@dataclass
class Reading:
    sensor: str
    seq: int
    values: np.ndarray          # float32 (channels,)
    ts: Optional[float] = None
    payload: bytes = b""        # the raw message, kept for a dead letter
    source: str = ""


@dataclass
class DeadLetter:
    reason: str
    detail: str
    payload: bytes = b""
    sensor: Optional[str] = None
    seq: Optional[int] = None
    source: str = ""


def raw_payload(r: Reading) -> bytes:
    """The reading as it came in, or its JSON form for readings a source built itself."""
    if r.payload:
        return r.payload
    return json.dumps({"sensor": r.sensor, "seq": r.seq, "values": [float(v) for v in r.values],
                       "ts": r.ts}).encode()


def finite_float32(vals) -> Optional[np.ndarray]:
    """vals as float32, or None when a value is NaN, infinite, or beyond float32's range."""
    try:
        arr = np.asarray([float(v) for v in vals], np.float64)
    except OverflowError:                  # an integer beyond float64
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(np.float32)
    return out if bool(np.isfinite(out).all()) else None


def parse(payload: bytes, channels: int, max_bytes: int, source: str = ""):
    """Validate one JSON reading {"sensor": str, "seq": int in [0, 2**63), "values": [channels numbers],
    "ts": number (optional)} -> Reading, or DeadLetter with the reason."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "replace")
    payload = bytes(payload)
    if len(payload) > max_bytes:
        kept = payload[:DEAD_LETTER_MAX_BYTES]
        more = f" (first {len(kept)} bytes kept)" if len(kept) < len(payload) else ""
        return DeadLetter("oversized", f"{len(payload)} bytes > {max_bytes}{more}", kept, source=source)
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # deep nesting -> RecursionError
        return DeadLetter("malformed-json", (str(e) or type(e).__name__)[:200], payload, source=source)
    if not isinstance(obj, dict):
        return DeadLetter("bad-schema", "payload is not a JSON object", payload, source=source)
    sensor, seq, vals, ts = obj.get("sensor"), obj.get("seq"), obj.get("values"), obj.get("ts")
    if not isinstance(sensor, str) or not sensor or len(sensor) > SENSOR_MAX_CHARS or not sensor.isprintable():
        return DeadLetter("bad-schema", f"missing or invalid 'sensor' (1-{SENSOR_MAX_CHARS} printable "
                          "characters)", payload, source=source)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= SEQ_MAX:
        return DeadLetter("bad-schema", "missing or invalid 'seq' (an integer from 0 to 2**63-1)", payload,
                          sensor=sensor, source=source)
    if not isinstance(vals, list):
        return DeadLetter("bad-schema", "missing 'values' list", payload, sensor, seq, source)
    if len(vals) != channels:
        return DeadLetter("wrong-channel-count", f"{len(vals)} values, expected {channels}", payload,
                          sensor, seq, source)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return DeadLetter("bad-schema", "values must be numbers", payload, sensor, seq, source)
    values = finite_float32(vals)
    if values is None:
        return DeadLetter("non-finite", "NaN, inf or beyond float32 range in values", payload, sensor, seq,
                          source)
    return Reading(sensor, seq, values, _timestamp(ts), payload, source)


def _timestamp(ts) -> Optional[float]:
    """An optional finite number; anything else is dropped (the reading itself is fine)."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return None
    try:
        ts = float(ts)
    except OverflowError:
        return None
    return ts if math.isfinite(ts) else None


def _storable(seq) -> bool:
    return isinstance(seq, int) and -SEQ_MAX - 1 <= seq <= SEQ_MAX


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    return conn


class Spool:
    """The writer side. `keep`: readings of each sensor kept (the dedup memory, >= the model window).
    `sensors`: allowed sensor ids (fnmatch patterns; empty = any); `max_sensors`: distinct sensors
    accepted; readings beyond either are dead-lettered."""

    def __init__(self, state_dir: Path, keep: int = 4096, sensors=(), max_sensors: int = 1000):
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "spool.sqlite"
        self.w = connect(self.path)              # the ingest (writer) connection
        self.w.executescript(SCHEMA)
        self.keep, self.allowed, self.max_sensors = keep, tuple(sensors), max_sensors
        self.lock = threading.Lock()
        self.last_seq = {}                       # sensor -> highest seq seen
        for sensor, seq in self.w.execute("SELECT sensor, MAX(seq) FROM readings GROUP BY sensor"):
            self.last_seq[sensor] = seq
        for sensor, seq in self.w.execute("SELECT sensor, last_seq FROM streams"):
            self.last_seq[sensor] = max(seq, self.last_seq.get(sensor, -1))

    def reader(self) -> sqlite3.Connection:
        return connect(self.path)

    # ---- ingest ---------------------------------------------------------------------------------
    def commit(self, items) -> tuple:
        """Commit readings and dead letters in one transaction. Returns (accepted readings, dead
        letters including those found here, late readings accepted). Raises SpoolUnavailable when
        SQLite cannot write (the caller retries the same items); a row SQLite refuses for its own
        content is dead-lettered alone, never its batch."""
        now = time.time()
        with self.lock:
            last = dict(self.last_seq)
            accepted, dead, late, batch_keys = [], [], 0, set()
            for it in items:
                if isinstance(it, DeadLetter):
                    dead.append(it)
                    continue
                why = self._refuse_sensor(it.sensor, last)
                if why:
                    dead.append(DeadLetter(why[0], why[1], raw_payload(it), it.sensor, it.seq, it.source))
                    continue
                key = (it.sensor, it.seq)
                prev = last.get(it.sensor, -1)
                if it.seq <= prev and (key in batch_keys or self.w.execute(
                        "SELECT 1 FROM readings WHERE sensor=? AND seq=?", key).fetchone() is not None):
                    dead.append(DeadLetter("duplicate-seq", f"seq {it.seq} of {it.sensor!r} is already in the "
                                           "spool", raw_payload(it), it.sensor, it.seq, it.source))
                    continue
                late += it.seq < prev
                last[it.sensor] = max(prev, it.seq)
                batch_keys.add(key)
                accepted.append(it)
            try:
                self._write(accepted, dead, now)
            except sqlite3.OperationalError as e:       # locked, busy, disk full, I/O error
                raise SpoolUnavailable(str(e)) from None
            except (sqlite3.Error, OverflowError, ValueError, TypeError):
                accepted = self._write_one_by_one(accepted, dead, now)
            self.last_seq = last
        return accepted, dead, late

    def _refuse_sensor(self, sensor: str, known: dict):
        if sensor in known:
            return None
        if self.allowed and not any(fnmatch.fnmatchcase(sensor, pat) for pat in self.allowed):
            return "unknown-sensor", f"sensor {sensor!r} is not in [daemon] sensors"
        if len(known) >= self.max_sensors:
            return "too-many-sensors", f"already {len(known)} sensors ([daemon] max_sensors)"
        known[sensor] = -1                     # counts against the cap from now on
        return None

    def _write(self, readings, dead, now):
        rows = [(r.sensor, r.seq, r.ts, now, r.values.astype(np.float32).tobytes()) for r in readings]
        dl = [(now, d.source, d.sensor, d.seq if _storable(d.seq) else None, d.reason, d.detail, bytes(d.payload))
              for d in dead]
        self.w.execute("BEGIN IMMEDIATE")
        try:
            if rows:
                self.w.executemany("INSERT INTO readings(sensor, seq, ts, received, vals) VALUES (?,?,?,?,?)",
                                   rows)
            if dl:
                self.w.executemany("INSERT INTO dead_letters(at, source, sensor, seq, reason, detail, payload) "
                                   "VALUES (?,?,?,?,?,?,?)", dl)
            self.w.execute("COMMIT")
        except BaseException:
            if self.w.in_transaction:
                self.w.execute("ROLLBACK")
            raise

    def _write_one_by_one(self, readings, dead, now) -> list:
        """A batch SQLite refused for its content: each reading alone; the ones refused again become
        dead letters (with their payload) so the rest of the batch goes through."""
        ok = []
        for r in readings:
            try:
                self._write([r], [], now)
                ok.append(r)
            except sqlite3.OperationalError as e:
                raise SpoolUnavailable(str(e)) from None
            except (sqlite3.Error, OverflowError, ValueError, TypeError) as e:
                dead.append(DeadLetter("spool-refused", f"{type(e).__name__}: {e}"[:200], raw_payload(r),
                                       r.sensor, r.seq, r.source))
        try:
            self._write([], dead, now)
        except sqlite3.OperationalError as e:
            raise SpoolUnavailable(str(e)) from None
        return ok

    def last_seq_of(self, sensor: str) -> int:
        return self.last_seq.get(sensor, -1)

    # ---- processing (reader connection, inference thread) ---------------------------------------
    @staticmethod
    def pending(conn, limit: int):
        return conn.execute("SELECT id, sensor, seq, ts, received, vals FROM readings "
                            "WHERE processed = 0 ORDER BY id LIMIT ?", (limit,)).fetchall()

    @staticmethod
    def count_pending(conn) -> int:
        return conn.execute("SELECT COUNT(*) FROM readings WHERE processed = 0").fetchone()[0]

    def mark_processed(self, rowids, streams, jsonl_offset: int):
        """Commit a processed batch (SpoolUnavailable: retry it). Writes from both threads go through
        the one writer connection under a Python lock, so they never wait on each other in SQLite."""
        with self.lock:
            try:
                self._mark_processed(self.w, rowids, streams, jsonl_offset)
            except sqlite3.OperationalError as e:
                raise SpoolUnavailable(str(e)) from None

    @staticmethod
    def _mark_processed(conn, rowids, streams, jsonl_offset: int):
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("UPDATE readings SET processed = 1 WHERE id = ?", [(r,) for r in rowids])
            conn.executemany(
                "INSERT INTO streams(sensor, last_seq, n, ema, alarm, since_infer) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(sensor) DO UPDATE SET last_seq=excluded.last_seq, n=excluded.n, "
                "ema=excluded.ema, alarm=excluded.alarm, since_infer=excluded.since_infer",
                [(s.sensor, s.last_seq, s.n, s.ema, int(s.alarm), s.since_infer) for s in streams])
            conn.execute("INSERT INTO meta(key, value) VALUES ('jsonl_offset', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (str(jsonl_offset),))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @staticmethod
    def jsonl_offset(conn) -> Optional[int]:
        r = conn.execute("SELECT value FROM meta WHERE key='jsonl_offset'").fetchone()
        return int(r[0]) if r else None

    @staticmethod
    def restore_streams(conn, engine):
        """Rebuild the engine's per-stream state (window frames, counters, alarm filter)."""
        for sensor, last_seq, n, ema, alarm, since in conn.execute(
                "SELECT sensor, last_seq, n, ema, alarm, since_infer FROM streams").fetchall():
            st = engine.stream(sensor)
            rows = conn.execute("SELECT vals FROM readings WHERE sensor=? AND processed=1 "
                                "ORDER BY id DESC LIMIT ?", (sensor, st.window)).fetchall()
            frames = [np.frombuffer(r[0], np.float32) for r in reversed(rows)]
            k = len(frames)
            st.n = n
            for j, f in enumerate(frames):
                st.frames[(n - k + j) % st.window] = f
            st.last_seq, st.ema, st.alarm, st.since_infer = last_seq, ema, bool(alarm), since

    def prune(self) -> int:
        """Keep the last `keep` processed readings of each sensor (arrival order) and the newest dead
        letters (DEAD_LETTERS_KEPT, DEAD_LETTERS_KEPT_BYTES). Returns the dead letters dropped."""
        with self.lock:
            try:
                return self._prune()
            except sqlite3.OperationalError as e:
                raise SpoolUnavailable(str(e)) from None

    def _prune(self):
        for (sensor,) in self.w.execute("SELECT sensor FROM streams").fetchall():
            cut = self.w.execute("SELECT id FROM readings WHERE sensor=? ORDER BY id DESC LIMIT 1 OFFSET ?",
                                 (sensor, self.keep)).fetchone()
            if cut:
                self.w.execute("DELETE FROM readings WHERE sensor=? AND id<=? AND processed=1",
                               (sensor, cut[0]))
        total, cut = 0, None
        for i, (dl_id, size) in enumerate(self.w.execute(
                "SELECT id, length(payload) FROM dead_letters ORDER BY id DESC")):
            total += size or 0
            if i >= DEAD_LETTERS_KEPT or total > DEAD_LETTERS_KEPT_BYTES:
                cut = dl_id
                break
        if cut is None:
            return 0
        return self.w.execute("DELETE FROM dead_letters WHERE id <= ?", (cut,)).rowcount

    @staticmethod
    def dead_letter_counts(conn) -> dict:
        return dict(conn.execute("SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason").fetchall())
