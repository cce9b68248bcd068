"""A bundle's engines (`zeroedge build`, and `python -m zeroedge.backends.tensorrt build` on a
device): one engine per BUNDLE/*.trt.onnx (`build_bundle_engines`), built in a temporary folder and
moved into OUT only when all of them built, with engines.json beside them; what `--json` prints
(`build_report`) and the line per engine (`engine_line`).

The workspace from the bundle's plan (else 256 MiB, the planner's assumption; grown once when it
runs out), one optimisation profile per graph (token length 1..max_tokens, every other dynamic
dimension fixed at the bundle's KV window; a chunked prefill graph: tokens 1..chunk and its prefix
K/V 0..max_tokens-1 tokens, see plan.profile_shapes), a timing cache kept beside the engines where
the runtime keeps one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from zeroedge.backends.tensorrt.engine import EngineFromOnnx, _write_atomic
from zeroedge.backends.tensorrt.loader import import_tensorrt, runtime_traits
from zeroedge.backends.tensorrt.plan import max_tokens_from_plan, workspace_from_plan
from zeroedge.backends.tensorrt.plugins import default_plugin_lib
from zeroedge.backends.tensorrt.target import build_target
from zeroedge.bundle import prefill_plan
from zeroedge.errors import UserError


GRAPHS = ("prefill", "decode")


def _sha256(path: Path) -> str:
    """bundle.sha256_file of the file a path names (the plugin library may be reached by a link)."""
    from zeroedge.bundle import sha256_file

    return sha256_file(Path(path).resolve())


def bundle_trt_graphs(manifest: dict) -> list:
    """The bundle's *.trt.onnx files (listed in its manifest, so verified), prefill and decode first."""
    names = [rel for rel in manifest.get("files", {}) if rel.endswith(".trt.onnx") and "/" not in rel]
    order = {f"{g}.trt.onnx": i for i, g in enumerate(GRAPHS)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), n))


OUT_MODES = ("new", "force", "update")


def _prepare_out(out: Path, mode: str, bundle: Path, plugin_lib: Path) -> Path:
    """Check OUT before any work; returns the folder to build in (a fresh temporary folder beside OUT
    for "new" / "force", inside OUT for "update"), whose files _commit_out moves into place.

    new: OUT absent or empty. force: OUT replaced whatever it holds. update: the engine files replace
    their namesakes in OUT, the rest of OUT stays (the deploy builds into a release's build/ folder
    that holds the plugin library); an OUT that does not exist yet is made as for new."""
    import secrets

    if mode not in OUT_MODES:
        raise ValueError(mode)
    out = Path(os.path.abspath(out))
    if os.path.lexists(out) and not out.is_dir():
        raise UserError(f"-o {out}: exists and is not a folder")
    res = out.resolve()
    for what, path in (("the bundle", bundle.resolve()), ("the plugin library", plugin_lib.resolve())):
        if mode != "update" and (res == path or res in path.parents):
            raise UserError(f"-o {out}: holds {what} ({path}); choose another folder for the engines")
    if mode == "new" and out.is_dir() and any(out.iterdir()):
        raise UserError(f"-o {out}: not empty (pass --force to replace it)")
    parent = out if mode == "update" and out.is_dir() else res.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name or 'engines'}.building-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()  # the umask's mode, as the folder -o becomes
        return tmp
    except OSError as e:
        raise UserError(f"-o {out}: cannot write to {parent} ({e.strerror or e})") from None


