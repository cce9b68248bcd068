"""The thermal decoder's Triton kernels (zeroedge/kv/kernels.py) run in Triton's CPU
interpreter against the torch references: the sketch scores and their per-program log-sum-exp
shares, and the one-program and two-stage page swaps against the reference's decisions, from a full-precision, an
int8 and an int4 cold store (dequantized by the copy); the same kernels deciding only, and the staged
apply of a cold store in a file. scripts/setup
installs Triton (`pip install --no-deps triton`: the CPU torch wheel has none). The same
checks run on the GPU in benchmarks/gpu/thermal_kv_gpu.py (check_swap_kernel)."""
import textwrap

import interpreter_scripts
import pytest

SCRIPT = textwrap.dedent('''
    import torch
    from zeroedge.kv import kernels as K
    from zeroedge.kv.tiers import quantize

    g = torch.Generator().manual_seed(1)
    qp, kl = K._build()
    for nkv, grp, hd, r, n, psz, PB, progs in ((2, 4, 64, 16, 37, 16, 4, 3), (2, 3, 32, 32, 20, 8, 8, 64)):
        K.SKETCH_PROGRAMS = progs
        P = n * psz
        q, A = torch.randn(nkv * grp, hd, generator=g), torch.randn(nkv, hd, r, generator=g)
        codes = K.pack_int4(torch.randint(-7, 8, (nkv, P, r), generator=g))
        scales = torch.rand(nkv, n * psz, generator=g).half()
        nb, it = K.sketch_blocks(n, PB)
        GP = 1 << max(0, (grp - 1).bit_length())
        qr = torch.empty(nkv, grp, r)
        qp[(nkv,)](q, A, 1.0 / hd ** 0.5, qr, q, q, q, grp, GP=GP, HD=hd, R=r)
        # the query before RoPE, rotated by the kernel at a position, against kernels.rope_rows
        f = torch.outer(torch.arange(9).float(), torch.rand(hd // 2, generator=g))
        cos, sin = torch.cat((f, f), -1).cos(), torch.cat((-f.sin(), f.sin()), -1)
        pos = torch.tensor([5])
        qr_rope = torch.empty(nkv, grp, r)
        qp[(nkv,)](q, A, 1.0 / hd ** 0.5, qr_rope, cos, sin, pos, grp, GP=GP, HD=hd, R=r, ROPE=True)
        want_rope = torch.bmm(K.rope_rows(q, cos, sin, pos).view(nkv, grp, hd), A) / hd ** 0.5
        assert float((qr_rope - want_rope).abs().max()) < 1e-4
        out, pm, ps = torch.empty(nkv, grp, n), torch.empty(nkv, grp, nb), torch.empty(nkv, grp, nb)
        kl[(nkv, nb)](qr, codes, scales, out, pm, ps, P, n, nb, ITER=it, GRP=grp, GP=GP, R2=r // 2, PS=psz,
                      PB=PB, PART=True)
        want = K.sketch_page_lse_ref(torch.bmm(q.view(nkv, grp, hd), A) / hd ** 0.5, codes, scales, psz)
        lse = pm.amax(-1) + torch.log((ps * (pm - pm.amax(-1, keepdim=True)).exp()).sum(-1))
        assert float((out - want).abs().max()) < 1e-3
        assert float((lse - want.logsumexp(-1)).abs().max()) < 1e-3
    swk = K._build_swap()
    for nkv, grp, n, S, PE, F, C, tied in ((2, 4, 700, 96, 16, 4, 128, False), (3, 2, 300, 40, 8, 8, 64, False),
                                          (2, 2, 200, 30, 8, 3, 64, False), (2, 1, 300, 40, 8, 8, 64, True)):
        pl = torch.randn(nkv, grp, n, generator=g)
        if tied:            # whole numbers: many pages score the same (the lowest page first)
            pl = torch.randint(-2, 2, (nkv, grp, n), generator=g).float()
        bias = torch.zeros(n)
        bias[:1] = float("-inf")
        bias[-2:] = float("-inf")
        sp = torch.stack([torch.randperm(n - 3, generator=g)[:S] + 1 for _ in range(nkv)])
        if tied:            # NaN scores (pages resident in head 0 and not) never move, as in the reference
            bias[sp[0, :2]] = float("nan")
            bias[[p for p in range(1, n - 2) if p not in sp[0].tolist()][:2]] = float("nan")
        ps0 = torch.full((nkv, n), -1, dtype=torch.long)
        for h in range(nkv):
            ps0[h, sp[h]] = torch.arange(S)
        hk, hv = torch.randn(nkv, n, PE, generator=g), torch.randn(nkv, n, PE, generator=g)
        wk, wv = torch.randn(nkv, S, PE, generator=g), torch.randn(nkv, S, PE, generator=g)
        cold_stores = {b: (quantize(hk, b, 4), quantize(hv, b, 4)) for b in (8, 4)}   # int8 / int4 cold stores
        nb = -(-n // 16)
        pad = torch.full((nkv, grp, nb * 16), float("-inf"))
        pad[..., :n] = pl
        blk = pad.view(nkv, grp, nb, 16)
        pm = blk.amax(-1)
        psum = (blk - pm[..., None]).exp().sum(-1)
        FP = 1 << max(0, (F - 1).bit_length())
        nc = -(-n // C)
        for bits in (0, 8, 4):
            (ck, ks), (cv, vs) = cold_stores[bits] if bits else ((hk, None), (hv, None))
            scales = (ks, vs) if bits else None
            ref = [t.clone() for t in (ps0, sp, wk, wv)]
            K.swap_pages_ref(K.page_scores_ref(pl, bias), *ref, ck, cv, F, scales, bits or 8)
            got = [t.clone() for t in (ps0, sp, wk, wv)]          # the two-stage kernels, then a program a pair
            quant = dict(G=4 if scales else 1, QUANT=bits)
            K._swap_launch(pl, bias, got[0], F, (pm, psum), C, (got[1], got[2], got[3], ck, cv,
                                                                *(scales or (ck, cv)), None), quant)
            assert int((ref[1] != sp).sum()) > 0                   # something moved
            assert all(torch.equal(a, b) for a, b in zip(ref[:2], got[:2]))
            assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref[2:], got[2:]))
            one = [t.clone() for t in (ps0, sp, wk, wv)]          # the one-program kernel decides the same
            swk[0][(nkv,)](pl, bias, one[0], one[1], one[2], one[3], ck, cv, *(scales or (ck, cv)), one[0], n, S,
                           one[2].stride(0), GRP=grp, NP=1 << max(0, (n - 1).bit_length()), F=F, FP=FP, PE=PE,
                           PEB=1 << max(0, (PE - 1).bit_length()), G=4 if scales else 1, QUANT=bits, DECIDE=False)
            assert all(torch.equal(a, b) for a, b in zip(ref[:2], one[:2]))
            assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref[2:], one[2:]))
            if scales:   # the fetched pages are the cold pages, dequantized: within int8 / int4 rounding
                moved = ref[1] != sp
                qmax = 2 ** (bits - 1) - 1
                for h in range(nkv):
                    for s in moved[h].nonzero().flatten().tolist():
                        page = int(ref[1][h, s])
                        err = (got[2][h, s] - hk[h, page]).abs().max()
                        assert float(err) <= float(hk[h, page].abs().max()) / qmax * 0.51 + 1e-6
        # a cold store the device cannot read (kv.host_fetch): both kernel forms only decide, the same
        # as the reference, and `move` applies the decisions from a staging buffer (int8 / int4)
        want = K.swap_decisions_ref(K.page_scores_ref(pl, bias), ps0, F)
        assert int((want[:, 1] >= 0).sum()) > 0
        for form in ("one", "two"):
            got_dec = torch.full((nkv, 3, FP), 7, dtype=torch.long)          # poisoned: every entry written
            tabs = ps0.clone()
            K._swap_launch(pl, bias, tabs, F, None if form == "one" else (pm, psum), C, (tabs,) * 7 + (got_dec,),
                           dict(G=1, QUANT=0))
            assert torch.equal(got_dec, want) and torch.equal(tabs, ps0), form   # decided; nothing moved
        for bits in (8, 4):
            (ck, ks), (cv, vs) = cold_stores[bits]
            h, i = torch.nonzero(want[:, 1] >= 0, as_tuple=True)
            stage = [torch.randint(0, 100, (nkv, F, *c.shape[2:])).to(c.dtype) for c in (ck, cv, ks, vs)]  # stale rows
            for st, c in zip(stage, (ck, cv, ks, vs)):
                st[h, i] = c[h, want[h, 0, i]]
            ref = [t.clone() for t in (ps0, sp, wk, wv)]
            K.apply_swaps_ref(want, *ref, *stage[:2], stage[2:], bits, staged=True)
            got = [t.clone() for t in (ps0, sp, wk, wv)]
            swk[3][(nkv, F)](want, *got, *stage, n, S, got[2].stride(0), F, FP=FP, PE=PE,
                             PEB=1 << max(0, (PE - 1).bit_length()), G=4, QUANT=bits, STAGED=True)
            assert all(torch.equal(a, b) for a, b in zip(ref[:2], got[:2]))
            assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref[2:], got[2:]))
            moved = ref[1] != sp                   # the same window as the in-place swap from the store
            inplace = [t.clone() for t in (ps0, sp, wk, wv)]
            K.swap_pages_ref(K.page_scores_ref(pl, bias), *inplace, ck, cv, F, (ks, vs), bits)
            assert int(moved.sum()) > 0 and all(torch.equal(a, b) for a, b in zip(inplace, ref))
            short = [st[:, :F - 1].contiguous() for st in stage]      # no row for the last pair: not applied
            assert bool((want[:, 1, F - 1] >= 0).any())              # (some kv head took a last pair)
            ref = [t.clone() for t in (ps0, sp, wk, wv)]
            K.apply_swaps_ref(want, *ref, *short[:2], short[2:], bits, staged=True)
            got = [t.clone() for t in (ps0, sp, wk, wv)]
            swk[3][(nkv, F - 1)](want, *got, *short, n, S, got[2].stride(0), F - 1, FP=FP, PE=PE,
                                 PEB=1 << max(0, (PE - 1).bit_length()), G=4, QUANT=bits, STAGED=True)
            assert all(torch.equal(a, b) for a, b in zip(ref[:2], got[:2]))
            assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref[2:], got[2:]))
    print("OK")
''')


@pytest.mark.interpreter_script(interpreter_scripts.register("kv_kernels", SCRIPT))
def test_sketch_and_two_stage_swap_in_the_triton_interpreter():
    interpreter_scripts.check("kv_kernels")
