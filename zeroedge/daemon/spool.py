"""The local SQLite spool (WAL, synchronous=FULL): every reading is committed here before its MQTT
message is acknowledged, deduplicated on (sensor, seq); bad input lands in `dead_letters` with its
reason; per-stream alarm state and the JSONL output offset are committed together with the
readings they cover, so a restart resumes exactly where the last commit left off.

Tables:
  readings(id = arrival order, sensor, seq, ts, received, vals BLOB float32[channels], processed 0|1),
           UNIQUE (sensor, seq)
  streams(sensor PK, last_seq, n, ema, alarm, since_infer)    -- state after the last processed reading
  dead_letters(id, at, source, sensor, seq, reason, detail, payload)
  meta(key PK, value)                                          -- jsonl_offset
"""
from __future__ import annotations

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
CREATE TABLE IF NOT EXISTS streams (
  sensor TEXT PRIMARY KEY, last_seq INTEGER NOT NULL, n INTEGER NOT NULL, ema REAL NOT NULL,
  alarm INTEGER NOT NULL, since_infer INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS dead_letters (
  id INTEGER PRIMARY KEY, at REAL NOT NULL, source TEXT, sensor TEXT, seq INTEGER,
  reason TEXT NOT NULL, detail TEXT, payload BLOB);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""

REASONS = ("oversized", "malformed-json", "bad-schema", "wrong-channel-count", "non-finite",
           "duplicate-seq", "out-of-order-seq")


@dataclass
class Reading:
    sensor: str
    seq: int
    values: np.ndarray          # float32 (channels,)
    ts: Optional[float] = None


@dataclass
class DeadLetter:
    reason: str
    detail: str
    payload: bytes = b""
    sensor: Optional[str] = None
    seq: Optional[int] = None
    source: str = ""


def parse(payload: bytes, channels: int, max_bytes: int, source: str = ""):
    """Validate one JSON reading {"sensor": str, "seq": int >= 0, "values": [channels numbers],
    "ts": number (optional)} -> Reading, or DeadLetter with the reason."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "replace")
    if len(payload) > max_bytes:
        return DeadLetter("oversized", f"{len(payload)} bytes > {max_bytes}", payload[:1024], source=source)
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # deep nesting -> RecursionError
        return DeadLetter("malformed-json", (str(e) or type(e).__name__)[:200], payload, source=source)
    if not isinstance(obj, dict):
        return DeadLetter("bad-schema", "payload is not a JSON object", payload, source=source)
    sensor, seq, vals, ts = obj.get("sensor"), obj.get("seq"), obj.get("values"), obj.get("ts")
    if not isinstance(sensor, str) or not sensor or len(sensor) > 200:
        return DeadLetter("bad-schema", "missing or invalid 'sensor'", payload, source=source)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return DeadLetter("bad-schema", "missing or invalid 'seq' (non-negative integer)", payload,
                          sensor=sensor, source=source)
    if not isinstance(vals, list):
        return DeadLetter("bad-schema", "missing 'values' list", payload, sensor, seq, source)
    if len(vals) != channels:
        return DeadLetter("wrong-channel-count", f"{len(vals)} values, expected {channels}", payload,
                          sensor, seq, source)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return DeadLetter("bad-schema", "values must be numbers", payload, sensor, seq, source)
    if not all(math.isfinite(v) for v in vals):
        return DeadLetter("non-finite", "NaN or inf in values", payload, sensor, seq, source)
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts)):
        ts = None
    return Reading(sensor, seq, np.asarray(vals, np.float32), None if ts is None else float(ts))


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


class Spool:
    def __init__(self, state_dir: Path):
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "spool.sqlite"
        self.w = connect(self.path)              # the ingest (writer) connection
        self.w.executescript(SCHEMA)
        self.lock = threading.Lock()
        self.last_seq = {}
        for sensor, seq in self.w.execute("SELECT sensor, MAX(seq) FROM readings GROUP BY sensor"):
            self.last_seq[sensor] = seq
        for sensor, seq in self.w.execute("SELECT sensor, last_seq FROM streams"):
            self.last_seq[sensor] = max(seq, self.last_seq.get(sensor, -1))

    def reader(self) -> sqlite3.Connection:
        return connect(self.path)

    # ---- ingest ---------------------------------------------------------------------------------
    def commit(self, items) -> tuple:
        """Commit readings and dead letters in one transaction. Returns (accepted readings,
        dead letters including duplicates / out-of-order found here)."""
        now = time.time()
        accepted, dead = [], []
        with self.lock:
            last = dict(self.last_seq)
            rows, dl = [], []
            for it in items:
                if isinstance(it, DeadLetter):
                    dead.append(it)
                    continue
                prev = last.get(it.sensor, -1)
                if it.seq <= prev:
                    exists = self.w.execute("SELECT 1 FROM readings WHERE sensor=? AND seq=?",
                                            (it.sensor, it.seq)).fetchone()
                    dup = exists is not None or any(r[0] == it.sensor and r[1] == it.seq for r in rows)
                    dead.append(DeadLetter("duplicate-seq" if dup else "out-of-order-seq",
                                           f"seq {it.seq} <= last {prev}", b"", it.sensor, it.seq))
                    continue
                last[it.sensor] = it.seq
                rows.append((it.sensor, it.seq, it.ts, now, it.values.astype(np.float32).tobytes()))
                accepted.append(it)
            for d in dead:
                dl.append((now, d.source, d.sensor, d.seq, d.reason, d.detail, d.payload[:4096]))
            self.w.execute("BEGIN IMMEDIATE")
            try:
                if rows:
                    self.w.executemany("INSERT INTO readings(sensor, seq, ts, received, vals) "
                                       "VALUES (?,?,?,?,?)", rows)
                if dl:
                    self.w.executemany("INSERT INTO dead_letters(at, source, sensor, seq, reason, "
                                       "detail, payload) VALUES (?,?,?,?,?,?,?)", dl)
                self.w.execute("COMMIT")
            except BaseException:
                self.w.execute("ROLLBACK")
                raise
            self.last_seq = last
        return accepted, dead

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
        """Commit a processed batch. Writes from both threads go through the one writer connection
        under a Python lock, so they never meet SQLite's busy handler (which sleeps)."""
        with self.lock:
            self._mark_processed(self.w, rowids, streams, jsonl_offset)

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
            rows = conn.execute("SELECT vals FROM readings WHERE sensor=? AND processed=1 AND seq<=? "
                                "ORDER BY seq DESC LIMIT ?", (sensor, last_seq, st.window)).fetchall()
            frames = [np.frombuffer(r[0], np.float32) for r in reversed(rows)]
            k = len(frames)
            st.n = n
            for j, f in enumerate(frames):
                st.frames[(n - k + j) % st.window] = f
            st.last_seq, st.ema, st.alarm, st.since_infer = last_seq, ema, bool(alarm), since

    def prune(self, keep: int):
        with self.lock:
            self._prune(self.w, keep)

    @staticmethod
    def _prune(conn, keep: int):
        conn.execute("DELETE FROM readings WHERE processed = 1 AND seq < "
                     "(SELECT s.last_seq FROM streams s WHERE s.sensor = readings.sensor) - ?", (keep,))
        conn.execute("DELETE FROM dead_letters WHERE id < (SELECT MAX(id) FROM dead_letters) - 100000")

    @staticmethod
    def dead_letter_counts(conn) -> dict:
        return dict(conn.execute("SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason").fetchall())
