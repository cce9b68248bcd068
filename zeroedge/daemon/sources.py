"""Reading sources. Each puts `Incoming` items on the daemon's bounded queue; the spool writer
commits them and only then calls `ack` (MQTT manual ack). A source resumes after the last seq the
spool holds for its sensor (file, simulator)."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional



@dataclass
class Incoming:
    payload: object                     # bytes (to validate) or a spool.Reading
    ack: Optional[Callable] = None
    source: str = ""


class Source:
    kind = "?"

    def __init__(self, cfg: dict, put, log, spool):
        self.cfg, self.put, self.log, self.spool = cfg, put, log, spool
        self.done = threading.Event()       # no more input will come (EOF)
        self.stopping = threading.Event()
        self.connected = True

    def start(self):
        threading.Thread(target=self._run_guarded, name=f"source-{self.kind}", daemon=True).start()

    def _run_guarded(self):
        try:
            self.run()
        except Exception as e:  # a source error must not kill the daemon silently
            self.log.error(f"source {self.kind} failed: {e!r}")
        finally:
            self.done.set()

    def run(self):
        raise NotImplementedError

    def stop(self):
        self.stopping.set()

    def close(self):
        pass

    def _pace(self, t0, i):
        rate = float(self.cfg.get("rate") or 0)
        if rate > 0:
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)


class FileSource(Source):
    """A 52-column run file (one reading per row; seq = row index) or a JSON-lines file."""
    kind = "file"

    def run(self):
        from zeroedge.daemon.spool import Reading

        path = Path(self.cfg["path"])
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            t0 = time.monotonic()
            with open(path, "rb") as f:
                for i, line in enumerate(f):
                    if self.stopping.is_set():
                        return
                    self._pace(t0, i)
                    if line.strip():
                        self.put(Incoming(line.rstrip(b"\n"), source="file"))
            return
        from zeroedge.sensor.tep import load_run

        sensor = self.cfg.get("sensor") or path.stem
        data = load_run(path, finite=False)    # a non-finite reading is rejected alone, as a live one
        start = self.spool.last_seq_of(sensor) + 1
        if start:
            self.log.info(f"file source {path}: resuming {sensor} at seq {start}")
        t0 = time.monotonic()
        for i in range(start, len(data)):
            if self.stopping.is_set():
                return
            self._pace(t0, i - start)
            self.put(Incoming(Reading(sensor, i, data[i], None, source="file"), source="file"))


class StdinSource(Source):
    kind = "stdin"

    def run(self):
        for line in sys.stdin.buffer:
            if self.stopping.is_set():
                return
            if line.strip():
                self.put(Incoming(line.rstrip(b"\n"), source="stdin"))


class SimulatorSource(Source):
    """The tep-studio closed loop, one reading per simulated 3 minutes (needs tep-studio)."""
    kind = "simulator"

    def run(self):
        from zeroedge.daemon.spool import Reading
        from zeroedge.sensor.tep import stream

        c = self.cfg
        sensor = c.get("sensor") or "tep-sim"
        start = self.spool.last_seq_of(sensor) + 1
        t0 = time.monotonic()
        for i, frame in enumerate(stream(int(c["fault"]), int(c["seed"]), float(c["hours"]),
                                         float(c["onset_h"]))):
            if self.stopping.is_set():
                return
            if i < start:
                continue
            self._pace(t0, i - start)
            self.put(Incoming(Reading(sensor, i, frame, time.time(), source="simulator"), source="simulator"))


class MqttSource(Source):
    """MQTT v5, QoS 1, persistent session (clean_start=False, session expiry), manual ack."""
    kind = "mqtt"

    def __init__(self, cfg, put, log, spool):
        super().__init__(cfg, put, log, spool)
        self.connected = False
        self.client = make_client(cfg, cfg["client_id"], log, self)

    def start(self):
        self.client.loop_start()

    def run(self):  # pragma: no cover - paho runs the network loop
        pass

    def on_message(self, client, userdata, msg):
        if self.stopping.is_set():
            return                       # not acked: the broker redelivers it next session
        mid, qos = msg.mid, msg.qos
        try:
            topic = msg.topic
        except UnicodeDecodeError:          # an exception here would end paho's network thread
            topic = "<topic not UTF-8>"
        self.put(Incoming(bytes(msg.payload), ack=(lambda: client.ack(mid, qos)) if qos else None,
                          source=f"mqtt:{topic}"))

    def publish(self, topic, payload: bytes, qos=1):
        self.client.publish(topic, payload, qos=qos)

    def close(self):
        try:
            self.client.disconnect()
        finally:
            self.client.loop_stop()


def make_client(cfg, client_id, log, owner=None):
    from zeroedge.errors import require

    mqtt = require("paho.mqtt.client", "daemon")
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    if cfg.get("username"):
        c.username_pw_set(cfg["username"], cfg.get("password"))
    if cfg.get("tls_ca") or cfg.get("tls_cert"):
        import ssl

        # the broker's certificate must chain to tls_ca (else the system CAs) and name the host
        c.tls_set(ca_certs=_str(cfg.get("tls_ca")), certfile=_str(cfg.get("tls_cert")),
                  keyfile=_str(cfg.get("tls_key")), cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
    c.reconnect_delay_set(min_delay=0.2, max_delay=5)
    c.max_inflight_messages_set(1000)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = int(cfg.get("session_expiry_s", 604800))
    props.ReceiveMaximum = 1000

    def on_connect(client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            log.warning(f"mqtt connect to {cfg['host']}:{cfg['port']} refused: {reason_code}")
            return
        failures[0] = 0
        if owner is not None:
            client.subscribe(cfg["topic"], qos=int(cfg.get("qos", 1)))
            log.info(f"mqtt connected to {cfg['host']}:{cfg['port']} (session present: "
                     f"{flags.session_present}); subscribed {cfg['topic']}")

    def on_disconnect(client, userdata, flags, reason_code, properties):
        if owner is not None:
            if owner.connected:
                log.warning(f"mqtt disconnected ({reason_code}); reconnecting")
            owner.connected = False

    def on_subscribe(client, userdata, mid, reason_codes, properties):
        if owner is not None:
            if any(rc.is_failure for rc in reason_codes):
                log.error(f"mqtt subscribe to {cfg['topic']} refused: {reason_codes}")
            else:
                owner.connected = True      # healthy once the subscription is in place

    failures = [0]

    def on_connect_fail(client, userdata):
        failures[0] += 1
        if failures[0] in (1, 10) or failures[0] % 100 == 0:     # a broker down for hours: a few lines
            log.warning(f"mqtt connection to {cfg['host']}:{cfg['port']} failed ({failures[0]} attempts"
                        f"{'; TLS: check tls_ca / the broker certificate' if cfg.get('tls_ca') else ''}); retrying")

    c.on_connect, c.on_disconnect, c.on_subscribe = on_connect, on_disconnect, on_subscribe
    c.on_connect_fail = on_connect_fail
    if owner is not None:
        c.manual_ack_set(True)
        c.on_message = owner.on_message
    c.connect_async(cfg["host"], int(cfg["port"]), keepalive=int(cfg.get("keepalive_s", 30)),
                    clean_start=False, properties=props)
    return c


def _str(path):
    return None if path is None else str(path)


SOURCES = {"mqtt": MqttSource, "file": FileSource, "stdin": StdinSource, "simulator": SimulatorSource}
