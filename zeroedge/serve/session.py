"""A request-level serving session: per request, which decoder runs and with what mechanisms.

    s = ServingSession(model, kv_budget=0.1, artifact=(meta, tensors), release_level=3)
    s = ServingSession(open_bundle("bundle/"))  # or a bundle's runner (onnxruntime; tensorrt with engines)
    r = s.generate(prompt_ids, max_new=64)      # Result: tokens, mechanisms, tokens/s, KV bytes
    p = s.plan(len(prompt_ids), max_new=64)     # RunPlan: what generate would run, decided before it runs
    d = s.open(prompt_ids, 64, p)               # its decoder: prefill, step, verify, close
    s.set_level(1)                              # at run time (both gates, or which="thermal")

`generate` runs the request through the serving engine (zeroedge.serve.engine, in the caller's
thread) over zeroedge.serve.backends.SessionSequential, which steps the decoder `open` made: the
engine picks the tokens (greedy or sampled, drafts checked while they agree), as for every request
`zeroedge serve` runs.

Two ReleaseGates (zeroedge.kv.policy, levels L0 off / L1 < 512 tokens / L2 < 4096 tokens at
temperature 0 / L3 all) decide per request, from (prompt + new tokens, temperature):
- thermal KV runs when the session has a KV budget and its gate allows; otherwise the cache is
  dense (exact), and the reason is reported. Prompts under MIN_THERMAL_TOKENS bypass it (a short
  input has too few pages to tier).
- decode paths run when the session holds path policies (checked against the model when the
  session starts: a missing 'paths' section, another model or missing tensors is a UserError) and
  their gate allows. They are off by default below that level. A request that asks for paths
  (`generate(..., paths=True)`) and cannot have them is refused with a UserError naming why: dense decode is
  never used silently in place of sparse.
The pages a thermal request migrated go to the thermal gate's circuit breaker (5 requests in a row
over `trip_pages` -> one level down, an alert).

The artifact (`artifact=`: a folder or (meta, tensors); the torch backend) may also hold a weights section (4-bit weights):
the torch backend applies it to the model when the session starts (zeroedge.quant.apply, packed), and
on CUDA the decoders read the packed GEMVs with int8 inputs (mechanisms "weights", "weights_decode").
Its SIH/PAD layers run in the torch backend's prefill (chunked, each chunk deciding as one pass would;
mechanisms "sih_pad", "sih_pad_layers", "sih_pad_ffn_flops_skipped"), off at temperature > 1; head
pruning is not applied there (said in "not_applied"); the bundle backends run what the bundle holds.

Decoders: on "torch" (TorchDecoding) zeroedge.runtime.fast's Decoder with the attention (dense or
thermal) and FFN (dense or paths) the gates chose: DenseDecoder, ThermalDecoder, PathsDecoder or
ThermalPathsDecoder; on CUDA with CUDA graphs and, for the dense cache, the Triton attention
(mechanisms "attention_decode"). On "onnxruntime" (BundleDecoding) OrtRunner over a bundle's
fixed-slot window, dense (a window of every position) or with OrtThermalPolicy (pages, heat, an
int8 store); a bundle exported with a magnitude paths artifact runs its ZeroEdgePathsFFN nodes there,
and a request its release level does not allow sparse is refused, never decoded dense instead.
"tensorrt" is the same decoding over the bundle's TensorRT engines (TrtRunner, built by `zeroedge build`):
the two bundle backends differ only in the runner they open.

Units of `pages_migrated`: torch counts (layer, kv head) page fetches into the slot window (the
PageTable's unit); onnxruntime counts pages of P positions across all layers (its window is shared).
The breaker counts whole-model pages on both backends: torch fetches divided by layers x kv heads
(rounded up), so one trip point means the same traffic everywhere.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional, Union

import numpy as np

from zeroedge.errors import UserError
from zeroedge.kv.policy import LEVELS, ReleaseGate, memory_kind, plan_tiers

MIN_THERMAL_TOKENS = 32
BACKENDS = ("torch", "onnxruntime", "tensorrt")  # torch: a model; the others: an exported bundle


def _allocator_segments() -> str:
    """"expandable" or "fixed": the CUDA allocator's segments as it made them (a cap holds what it
    reserves), "unknown" before it made any."""
    import torch

    segs = torch.cuda.memory_snapshot()
    if not segs or "is_expandable" not in segs[0]:
        return "unknown"
    return "expandable" if any(g["is_expandable"] for g in segs) else "fixed"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class Result:
    tokens: List[int]
    mechanisms: dict
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    device_kv_bytes: int
    full_kv_bytes: int
    pages_migrated: int = 0
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "mechanisms": self.mechanisms,
                "prompt_tokens": self.prompt_tokens, "new_tokens": len(self.tokens),
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "tokens_per_s": self.tokens_per_s, "device_kv_bytes": self.device_kv_bytes,
                "full_kv_bytes": self.full_kv_bytes, "pages_migrated": self.pages_migrated,
                **self.detail}


@dataclass
class RunPlan:
    """One request's plan, made whole before it runs (ServingSession.plan) and only read after: each
    mechanism on or off with the reason, what the device memory forecast chose, and, for thermal KV,
    the hot fraction and the cold store. `to_dict()` is the start of Result.mechanisms (what ran is
    added there: the decode kernels, the layers SIH/PAD skipped in, the release level after)."""
    release_level: int
    paths_level: int
    thermal_kv: bool = False
    thermal_kv_reason: Optional[str] = None
    paths: bool = False
    paths_reason: Optional[str] = None
    sih_pad: Optional[bool] = None              # None: the session has no SIH/PAD layers
    sih_pad_reason: Optional[str] = None
    speculative: Union[str, bool, None] = None  # None: not asked for; False: refused (the reason)
    speculative_reason: Optional[str] = None
    weights: Optional[dict] = None
    not_applied: Optional[List[str]] = None
    device_memory: Optional[dict] = None
    thermal_budget: Optional[float] = field(default=None, metadata={"internal": True})
    cold_store: Optional[str] = field(default=None, metadata={"internal": True})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None and not f.metadata.get("internal")}


def _why_not(gate: ReleaseGate, n: int, temperature: float) -> str:
    return f"release level L{gate.level} ({LEVELS[gate.level]}) excludes {n} tokens at temperature {temperature:g}"


def _sih_prefill(meta: dict, tensors: dict):
    """(the artifact's SIH/PAD policies and their runtime, or None; what the artifact holds that the
    torch session does not run): the torch prefill runs the SIH/PAD layers (in its chunks, deciding as
    one pass), but keeps every attention head."""
    from zeroedge import calib_artifact
    from zeroedge.mechanisms.pad import artifact_policies

    cal = calib_artifact.Calibration.from_meta(meta)
    pruned = sorted(layer for layer, heads in cal.pruned_heads.items() if heads)
    not_applied = [f"head pruning on layers {pruned}: the torch session keeps every head (the exported "
                   "bundle prunes them)"] if pruned else []
    return (artifact_policies(meta, tensors) if cal.skip_layers else None), not_applied


def _artifact(calib, where="artifact"):
    """calib: an artifact folder, or (meta, tensors) -> (meta, tensors, where), checked to hold a
    paths or a weights section and to say which model it was made for."""
    from zeroedge import calib_artifact

    if isinstance(calib, (tuple, list)):
        meta, tensors = calib
    else:
        where = str(calib)
        cal = calib_artifact.read(calib)
        if cal.weights is None:
            cal.require_paths()                           # before the tensors are loaded
        meta, tensors = calib_artifact.load(calib)
    if "model" not in meta:
        raise UserError(f"{where} does not say which model it was made for (meta section 'model' is "
                        "missing)")
    return meta, tensors, where


def path_policies(model, paths, where="artifact") -> dict:
    """paths: an artifact folder, or (meta, tensors). Returns the per-layer policies for `model`,
    or UserError naming what is missing / which model the artifact was made for."""
    from zeroedge.paths.policies import policies_from_artifact

    meta, tensors, where = _artifact(paths, where)
    return policies_from_artifact(model, meta, tensors, where)


def quantize_weights(model, calib, where="artifact"):
    """Apply the artifact's weights section to `model` in place, packed (zeroedge.quant.apply with
    pack=True: the decoders read the 4-bit forms with the CUDA GEMV, and prefill the same weights);
    returns the WeightsSection, or None when the artifact has none."""
    from zeroedge.quant.apply import MARK, apply_artifact

    meta, tensors, where = _artifact(calib, where)
    if getattr(model, MARK, None):
        raise UserError(f"{where}: this model's weights are already quantized ({getattr(model, MARK)})")
    from zeroedge.runtime.fast import forget_fused_weights

    forget_fused_weights(model)                        # decoders built before fuse the new weights
    return apply_artifact(model, meta, tensors, where=where, pack=True)


class ServingSession:
    def __init__(self, source, kv_budget: Optional[float] = None, page_size: Optional[int] = None,
                 artifact=None, release_level: int = 3, paths_level: Optional[int] = None,
                 trip_pages: int = 1200, trip_requests: int = 5, on_alert: Optional[Callable[[str], None]] = None,
                 graph: bool = True, thermal_opts: Optional[dict] = None, device_memory: Optional[int] = None,
                 invariant: bool = False):
        """source: a model in eval mode (the torch backend) or a bundle's runner (`open_bundle`: the
        onnxruntime or tensorrt backend). invariant: the dense decoder's steps and checks through
        batch-invariant products (runtime.fast.Decoder's `invariant`: on CUDA, speculative decoding
        then gives plain decoding's tokens bit for bit); the model's fp weights on CUDA, no thermal KV
        or decode paths."""
        from zeroedge.backends.window import WindowRunner

        if source is None:
            raise UserError("a serving session needs a model or a bundle's runner (open_bundle)")
        backend = source.backend if isinstance(source, WindowRunner) else "torch"
        if kv_budget is not None:
            try:
                ok = 0 < float(kv_budget) <= 1
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise UserError(f"KV budget {kv_budget!r} is out of range: it must be in (0, 1]")
        if page_size is None:       # the torch decoder's pages (kv.policy.THERMAL), the bundle runners' own
            from zeroedge.kv.ort_policy import PAGE_SIZE
            from zeroedge.kv.policy import THERMAL

            page_size = THERMAL.page_size if backend == "torch" else PAGE_SIZE
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise UserError(f"page size must be a positive integer (got {page_size!r})")
        self.backend, self.kv_budget, self.page_size = backend, kv_budget, page_size
        self.alerts: List[str] = []
        self._on_alert = on_alert
        self.thermal_gate = ReleaseGate(release_level, trip_pages, trip_requests, on_alert=self._alert)
        self.paths_gate = ReleaseGate(release_level if paths_level is None else paths_level)
        self.graph, self.thermal_opts = graph, dict(thermal_opts or {})
        self._check_thermal_opts()
        model = source if backend == "torch" else None
        self.model, self.runner, self.policies = model, (None if backend == "torch" else source), None
        self.device_memory = device_memory
        if device_memory is not None and backend != "torch":
            raise UserError(f"a device memory cap applies to the torch backend; for a bundle, "
                            f"`zeroedge plan BUNDLE --board B --ctx N` forecasts the {backend} runtime")
        if backend == "torch" and model.training:
            raise UserError("the serving session is inference-only: call model.eval() first")
        # the longest prompt + completion: the model's context (TensorRT engines: their window at most)
        if backend == "torch":
            self.context = model.cfg.max_seq_len
        else:
            self.context = int(self.runner.manifest["model"].get("max_seq_len") or 2048)
            if backend == "tensorrt":
                self.context = min(self.context, self.runner.slots)
        self.bundle_paths = []
        self.not_applied: List[str] = []   # what the artifact holds that this backend does not run
        self.sih = None                    # (policies, runtime): the artifact's SIH/PAD layers (torch prefill)
        self.weights = None                # the artifact's weights section, applied (torch backend)
        self._draft = None                 # speculative "packed": the drafter (DraftModel, DecoderDraftModel)
        self._dense = None                 # the dense decoder kept for the next request (_dense_decoder)
        if backend == "torch":
            if artifact is not None:
                from zeroedge import calib_artifact

                meta, tensors, where = _artifact(artifact)
                cal = calib_artifact.Calibration.from_meta(meta, where)
                if cal.paths is not None or cal.weights is None:
                    self.policies = path_policies(model, (meta, tensors), where)
                if cal.weights is not None:     # the model changes in place: after every check
                    self.weights = quantize_weights(model, (meta, tensors), where)
                self.sih, self.not_applied = _sih_prefill(meta, tensors)
            if device_memory is not None:       # after the weights section: its packed forms count
                self._cap_memory(device_memory)
            dev = next(model.parameters()).device
            if dev.type == "cuda" and (kv_budget is not None or device_memory is not None):
                self._scheduler(dev)            # its bandwidth probe runs now, not at a request's memory peak
        else:
            # bundle backends: decode paths are nodes of the bundle's decode graph (zeroedge export with
            # a paths artifact), on for every request; a paths artifact here would be a second source
            cal = self.runner.manifest.get("calibration") or {}
            self.bundle_paths = list(cal.get("paths_layers") or [])
            if artifact is not None:
                raise UserError(f"the {backend} backend runs the decode paths its bundle was exported "
                                "with: give --bundle only (zeroedge export MODEL --calib PATHS_ARTIFACT)")
            if self.bundle_paths:
                self.policies = {"bundle": self.bundle_paths}
        self.invariant = invariant
        if invariant and not (backend == "torch" and next(model.parameters()).device.type == "cuda"
                              and kv_budget is None and self.policies is None and self.weights is None
                              and device_memory is None):
            raise UserError("batch-invariant decoding runs the model's own weights on CUDA, without thermal KV, "
                            "decode paths, a weights artifact or a memory cap")

    def _scheduler(self, device):
        """The session's bandwidth scheduler (one per session: its records span requests): peak from a
        measured copy, utilisation also from NVML (discrete GPU) or jtop's EMC load (Jetson)."""
        if getattr(self, "_bw_scheduler", None) is None:
            from zeroedge.kv.scheduler import BandwidthScheduler, hardware_sampler
            from zeroedge.kv.tiers import copy_bandwidth

            self._bw_scheduler = BandwidthScheduler(copy_bandwidth(device), sample_every=0.02,
                                                    sampler=hardware_sampler(memory_kind(device)))
        return self._bw_scheduler

    def _cap_memory(self, cap: int):
        """The weights must fit under the cap; on CUDA the caching allocator is held to it too, so a
        forecast that falls short fails as an out-of-memory error, not by taking memory beyond it."""
        from zeroedge.runtime.memory import weights_bytes

        p = next(self.model.parameters())
        w = weights_bytes(self.model.cfg, p.element_size()) + self._packed_bytes()
        if w >= cap:
            raise UserError(f"the model's weights ({_gib(w)}) do not fit "
                            f"the device memory cap of {_gib(cap)}")
        if p.device.type == "cuda":
            import torch

            total = torch.cuda.get_device_properties(p.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), p.device)

    def _packed_bytes(self) -> int:
        """Bytes of the packed weights the model holds beside its own (a weights section applied)."""
        from zeroedge.quant.apply import LINEARS

        mods = [b.get_submodule(n) for b in self.model.layers for n in LINEARS] + [self.model.lm_head]
        return sum(mod.packed.nbytes() for mod in mods if getattr(mod, "packed", None) is not None)

    def _cold_store(self, device) -> str:
        """Where cold pages live follows the memory (kv.policy.plan_tiers): compressed where host memory
        frees nothing (a Jetson's unified DRAM, a CPU), full precision in pinned host memory beside a
        discrete GPU, or in a file (`spill_dir`: compressed); unless the session's thermal options say."""
        compressed = "spill_dir" in self.thermal_opts or plan_tiers(memory_kind(device)).cold_compressed
        return self.thermal_opts.get("cold") or ("int8" if compressed else "host")

    def _fit_memory(self, T: int, max_new: int, temperature: float, plan: RunPlan):
        """Under a device memory cap: the request's forecast (zeroedge.runtime.memory) with the KV the
        gates chose must fit. Dense KV that does not fit is replaced by thermal KV (the session's
        budget, else 10 %) when the thermal gate allows it; a thermal request whose int8 cold store
        does not fit gets the int4 one (unless the session's options name the cold store);
        a thermal request that fits no cold store runs dense if dense fits; otherwise a UserError
        names the forecasts. Sets the plan's thermal_kv, thermal_budget and cold_store."""
        from zeroedge.runtime.memory import HEADROOM, request_bytes

        m = self.model
        p = next(m.parameters())
        budget = self.kv_budget or 0.1
        cold = self._cold_store(p.device)
        colds = [cold] + (["int4"] if cold == "int8" and "cold" not in self.thermal_opts else [])
        packed = self._packed_bytes()
        forecast = lambda **kw: int(request_bytes(m.cfg, p.element_size(), T, max_new, packed=packed,  # noqa: E731
                                                  **kw)["peak"] * (1 + HEADROOM))
        dense = forecast()
        therm = {c: forecast(budget=budget, settings=self._settings(), cold=c,
                             cold_shares_memory=memory_kind(p.device) != "discrete",
                             cold_in_file="spill_dir" in self.thermal_opts) for c in colds}
        cap = self.device_memory
        fits = [c for c in colds if therm[c] <= cap]
        mem = plan.device_memory = {"cap": cap, "dense_forecast": dense, "thermal_forecast": therm[cold],
                                    "thermal_budget": budget, "cold_store": cold}
        if p.device.type == "cuda":             # fixed segments: the cap also holds their unused reserve
            mem["allocator_segments"] = _allocator_segments()
        if len(colds) > 1:
            mem["thermal_int4_forecast"] = therm["int4"]
        thermal = plan.thermal_kv
        if not thermal and dense <= cap:
            return
        s = self._settings()
        allowed = thermal or (self.thermal_gate.allows(T + max_new, temperature)
                              and (T - 1) // self.page_size > s.sink_pages + s.recent_pages)
        if thermal and not fits and dense <= cap:
            plan.thermal_kv, plan.thermal_kv_reason = False, (
                f"thermal KV at {budget:.0%} hot needs {_gib(min(therm.values()))}, over the {_gib(cap)} device "
                f"memory cap; dense KV fits ({_gib(dense)})")
            return
        if allowed and fits:
            mem["cold_store"] = fits[0]
            if not thermal:
                plan.thermal_kv, plan.thermal_kv_reason = True, (
                    f"dense KV needs {_gib(dense)}, over the {_gib(cap)} device memory cap; thermal KV at "
                    f"{budget:.0%} hot with the {fits[0]} cold store needs {_gib(therm[fits[0]])}")
            plan.thermal_budget, plan.cold_store = budget, fits[0]
            return
        why = "" if allowed else " (thermal KV is not allowed for this request: " + (
            plan.thermal_kv_reason or "release level") + ")"
        options = ", ".join(f"{c} cold store {_gib(therm[c])}" for c in colds)
        raise UserError(f"{T} prompt + {max_new} new tokens do not fit the {_gib(cap)} device memory cap: "
                        f"dense KV needs {_gib(dense)}, thermal KV at {budget:.0%} hot: {options}{why}")

    def _settings(self):
        from dataclasses import fields, replace

        from zeroedge.kv.policy import ThermalSettings, thermal_settings

        known = {f.name for f in fields(ThermalSettings)}
        return replace(thermal_settings(self.page_size), **{k: v for k, v in self.thermal_opts.items() if k in known})

    def _check_thermal_opts(self):
        import inspect

        if self.backend == "torch":
            from zeroedge.kv.attention import ThermalAttention as target
        else:
            from zeroedge.kv.ort_policy import OrtThermalPolicy as target
        known = set(inspect.signature(target.__init__).parameters) - {
            "self", "prefix_len", "gen_len", "budget", "page_size"}
        bad = sorted(set(self.thermal_opts) - known)
        if bad:
            raise UserError(f"unknown thermal KV option(s) for the {self.backend} backend: "
                            f"{', '.join(bad)} (known: {', '.join(sorted(known))})")
        if self.backend == "torch" and "spill_dir" in self.thermal_opts and self.thermal_opts.get("cold") == "host":
            raise UserError("a cold store in a file (spill_dir) is compressed: cold must be int8 or int4")

    # -- control -------------------------------------------------------------------------------
    def set_level(self, level: int, which: str = "both"):
        """Switch release levels at run time: which = "thermal", "paths" or "both"."""
        if which not in ("thermal", "paths", "both"):
            raise UserError(f"which must be thermal, paths or both (got {which!r})")
        if which in ("thermal", "both"):
            self.thermal_gate.set_level(level)
        if which in ("paths", "both"):
            self.paths_gate.set_level(level)

    def _alert(self, msg: str):
        self.alerts.append(msg)
        if self._on_alert:
            self._on_alert(msg)

    @property
    def metrics(self) -> dict:
        return dict(self.thermal_gate.metrics, thermal_kv_level=self.thermal_gate.level,
                    paths_level=self.paths_gate.level)

    # -- requests ------------------------------------------------------------------------------
    def decide(self, n_prompt: int, max_new: int, temperature: float = 0.0, paths: Optional[bool] = None
               ) -> RunPlan:
        """What the release gates allow a request: thermal KV and decode paths, on or off with the reason
        (`plan` adds what the prompt, the memory cap and the decoder decide)."""
        n = n_prompt + max_new
        out = RunPlan(release_level=self.thermal_gate.level, paths_level=self.paths_gate.level,
                      not_applied=list(self.not_applied) or None,
                      weights=self.weights.describe() if self.weights is not None else None)
        if self.kv_budget is None:
            out.thermal_kv_reason = "no KV budget given"
        elif not self.thermal_gate.allows(n, temperature):
            out.thermal_kv_reason = _why_not(self.thermal_gate, n, temperature)
        elif n_prompt < MIN_THERMAL_TOKENS:
            out.thermal_kv_reason = f"prompt under {MIN_THERMAL_TOKENS} tokens bypasses thermal KV"
        else:
            out.thermal_kv = True
        if self.bundle_paths:             # bundle backends: the graph always runs them
            if paths is False:
                raise UserError("this bundle's decode graph runs decode paths on every request: "
                                "use a bundle exported without them to decode dense")
            if not self.paths_gate.allows(n, temperature):
                raise UserError(f"this bundle's decode graph runs decode paths, but "
                                f"{_why_not(self.paths_gate, n, temperature)}: raise the release level "
                                "or use a bundle exported without paths")
            out.paths, out.paths_reason = True, f"the bundle's decode graph (layers {self.bundle_paths})"
            return out
        if paths is False:
            out.paths_reason = "not asked for"
            return out
        if paths and self.backend != "torch":
            raise UserError(f"{self.runner.dir} has no decode paths (its decode graph is dense): export it with "
                            "a paths artifact; refusing to run dense in place of sparse")
        if self.policies is None:
            if paths:
                raise UserError("paths asked for but the session has no path predictors (give "
                                "--calib ARTIFACT made by zeroedge calibrate --paths)")
            out.paths_reason = "no path predictors loaded"
        elif not self.paths_gate.allows(n, temperature):
            if paths:
                raise UserError(f"paths asked for but {_why_not(self.paths_gate, n, temperature)}; "
                                "refusing to run dense in place of sparse (raise the release level)")
            out.paths_reason = _why_not(self.paths_gate, n, temperature)
        else:
            out.paths = True
        return out

    def plan(self, prompt_len: int, max_new: int, temperature: float = 0.0, paths: Optional[bool] = None,
             speculative: str = "off") -> RunPlan:
        """The request's whole plan, before anything runs: the gates' decision (`decide`), then on the
        torch backend thermal KV only where the prompt has pages to leave cold, the device memory cap
        (`_fit_memory`), SIH/PAD for the prefill and whether a speculative check can run."""
        if speculative != "off" and self.backend != "torch":
            raise UserError(f"speculative decoding needs the torch backend (the {self.backend} backend's step "
                            "gives the last position's logits only)")
        if prompt_len + max_new > self.context:
            raise UserError(f"{prompt_len} prompt + {max_new} new tokens exceed the "
                            + ("model's context" if self.backend != "tensorrt" else "engines' window")
                            + f" ({self.context})")
        plan = self.decide(prompt_len, max_new, temperature, paths)
        if self.backend != "torch":
            return plan
        T, ps = prompt_len, self.page_size
        P = ((T - 1) // ps) * ps             # the prefilled part: up to the prompt's last whole page
        self._plan_thermal(plan, T, P, max_new, temperature)
        if self.sih is not None:
            from zeroedge.mechanisms.pad import check_sampling

            plan.sih_pad = False
            if not check_sampling(temperature):
                plan.sih_pad_reason = (f"temperature {temperature:g} > 1.0 (skipping prunes the tail sampling "
                                       "draws from)")
            elif P < self.sih[1].min_tokens:
                plan.sih_pad_reason = f"prefill of {P} tokens, under {self.sih[1].min_tokens}"
            else:
                plan.sih_pad = True
        if speculative != "off":
            cuda = next(self.model.parameters()).device.type == "cuda"
            why = ("decode paths: their decoder checks one token a step" if plan.paths
                   else "thermal KV with its cold store in a file: a check's refreshes read it row by row"
                   if plan.thermal_kv and "spill_dir" in self.thermal_opts
                   else "thermal KV on CUDA: a check runs its rows' refreshes and attention eagerly, row by row "
                        "(0.05-0.07x plain decoding on an H100)"
                   if plan.thermal_kv and cuda
                   else "packed GEMV on int8-rounded inputs: a check by the fp weights would be another model"
                   if self.weights is not None and cuda else None)
            if why is None and speculative == "packed":
                why = ("thermal KV: the packed drafter takes the prompt's K/V from the dense cache"
                       if plan.thermal_kv
                       else "the model decodes on its artifact's 4-bit weights already" if self.weights is not None
                       else "a device memory cap: the drafter's weights and KV are not in its forecast"
                       if self.device_memory is not None
                       else "the 4-bit CPU step drafts for a float32 model"
                       if not cuda and str(next(self.model.parameters()).dtype) != "torch.float32" else None)
            plan.speculative, plan.speculative_reason = (speculative, None) if why is None else (False, why)
        return plan

    def generate(self, prompt: List[int], max_new: int, temperature: float = 0.0,
                 paths: Optional[bool] = None, eos: Optional[int] = None, seed: int = 0,
                 speculative: str = "off") -> Result:
        """One request through the serving engine (zeroedge.serve.engine, in this thread) over this
        session's decoder. speculative: "off", "ngram" or "auto" (zeroedge.speculative: drafts by
        prompt lookup, checked by the model; the torch backend's dense decoder). The tokens end with
        `eos` when the model picked it."""
        from zeroedge.serve.backends import SessionSequential
        from zeroedge.serve.engine import Engine
        from zeroedge.serve.plan import Plan, Sampling

        prompt = [int(t) for t in prompt]
        if not prompt:
            raise UserError("the prompt is empty")
        if max_new < 1:
            raise UserError(f"max new tokens must be >= 1 (got {max_new})")
        if temperature < 0 or temperature != temperature:
            raise UserError(f"temperature must be >= 0 (got {temperature})")
        plan = self.plan(len(prompt), max_new, temperature, paths, speculative)
        T = len(prompt)
        request = Plan(prompt, Sampling(max_new, temperature, 1.0, seed), T + max_new, 0,
                       eos=() if eos is None else (int(eos),), session_plan=plan)
        backend = SessionSequential(self, T + max_new, thermal=plan.thermal_kv)
        draft = self._draft_model(T + max_new) if plan.speculative == "packed" else None
        try:
            seq = Engine(backend, speculative=plan.speculative or "off", draft_model=draft).run(request)
        except Exception as e:                      # torch.OutOfMemoryError, without importing torch here
            if self.device_memory is None or type(e).__name__ != "OutOfMemoryError":
                raise
            hint = ("" if _allocator_segments() != "fixed" else "; the allocator's segments are fixed and "
                    "their unused reserve counts: start the process with PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True")
            raise UserError(f"out of memory under the {_gib(self.device_memory)} device memory cap "
                            f"(the forecast said {plan.device_memory}): {str(e).splitlines()[0]}{hint}"
                            ) from None
        if draft is not None:
            backend.last.report.mechanisms["speculative_drafter"] = draft.weights
        return result_of(seq, eos, backend.last.report)

    def _draft_model(self, positions: int):
        """The packed drafter for a request of `positions` prompt + new tokens (made once a session, its
        KV grown when a request needs more; its weights made once): on CUDA the dense decoder's step on
        packed forms of the model's weights, else the 4-bit CPU step."""
        import torch

        from zeroedge.serve.backends import DecoderDraftModel, DraftModel

        d = self._draft
        if next(self.model.parameters()).device.type == "cuda":
            if d is None or d.positions_total < positions:
                self._draft = None
                self._draft = DecoderDraftModel(self.model, positions, d.forms if d is not None else None)
        elif d is None or d.b.positions_total < positions:
            self._draft = None
            self._draft = DraftModel.build(self.model, torch.get_num_threads(), positions, 1, 128,
                                           d.b.step.q4 if d is not None else None)
        return self._draft

    def open(self, prompt: List[int], max_new: int, plan: Optional[RunPlan] = None):
        """The decoder `plan` chose for this request (made now when not given), before its prefill:
        a TorchDecoding or a BundleDecoding (prefill, step, verify where it checks drafts, close)."""
        if plan is None:
            plan = self.plan(len(prompt), max_new)
        return (TorchDecoding if self.backend == "torch" else BundleDecoding)(self, prompt, max_new, plan)

    def _closed(self, plan: RunPlan, mechanisms: dict, pages_migrated: int) -> None:
        """A request's decoder closed: the thermal gate's breaker counts the pages it migrated."""
        if plan.thermal_kv:
            self.thermal_gate.record(self.model_pages(pages_migrated))
        mechanisms["release_level_after"] = self.thermal_gate.level

    def model_pages(self, pages: int) -> int:
        """Pages migrated in whole-model pages of P positions (the breaker's unit)."""
        if self.backend != "torch":
            return int(pages)
        per = len(self.model.layers) * self.model.cfg.n_kv_heads
        return -(-int(pages) // per)

    # -- torch ---------------------------------------------------------------------------------
    def _plan_thermal(self, plan: RunPlan, T, P, max_new, temperature):
        """Thermal KV only where it saves memory (the prompt's P prefilled positions have pages to
        leave cold), then the device memory cap."""
        ps, st = self.page_size, self._settings()
        least = st.sink_pages + st.recent_pages + 1        # the window's fixed pages and a slot
        if plan.thermal_kv and P // ps < least:
            plan.thermal_kv, plan.thermal_kv_reason = False, f"prompt of {T} tokens is under {least} pages of {ps}"
        if plan.thermal_kv and self.kv_budget < 1:
            from zeroedge.kv.policy import window_pages

            fixed, slots = window_pages(P, self.kv_budget, st)
            if fixed + slots >= P // ps:                       # nothing would be cold: no saving
                plan.thermal_kv, plan.thermal_kv_reason = False, (
                    f"prompt of {T} tokens: the thermal window ({fixed} fixed pages and {slots} slot(s)) "
                    f"would hold all {P // ps} pages of {ps}")
        if plan.thermal_kv:
            plan.thermal_budget = self.kv_budget
        if self.device_memory is not None:
            self._fit_memory(T, max_new, temperature, plan)

    @contextlib.contextmanager
    def _sih_prefill_on(self, n: int, plan: RunPlan, ran: dict):
        """The artifact's SIH/PAD layers on for the n-token prefill inside the block where the plan has
        them (its chunks decide as one pass would), off again after it; `ran` gets what they skipped."""
        if not plan.sih_pad:
            yield
            return
        from zeroedge.mechanisms.pad import flops_summary, install, remove

        pol, rt = self.sih
        install(self.model, pol, rt)
        rt.reset_stats()
        rt.active = True
        rt.begin_prompt(n)
        try:
            yield
            ran.update(sih_pad_layers=sorted(pol),
                       sih_pad_ffn_flops_skipped=flops_summary(self.model, rt)["ffn_flops_skipped"])
        finally:
            rt.active = False
            rt.end_prompt()
            remove(self.model)

    def _torch_decoder(self, prompt, P, max_new, plan: RunPlan, ran: dict):
        """The decoder the plan chose (one attention strategy, one FFN), its cache filled by the
        prompt's first P tokens (with the artifact's SIH/PAD layers); and the cold store it uses (None
        without thermal KV). `ran` gets the decode kernels."""
        from zeroedge.model import PREFILL_CHUNK, chunked_prefill
        from zeroedge.runtime.fast import PathsDecoder, ThermalDecoder, ThermalPathsDecoder

        m, T = self.model, len(prompt)
        dev = next(m.parameters()).device
        chunk = PREFILL_CHUNK
        if self.sih is not None:              # every chunk a whole number of the block rule's blocks
            from zeroedge.mechanisms.pad import chunk_on_blocks

            chunk = chunk_on_blocks(chunk, self.sih[0].values())
        # packed weights on a GPU: the GEMV on int8-rounded inputs (dp4a; benchmarks/weights.md: +0.1 % ppl)
        i8 = self.weights is not None and dev.type == "cuda"
        thermal = plan.thermal_kv
        if thermal:
            kw = dict(budget=plan.thermal_budget, page_size=self.page_size, **self.thermal_opts)
            kw["cold"] = cold = plan.cold_store or self._cold_store(dev)
            if dev.type == "cuda":              # refreshes wait while memory bandwidth is busy
                kw.setdefault("scheduler", self._scheduler(dev))
            G = T - P + max_new

            def decoder():
                return (ThermalPathsDecoder(m, P, G, self.policies, graph=self.graph, int8_inputs=i8, **kw)
                        if plan.paths else ThermalDecoder(m, P, G, graph=self.graph, int8_inputs=i8, **kw))

            if cold != "host":                  # the prefill writes int8 / int4 K/V straight into the cold store
                dec = decoder()
                with self._sih_prefill_on(P, plan, ran):
                    ks, vs, qcov = chunked_prefill(m, prompt[:P], chunk,
                                                   caches=dec.attention.prefill_caches())
            else:                               # full-precision K/V, copied to pinned host memory
                with self._sih_prefill_on(P, plan, ran):
                    ks, vs, qcov = chunked_prefill(m, prompt[:P], chunk)
                dec = decoder()
            dec.load_prefix(ks, vs, qcov)
            del ks, vs, qcov                    # the prefill cache goes here
        else:
            cold = None
            dec = (PathsDecoder(m, T + max_new, self.policies, graph=self.graph, int8_inputs=i8) if plan.paths
                   else self._dense_decoder(T + max_new, i8))
            if P > 0:                           # the prefill writes straight into the decoder's cache
                att = dec.attention
                with self._sih_prefill_on(P, plan, ran):
                    chunked_prefill(m, prompt[:P], chunk, into=list(zip(att.k, att.v)))
        ran["attention_decode"] = (("thermal window, " if thermal else "")
                                   + ("paged Triton attention, batch-invariant products (a step is a check of "
                                      "one token)" if dec.invariant
                                      else "Triton split attention" if dec.attention.takes_qkv
                                      else dec.attention.attn))
        if self.weights is not None:
            ran["weights_decode"] = ("packed GEMV, int8 inputs (dp4a)" if dec.int8_inputs
                                      else "packed GEMV" if dec.packed_layers is not None
                                      else "dequantized weights (no packed GEMV on this device)")
        return dec, cold

    def _dense_decoder(self, positions: int, int8_inputs: bool):
        """A DenseDecoder of at least `positions`. On CUDA with graphs and no memory cap one is kept for
        the next request, with the graphs it captured (its step, each check's row count: capturing them
        again for every request cost `run --speculative` a fifth of its decode time on SmolLM2): a cache
        of the next power of two of positions (1024 at least, the context at most), made anew when a
        request needs more. Its positions past a request's are never read."""
        from zeroedge.runtime.fast import DenseDecoder

        m = self.model
        if not (self.graph and next(m.parameters()).device.type == "cuda" and self.device_memory is None):
            return DenseDecoder(m, positions, graph=self.graph, int8_inputs=int8_inputs, invariant=self.invariant)
        d = self._dense
        if d is None or d.max_len < positions or d.int8_inputs != int8_inputs:
            size = max(positions, min(max(1024, 1 << (positions - 1).bit_length()), self.context))
            self._dense = d = None              # the old cache goes first
            self._dense = d = DenseDecoder(m, size, graph=True, int8_inputs=int8_inputs, invariant=self.invariant)
        return d


def open_bundle(bundle, backend: str = "onnxruntime", engines=None, plugin_lib=None, threads: Optional[int] = None,
                model_cfg=None):
    """A bundle's runner for a ServingSession: OrtRunner (onnxruntime) or TrtRunner over the TensorRT
    engines `zeroedge build BUNDLE -o ENGINES` made; with model_cfg, checked to be that model's."""
    from pathlib import Path

    if backend not in BACKENDS[1:]:
        raise UserError(f"a bundle runs on {' or '.join(BACKENDS[1:])} (got {backend!r})")
    if bundle is None or not Path(bundle).is_dir():
        raise UserError(f"bundle not found: {bundle}")
    if backend == "tensorrt":
        from zeroedge.backends.tensorrt import TrtRunner

        if engines is None:
            raise UserError("the tensorrt backend needs --engines DIR (made by zeroedge build BUNDLE -o DIR)")
        runner = TrtRunner(bundle, engines, plugin_lib)
    else:
        from zeroedge.backends.onnxruntime import OrtRunner

        runner = OrtRunner(bundle, threads=threads)
    if model_cfg is not None:
        from zeroedge.calib_artifact import shape_mismatch

        cfg, mine = runner.manifest["model"], model_cfg.to_dict()
        bad = shape_mismatch(cfg, mine)
        if bad:
            raise UserError(f"{bundle} was exported from {cfg.get('name')} ({bad[0]}), not from "
                            f"{mine.get('name')} ({bad[1]})")
    return runner


@dataclass
class Report:
    """What a closed request's decoder reports (the Result's fields past the tokens and times)."""
    mechanisms: dict
    device_kv_bytes: int
    full_kv_bytes: int
    pages_migrated: int
    detail: dict


def result_of(seq, eos: Optional[int], report: Report) -> Result:
    """A request the engine ran (zeroedge.serve.engine.Sequence) as a Result: its tokens (ending with
    `eos` when the model picked it), its times and what its decoder reported."""
    tokens = seq.out + ([int(eos)] if seq.finish_reason == "stop" and eos is not None else [])
    if seq.spec is not None:
        report.detail["speculative"] = seq.spec.stats.to_dict()
    prefill_s, decode_s = seq.t_first - seq.t_submit, seq.t_done - seq.t_first
    steps = seq.picks - 1                   # tokens after the first, an EOS picked included
    return Result(tokens, report.mechanisms, len(seq.plan.prompt), prefill_s, decode_s,
                  steps / decode_s if steps and decode_s > 0 else 0.0, report.device_kv_bytes,
                  report.full_kv_bytes, report.pages_migrated, report.detail)


class TorchDecoding:
    """A request on the torch backend: the decoder its plan chose (one attention strategy, one FFN),
    filled by the prompt's prefill up to its last whole page (exact, or into a compressed cold store)
    and the prompt's tail teacher-forced through the decode step (with the decode mechanisms); then
    one token a step, or a draft checked in one step (Decoder.verify; the dense and thermal
    decoders). Thermal page swaps are counted as the steps make them (a check's, once the next call
    has undone those of the rows it did not keep)."""

    def __init__(self, session: ServingSession, prompt: List[int], max_new: int, plan: RunPlan):
        self.s, self.prompt, self.max_new, self.plan = session, prompt, max_new, plan
        self.ran = plan.to_dict()            # the mechanisms, and below what ran
        self.dec = self.cold = self.report = self.moved = self._slot_page = self._prev = None

    def prefill(self, tokens) -> np.ndarray:
        import torch

        T, ps = len(self.prompt), self.s.page_size
        P = ((T - 1) // ps) * ps
        self.dec, self.cold = self.s._torch_decoder(self.prompt, P, self.max_new, self.plan, self.ran)
        self.moved = torch.zeros((), dtype=torch.long, device=self.dec.device)
        if self.plan.thermal_kv:
            self._slot_page = self.dec.attention.slot_page
            self._prev = self._slot_page.clone()
        for pos in range(P, T):
            logits = self._step(self.prompt[pos], pos)
        return logits.float().cpu().numpy()

    def _step(self, token: int, pos: int):
        out = self.dec.step(token, pos)
        if self.plan.thermal_kv:
            self.moved.add_((self._slot_page != self._prev).sum())
            self._prev.copy_(self._slot_page)
        return out

    def step(self, token: int, pos: int) -> np.ndarray:
        return self._step(token, pos).float().cpu().numpy()

    def verify(self, tokens: List[int], pos: int) -> np.ndarray:
        return self.dec.verify(tokens, pos).float().cpu().numpy()

    def device_kv_bytes(self) -> int:
        if self.dec is None:
            return 0
        if not self.plan.thermal_kv:
            return self.dec.kv_bytes()
        kb = self.dec.device_kv_bytes()
        return kb["hot"] + kb["summaries"] + kb["generated"] + kb["page_table"] + kb["cold_on_device"]

    def close(self) -> None:
        import torch

        dec = self.dec
        if dec is None or self.report is not None:
            return
        m, T, ps = self.s.model, len(self.prompt), self.s.page_size
        el = torch.finfo(dec.dtype).bits // 8
        full = 2 * len(m.layers) * m.cfg.n_kv_heads * (T + self.max_new) * m.cfg.head_dim * el
        detail = {"decoder": type(dec).__name__, "backend": "torch", "device": str(dec.device)}
        moved = int(self.moved) if self.plan.thermal_kv else 0
        if self.plan.thermal_kv:
            kb = dec.device_kv_bytes()
            detail.update(hot_kv_bytes=kb["hot"], summary_bytes=kb["summaries"], page_size=ps,
                          cold_store=self.cold, cold_on_device_bytes=kb["cold_on_device"],
                          cold_in_file_bytes=kb["cold_in_file"],
                          scheduler=dec.attention.scheduler_report(), thermal_policy=dec.attention.policy(),
                          migrated_bytes=moved * 2 * ps * m.cfg.head_dim * el)
        if self.plan.paths:
            detail["paths_channels_kept_last_step"] = dec.kept()
        self.report = Report(self.ran, self.device_kv_bytes(), full, moved, detail)
        self.dec = self.moved = self._slot_page = self._prev = None   # its device memory goes with them
        self.s._closed(self.plan, self.ran, moved)


class BundleDecoding:
    """A request on a bundle backend: the runner's window sized to it (every position: exact), or
    thermal KV's window of pages with OrtThermalPolicy; the prompt in one prefill, then one token a
    step."""

    def __init__(self, session: ServingSession, prompt: List[int], max_new: int, plan: RunPlan):
        from zeroedge.kv.ort_policy import OrtThermalPolicy

        r, T, ps = session.runner, len(prompt), session.page_size
        if T < 2:
            raise UserError(f"the {session.backend} backend needs a prompt of at least 2 tokens")
        self.s, self.r, self.prompt, self.max_new, self.plan = session, r, prompt, max_new, plan
        if plan.thermal_kv:
            self.pol = OrtThermalPolicy(page_size=ps, **session.thermal_opts)
            r.slots, r.policy = self.pol.window_pages(r.sinks, session.kv_budget, T, max_new) * ps, self.pol
        else:
            self.pol = None
            r.slots, r.policy = T + max_new, None          # a window of every position: exact
        self.decode_s0 = r.timings["decode_s"]
        self.report = None

    def prefill(self, tokens) -> np.ndarray:
        return self.r.prefill(np.asarray(tokens))

    def step(self, token: int, pos: int) -> np.ndarray:
        return self.r.step(token)

    def verify(self, tokens, pos):
        raise UserError(f"the {self.s.backend} backend's step gives the last position's logits only")

    def device_kv_bytes(self) -> int:
        n = self.r.window_bytes()
        if self.pol is not None:
            st = self.pol.stats()
            n += st["summary_bytes"] + st["page_table_bytes"]
        return n

    def close(self) -> None:
        if self.report is not None:
            return
        r, ps = self.r, self.s.page_size
        full = 2 * r.L * r.nkv * (len(self.prompt) + self.max_new) * r.hd * 4
        detail = {"decoder": type(r).__name__, "backend": self.s.backend, "window_slots": r.slots,
                  "graph_decode_s": r.timings["decode_s"] - self.decode_s0}
        if self.s.bundle_paths:
            detail["paths_layers"] = self.s.bundle_paths
        moved = 0
        if self.pol is not None:
            st = self.pol.stats()
            detail.update(hot_kv_bytes=r.window_bytes(), page_size=ps, thermal=st, migrated_bytes=st["migrated_bytes"])
            moved = self.pol.migrated
        mech = self.plan.to_dict()
        self.report = Report(mech, self.device_kv_bytes(), full, moved, detail)
        self.s._closed(self.plan, mech, moved)
