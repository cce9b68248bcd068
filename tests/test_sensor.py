"""Sensor model, data, PCA baseline, bundle export, sensor-eval contract and the demo hook."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tep-braatz"


def test_load_run_transposes_d00_and_rejects_bad_files(tmp_path):
    from zeroedge.errors import UserError
    from zeroedge.sensor.tep import load_run

    assert load_run(SHARED / "d00.dat").shape == (500, 52)
    assert load_run(SHARED / "d01.dat").shape == (480, 52)
    bad = tmp_path / "bad.dat"
    bad.write_text("1 2 3\n4 5 6\n")
    with pytest.raises(UserError, match="52 columns"):
        load_run(bad)
    bad.write_text("a b c\n")
    with pytest.raises(UserError):
        load_run(bad)


def test_detection_metrics():
    from zeroedge.sensor.metrics import detection_metrics

    a = np.zeros(100, bool)
    a[5] = True                     # one false alarm before onset 50
    a[55] = True                    # a blip, not sustained
    a[60:] = True
    m = detection_metrics(a, 50)
    assert m["far"] == pytest.approx(1 / 50)
    assert m["fdr"] == pytest.approx(41 / 50)
    assert m["delay"] == 10
    assert detection_metrics(np.zeros(10, bool), 5)["delay"] is None


def test_model_is_causal_and_prefix_consistent():
    import torch

    from zeroedge.sensor.model import SensorConfig, SensorTransformer

    torch.manual_seed(0)
    m = SensorTransformer(SensorConfig(window=16, dim=32, n_layers=2, n_heads=4, ffn_dim=64)).eval()
    x = torch.randn(2, 16, 52)
    with torch.no_grad():
        full = m(x)
        pre = m(x[:, :9])
        y = x.clone()
        y[:, 12:] += 5.0                # the future must not change the past
        changed = m(y)
    assert torch.allclose(full[:, :9], pre, atol=1e-5)
    assert torch.allclose(full[:, :12], changed[:, :12], atol=1e-5)
    assert not torch.allclose(full[:, 12:], changed[:, 12:], atol=1e-3)


def test_export_bundle_matches_torch_and_verifies(tmp_path):
    import torch

    from zeroedge import bundle as zb
    from zeroedge.sensor import CLASS_NAMES
    from zeroedge.sensor.model import SensorConfig, SensorTransformer
    from zeroedge.sensor.runtime import load_bundle
    from zeroedge.sensor.train import export_bundle, save_model

    torch.manual_seed(1)
    cfg = SensorConfig(window=16, dim=32, n_layers=1, n_heads=4, ffn_dim=64)
    m = SensorTransformer(cfg).eval()
    meta = {"config": cfg.to_dict(), "window": 16, "channels": 52, "class_names": CLASS_NAMES,
            "hard_faults": [3, 9, 15], "normalisation": {"mean": [1.0] * 52, "std": [2.0] * 52},
            "alarm": {"ema_alpha": 0.5, "threshold": 0.5}}
    save_model(tmp_path / "w.npz", m, meta)
    man = export_bundle(tmp_path / "b", tmp_path / "w.npz")
    assert man["kind"] == "sensor" and man["sensor"]["window"] == 16
    assert set(man["files"]) == {"model.onnx", "weights.npz"}
    zb.verify(tmp_path / "b")
    x = np.random.default_rng(0).normal(1.0, 2.0, (3, 16, 52)).astype(np.float32)
    ort_det = load_bundle(tmp_path / "b")
    torch_det = load_bundle(tmp_path / "b", backend="torch")
    p1, p2 = ort_det.probs(x), torch_det.probs(x)
    assert p1.shape == (3, len(CLASS_NAMES))
    np.testing.assert_allclose(p1, p2, atol=1e-5)
    with torch.no_grad():
        ref = m(torch.from_numpy((x - 1.0) / 2.0))[:, -1].softmax(-1).numpy()
    np.testing.assert_allclose(p1, ref, atol=1e-5)
    np.testing.assert_allclose(ort_det.probs(x[:, :5]), torch_det.probs(x[:, :5]), atol=1e-5)


def test_pca_monitor_limits_and_detection():
    from zeroedge.sensor.pca import PCAMonitor
    from zeroedge.sensor.tep import load_run

    normal = load_run(SHARED / "d00.dat")
    pca = PCAMonitor().fit(normal)
    a = pca.alarms(normal)
    assert a["t2"].mean() < 0.03 and a["q"].mean() < 0.03     # 99 % limits
    f1 = pca.alarms(load_run(SHARED / "d01.dat"))
    assert f1["t2_or_q"][50:].mean() > 0.9


def test_simulator_stream_is_reproducible():
    pytest.importorskip("tep_studio")
    from zeroedge.sensor.tep import simulate

    a = simulate(21, 7, 1.0, 0.5)
    b = simulate(21, 7, 1.0, 0.5)
    c = simulate(0, 8, 1.0, 0.5)
    assert a.shape == (20, 52)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.all(a[11:, 44] == a[11, 44])      # fault 21: stream-4 valve (XMV 4) stuck from onset


@pytest.fixture(scope="module")
def shipped_bundle(tmp_path_factory):
    from zeroedge.sensor.train import SHIPPED, ensure_bundle

    assert SHIPPED.is_file() and SHIPPED.stat().st_size < 5e6
    return ensure_bundle(tmp_path_factory.mktemp("b") / "sensor")


def test_sensor_eval_contract(tmp_path, shipped_bundle):
    pytest.importorskip("tep_studio")
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.tep import load_run, save_run, simulate

    run = tmp_path / "f01.dat"
    save_run(run, simulate(1, 77, 8.0, 3.0))      # IDV(1) from sample 60 of 160
    p = run_cli("sensor-eval", run, SHARED / "d00.dat", "--onset", 60, "--json", "--bundle",
                shipped_bundle, check_rc=0)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert {"file", "fdr", "far", "delay", "predicted_fault"} <= set(r)
        assert 0.0 <= r["fdr"] <= 1.0 and 0.0 <= r["far"] <= 1.0
    assert rows[0]["file"] == str(run)
    assert rows[0]["fdr"] > 0.6 and rows[0]["far"] <= 0.1 and rows[0]["predicted_fault"] == "fault_01"
    m = evaluate_frames(load_bundle(shipped_bundle), load_run(run), 60)
    assert (m["fdr"], m["far"], m["delay"]) == (rows[0]["fdr"], rows[0]["far"], rows[0]["delay"])
    p = run_cli("sensor-eval", tmp_path / "missing.dat", "--onset", 1)
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_demo_hook(tmp_path, shipped_bundle):
    pytest.importorskip("tep_studio")
    from zeroedge.sensor import demo

    s = demo.run(tmp_path, hours=6.0, onset_h=2.0)
    assert Path(s["png"]).is_file() and Path(s["png"]).stat().st_size > 10000
    for k in ("fdr", "far", "delay", "predicted_fault", "readings_per_s"):
        assert k in s
    assert s["predicted_fault"] == "fault_01" and s["fdr"] > 0.5


class _ConstBackend:
    name = "const"

    def __init__(self):
        self.calls = []

    def __call__(self, x):
        self.calls.append(x.shape)
        p = np.zeros((len(x), 22), np.float32)
        p[:, 0] = 0.2
        p[:, 4] = 0.8
        return p


def _detector(window=8):
    from zeroedge.sensor import CLASS_NAMES
    from zeroedge.sensor.runtime import Detector

    meta = {"window": window, "channels": 52, "class_names": CLASS_NAMES,
            "normalisation": {"mean": [0.0] * 52, "std": [1.0] * 52},
            "alarm": {"ema_alpha": 0.5, "threshold": 0.5}}
    return Detector(meta, _ConstBackend())


def test_engine_windows_cadence_and_bounded_state():
    from zeroedge.sensor.runtime import Engine

    det = _detector()
    eng = Engine(det, infer_every=4)
    frames = np.arange(30 * 52, dtype=np.float32).reshape(30, 52)
    res = eng.process([("a", i, f, None) for i, f in enumerate(frames)], now=0.0)
    assert [r["seq"] for r in res] == [3, 7, 11, 15, 19, 23, 27]
    assert all(r["alarm"] and r["fault"] == "fault_04" for r in res)
    assert res[0]["rising"] and not res[1]["rising"]
    assert det.backend.calls[0] == (1, 4, 52) and (1, 8, 52) in det.backend.calls or \
        any(c[1] == 8 for c in det.backend.calls)
    st = eng.streams["a"]
    np.testing.assert_array_equal(st.snapshot(), frames[-8:])   # ring in time order
    assert st.memory_bytes() == 8 * 52 * 4
    # time-based inference: a stream with unseen readings gets a result after the interval
    eng2 = Engine(_detector(), infer_every=1000, infer_interval_s=5.0)
    assert eng2.process([("b", 0, frames[0], None)], now=0.0)       # first reading: interval elapsed
    assert eng2.process([("b", 1, frames[1], None)], now=1.0) == []
    assert eng2.tick(now=2.0) == []
    out = eng2.tick(now=6.0)
    assert [r["seq"] for r in out] == [1]
