"""Thermal KV bookkeeping with plain integers: no torch imported here."""
import logging
import math
import sys

import pytest

from zeroedge.errors import UserError
from zeroedge.kv import heat as H
from zeroedge.kv.pages import (MAX_OFFSET, MAX_SLOT, PageTable, SlotWindow, Tier, pack_entry,
                               unpack_entry)
from zeroedge.kv.policy import ReleaseGate, check_cold_path, plan_tiers
from zeroedge.kv.scheduler import BandwidthScheduler


def test_entry_is_8_bytes_and_round_trips():
    for tier, slot, off, flags in [(0, 0, 0, 0), (3, MAX_SLOT, MAX_OFFSET, 1), (4, 12345, 16 * 999, 0),
                                   (7, 1, 2, 31)]:
        e = pack_entry(tier, slot, off, flags)
        assert 0 <= e < 2 ** 64
        assert unpack_entry(e) == (tier, slot, off, flags)
    with pytest.raises(ValueError):
        pack_entry(8, 0, 0)
    with pytest.raises(ValueError):
        pack_entry(0, MAX_SLOT + 1, 0)
    with pytest.raises(ValueError):
        pack_entry(0, 0, MAX_OFFSET + 1)
    t = PageTable(16, {Tier.HOT: 4, Tier.COLD: 8})
    for _ in range(3):
        t.alloc()
    assert t.nbytes() == 24 and len(t.to_bytes()) == 24


def test_page_table_moves_and_refuses_bad_moves():
    t = PageTable(16, {Tier.HOT: 2, Tier.WARM8: 1, Tier.COLD: 4})
    sink = t.alloc(pinned=True)
    p = t.alloc()
    with pytest.raises(MemoryError):
        t.alloc()                                   # HOT has 2 slots
    assert t.lookup(p)[2] == 16                      # offset = first position of page 1
    with pytest.raises(ValueError, match="pinned"):
        t.move(sink, Tier.COLD)
    src, dslot = t.prepare(p, Tier.COLD)
    assert t.tier(p) == Tier.MOVING and src == Tier.HOT
    with pytest.raises(ValueError, match="moving"):
        t.prepare(p, Tier.WARM8)
    t.complete(p, nbytes=4096, ok=False)            # failed copy: page stays where it was
    assert t.tier(p) == Tier.HOT and t.pools[Tier.COLD].free == 4
    t.move(p, Tier.COLD, nbytes=4096)
    assert t.tier(p) == Tier.COLD and t.pools[Tier.HOT].free == 1
    assert t.log.counts["migrate"] == 1 and t.log.bytes["migrate"] == 4096
    assert t.log.counts["migrate_failed"] == 1
    q = t.alloc()                                    # the freed HOT slot is reusable
    assert t.tier(q) == Tier.HOT and t.pages_in(Tier.HOT) == [sink, q]


def test_decay_kernel_follows_power_law():
    worst = max(abs(H.decay_kernel(a) / H.exact_kernel(a) - 1) for a in range(1, 4097))
    assert worst < 0.07
    # and it is a real power law, not an exponential: 100x older keeps ~ 100^-0.7 = 4 %
    assert 0.035 < H.decay_kernel(101) / H.decay_kernel(1) < 0.045


def test_heat_decays_and_weights_by_cosine():
    h = H.HeatTracker()
    h.step({1: 1.0, 2: 0.5})
    assert h.heat(1) == pytest.approx(1.0, rel=0.07)
    for _ in range(9):
        h.step({})
    assert h.heat(1) == pytest.approx(10 ** -0.7, rel=0.07)     # age 10
    assert h.heat(2) == pytest.approx(0.5 * 10 ** -0.7, rel=0.07)
    h.step({2: 1.0}, cosines={1: 0.5})
    assert h.heat(1) == pytest.approx(0.5 * 11 ** -0.7, rel=0.07)
    assert h.heat(2) > h.heat(1) and h.heat(99) == 0.0
    with pytest.raises(ValueError):
        h.step({3: -1.0})


def test_migration_threshold_is_hysteresis():
    hot, cold = {1: 0.30, 2: 0.10}, {7: 0.12, 8: 0.40}
    assert H.plan_migration(hot, cold, threshold=0.05) == [(8, 2)]      # 0.12 - 0.30 < 0.05 stops
    assert H.plan_migration(hot, cold, threshold=0.5) == []
    assert H.plan_migration(hot, cold, threshold=0.0) == [(8, 2)]
    assert H.plan_migration({1: 0.0, 2: 0.0}, {7: 0.2, 8: 0.4}, 0.05, max_moves=1) == [(8, 1)]


