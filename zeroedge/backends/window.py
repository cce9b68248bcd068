"""The fixed-slot KV window of a bundle runner, whatever runs its graphs: WindowRunner (the base of
backends.onnxruntime.OrtRunner and backends.tensorrt.TrtRunner) and PrefillGraph.

The window is `slots` KV slots per layer holding keys after RoPE, so any slot can take any
position: `slot_pos[s]` is the position a slot holds (-1 = empty), and only validity enters the
graph. The decode graph returns the new token's K/V (written here into a free slot), the step's
queries (`last_query`; bundles exported since it was added) and the attention mass every slot
received: it accumulates into `heat` (decayed each step). When the window is full, the coldest
slot outside the first `sinks` positions is refilled; `evict` can be replaced by the thermal KV
runtime's policy, or a whole policy object given as `policy` takes over the window
(zeroedge.kv.ort_policy.OrtThermalPolicy: pages, heat, a WARM/COLD store): it fills the window at
prefill (`policy.prefill`), picks each new token's slot (`policy.slot_for`) and moves
pages after the step (`policy.after_step`). Without one, the behaviour above is unchanged.

Chunked prefill: a prompt longer than `chunk` tokens runs through the prefill graph `chunk` tokens at
a time; each chunk reads the K/V of the tokens before it (the graph's prefix_k/v inputs, token-major,
fed as views of one [T, Hkv, hd] buffer per layer) and adds its attention mass to the whole prompt's,
so the results equal one pass within float rounding while the scores live at [h, chunk, past+chunk]
instead of [h, T, T]. SIH/PAD layers exported for chunks (ZeroEdgeSIHChunk) carry their score moving
average from chunk to chunk (PrefillGraph) and skip exactly what one pass skips. Each backend picks
the chunk (`chunk`, None: one pass) and says why in `prefill_mode`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from zeroedge.errors import UserError


class PrefillGraph:
    """A prefill session (onnxruntime or TensorRT) whose `run(None, feed)` fills prefix inputs the feed
    leaves out with empty ones (P = 0): a whole prompt runs as before from {"tokens": ...} alone.

    A graph with chunked SIH/PAD nodes (inputs sih_span, sih_carry.i; outputs sih_carry_out.i) is fed
    here too: `run(None, feed, start, prompt_len)` for the chunk at positions start.. of a prompt_len-token
    prompt passes (start, prompt_len) and the carry the previous chunk returned, keeps the new carry
    and returns the other outputs, in order (all of them: the runners ask for every output)."""

    def __init__(self, session, input_names, nkv: int, hd: int, output_names=()):
        import numpy as np

        self.np = np
        self.session = session
        self.prefix = [n for n in input_names if n.startswith("prefix_")]
        self.empty = np.zeros((1, 0, nkv, hd), np.float32)
        self.sih_in = [n for n in input_names if n.startswith("sih_carry.")]
        # output index -> the input its value feeds next chunk (sih_carry_out.i -> sih_carry.i)
        self.sih_out = {i: "sih_carry." + n[len("sih_carry_out."):] for i, n in enumerate(output_names)
                        if n.startswith("sih_carry_out.")}
        if sorted(self.sih_in) != sorted(self.sih_out.values()) or (self.sih_in and "sih_span" not in input_names):
            raise UserError("the prefill graph's SIH carry inputs and outputs do not match "
                            f"({len(self.sih_in)} sih_carry inputs, {len(self.sih_out)} sih_carry_out outputs)")
        self.carry = None

    def run(self, names, feed: dict, start: int = 0, prompt_len: Optional[int] = None):
        np = self.np
        missing = [n for n in self.prefix if n not in feed]
        if missing:
            feed = {**feed, **{n: self.empty for n in missing}}
        if not self.sih_in:
            return self.session.run(names, feed)
        n = start + feed["tokens"].shape[1] if prompt_len is None else prompt_len
        carry = self.carry if start else None
        if carry is None:
            carry = {name: np.zeros(2, np.float32) for name in self.sih_in}
        out = self.session.run(None, {**feed, "sih_span": np.array([start, n], np.int32), **carry})
        self.carry = {name: out[i] for i, name in self.sih_out.items()}
        return [o for i, o in enumerate(out) if i not in self.sih_out]

    def __getattr__(self, name):             # close(), buffers, get_inputs() ... of the session
        if name == "session":
            raise AttributeError(name)
        return getattr(self.session, name)


class WindowRunner:
    """Prefill, decode steps and greedy generation of a bundle over the fixed-slot window (module
    docstring), for sessions that take `run(None, feed) -> [outputs]` (host numpy in and out).

    A backend's __init__ calls _read_bundle, _read_model, sets `pre` (a PrefillGraph), `dec`,
    `chunk` and `prefill_mode`, then calls _start. Its hooks:

    _input_dtype(name) -> the numpy dtype of decode-graph input `name` (the window's K/V are made
                          with it); every backend gives it.
    _run_decode(token) -> the decode graph's outputs for `token` at position `pos`, in the graph's
                          order; this class's feeds the window through `dec.run(None, feed)`."""

    # -- construction (called by the backend's __init__) -------------------------------------------
    def _read_bundle(self, bundle, verify: bool):
        """The bundle's manifest, verified (its hashes) unless `verify` is false."""
        import numpy as np

        from zeroedge import bundle as bundle_mod

        self.np = np
        self.dir = Path(bundle)
        self.manifest = bundle_mod.verify(self.dir) if verify else bundle_mod.read_manifest(self.dir)

    def _read_model(self, slots: Optional[int]):
        """The model's shape from the manifest, and the window's slots (else the manifest's window)."""
        cfg = self.manifest["model"]
        self.L, self.nkv = cfg["n_layers"], cfg["n_kv_heads"]
        self.hd = cfg["dim"] // cfg["n_heads"]
        self.vocab = cfg["vocab_size"]
        self.slots = int(slots or self.manifest.get("window", 1024))

    def _start(self, sinks: int, decay: float, evict: Optional[Callable], policy):
        """The eviction rule, the thermal window policy (zeroedge.kv.ort_policy) and an empty window."""
        self.sinks, self.decay = sinks, decay
        self.evict = evict or self._coldest
        self.policy = policy
        self.timings = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0}
        self.reset()

    # -- backend hooks ----------------------------------------------------------------------------
    def _input_dtype(self, name: str):
        raise NotImplementedError

    def _run_decode(self, token: int) -> list:
        np = self.np
        feed = {"tokens": np.array([[int(token)]], np.int64), "pos": np.array([self.pos], np.int64),
                "slot_pos": self.slot_pos}
        for i in range(self.L):
            feed[f"past_k.{i}"] = self.k[i]
            feed[f"past_v.{i}"] = self.v[i]
        return self.dec.run(None, feed)

    # -- state --------------------------------------------------------------------------------
    def reset(self):
        np = self.np
        shape = (1, self.nkv, self.slots, self.hd)
        self.k = [np.zeros(shape, self._input_dtype("past_k.0")) for _ in range(self.L)]
        self.v = [np.zeros(shape, self._input_dtype("past_v.0")) for _ in range(self.L)]
        self.slot_pos = np.full((1, self.slots), -1, np.int64)
        self.heat = np.zeros(self.slots, np.float64)
        self.pos = 0
        self.last_mass = self.last_query = None
        if getattr(self, "policy", None) is not None:
            self.policy.reset(self)

    def window_bytes(self) -> int:
        return self.L * (self.k[0].nbytes + self.v[0].nbytes)

    def _coldest(self, runner) -> int:
        np = self.np
        h = self.heat.copy()
        h[(self.slot_pos[0] >= 0) & (self.slot_pos[0] < self.sinks)] = np.inf
        return int(np.argmin(h))

    def _free_slot(self) -> int:
        free = self.np.flatnonzero(self.slot_pos[0] < 0)
        return int(free[0]) if free.size else self.evict(self)

    # -- inference ----------------------------------------------------------------------------
    def prefill(self, tokens):
        """tokens: 1-D or (1, T) ints. Returns logits (V,) of the last position."""
        np = self.np
        tokens = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        T = tokens.shape[1]
        if T < 2:
            raise UserError("prefill needs at least 2 tokens (use step() for one)")
        self.reset()
        t0 = time.perf_counter()
        if self.chunk is None or T <= self.chunk:
            out = self.pre.run(None, {"tokens": tokens})
            logits, kv, mass = out[0], out[1:-1], out[-1]
        else:
            logits, kv, mass = self._chunked(tokens, self.chunk)
        self.timings["prefill_s"] += time.perf_counter() - t0
        self.timings["prefill_tokens"] += T
        m = mass[0].mean(0)                                     # (T,) over layers
        if self.policy is not None:
            self.policy.prefill(self, kv, mass, T)
            self.pos = T
            return logits[0, 0]
        if T <= self.slots:
            keep = np.arange(T)
        else:                                                   # sinks + the hottest of the rest
            rest = np.argsort(-m[self.sinks:], kind="stable")[: self.slots - self.sinks] + self.sinks
            keep = np.concatenate([np.arange(self.sinks), np.sort(rest)])
        n = len(keep)
        for i in range(self.L):
            self.k[i][:, :, :n] = kv[2 * i][:, :, keep]
            self.v[i][:, :, :n] = kv[2 * i + 1][:, :, keep]
        self.slot_pos[0, :n] = keep
        self.heat[:n] = m[keep]
        self.pos = T
        return logits[0, 0]

    def _chunked(self, tokens, C: int):
        """The prompt C tokens at a time: (last logits, K/V [1, Hkv, T, hd] per layer (views of the
        token-major buffers), attention mass [1, L, T] summed over every chunk's queries)."""
        np = self.np
        T = tokens.shape[1]
        names = self.pre.prefix                      # prefix_k.0, prefix_v.0, prefix_k.1, ...
        buf = [np.empty((1, T, self.nkv, self.hd), np.float32) for _ in names]
        mass = np.zeros((1, self.L, T), np.float32)
        for a in range(0, T, C):
            e = min(a + C, T)
            feed = {"tokens": tokens[:, a:e]}
            for n, b in zip(names, buf):
                feed[n] = b[:, :a]                   # contiguous: the first a rows
            out = self.pre.run(None, feed, a, T)
            for j, b in enumerate(buf):
                b[0, a:e] = out[1 + j][0].transpose(1, 0, 2)
            mass[:, :, :e] += out[-1]
            logits = out[0]
            del out, feed
        return logits, [b.transpose(0, 2, 1, 3) for b in buf], mass

    def step(self, token: int):
        """One decode step; the token is at position self.pos. Returns logits (V,)."""
        np = self.np
        t0 = time.perf_counter()
        out = self._run_decode(token)
        self.timings["decode_s"] += time.perf_counter() - t0
        self.timings["decode_tokens"] += 1
        mass = out[-1][0].mean(0)                                # (S,) over layers
        self.last_mass = mass
        # the queries of this step [1, L, H, hd] (attn_query, before attn_mass), in graphs exported since
        # the thermal policy ranks pages by them; None from older bundles
        self.last_query = out[-2] if len(out) == 2 * self.L + 3 else None
        self.heat = self.heat * self.decay + np.where(self.slot_pos[0] >= 0, mass, 0.0)
        s = self.policy.slot_for(self, out) if self.policy is not None else self._free_slot()
        for i in range(self.L):
            self.k[i][:, :, s] = out[1 + 2 * i][:, :, 0]
            self.v[i][:, :, s] = out[2 + 2 * i][:, :, 0]
        self.slot_pos[0, s] = self.pos
        self.heat[s] = 0.0
        self.pos += 1
        if self.policy is not None:
            self.policy.after_step(self)
        return out[0][0, 0].copy()                # a bound output is overwritten by the next step

    def generate(self, tokens, max_new: int, eos: Optional[int] = None):
        """Greedy decoding: prefill then max_new steps. Returns the new token ids."""
        logits = self.prefill(tokens)
        new = []
        for _ in range(max_new):
            t = int(logits.argmax())
            new.append(t)
            if eos is not None and t == eos:
                break
            logits = self.step(t)
        return new

    # -- context manager (Polygraphy-style runner) ----------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pre = self.dec = None
        return False
