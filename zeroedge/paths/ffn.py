"""Decode paths as the decode step's FFN strategy (zeroedge.runtime.fast.Decoder composes it with an
attention strategy): each sparse layer's FFN is the gather-GEMV step (predictor score -> live rows
of W_gate / W_up -> live rows of W_down^T). On CUDA with Triton it runs the kernels of
zeroedge.paths.triton_gemv inside the decoder's CUDA graph; elsewhere the torch references (same
function), so the CPU tests check the loop end to end.

Magnitude policies (|x| / |a| thresholds) run the row-gather kernel twice: over [W_gate; W_up]^T
with the small |x_k| zeroed (their rows are never read), then over W_down^T with the small |a_j|
zeroed. Dense layers (no policy) keep the dense FFN. In a decoder that reads packed 4-bit weights
(zeroedge.quant.packed) the magnitude rule gathers the same rows from input-major 4-bit codes
(quant.packed.PackedInputs; a group of inputs that are all 0 is not read at all); the predictor rule
reads only its live channels' rows of the 4-bit [W_gate; W_up] (the packed GEMV with a row mask)
and then gathers the down rows as the magnitude rule does.

kernels="cuda" runs the plugin library's CUDA C kernels instead (zeroedge.paths.cuda_gemv: two
launches an FFN, the code the TensorRT plugin runs; on the H200 the magnitude rule decodes 1.03-1.14x
dense with them, against 0.80-0.86x with Triton). "auto" picks those kernels on CUDA when the
plugin library is built (zeroedge.paths.cuda_gemv.default_path), else Triton, and the torch
references off CUDA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroedge.paths import triton_gemv as tg
from zeroedge.quant import packed


def _use_triton(device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class PathsFFN:
    """The FFN of the layers in `policies` (layer -> zeroedge.paths.sparse.PathPolicy) as gather-GEMVs;
    the other layers' FFN stays dense. `bind` gets the decoder's fused weights, device and dtype."""

    def __init__(self, policies: dict, kernels: str = "auto", kernels_lib=None):
        if not policies:
            raise ValueError("decode paths need path policies (none given): refusing to run dense "
                             "in place of sparse")
        bad = [i for i, p in policies.items() if p.method not in ("predictor", "magnitude")]
        if bad:
            raise ValueError(f"decode paths run predictor or magnitude policies (layers {bad} are not)")
        if kernels not in ("auto", "triton", "cuda", "torch"):
            raise ValueError(f"kernels must be auto, triton, cuda or torch, not {kernels!r}")
        self.policies, self.kernels_wanted, self.kernels_lib = policies, kernels, kernels_lib

    def bind(self, layers: list, cfg, device, dtype, packed_layers=None, int8_inputs: bool = False):
        """layers: the decoder's fused weights per layer (w13 = [W_gate; W_up], w2 = W_down, ...);
        packed_layers: the decoder's packed 4-bit forms (zeroedge.quant.packed), when it reads them:
        sparse layers then read rows of those (magnitude: input-major forms; predictor: live rows);
        int8_inputs: the decoder's packed GEMVs round their inputs to int8 (dp4a), these too."""
        self.device, self.dtype, self.int8_inputs = device, dtype, int8_inputs
        self._pick_kernels(self.kernels_wanted, self.kernels_lib)
        self._build_paths(layers, cfg, self.policies, packed_layers)

    def _pick_kernels(self, kernels: str, kernels_lib=None):
        """Sets self.kernels / self.triton / self.cuda_lib."""
        if kernels == "auto" and self.device.type == "cuda":
            from zeroedge.paths import cuda_gemv
            if kernels_lib or cuda_gemv.default_path().is_file():
                kernels = "cuda"
        self.kernels = kernels
        self.triton = kernels in ("auto", "triton") and _use_triton(self.device)
        if kernels == "triton" and not self.triton:
            raise ValueError("kernels='triton' needs a CUDA device and Triton")
        self.cuda_lib = None
        if kernels == "cuda":
            if self.device.type != "cuda":
                raise ValueError("kernels='cuda' needs a CUDA device")
            from zeroedge.paths import cuda_gemv
            self.cuda_lib = cuda_gemv.load(kernels_lib)

    def _build_paths(self, layers: list, cfg, policies: dict, packed_layers=None):
        """Per sparse layer: the predictor / thresholds and the transposed weights the gather
        kernels read (4-bit, input-major, for a magnitude layer of a packed decoder)."""
        D, Fd = cfg.dim, cfg.ffn_dim
        self.paths = {}
        if self.cuda_lib is not None:  # one scratch for every layer: the kernels leave it zeroed
            from zeroedge.paths import cuda_gemv
            self.cuda_work = cuda_gemv.work_buffer(self.cuda_lib, 1, D, Fd, self.device)
            self.cuda_out = torch.zeros(1, D, device=self.device, dtype=self.dtype)
        for i, pol in policies.items():
            pr, w = pol.predictor, layers[i]
            if pol.method == "magnitude" and packed_layers is not None:
                self.paths[i] = dict(
                    kind="magnitude_packed", thr_in=float(pol.threshold_in), thr=float(pol.threshold),
                    w13t=packed.PackedInputs.of(packed_layers[i]["w13"]),
                    wdt=packed.PackedInputs.of(packed_layers[i]["w2"]),
                    act=torch.zeros(1, Fd, device=self.device, dtype=self.dtype))
                continue
            if pol.method == "predictor" and packed_layers is not None:
                self.paths[i] = dict(
                    kind="predictor_packed", at=pr.a.T.contiguous().to(self.device, self.dtype),
                    bg=pr.bg.to(self.device, torch.float32), thr=float(pr.threshold),
                    bu=tg.fold_down_norm(pr.bu, pr.wd_norm).to(self.device, torch.float32),
                    w13=packed_layers[i]["w13"], wdt=packed.PackedInputs.of(packed_layers[i]["w2"]),
                    act=torch.zeros(1, Fd, device=self.device, dtype=self.dtype))
                continue
            if pol.method == "magnitude":
                self.paths[i] = dict(
                    kind="magnitude", thr_in=float(pol.threshold_in), thr=float(pol.threshold),
                    w13t=w["w13"].T.contiguous(), wdt=w["w2"].T.contiguous(),
                    act=torch.zeros(1, Fd, device=self.device, dtype=self.dtype),
                    part=torch.zeros(tg.CONFIG["down"]["splits"], 1, D, device=self.device,
                                     dtype=torch.float32),
                    part2=torch.zeros(tg.CONFIG["down"]["splits"], 1, 2 * Fd, device=self.device,
                                      dtype=torch.float32))
                continue
            self.paths[i] = dict(
                kind="predictor", at=pr.a.T.contiguous().to(self.device, self.dtype),
                bg=pr.bg.to(self.device, self.dtype).contiguous(),
                bu=tg.fold_down_norm(pr.bu, pr.wd_norm).to(self.device, self.dtype).contiguous(),
                bg_t=pr.bg.T.to(self.device, self.dtype).contiguous(),
                bu_t=tg.fold_down_norm(pr.bu, pr.wd_norm).T.to(self.device, self.dtype).contiguous(),
                thr=float(pr.threshold), wg=w["w13"][:Fd], wu=w["w13"][Fd:],
                wdt=w["w2"].T.contiguous(),
                act=torch.zeros(1, Fd, device=self.device, dtype=self.dtype),
                part=torch.zeros(tg.CONFIG["down"]["splits"], 1, D, device=self.device,
                                 dtype=torch.float32))

    def _paths_ffn(self, p, h):
        if p["kind"] == "predictor_packed":   # the live channels' 4-bit gate / up rows, then their down rows
            z = F.linear(h, p["at"])
            p["act"].copy_(packed.swiglu(h, p["w13"], predictor=(z, p["bg"], p["bu"], p["thr"]),
                                         int8_inputs=self.int8_inputs))
            return packed.gather_inputs(p["act"], p["wdt"])
        if p["kind"] == "magnitude_packed":   # rows of the 4-bit codes, only for surviving inputs
            g, u = packed.gather_inputs(h * (h.abs() >= p["thr_in"]), p["w13t"]).chunk(2, -1)
            a = F.silu(g) * u
            p["act"].copy_(a * (a.abs() >= p["thr"]))
            return packed.gather_inputs(p["act"], p["wdt"])
        if self.cuda_lib is not None:
            from zeroedge.paths import cuda_gemv
            if p["kind"] == "magnitude":
                return cuda_gemv.ffn_magnitude(self.cuda_lib, h, p["w13t"], p["wdt"], p["thr_in"],
                                               p["thr"], self.cuda_work, self.cuda_out)
            z = F.linear(h, p["at"])
            return cuda_gemv.ffn_predictor(self.cuda_lib, h, z, p["bg_t"], p["bu_t"], p["wg"], p["wu"],
                                           p["wdt"], p["thr"], self.cuda_work, self.cuda_out)
        if p["kind"] == "magnitude":
            hm = h * (h.abs() >= p["thr_in"])
            if self.triton:  # D rows -> 2F outputs: fewer splits keep the atomic adds down
                gu = tg.paths_down(hm, p["w13t"], part=p["part2"], splits=max(1, min(256, hm.shape[-1] // 64)))
            else:
                gu = tg.paths_down_ref(hm, p["w13t"])
            g, u = gu.chunk(2, -1)
            a = F.silu(g) * u
            act = a * (a.abs() >= p["thr"])
            p["act"].copy_(act)
            if self.triton:
                return tg.paths_down(p["act"], p["wdt"], part=p["part"])
            return tg.paths_down_ref(act, p["wdt"])
        z = F.linear(h, p["at"])
        if self.triton:
            act = tg.paths_gateup(h, z, p["bg"], p["bu"], p["wg"], p["wu"], p["thr"], out=p["act"])
            return tg.paths_down(act, p["wdt"], part=p["part"])
        act = tg.paths_gateup_ref(h, z, p["bg"], p["bu"], p["wg"], p["wu"], p["thr"])
        p["act"].copy_(act)
        return tg.paths_down_ref(act, p["wdt"])

    def out(self, li: int, w: dict, wo, x, o):
        """The layer's output after attention (residuals included), or None for a dense layer; wo the
        o_proj weight the step reads (fp or packed)."""
        p = self.paths.get(li)
        if p is None:
            return None
        x = packed.linear(o.reshape(1, -1), wo, residual=x, int8_inputs=self.int8_inputs)
        h = F.rms_norm(x, (x.shape[-1],), w["ln2"], w["eps2"])
        return x + self._paths_ffn(p, h)

    def kept(self) -> dict:
        """Fraction of channels the last step computed, per sparse layer."""
        return {i: float((p["act"] != 0).float().mean()) for i, p in self.paths.items()}
