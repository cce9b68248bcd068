"""The zeroedge plugin library as this backend sees it: where it is (`default_plugin_lib`), what it
logged (`plugin_messages`: TensorRT-RTX hands plugins no logger) and which zeroedge nodes of a graph
none of its creators takes (`plugin_node_problems`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from zeroedge.errors import UserError


def plugin_messages(plugin_lib, clear: bool = True) -> str:
    """The plugin library's errors and warnings since the last clear (zeroedge_plugin_messages), '' if it
    cannot say (not loadable, an older build)."""
    import ctypes

    try:
        f = ctypes.CDLL(str(Path(plugin_lib).resolve())).zeroedge_plugin_messages
    except (OSError, AttributeError):
        return ""
    f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    n = int(f(None, 0, 0))
    buf = ctypes.create_string_buffer(n + 1)
    f(buf, n + 1, int(clear))
    return buf.value.decode("utf-8", "replace").strip()


def plugin_node_problems(onnx_path) -> list:
    """One line per zeroedge node of a graph that no creator of this plugin library can take: an op
    the library does not ship, a plugin_version / plugin_namespace other than plugin_spec's (TensorRT
    itself only says "Plugin not found"). [] when fine or when the graph cannot be read here."""
    from zeroedge import plugin_spec as spec

    try:
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception:  # not readable here (no onnx, not a graph): TensorRT's parser will say
        return []
    out = []
    for n in graph.node:
        if n.domain != spec.DOMAIN:
            continue
        where = f"node '{n.name or (n.output[0] if n.output else '?')}' ({n.op_type})"
        if n.op_type not in spec.NODES:
            out.append(f"{where}: this plugin library ships {', '.join(spec.NODES)} only")
            continue
        attrs = {a.name: a for a in n.attribute}
        for key, want in (("plugin_version", spec.PLUGIN_VERSION), ("plugin_namespace", spec.PLUGIN_NAMESPACE)):
            a = attrs.get(key)
            if a is None:
                continue
            if a.type != onnx.AttributeProto.STRING:
                out.append(f"{where}: {key} must be a STRING attribute ('{want}')")
            elif a.s.decode("utf-8", "replace") != want:
                out.append(f"{where}: asks for {key} '{a.s.decode('utf-8', 'replace')}', this plugin library "
                           f"ships {n.op_type} {key} '{want}' (re-export the bundle with this zeroedge)")
    return out


def source_checkout_plugins() -> Optional[Path]:
    """plugins/build/libzeroedge_plugins.so of the source checkout this zeroedge runs from (None when
    it is an installed package)."""
    root = Path(__file__).resolve().parents[3]
    if (root / "plugins" / "CMakeLists.txt").is_file():
        return root / "plugins" / "build" / "libzeroedge_plugins.so"
    return None


PLUGINS_ENV = "ZEROEDGE_PLUGINS_LIB"


def default_plugin_lib(plugin_lib=None) -> Path:
    """The plugin library to build with: `plugin_lib`, else $ZEROEDGE_PLUGINS_LIB, else the source
    checkout's plugins/build/libzeroedge_plugins.so; UserError when that file is not there."""
    if plugin_lib:
        path, why = Path(plugin_lib), "--plugins"
    elif os.environ.get(PLUGINS_ENV):
        path, why = Path(os.environ[PLUGINS_ENV]), f"${PLUGINS_ENV}"
    else:
        path, why = source_checkout_plugins(), "the default"
        if path is None:
            raise UserError("no plugin library: pass --plugins libzeroedge_plugins.so (build it from a zeroedge "
                            f"checkout with scripts/build_plugins) or set ${PLUGINS_ENV}")
    if not path.is_file():
        raise UserError(f"plugin library not found: {path} ({why}); build it with scripts/build_plugins "
                        "[--trt-include DIR] (it writes plugins/build/libzeroedge_plugins.so)")
    return path