def _commit_out(tmp: Path, out: Path, mode: str):
    """Move what `tmp` holds into OUT. An OUT that exists keeps its folder (its mode, a mount point,
    a shell standing in it): for force, what it held goes first into a trash folder beside it."""
    import shutil

    out = Path(os.path.abspath(out))
    if not out.is_dir():
        os.rename(tmp, out)
        return
    trash = None
    if mode == "force":
        trash = tmp.with_name(f"{tmp.name}.old")
        trash.mkdir()
        for f in list(out.iterdir()):
            if f != tmp:
                os.rename(f, trash / f.name)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def build_bundle_engines(bundle, plugin_lib, out, *, max_tokens: Optional[int] = None,
                         workspace_bytes: Optional[int] = None, serialize_plugins: bool = True,
                         cc: Optional[str] = None, log: Callable[[str], None] = print, mode: str = "update",
                         progress: Optional[Callable[[str, str, int, int], None]] = None,
                         on_engine: Optional[Callable[[dict], None]] = None,
                         verbose: Optional[Callable[[str], None]] = None,
                         prefill_chunk: Optional[int] = None) -> dict:
    """Build one engine per BUNDLE/*.trt.onnx (GRAPH.trt.onnx -> OUT/GRAPH.engine), plus timing.cache
    where the runtime keeps one and engines.json. Every input is checked before the first build, the
    engines are built in a temporary folder and moved into OUT only when all of them built (`mode`:
    see _prepare_out), so a failure leaves OUT as it was. This is `zeroedge build` and `python -m
    zeroedge.backends.tensorrt build` (mode "update").

    workspace_bytes None: the bundle plan's workspace, else DEFAULT_WORKSPACE, grown once on a
    workspace OutOfMemory (EngineFromOnnx's workspace_auto). progress(graph, phase, step, steps);
    on_engine(row) after each engine. prefill_chunk: the chunk the prefill engine's profile covers
    (default: the manifest's prefill.chunk; one pass for a bundle whose manifest says one_pass), recorded
    as engines.json's prefill_chunk for TrtRunner. Returns the engines.json content; its "engines" maps each graph
    to {"file", "bytes", "layers", "plugin_layers", "seconds", "workspace_bytes", "profiles"}."""
    import shutil

    from zeroedge import bundle as bundle_mod
    from zeroedge import plugin_spec

    bundle, out = Path(bundle), Path(out)
    manifest = bundle_mod.verify(bundle)
    abi = manifest.get("plugin_abi")
    if abi is not None and abi != plugin_spec.PLUGIN_ABI:
        raise UserError(f"{bundle}: exported for plugin ABI {abi}, this zeroedge builds ABI "
                        f"{plugin_spec.PLUGIN_ABI}; re-export the bundle")
    files = bundle_trt_graphs(manifest)
    if not files:
        raise UserError(f"{bundle}: no *.trt.onnx graph to build (export it with a TensorRT target: "
                        "zeroedge export MODEL -o BUNDLE)")
    trt = import_tensorrt()
    traits = runtime_traits(trt)
    plugin_lib = default_plugin_lib(plugin_lib)
    _, cc_label = build_target(trt, cc) if traits["target_cc"] or cc is not None else (None, None)
    auto = not workspace_bytes
    ws = int(workspace_bytes or workspace_from_plan(manifest))
    mt = int(max_tokens or max_tokens_from_plan(manifest))
    window = int(manifest.get("window") or 1024)
    chunk = prefill_plan(manifest, True, prefill_chunk)[0]   # the profiles: tokens and prefix of a chunk
    meta = {"tensorrt": traits["version"], "backend": f"{traits['name']} {traits['version']}",
            "runtime": traits["name"], "bundle_manifest_sha256": _sha256(bundle / "manifest.json"), "cc": cc_label, "plugins": str(plugin_lib.resolve()),
            "plugins_sha256": _sha256(plugin_lib), "serialize_plugins": serialize_plugins,
            "workspace_bytes": ws, "workspace_auto": auto, "max_tokens": mt, "window": window,
            "prefill_chunk": chunk,
            "timing_cache": "timing.cache" if traits["timing_cache"] else None, "engines": {}}
    tmp = _prepare_out(out, mode, bundle, plugin_lib)
    try:
        cache = tmp / "timing.cache"
        if traits["timing_cache"] and (out / "timing.cache").is_file() and mode != "new":
            shutil.copyfile(out / "timing.cache", cache)  # a cache of earlier builds speeds this one up
        for rel in files:
            g = rel[: -len(".trt.onnx")]
            stage = EngineFromOnnx(bundle / rel, plugin_lib, workspace_bytes=ws, timing_cache=cache,
                                   max_tokens=mt, window=window, serialize_plugins=serialize_plugins, cc=cc,
                                   chunk=chunk if g == "prefill" else None,
                                   log=log, workspace_auto=auto, verbose=verbose,
                                   progress=(lambda ph, i, n, g=g: progress(g, ph, i, n)) if progress else None)
            blob = stage()
            _write_atomic(tmp / f"{g}.engine", blob)
            row = {"file": f"{g}.engine", "bytes": len(blob), "layers": stage.layers,
                   "plugin_layers": stage.plugin_layers, "seconds": round(stage.build_s, 2),
                   "workspace_bytes": stage.workspace_bytes,
                   "profiles": {k: [list(s) for s in v] for k, v in stage.profiles.items()}}
            meta["engines"][g] = row
            if on_engine is not None:
                on_engine(dict(row, graph=g))
        _write_atomic(tmp / "engines.json", json.dumps(meta, indent=2).encode())
        _commit_out(tmp, out, mode)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def build_report(meta: dict, out) -> dict:
    """`zeroedge build --json`: {"backend": "<name> <version>", "engines": [{"graph", "file" (the
    engine's path), "bytes", "layers", "plugin_layers", ...}], "prefill_chunk" (the chunk the prefill
    engine's profile covers; None: one pass), ...}."""
    out = Path(os.path.abspath(out))
    engines = [dict({"graph": g, "file": str(out / e["file"])}, **{k: v for k, v in e.items()
                                                                 if k not in ("file", "profiles")})
               for g, e in meta["engines"].items()]
    cache = meta.get("timing_cache")
    return {"backend": meta["backend"], "engines": engines, "out": str(out), "cc": meta.get("cc"),
            "plugins": meta["plugins"], "plugins_serialized": bool(meta["serialize_plugins"]),
            "max_tokens": meta["max_tokens"], "workspace_bytes": meta["workspace_bytes"],
            "prefill_chunk": meta.get("prefill_chunk"),
            "timing_cache": str(out / cache) if cache and (out / cache).is_file() else None,
            "tensorrt": meta["tensorrt"]}


def engine_line(row: dict) -> str:
    """The readable line `zeroedge build` prints per engine."""
    return (f"{row['graph']}: {row['layers']} layers, {row['plugin_layers']} plugin layers, "
            f"{row['bytes'] / (1 << 20):.1f} MiB, {row['seconds']:.1f} s -> {row['file']}")
