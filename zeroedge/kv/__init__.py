"""Thermal KV: a tiered, paged KV cache with heat, cold-page retrieval and a bandwidth-aware
scheduler.

Torch-free bookkeeping (import freely anywhere): `pages` (8-byte page-table entries, page table,
slot window, event log), `heat` (t^-0.7 decayed, cosine-weighted heat; migration planning),
`policy` (release levels, circuit breaker, target-aware tiers), `scheduler` (transfer records,
NVML / jtop utilisation, deferral with hysteresis).
Torch parts (import lazily): `attention` (ThermalAttention: the serving decoder's thermal attention
strategy, with its int4 key sketches and cold store), `kernels` (its Triton kernels), `tiers`
(int8 / int4 page quantization, the file-backed cold store, timed transfers), `evaluate` (the
`zeroedge eval --kv-budget` contract and the eviction peers). NumPy: `ort_policy` (the same policy
over an onnxruntime / TensorRT runner's slot window).
"""
from zeroedge.kv.heat import DEFAULT_THRESHOLD, HeatTracker, plan_migration
from zeroedge.kv.pages import (EventLog, PageTable, SlotWindow, Tier, pack_entry, unpack_entry)
from zeroedge.kv.policy import ReleaseGate, plan_tiers
from zeroedge.kv.scheduler import BandwidthScheduler, TransferRecord

__all__ = ["DEFAULT_THRESHOLD", "HeatTracker", "plan_migration", "EventLog", "PageTable",
           "SlotWindow", "Tier", "pack_entry", "unpack_entry", "ReleaseGate", "plan_tiers",
           "BandwidthScheduler", "TransferRecord"]