def test_slot_window_reuses_residents_and_caps_fetches():
    w = SlotWindow(n_slots=5, pinned=[0, 9])             # sink + recent page
    read, fetched, ev = w.request([3, 4, 5, 6], k=3)
    assert read == [3, 4, 5] and fetched == [3, 4, 5] and ev == []
    read, fetched, ev = w.request([4, 6, 3], k=3, heat={5: 0.0})
    assert fetched == [6] and ev == [5] and sorted(read) == [3, 4, 6]
    # cap: only one fetch allowed; the best-ranked residents stand in for the rest
    read, fetched, ev = w.request([1, 2, 3], k=3, fetch_cap=1)
    assert fetched == [1] and len(read) == 3 and 3 in read and 2 not in read
    assert set(w.resident) <= {0, 9, 1, 3, 4, 6} and len(w.resident) == 5
    assert w.fetched_total == 5


def test_release_levels_and_circuit_breaker(caplog):
    g = ReleaseGate(level=3)
    assert g.allows(100_000, temperature=1.0)
    g.set_level(2)
    assert g.allows(4095) and not g.allows(4096) and not g.allows(100, temperature=0.7)
    g.set_level(1)
    assert g.allows(511) and not g.allows(512)
    g.set_level(0)
    assert not g.allows(1)
    with pytest.raises(UserError):
        g.set_level(4)
    g = ReleaseGate(level=3)
    with caplog.at_level(logging.WARNING, logger="zeroedge.kv"):
        for n in (1300, 1300, 1300, 1300, 100):         # a quiet request resets the streak
            assert not g.record(n)
        trips = [g.record(1201) for _ in range(5)]
    assert trips == [False] * 4 + [True] and g.level == 2
    assert g.metrics["thermal_kv_breaker_trips"] == 1 and "L3 -> L2" in caplog.text
    assert not g.record(1201)                            # streak restarts after a trip


def test_tier_policy_is_target_aware(tmp_path):
    j = plan_tiers("jetson")
    assert j.cold_compressed and j.cold in (Tier.WARM8, Tier.WARM4)        # never pinned host
    js = plan_tiers("jetson", stream=True, cold_path=str(tmp_path / "nvme"))
    assert js.cold == Tier.FILE and js.cold_compressed
    d = plan_tiers("discrete")
    assert d.cold == Tier.COLD and not d.cold_compressed
    c = plan_tiers("cpu")                                # host memory is the only memory there
    assert c.cold_compressed and c.cold in (Tier.WARM8, Tier.WARM4)
    with pytest.raises(ValueError, match="unknown memory kind"):
        plan_tiers("tpu")
    with pytest.raises(UserError, match="int8 or int4"):
        plan_tiers("jetson", cold_bits=2)


def test_cold_store_path_errors(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UserError, match="cannot create|not a folder"):
        check_cold_path(str(f / "sub"))
    with pytest.raises(UserError, match="bytes free"):
        check_cold_path(str(tmp_path), need_bytes=1 << 62)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os
        if os.geteuid() != 0:       # root writes anywhere
            with pytest.raises(UserError, match="not writable"):
                check_cold_path(str(ro))
    finally:
        ro.chmod(0o700)


def test_scheduler_defers_with_hysteresis_and_drains_when_idle():
    now = [0.0]
    u = [0.0]
    s = BandwidthScheduler(peak_bytes_per_s=1000, window_s=1.0, sampler=lambda: u[0],
                           clock=lambda: now[0])
    done = []

    def do(page, dst):
        done.append(page)
        return 10

    assert s.submit([(1, 3)], do) == 1 and done == [1]
    u[0] = 0.9                                            # NVML / EMC says busy
    assert s.submit([(2, 3)], do) == 0 and s.deferring
    u[0] = 0.8                                            # between low and high: still deferring
    assert not s.may_migrate()
    s.record("fetch", 900, 0.5)                           # the policy's own transfers: 900 B in the window
    u[0] = 0.0
    assert s.utilization() == pytest.approx(0.91) and not s.may_migrate()   # + 10 B migrated
    now[0] = 5.0                                          # window passed, traffic gone
    assert s.may_migrate()
    u[0] = 0.95
    assert s.submit([(3, 3)], do) == 0
    assert s.idle(do) == 2 and done == [1, 2, 3]          # idle gap drains the queue
    summ = s.summary()
    assert summ["migrate"]["count"] == 3 and summ["fetch"]["bytes"] == 900
    with pytest.raises(ValueError):
        BandwidthScheduler(1000, high=0.5, low=0.9)


def test_bookkeeping_does_not_import_torch():
    import subprocess
    code = ("import sys, zeroedge.kv, zeroedge.kv.pages, zeroedge.kv.heat, zeroedge.kv.policy, "
            "zeroedge.kv.scheduler; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scheduler_reads_the_hardware_at_most_every_sample_every():
    """A decode loop asks every step; NVML / jtop are read at most every `sample_every` seconds."""
    now, reads = [0.0], []
    s = BandwidthScheduler(1000, sampler=lambda: reads.append(now[0]) or 0.5, clock=lambda: now[0],
                           sample_every=0.02)
    for _ in range(10):
        s.utilization()
        now[0] += 0.005
    assert len(reads) == 3 and s.utilization() == pytest.approx(0.5)
