"""Tier storage (torch): int8 / int4 pages with per-group scales, the compressed prefill cache,
the file cold store (a whole cold store mapped from one private file on NVMe), and the transfer
handler that moves pages on its own CUDA stream and reports bytes and seconds per transfer. (The
pinned host store of a discrete GPU is ThermalAttention's own, zeroedge.kv.attention.)
"""
from __future__ import annotations

import functools
import threading
import time

import torch


# --------------------------------------------------------------------------------------------
# quantisation: symmetric, one fp16 scale per `group` consecutive values of the last dim
# --------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor, bits: int = 8, group: int = 32):
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    *lead, d = x.shape
    if d % group:
        raise ValueError(f"last dim {d} is not a multiple of the group {group}")
    g = x.float().reshape(*lead, d // group, group)
    qmax = 2 ** (bits - 1) - 1
    scale = (g.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8).half()
    q = torch.round(g / scale.float()).clamp(-qmax, qmax).to(torch.int8).reshape(*lead, d)
    if bits == 4:
        u = (q + 8).to(torch.uint8)                     # 1..15
        q = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()
    return q, scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int = 8, group: int = 32,
               dtype=torch.float16, out=None):
    """codes and scales (quantize's) -> values in dtype; out: a tensor of that shape to fill (no
    temporary of its size beside the fp32 step)."""
    if bits == 4:                                     # unpack straight into the fp32 buffer
        g = torch.empty(*q.shape[:-1], q.shape[-1], 2, dtype=torch.float32, device=q.device)
        g[..., 0] = q & 0xF
        g[..., 1] = q >> 4
        g = g.flatten(-2).sub_(8)
    else:
        g = q.float()
    *lead, d = g.shape
    g = g.reshape(*lead, d // group, group)
    g.mul_(scale.float()[..., None])                  # in place: one fp32 copy, not two
    if out is not None:
        if tuple(out.shape) != (*lead, d):
            raise ValueError(f"out has shape {tuple(out.shape)}, the values {(*lead, d)}")
        return out.copy_(g.reshape(*lead, d))
    return g.reshape(*lead, d).to(dtype)


class QuantKVCache(torch.nn.Module):
    """A prefill KV cache (zeroedge.model.chunked_prefill) that keeps K and V as int8 or int4 codes
    (int4: two a byte) with one fp16 scale per `group` values: the thermal decoder's cold store,
    written in place, so a long prompt never holds its K/V at full precision. Attention reads the
    dequantized past (the current chunk included), as the decoder's fetches read it. codes
    (n_kv, P, hd * bits / 8) int8 / uint8, scales (n_kv, P, hd // group) fp16; with track_queries,
    the sum of q^T q per kv head (KVCache's)."""

    def __init__(self, codes_k, scales_k, codes_v, scales_v, bits: int, group: int, dtype,
                 track_queries: bool = True, device=None, records=None):
        super().__init__()      # a module, as the attention's kv_cache slot wants (its tensors: views it does not own)
        self.ck, self.sk, self.cv, self.sv = codes_k, scales_k, codes_v, scales_v
        # records: (the (n_kv, P, record bytes) uint8 tensor the four are fields of, their byte offsets
        # as FileTensors.offsets): a cold store in a file, written and read a whole record at a time
        self.records, self.offsets = records if records is not None else (None, None)
        self.bits, self.group, self.dtype = bits, group, dtype
        # where attention runs: the codes may live elsewhere (a mapped file: FileTensors)
        self.device = torch.device(device) if device is not None else codes_k.device
        nkv, _, d = codes_k.shape
        self.hd = d * 8 // bits
        self.qcov = (torch.zeros(nkv, self.hd, self.hd, device=self.device, dtype=torch.float32)
                     if track_queries else None)
        self._v = None      # (n, V): made with K from the file's records, for layer_kv's V call that follows
        self._held = None   # (K, V) of positions [0, end) on the device while a span is prefilled (hold)
        self.read_positions = 0     # positions dequantized from the store (each K and V pair once)

    @classmethod
    def empty(cls, bits: int, n_kv: int, length: int, hd: int, group: int, dtype, device=None):
        c = lambda d, t: torch.zeros(n_kv, length, d, dtype=t, device=device)  # noqa: E731
        ct = torch.int8 if bits == 8 else torch.uint8
        return cls(c(hd * bits // 8, ct), c(hd // group, torch.float16), c(hd * bits // 8, ct),
                   c(hd // group, torch.float16), bits, group, dtype)

    FIELDS = ("k", "ks", "v", "vs")

    def hold(self, start: int, end: int):
        """Prefill of the span [start, end) a layer at a time (zeroedge.model.chunked_prefill): the past
        [0, start) is read and dequantized once into device buffers of `end` positions, and each
        update of the span writes its chunk's codes to the store and their dequantized values
        there, so the chunks attend to what they would read back, without reading the past again."""
        self._held = self.past_kv(start, size=end)

    def release(self):
        self._held = None

    def update(self, start: int, k, v, q=None, kv_index=None):
        end = start + k.shape[2]
        self._v = None
        (ck, sk), (cv, sv) = (quantize(x[0], self.bits, self.group) for x in (k, v))
        if self._held is not None:
            if end > self._held[0].shape[1]:
                raise ValueError(f"positions {start}..{end} run past the held span ({self._held[0].shape[1]})")
            for c, sc, dst in ((ck, sk, self._held[0]), (cv, sv, self._held[1])):
                dequantize(c, sc, self.bits, self.group, out=dst[:, start:end])
        if self.records is not None:        # the chunk's records made whole on the device, one copy out
            rec = torch.empty(ck.shape[0], end - start, self.records.shape[-1], dtype=torch.uint8, device=ck.device)
            for name, x in zip(self.FIELDS, (ck, sk, cv, sv)):
                o, b = self.offsets[name]
                rec[..., o:o + b] = x.view(torch.uint8)
            self.records[:, start:end] = rec
        else:
            for x, dst in zip((ck, sk, cv, sv), (self.ck, self.sk, self.cv, self.sv)):
                dst[:, start:end] = x
        if self.qcov is not None and q is not None:
            qf = q[0].float()
            self.qcov.index_add_(0, kv_index, qf.transpose(1, 2) @ qf)
        if self._held is not None:
            return tuple(x[None, :, :end] for x in self._held)
        return tuple(x[None] for x in self.past_kv(end))

    def past_kv(self, n: int, which=(0, 1), size: int = 0):
        """K (0) and / or V (1) of the first n positions, dequantized on the device: (n_kv, n, hd)
        each (in buffers of max(n, size) positions), DEQUANT_BLOCK positions at a time (its fp32
        step and the codes it moves are one block's; from a file, a block's whole records in one
        copy)."""
        from zeroedge.kv.policy import DEQUANT_BLOCK

        out = [torch.empty(self.ck.shape[0], max(n, size), self.hd, dtype=self.dtype, device=self.device)
               for _ in which]
        self.read_positions += n
        fields = ((self.ck, self.sk), (self.cv, self.sv))
        for i in range(0, n, DEQUANT_BLOCK):
            j = min(n, i + DEQUANT_BLOCK)
            raw = self.records[:, i:j].to(self.device) if self.records is not None else None
            for o, w in zip(out, which):
                if raw is None:
                    c, sc = (t[:, i:j].to(self.device) for t in fields[w])
                else:
                    (oc, bc), (os_, bs) = (self.offsets[f] for f in self.FIELDS[2 * w:2 * w + 2])
                    c, sc = raw[..., oc:oc + bc].view(fields[w][0].dtype), raw[..., os_:os_ + bs].view(torch.float16)
                dequantize(c, sc, self.bits, self.group, out=o[:, i:j])
        return out

    def layer_kv(self, n: int, which: int):
        """K (which 0) or V (1) of the first n positions (past_kv), for zeroedge.model.LayerKV. From a
        file, K's call dequantizes V from the same records and keeps it for the V call that follows
        (a decoder's load_prefix asks K then V of each layer): the records are read once, not twice."""
        if which == 1 and self._v is not None and self._v[0] == n:
            v, self._v = self._v[1], None
            return v
        if which == 0 and self.records is not None:
            k, v = self.past_kv(n)
            self._v = (n, v)
            return k
        return self.past_kv(n, (which,))[0]


def quantized_nbytes(numel: int, bits: int, group: int) -> int:
    return numel * bits // 8 + (numel // group) * 2


# --------------------------------------------------------------------------------------------
# cold stores
# --------------------------------------------------------------------------------------------
class FileTensors:
    """Records in one private page file (zeroedge.kv.spill.PageFile: in a checked folder, unlinked at
    once, mode 0600, every byte reserved before anything is written), mapped into memory: the torch
    decoder's cold store on NVMe (`spill_dir`). One record per index of `lead` holds every field side
    by side (a token's K codes, V codes, K scales, V scales), so a page of tokens is one stretch of
    the file: one read when it is not in memory. fields: name -> (count, dtype). tensors[name]
    (lead + (count,)) is a strided view of its field; records (lead + (record bytes,), uint8) the
    raw bytes; offsets[name] = (byte offset in a record, bytes). They are CPU tensors; the kernel's
    page cache holds what was read or written lately (memory it takes back under pressure), the
    disk the rest. Every field starts zero."""

    ALIGN = 4096

    def __init__(self, folder, lead: tuple, fields: dict):
        from zeroedge.kv.spill import PageFile

        self.offsets, rec, widest = {}, 0, 1
        for name, (count, dtype) in fields.items():
            size = torch.empty((), dtype=dtype).element_size()
            rec = -(-rec // size) * size                       # each field aligned to its element
            self.offsets[name] = (rec, count * size)
            rec += count * size
            widest = max(widest, size)
        rec = -(-rec // widest) * widest                       # and so in every record
        n = max(1, int(torch.Size(lead).numel())) * rec
        self.file = PageFile(folder, -(-n // self.ALIGN) * self.ALIGN, reserve_pages=1)
        self.nbytes = self.file.nbytes
        self.records = torch.frombuffer(self.file.mapped(), dtype=torch.uint8, count=n).view(*lead, rec)
        self.tensors = {name: self.records[..., o:o + b].view(fields[name][1]) for name, (o, b) in self.offsets.items()}


# --------------------------------------------------------------------------------------------
# transfers
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _stream(index: int, role: str, priority: int, thread: int):
    return torch.cuda.Stream(index, priority=priority)


def shared_stream(device, role: str, priority: int = 0):
    """One CUDA stream for `role` on `device` per thread of the process, for work every request
    repeats (graph warm-ups and captures, thermal KV's step and refresh streams). cuBLAS keeps a
    workspace for every stream it has run on: a new stream a request (torch's pool has 32 a
    priority) left 32-64 MiB a request allocated on the H200 until the pool came round
    (benchmarks/thermal_kv.md). Per thread: a capture records whatever its stream runs."""
    d = torch.device(device)
    return _stream(torch.cuda.current_device() if d.index is None else d.index, role, priority,
                   threading.get_ident())


class TransferHandler:
    """Copies on a dedicated CUDA stream with events (or synchronously on CPU); every transfer
    is reported to the scheduler as (kind, bytes, seconds)."""

    def __init__(self, scheduler=None, device=None):
        self.scheduler = scheduler
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str = "fetch"):
        nbytes = src.numel() * src.element_size()
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            if self.scheduler is not None:
                self.scheduler.record(kind, nbytes, time.perf_counter() - t0)
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        self.pending.append((kind, nbytes, start, end))
        return end

    def wait(self):
        """Make the compute stream wait for all copies; report their timings."""
        if not self.cuda:
            return
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for kind, nbytes, s, e in self.pending:
            e.synchronize()
            if self.scheduler is not None:
                self.scheduler.record(kind, nbytes, s.elapsed_time(e) / 1e3)
        self.pending.clear()


def copy_bandwidth(device, nbytes: int = 128 << 20, reps: int = 3) -> float:
    """Bytes read + written per second by a device-to-device copy larger than any L2: the peak the
    bandwidth scheduler measures its utilisation against (a Jetson's DRAM too: the copy runs in it).
    Its buffers are handed back to the device afterwards (serving memory is tight on an Orin)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    seconds = e0.elapsed_time(e1) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return reps * 2 * nbytes / seconds
