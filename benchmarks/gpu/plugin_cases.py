"""The plugins' enqueue paths on a GPU, on the very nodes a real TensorRT builder accepted.

TensorRT-RTX builds the exported graphs in CI but runs no engine on the H200 (compute capability 9.0). So the
nodes of bundles whose engines built (fields, weights, shapes) are written out on the workstation, and
on the GPU the harness (`zeroedge_harness LIB --run CASE.txt`) creates each plugin from exactly those
fields and enqueues it; the outputs are compared with zeroedge.backends.plugin_reference.

    python benchmarks/gpu/plugin_cases.py extract BUNDLE... -o cases/          # workstation (onnx)
    python benchmarks/gpu/plugin_cases.py run cases/ --harness H --lib LIB     # GPU machine (torch)

extract: one folder per plugin node, `node.json` (op, fields as the graph gives them, where it came
from) and `weights.npz` (SIH: its head and anchor; PathsFFN: w13_t, wd_t). run: SIH at several
prompt lengths in float32 and float16 (ZeroEdgeSIHChunk also in chunks, the carry passed on, against the
reference's one pass), then PAD gather / scatter on its keep mask; PathsFFN at
B = 1, 4, 8 in float16 and bfloat16. Prints one line per check and a summary; exit 1 on a mismatch.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_setup as bs  # noqa: F401  (puts the repository root on sys.path for zeroedge)

SIH_T = (40, 300, 2048)
PATHS_B = (1, 4, 8)


# ------------------------------------------------------------------------------ workstation side

def _initializer_of(graph, name: str):
    """The float32 array behind `name`: an initializer, or one seen through a Cast (fp16 weights)."""
    import numpy as np
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name]).astype(np.float32)
    for n in graph.node:
        if n.op_type == "Cast" and n.output[0] == name and n.input[0] in inits:
            return numpy_helper.to_array(inits[n.input[0]]).astype(np.float32)
    return None


def extract(bundles, out: Path, per_op: int = 3) -> list:
    """Write the cases of every bundle's *.trt.onnx plugin nodes (at most `per_op` per op and bundle);
    returns one dict per node seen: op, bundle, graph, node, written (bool)."""
    import numpy as np
    import onnx

    from zeroedge import plugin_spec as spec

    out.mkdir(parents=True, exist_ok=True)
    seen = []
    for b in map(Path, bundles):
        count = {}
        for g in sorted(b.glob("*.trt.onnx")):
            model = onnx.load(str(g))
            for n in model.graph.node:
                if n.domain != spec.DOMAIN:
                    continue
                row = {"op": n.op_type, "bundle": b.name, "graph": g.name, "node": n.name, "written": False}
                seen.append(row)
                if n.op_type not in (*spec.SIH_OPS, "ZeroEdgePathsFFN") or count.get(n.op_type, 0) >= per_op:
                    continue  # PAD nodes run on each SIH case's keep mask
                count[n.op_type] = count.get(n.op_type, 0) + 1
                fields = {}
                for a in n.attribute:
                    if a.name in spec.NODES[n.op_type]["fields"]:
                        fields[a.name] = ("i", int(a.i)) if a.type == onnx.AttributeProto.INT else ("f", float(a.f))
                names = spec.NODES[n.op_type]["inputs"]
                weights = 12 if n.op_type in spec.SIH_OPS else len(n.input)   # not SIHChunk's carry / span
                arrays = {names[i]: _initializer_of(model.graph, n.input[i]) for i in range(1, weights)}
                if any(v is None for v in arrays.values()):
                    continue
                d = out / f"{b.name}.{g.name.split('.')[0]}.{len(list(out.iterdir())):03d}"
                d.mkdir()
                np.savez(d / "weights.npz", **arrays)
                (d / "node.json").write_text(json.dumps({"op": n.op_type, "fields": fields, "bundle": b.name,
                                                         "graph": g.name, "node": n.name}))
                row["written"] = True
    return seen


# ------------------------------------------------------------------------------ GPU side

def _write_case(folder: Path, op: str, fields: dict, ins, outs) -> Path:
    """ins / outs: (dtype name, shape, file name, torch tensor or None)."""
    import torch

    lines = [f"op {op}"] + [f"field {k} {t} {v!r}" for k, (t, v) in fields.items()]
    for kind, items in (("in", ins), ("out", outs)):
        for dt, shape, fname, tensor in items:
            if tensor is not None:
                tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tofile(folder / fname)
            lines.append(f"{kind} {dt} {len(shape)} {' '.join(map(str, shape))} {fname}")
    (folder / "case.txt").write_text("\n".join(lines) + "\n")
    return folder / "case.txt"


def _read(folder: Path, fname: str, dtype, shape):
    import numpy as np
    import torch

    raw = np.fromfile(folder / fname, dtype=np.uint8)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def _harness(harness, lib, case: Path) -> tuple:
    r = subprocess.run([str(harness), str(lib), "--run", str(case)], capture_output=True, text=True, timeout=300)
    return r.returncode, (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _torch_dtypes() -> dict:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sih_check(case, tmp, fields, values, w, T, dt, harness, lib, rows, chunk=None) -> int:
    """SIH on T random tokens (ZeroEdgeSIHChunk: in chunks of `chunk`, the carry passed on), against
    the reference's one pass, then PAD gather / scatter on its keep mask; returns the failures."""
    import torch

    from zeroedge.backends import plugin_reference as ref

    tdt = _torch_dtypes()
    D = w["w1"].shape[1]
    names = ["w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4", "anchor_a", "anchor_b", "anchor_c"]
    x = torch.randn(T, D).to(tdt[dt])
    ws = [w[n].to(tdt[dt]) for n in names]
    what = f"SIH T={T} {dt}" if chunk is None else f"SIH chunks of {chunk}, T={T} {dt}"
    keeps, bases, carry = [], [], torch.zeros(2)
    for a in range(0, T, chunk or T):
        xc = x[a:a + (chunk or T)]
        n = xc.shape[0]
        ins = [(dt, list(xc.shape), "x.bin", xc)] + [(dt, list(t.shape), f"{k}.bin", t) for k, t in zip(names, ws)]
        outs = [("int32", [n], "keep.bin", None), (dt, [n, D], "base.bin", None)]
        if chunk is not None:
            ins += [("float32", [2], "carry.bin", carry), ("int32", [2], "span.bin", torch.tensor([a, T], dtype=torch.int32))]
            outs += [("float32", [2], "carry_out.bin", None)]
        rc, msg = _harness(harness, lib, _write_case(tmp, "ZeroEdgeSIH" if chunk is None else "ZeroEdgeSIHChunk",
                                                     fields, ins, outs))
        if rc != 0:
            rows.append((case.name, what, "FAIL", msg[0]))
            return 1
        keeps.append(_read(tmp, "keep.bin", torch.int32, (n,)))
        bases.append(_read(tmp, "base.bin", tdt[dt], (n, D)))
        if chunk is not None:
            carry = _read(tmp, "carry_out.bin", torch.float32, (2,)).clone()
    keep, base = torch.cat(keeps), torch.cat(bases)
    rk, rb = ref.sih(x.double(), *[t.double() for t in ws], **values)
    diff = int((keep != rk.to(torch.int32)).sum())
    # the reference's base on the plugin's own keep mask (a token at the threshold may flip)
    rb = ref.sih_base(x.double(), keep, ws[8].double(), ws[9].double(), ws[10].double(),
                      int(values.get("anchor_rank", 16)))
    err = _rel(base, rb)
    tol = 1e-5 if dt == "float32" else 2e-2
    ok = diff <= max(1, T // 100) and err <= tol
    bad = int(not ok)
    rows.append((case.name, what, "ok" if ok else "FAIL",
                 f"kept {int(keep.sum())}/{T}, {diff} differ from the reference, base rel err {err:.1e}"))
    return bad + _pad_check(case, tmp, x, keep, base, T, D, dt, harness, lib, rows)


def _pad_check(case, tmp, x, keep, base, T, D, dt, harness, lib, rows) -> int:
    """PAD on the plugin's own keep mask: gather then scatter y = 2 xs, exact."""
    import torch

    from zeroedge.backends import plugin_reference as ref

    tdt = _torch_dtypes()
    K = int(keep.sum())
    c = _write_case(tmp, "ZeroEdgePADGather", {}, [(dt, [T, D], "x.bin", x), ("int32", [T], "keep.bin", keep)],
                    [(dt, [T, D], "xs.bin", None), ("int32", [T], "idx.bin", None),
                     ("int32", [], "cnt.bin", None)])
    rc, msg = _harness(harness, lib, c)
    xs_ref, idx_ref, _ = ref.pad_gather(x, keep)
    ok = rc == 0
    if ok:
        cnt = int(_read(tmp, "cnt.bin", torch.int32, (1,))[0])
        idx = _read(tmp, "idx.bin", torch.int32, (T,))[:cnt]
        xs = _read(tmp, "xs.bin", tdt[dt], (T, D))[:cnt]
        ok = cnt == K and torch.equal(idx.long(), idx_ref.long()) and torch.equal(xs, xs_ref)
    if ok and K:
        y = (xs * 2).to(tdt[dt])
        c = _write_case(tmp, "ZeroEdgePADScatter", {},
                        [(dt, [T, D], "base.bin", base), (dt, [K, D], "y.bin", y), ("int32", [K], "idx.bin", idx)],
                        [(dt, [T, D], "out.bin", None)])
        rc, msg = _harness(harness, lib, c)
        ok = rc == 0 and torch.equal(_read(tmp, "out.bin", tdt[dt], (T, D)), ref.pad_scatter(base, y, idx.long()))
    rows.append((case.name, f"PAD T={T} {dt}", "ok" if ok else "FAIL", f"K={K} gather+scatter exact"
                 if ok else msg[0]))
    return int(not ok)


def _paths_check(case, tmp, fields, values, w, B, dt, harness, lib, rows) -> int:
    """PathsFFN on B random rows; returns the failures."""
    import torch

    from zeroedge.backends import plugin_reference as ref

    tdt = _torch_dtypes()
    D, F2 = w["w13_t"].shape
    x = torch.randn(B, D).to(tdt[dt])
    w13, wd = w["w13_t"].to(tdt[dt]), w["wd_t"].to(tdt[dt])
    c = _write_case(tmp, "ZeroEdgePathsFFN", fields,
                    [(dt, [B, D], "x.bin", x), (dt, [D, F2], "w13.bin", w13), (dt, [F2 // 2, D], "wd.bin", wd)],
                    [(dt, [B, D], "y.bin", None)])
    rc, msg = _harness(harness, lib, c)
    if rc != 0:
        rows.append((case.name, f"paths B={B} {dt}", "FAIL", msg[0]))
        return 1
    y = _read(tmp, "y.bin", tdt[dt], (B, D))
    r = ref.paths_ffn(x.double(), w13.double(), wd.double(), values["threshold_in"], values["threshold"])
    err = _rel(y, r)
    ok = err <= (2e-2 if dt == "float16" else 6e-2)
    rows.append((case.name, f"paths B={B} {dt}", "ok" if ok else "FAIL", f"rel err {err:.1e}"))
    return int(not ok)


def run(cases: Path, harness, lib) -> int:
    import numpy as np
    import torch

    torch.manual_seed(0)
    rows, bad = [], 0
    for case in sorted(p for p in cases.iterdir() if (p / "node.json").is_file()):
        node = json.loads((case / "node.json").read_text())
        w = {k: torch.from_numpy(v) for k, v in np.load(case / "weights.npz").items()}
        fields = {k: tuple(v) for k, v in node["fields"].items()}
        values = {k: v for k, (_, v) in fields.items()}
        tmp = Path(tempfile.mkdtemp(dir=case))
        if node["op"] in ("ZeroEdgeSIH", "ZeroEdgeSIHChunk"):
            block = max(int(values.get("block_size", 0)), 1)
            for T in SIH_T:
                for dt in ("float32", "float16"):
                    bad += _sih_check(case, tmp, fields, values, w, T, dt, harness, lib, rows)
                    if node["op"] == "ZeroEdgeSIHChunk":     # chunks that do not divide T, on block boundaries
                        chunk = -(-(T // 3 + 1) // block) * block
                        bad += _sih_check(case, tmp, fields, values, w, T, dt, harness, lib, rows, chunk)
        else:
            for B in PATHS_B:
                for dt in ("float16", "bfloat16"):
                    bad += _paths_check(case, tmp, fields, values, w, B, dt, harness, lib, rows)
    for r in rows:
        print(" | ".join(r))
    print(f"plugin cases: {len(rows) - bad} of {len(rows)} checks passed "
          f"({len({r[0] for r in rows})} builder-accepted nodes)")
    return 1 if bad or not rows else 0


def main(argv=None) -> int:
    ap = bs.parser(__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("bundles", nargs="+")
    e.add_argument("-o", "--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("cases")
    r.add_argument("--harness", required=True)
    r.add_argument("--lib", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "extract":
        rows = extract(a.bundles, Path(a.out))
        print(json.dumps({"nodes": len(rows), "written": sum(r["written"] for r in rows)}))
        return 0
    return run(Path(a.cases), a.harness, a.lib)


if __name__ == "__main__":
    sys.exit(main())
