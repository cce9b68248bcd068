"""zeroedge sensor-fit: a bundle fitted to the standard TEP training runs, its provenance, the
sensor-eval contract on it, the drift warning (sensor-eval and daemon), and bad input."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tep-braatz"


def _write(path, X):
    np.savetxt(path, X, fmt="%.6g")
    return path


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """Fit files: d00[:340] and d01/d02/d06/d09 [:320]; held-out runs: d00[340:] then dNN[320:]."""
    from zeroedge.sensor.tep import load_run

    root = tmp_path_factory.mktemp("split")
    d0 = load_run(SHARED / "d00.dat")
    fit = {"normal": _write(root / "d00.dat", d0[:340])}
    held = {}
    for f in (1, 2, 6, 9):
        X = load_run(SHARED / f"d{f:02d}.dat")
        fit[f] = _write(root / f"d{f:02d}.dat", X[:320])
        held[f] = _write(root / f"test_{f:02d}.dat", np.concatenate([d0[340:], X[320:]]))
    held[0] = _write(root / "test_normal.dat", d0[340:])
    return root, fit, held


@pytest.fixture(scope="module")
def fitted(split):
    root, fit, _ = split
    out = root / "bundle"
    # the contract's shape: one --faults followed by more files
    p = run_cli("sensor-fit", fit["normal"], "--faults", fit[1], fit[2], fit[6], fit[9], "-o", out,
                "--max-steps", 200, "--json", check_rc=0)
    return out, json.loads(p.stdout.splitlines()[-1]), p.stderr


def test_fit_manifest_records_provenance(split, fitted):
    from zeroedge import bundle as zb
    from zeroedge.sensor.fit import _sha256

    root, fit, _ = split
    out, summary, log = fitted
    m = zb.verify(out)
    assert m["kind"] == "sensor" and set(m["files"]) == {"model.onnx", "weights.npz"}
    s = m["sensor"]
    prov = s["fit"]
    assert [f["file"] for f in prov["normal_files"]] == [str(fit["normal"])]
    assert prov["normal_files"][0]["sha256"] == _sha256(fit["normal"])
    assert {f["class"]: f["sha256"] for f in prov["fault_files"]} == {
        f"fault_{k:02d}": _sha256(fit[k]) for k in (1, 2, 6, 9)}
    assert prov["split"]["normal"][0]["train"] == [0, 255] and prov["split"]["normal"][0]["held_out"] == [255, 340]
    # fault 9 leaves no trace in the measurements: recognised, its windows train the normal class
    assert prov["unobservable_classes"] == ["fault_09"] and "fault_09" in log
    assert prov["train"]["best_step"] <= prov["train"]["steps"] <= 200
    assert s["alarm"]["far_target"] == 0.02 and 0 < s["alarm"]["threshold"] < 1
    assert s["alarm"]["val_far"] <= 0.02 and summary["held_out_far"] == s["alarm"]["val_far"]
    # the Q gate, when kept, is the bundle's (monitor) and the summary's; each held-out normal run's FAR
    assert s["monitor"]["q_limit"] == s["alarm"]["q_limit"] == summary["q_limit"]
    assert s["monitor"]["q_frames"] == 32 and s["monitor"]["q_scale"] > 0
    assert (s["alarm"]["q_limit"] is None) == (s["alarm"]["q_share"] == 0)
    # the channel gates likewise (the spread and level gates share the Q gate's quarter of the budget)
    from zeroedge.sensor.fit import GATE_SHARES

    assert tuple(s["alarm"][f"{g}_share"] for g in ("q", "spread", "level")) in GATE_SHARES
    for g in ("spread", "level"):
        assert s["monitor"][f"{g}_limit"] == s["alarm"][f"{g}_limit"] == summary[f"{g}_limit"]
        assert (s["alarm"][f"{g}_limit"] is None) == (s["alarm"][f"{g}_share"] == 0)
        assert len(s["monitor"][f"{g}_scale"]) == 52 and min(s["monitor"][f"{g}_scale"]) >= 0.1
    assert s["monitor"]["still_gate"] == s["alarm"]["still_gate"] == summary["still_gate"]
    assert s["monitor"]["channel_frames"] == 16 and len(s["monitor"]["still_std"]) == 52
    runs = s["alarm"]["val_far_runs"]
    assert list(runs) == [str(fit["normal"]), str(fit[9])] and all(0 <= v <= 1 for v in runs.values())
    assert abs(np.mean(list(runs.values())) - s["alarm"]["val_far"]) < 0.01      # two runs of 340 and 320
    # the alarm is calibrated out of fold: the two normal runs (d00 and the normal-looking d09) are
    # each held out whole; 660 samples are a score of independent alarm blocks, too few to support
    # FAR 0.01, and the fit says so (log, manifest, summary)
    assert s["alarm"]["validation"] == {"kind": "blocked folds", "folds": 4, "gap_samples": 32 + 44,
                                        "normal_held_out": "whole runs", "normal_samples": 340 + 320}
    ev = prov["validation"]["far_evidence"]
    span = ev["block_samples"]
    assert ev == s["alarm"]["val_far_evidence"] and ev["independent_blocks"] == 340 // span + 320 // span
    assert not ev["supported"] and ev["far_upper"] > 0.1 and summary["held_out_far_upper_95"] == ev["far_upper"]
    assert summary["far_target_supported"] is False and "bound the FAR only below" in log
    assert log.count("[sensor-fit] fold ") == 4
    assert set(prov["validation"]["per_class"]) == {"fault_01", "fault_02", "fault_06"}
    # the normalisation is the plant's own (training part of d00), not the shipped one
    from zeroedge.sensor.tep import load_run

    np.testing.assert_allclose(s["normalisation"]["mean"], load_run(fit["normal"])[:255].mean(0), rtol=1e-4)
    assert len(s["monitor"]["components"]) == 52 and s["monitor"]["limit"] > 0


def test_fitted_bundle_detects_held_out_runs(split, fitted):
    _, _, held = split
    out, _, _ = fitted
    files = [held[1], held[2], held[6], held[0]]
    p = run_cli("sensor-eval", "--bundle", out, *files, "--onset", 160, "--json", check_rc=0)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["file"] for r in rows] == [str(f) for f in files]
    for r in rows[:3]:
        assert {"file", "fdr", "far", "delay", "predicted_fault"} <= set(r)
        assert r["fdr"] > 0.8 and r["far"] <= 0.1 and r["delay"] is not None
    assert [r["predicted_fault"] for r in rows[:3]] == ["fault_01", "fault_02", "fault_06"]
    assert rows[3]["far"] <= 0.1                    # the held-out normal tail (all of it before onset)
    assert "warning" not in p.stderr                # the plant's own data: no drift warning
    # the same bundle through the torch backend gives the same decisions
    p2 = run_cli("sensor-eval", "--bundle", out, held[1], "--onset", 160, "--json", "--backend", "torch",
                 check_rc=0)
    r2 = json.loads(p2.stdout)
    assert abs(r2["fdr"] - rows[0]["fdr"]) <= 0.01 and r2["predicted_fault"] == "fault_01"


def test_normal_only_fit_keeps_shipped_weights_and_calibrates(split, tmp_path):
    from zeroedge import bundle as zb
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.tep import load_run
    from zeroedge.sensor.train import SHIPPED

    _, fit, held = split
    out = tmp_path / "normal-only"
    run_cli("sensor-fit", fit["normal"], "-o", out, "--far", "0.02", check_rc=0)
    s = zb.verify(out)["sensor"]
    assert s["fit"]["train"] is None and s["fit"]["fault_files"] == []
    shipped, mine = np.load(SHIPPED), np.load(out / "weights.npz")
    assert all(np.array_equal(shipped[k], mine[k]) for k in shipped.files if k != "__meta__")
    assert s["alarm"]["far_target"] == 0.02 and s["alarm"]["val_far"] <= 0.02
    det = load_bundle(out)
    m = evaluate_frames(det, load_run(held[1]), 160)
    assert m["fdr"] > 0.9 and m["far"] <= 0.1      # fault 1 is far from normal operation


def test_drift_warning_shipped_bundle_on_another_plant(sensor_bundle, fitted):
    from zeroedge.sensor.runtime import Engine, load_bundle
    from zeroedge.sensor.tep import load_run

    d00 = SHARED / "d00.dat"
    p = run_cli("sensor-eval", "--bundle", sensor_bundle, d00, "--onset", 100, "--json", check_rc=0)
    assert json.loads(p.stdout)["file"] == str(d00)           # stdout stays one JSON object per file
    assert "warning" in p.stderr and "do not look like" in p.stderr and "sensor-fit" in p.stderr
    X = load_run(d00)[:100]
    eng = Engine(load_bundle(sensor_bundle))
    eng.process([(s, i, f, None) for i, f in enumerate(X) for s in ("a", "b")], now=0.0)
    warns = eng.pop_warnings()
    assert sorted(s for s, _ in warns) == ["a", "b"] and eng.pop_warnings() == []   # once per stream
    eng2 = Engine(load_bundle(fitted[0]))
    eng2.process([("a", i, f, None) for i, f in enumerate(X)], now=0.0)
    assert eng2.pop_warnings() == []


def test_daemon_warns_on_data_unlike_the_bundle(tmp_path, sensor_bundle, fitted):
    import daemon_harness as T
    from zeroedge.sensor.tep import load_run

    X = load_run(SHARED / "d00.dat")[:60]
    lines = "".join(json.dumps(T.reading("line1", i, X[i].tolist())) + "\n" for i in range(len(X)))
    logs = {}
    for name, b in (("shipped", sensor_bundle), ("fitted", fitted[0])):
        d = tmp_path / name
        d.mkdir()
        cfg = T.write_config(d / "c.toml", b, {"kind": "stdin"}, T.free_port())
        p = subprocess.run([sys.executable, "-m", "zeroedge.cli", "daemon", "--config", str(cfg)], input=lines,
                           text=True, capture_output=True, timeout=120, cwd=d)
        assert p.returncode == 0, p.stderr[-2000:]
        assert len(T.read_results(d / "results.jsonl")) == len(X)
        logs[name] = p.stderr
    assert "sensor=line1: the first 32 samples do not look like" in logs["shipped"]
    assert "do not look like" not in logs["fitted"]


def test_far_evidence_counts_independent_blocks():
    from zeroedge.sensor.fit import far_evidence

    quiet = far_evidence([np.zeros(20_000, bool)], 32, 0.5, 0.01)   # blocks of 32 + 7 samples
    assert quiet["block_samples"] == 39 and quiet["independent_blocks"] == 512 and quiet["alarmed_blocks"] == 0
    assert abs(quiet["far_upper"] - (1 - 0.05 ** (1 / 512))) < 1e-4 and quiet["supported"]
    few = far_evidence([np.zeros(100, bool), np.zeros(100, bool)], 32, 1.0, 0.01)
    assert few["independent_blocks"] == 6 and not few["supported"]
    noisy = np.zeros(20_000, bool)
    noisy[::390] = True                                              # one block in ten alarms
    loud = far_evidence([noisy], 32, 0.5, 0.01)
    assert loud["alarmed_blocks"] == 52 and 0.1 < loud["far_upper"] < 0.2 and not loud["supported"]


def test_folds_hold_out_blocks_with_a_gap_and_whole_runs():
    from zeroedge.sensor.fit import fold_blocks, fold_gap, fold_scores
    from zeroedge.sensor.tep import load_run

    gap = fold_gap(32)
    held = []
    for j in range(4):
        (a, b), pieces = fold_blocks(500, j, gap)
        held.append((a, b))
        assert pieces and all(e <= a - gap or s >= b + gap for s, e in pieces)
    assert held[0][0] == 0 and held[-1][1] == 500 and all(held[i][1] == held[i + 1][0] for i in range(3))
    # a second normal run whose channel 9 sits 6 standard deviations off the first's: held out whole,
    # it is scored by a detector whose normalisation and monitor never saw it, and looks abnormal
    d0 = load_run(SHARED / "d00.dat")
    other = d0.copy()
    other[:, 8] += 6 * d0[:, 8].std()
    sc = fold_scores([d0, other], [], 32, 0, log=lambda m: None)
    assert [len(x) for x in sc.normal] == [500, 500] and sc.gap == gap
    assert np.mean(sc.normal[1] > 0.5) > 0.9
    # what the input check accepts is what the folds can train on: one run needs 280 samples, two
    # runs held out in turn need 2 windows each
    from zeroedge.sensor.fit import folds_can_train

    assert folds_can_train([280], 32) and not folds_can_train([279], 32)
    assert folds_can_train([150, 150], 32) and not folds_can_train([150, 63], 32)
    # one normal run: blocks of it, each scored once
    one = fold_scores([d0], [(load_run(SHARED / "d01.dat"), 1)], 32, 0, log=lambda m: None)
    assert [len(x) for x in one.normal] == [125] * 4 and len(one.faults) == 4 and not one.whole_runs


def test_threshold_and_monitor_units():
    from zeroedge.commands.sensor_fit import _split_args
    from zeroedge.sensor.fit import choose_threshold
    from zeroedge.sensor.runtime import apply_monitor

    rng = np.random.default_rng(0)
    s = 1 / (1 + np.exp(-rng.normal(-6, 1, 4000)))          # log-odds N(-6, 1)
    thr = choose_threshold(s[:200], 0.01)
    assert 0.003 < (s > thr).mean() < 0.03                   # ~1 % on data it never saw
    assert thr >= np.quantile(s[:200], 0.99)
    assert choose_threshold(s[:200], 0.001) > thr
    mon = {"center": np.zeros(3, np.float32), "components": np.eye(3, dtype=np.float32)[:, :2],
           "inv_var": np.ones(2, np.float32), "limit": 4.0, "steepness": 10.0}
    p = np.array([[0.9, 0.06, 0.04], [0.9, 0.06, 0.04]], np.float32)
    z = np.array([[0.1, 0.1, 9.0], [3.0, 0.0, 0.0]], np.float32)       # T^2 0.02 and 9 (limit 4)
    q = apply_monitor(mon, p, z)
    np.testing.assert_allclose(q.sum(1), 1.0, atol=1e-6)
    assert q[0, 0] > 0.89 and q[1, 0] < 0.01 and q[1, 1] > q[1, 2]
    argv = ["zeroedge", "sensor-fit", "n.dat", "--faults", "d01.dat", "d02.dat", "d00b.dat", "-o", "B", "x.dat"]
    assert _split_args(["n.dat", "d02.dat", "d00b.dat", "x.dat"], ["d01.dat"], argv) == (
        ["n.dat"], ["d01.dat", "d02.dat", "d00b.dat", "x.dat"])


def test_bad_input_one_line_exit_2_nothing_written(tmp_path):
    from zeroedge.sensor.tep import load_run

    d0 = load_run(SHARED / "d00.dat")
    ok = _write(tmp_path / "normal.dat", d0)
    f1 = _write(tmp_path / "d01.dat", load_run(SHARED / "d01.dat")[:100])
    cols = _write(tmp_path / "cols.dat", d0[:, :40])
    few = _write(tmp_path / "few.dat", d0[:100])
    mid = _write(tmp_path / "mid.dat", d0[:250])           # enough once, too few for the validation folds
    const = d0.copy()
    const[:, 7] = 3.0
    const = _write(tmp_path / "const.dat", const)
    nan = tmp_path / "nan.dat"
    nan.write_text(ok.read_text().replace("\n", "\nnan " + " ".join(["1"] * 51) + "\n", 1))
    short = _write(tmp_path / "d02.dat", load_run(SHARED / "d02.dat")[:20])
    nolabel = _write(tmp_path / "run7.dat", load_run(SHARED / "d07.dat")[:100])
    garbage = tmp_path / "garbage.dat"
    garbage.write_bytes(bytes(range(256)) * 10)
    exists = tmp_path / "exists"
    exists.mkdir()
    cases = [
        ([cols], "52 columns"),
        ([few], "too few"),
        ([mid], "validation folds"),
        ([few, "--window", "16", "--faults", f1, "--window", "64"], "too few"),
        ([const], "constant"),
        ([nan], "non-finite"),
        ([ok, "--faults", short], "fewer than the window"),
        ([ok, "--faults", nolabel], "--label"),
        ([ok, "--faults", nolabel, "--label", "run7.dat=99"], "out of range"),
        ([ok, "--faults", f1, "--label", "other.dat=3"], "not among --faults"),
        ([garbage], "numeric"),
        ([tmp_path / "missing.dat"], "no such file"),
        ([ok, "--faults", ok], "twice"),
        ([ok, "--far", "0.7"], "--far"),
        ([ok, "--window", "2"], "--window"),
    ]
    for args, words in cases:
        out = tmp_path / "never"
        p = run_cli("sensor-fit", *args, "-o", out)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (args, p.stderr)
        assert len(lines) == 1 and lines[0].startswith("zeroedge: error:") and words in lines[0], (args, p.stderr)
        assert not out.exists() and not list(tmp_path.glob("never*")), args
    p = run_cli("sensor-fit", ok, "-o", exists)
    assert p.returncode == 2 and "--force" in p.stderr and list(exists.iterdir()) == []


def test_demo_fits_one_run_and_detects_on_another(tmp_path):
    pytest.importorskip("tep_studio")
    from zeroedge.sensor import demo

    s = demo.fit_demo(tmp_path)                    # 15 h of normal operation: enough for the validation folds
    assert Path(s["bundle"], "manifest.json").is_file()
    assert s["predicted_fault"] == "fault_01" and s["fdr"] > 0.8 and s["far"] <= 0.05
    assert s["drift_warning"] is None


def test_a_plants_own_exports_read_as_the_standard_files(tmp_path):
    """CSV (comma or semicolon, a header line of names, comments) gives the numbers of the
    whitespace file; a NaN is refused with one line by sensor-eval as by sensor-fit."""
    from zeroedge.errors import UserError
    from zeroedge.sensor.tep import load_run

    X = load_run(SHARED / "d01.dat")[:200]
    header = ",".join(f"XMEAS{i + 1}" for i in range(41)) + "," + ",".join(f"XMV{i + 1}" for i in range(11))
    comma = tmp_path / "plant.csv"
    comma.write_text("# exported by the historian\n" + header + "\n"
                     + "\n".join(",".join(f"{v:.9g}" for v in row) for row in X) + "\n")
    semi = tmp_path / "plant_semicolon.txt"
    semi.write_text("\n".join("; ".join(f"{v:.9g}" for v in row) for row in X) + "\n")
    for f in (comma, semi):
        np.testing.assert_array_equal(load_run(f), X)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text(header + "\n" + ",".join(["1"] * 52) + "\n" + ",".join(["1"] * 51) + "\n")
    with pytest.raises(UserError, match="numeric"):
        load_run(ragged)
    nan = tmp_path / "nan.csv"
    rows = comma.read_text().splitlines()
    nan.write_text("\n".join(rows[:5] + ["nan," + ",".join(["1"] * 51)] + rows[5:]) + "\n")
    p = run_cli("sensor-eval", nan, "--onset", 10)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "non-finite" in lines[0], p.stderr
    assert np.isnan(load_run(nan, finite=False)).sum() == 1        # the daemon's file source: rejected alone
    huge = tmp_path / "huge.dat"
    with huge.open("wb") as f:                  # sparse: refused by its size before any read
        f.truncate((1 << 30) + 1)
    with pytest.raises(UserError, match="GiB"):
        load_run(huge)


def test_q_gate_runtime_matches_calibration_units():
    """The window Q the daemon gates on (runtime.window_q over each window) equals what the
    calibration reads for the same samples (runtime.run_q over the run); where it is above q_limit,
    P(normal) is 0 and the fault classes keep their order; without q_limit nothing changes."""
    from zeroedge.sensor.fit import fit_monitor
    from zeroedge.sensor.runtime import Detector, run_q, window_q

    rng = np.random.default_rng(1)
    Z = rng.normal(size=(400, 6)) @ rng.normal(size=(6, 6))
    mon = fit_monitor(Z, q_frames=5)
    assert mon["q_limit"] is None and mon["q_frames"] == 5
    run = np.concatenate([rng.normal(size=(30, 6)) @ rng.normal(size=(6, 6)), rng.normal(size=(20, 6)) * 4])
    per_sample = run_q(mon, run)
    by_window = [window_q(mon, run[None, max(0, t - 7):t + 1])[0] for t in range(len(run))]
    np.testing.assert_allclose(per_sample, by_window, rtol=1e-4)
    assert abs(run_q(mon, Z).mean() - 1.0) < 0.3                 # Q in units of its mean on the fit data
    assert per_sample[40:].min() > per_sample[:25].max()          # frames off the components: larger Q

    class Fixed:                                                  # a backend that says "normal, 90 %"
        def __call__(self, x):
            return np.tile(np.array([[0.9, 0.06, 0.04]], np.float32), (len(x), 1))

    def detector(q_limit):
        m = dict(mon, q_limit=q_limit, limit=1e9, steepness=100.0)   # T^2 out of the way
        return Detector({"window": 8, "channels": 6, "class_names": ["normal", "a", "b"],
                         "normalisation": {"mean": [0.0] * 6, "std": [1.0] * 6},
                         "alarm": {"ema_alpha": 1.0, "threshold": 0.5}, "monitor": m}, Fixed())

    windows = np.stack([run[t - 7:t + 1] for t in range(7, len(run))])
    limit = float(np.quantile(per_sample, 0.5))
    g, plain = detector(limit).probs(windows), detector(None).probs(windows)
    raised = per_sample[7:] > limit
    assert raised.any() and not raised.all()
    np.testing.assert_allclose(g.sum(1), 1.0, atol=1e-6)
    assert (g[raised, 0] == 0).all() and (g[raised, 1] > g[raised, 2]).all()
    np.testing.assert_allclose(g[~raised], plain[~raised], atol=1e-7)
    np.testing.assert_allclose(plain[:, 0], 0.9, atol=1e-6)


def test_channel_gates_read_each_channel_alone():
    """Over the last channel_frames frames: a channel that moved in every stretch of the normal data
    and then holds its value (a valve stuck where it was, a frozen sensor) raises the still gate; one
    that moves more than it did there raises the spread gate past its limit; one that sits off its
    normal mean by more than it did there, the level gate. Each reads the same sample by sample
    (calibration) as window by window (daemon); a channel that already stood still in the normal data
    never raises the still gate; with the gates off nothing changes."""
    from zeroedge.sensor.fit import fit_monitor
    from zeroedge.sensor.runtime import Detector, run_channel_stats, window_channel_stats

    rng = np.random.default_rng(2)
    Z = rng.normal(size=(400, 5))
    Z[100:120, 4] = 0.7                                       # channel 4 stands still in normal data
    mon = fit_monitor(Z, q_frames=8, channel_frames=6)
    assert mon["still_gate"] is False and mon["spread_limit"] is None and mon["level_limit"] is None
    assert mon["channel_frames"] == 6
    assert all(v > 0 for v in mon["still_std"][:4]) and mon["still_std"][4] == 0.0
    assert all(1.0 < v < 3.0 for v in mon["spread_scale"])    # the most a channel moved over 6 samples
    assert all(0.5 < v < 3.0 for v in mon["level_scale"])     # the furthest its 6-sample mean went
    # runs given apart are read one by one: no stretch spans the step from one run to the next
    other = np.random.default_rng(3).normal(size=(200, 5)) + 10
    assert max(fit_monitor([Z, other], channel_frames=6)["spread_scale"]) < 3.0
    assert max(fit_monitor(np.concatenate([Z, other]), channel_frames=6)["spread_scale"]) > 4.0

    run = rng.normal(size=(110, 5))
    run[30:, 1] = run[29, 1]                                  # channel 1 holds its value from sample 29
    run[10:40, 4] = 0.7                                       # channel 4 held still: as in normal data
    run[60:80, 2] *= 8                                        # channel 2 swings 8 times as far, 60-79
    run[90:, 3] += 6                                          # channel 3 sits 6 above its mean from 90
    st = run_channel_stats(mon, run)
    assert not st.still[:34].any() and st.still[34:].all()    # 6 equal values from 29 to 34
    assert st.spread[:60].max() < 2 and st.spread[65:80].min() > 2
    assert st.level[:60].max() < 2 and st.level[95:].min() > 2
    by_window = [window_channel_stats(mon, run[None, max(0, t - 7):t + 1]) for t in range(len(run))]
    assert list(st.still) == [bool(w.still[0]) for w in by_window]
    np.testing.assert_allclose(st.spread, [w.spread[0] for w in by_window], rtol=1e-5)
    np.testing.assert_allclose(st.level, [w.level[0] for w in by_window], rtol=1e-5)
    short = window_channel_stats(mon, run[None, 50:55])       # shorter than channel_frames: nothing
    assert not short.still[0] and short.spread[0] == 0 and short.level[0] == 0

    class Fixed:                                              # a backend that says "normal, 90 %"
        def __call__(self, x):
            return np.tile(np.array([[0.9, 0.06, 0.04]], np.float32), (len(x), 1))

    def detector(**gates):
        m = dict(mon, **gates, limit=1e9, steepness=100.0)    # T^2 out of the way
        return Detector({"window": 8, "channels": 5, "class_names": ["normal", "a", "b"],
                         "normalisation": {"mean": [0.0] * 5, "std": [1.0] * 5},
                         "alarm": {"ema_alpha": 1.0, "threshold": 0.5}, "monitor": m}, Fixed())

    windows = np.stack([run[t - 7:t + 1] for t in range(7, len(run))])
    np.testing.assert_allclose(detector().probs(windows)[:, 0], 0.9, atol=1e-6)
    for gates, raised in (({"still_gate": True}, st.still), ({"spread_limit": 2.0}, st.spread > 2),
                          ({"level_limit": 2.0}, st.level > 2),
                          ({"still_gate": True, "spread_limit": 2.0, "level_limit": 2.0},
                           st.still | (st.spread > 2) | (st.level > 2))):
        p, up = detector(**gates).probs(windows), raised[7:]
        assert up.any() and not up.all()
        assert (p[up, 0] == 0).all() and (p[~up, 0] > 0.8).all(), gates
