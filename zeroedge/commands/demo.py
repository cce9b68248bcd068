"""zeroedge demo: the main job on embedded defaults (what ./scripts/demo runs), each step beside its peer
measured in the same run, ending in one summary table (printed, and DIR/summary.json).

1. bundles   the bundled SmolLM2-135M exported to a 4-bit bundle and to an fp16 one (onnxruntime graphs,
             zeroedge's CPU kernels where built; kept in DIR/bundles, so a rerun reuses them), both
             decoding one prompt greedily in interleaved runs: tokens/s, and the 4-bit bundle's
             perplexity and greedy tokens against the fp16 bundle's
2. thermal   thermal KV on a long KJV passage (the torch decoder's policy, as `zeroedge eval --kv-budget`):
             KV on the device and perplexity against full KV over the same tokens
3. prefill   SIH + anchors + PAD compaction (the shipped calibration artifact) against the dense prefill:
             prefill time, FFN FLOPs skipped, continuation perplexity; a trtexec-style summary and a PNG
4. serve     `zeroedge serve` on 127.0.0.1 answering four clients at once over its OpenAI-compatible API,
             then the same four one at a time
5. sensor    the TEP simulator streamed through the daemon's inference path, then sensor-fit on one plant
             run and detection on another; the classical PCA T^2 / Q monitor on the same runs as the peer
"""
import click

from zeroedge.commands.common import ctx_option, examples, fraction_option, output_option

MODEL = "smollm2-135m"
THERMAL_SCORED = 256       # thermal step: the last tokens of the passage, scored (the rest is the prompt)
QUALITY_TOKENS = (256, 128)  # bundle step: a KJV prompt of 256 tokens, then 128 scored teacher-forced
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@click.command("demo", epilog=examples("zeroedge demo -o out/demo",
                                       "zeroedge demo --skip-serve --skip-sensor --repeats 1"))
@ctx_option("SIH/PAD step: tokens of the KJV passage; prefill ctx-1024, score 1024.", default=4096)
@click.option("--offset", default=300_000, show_default=True,
              help="Token offset into the KJV (the shipped artifact was calibrated on its start).")
@click.option("--calib", type=click.Path(), default=None,
              help="Calibration artifact (default: the one shipped for SmolLM2).")
@click.option("--repeats", default=3, show_default=True,
              help="Timed runs per side (decode of each bundle, dense and zero prefill), interleaved.")
@click.option("--max-new", "max_new", default=48, show_default=True, help="Bundle step: new tokens a decode run.")
@fraction_option("--kv-budget", "kv_budget", default=0.1,
                 help="Thermal step: the hot fraction of the prompt's KV.")
@click.option("--kv-ctx", "kv_ctx", default=2048, show_default=True, type=int, metavar="N",
              help=f"Thermal step: tokens of the KJV passage; the last {THERMAL_SCORED} are scored.")
@output_option("Folder for the bundles, the plots, the sensor-path results and summary.json.", dest="out_dir",
               required=False, default="out/demo", old_out=True, metavar="DIR")
@click.option("--skip-bundles", is_flag=True, help="Leave out the 4-bit / fp16 bundle step.")
@click.option("--skip-thermal", is_flag=True, help="Leave out the thermal KV step.")
@click.option("--skip-prefill", is_flag=True, help="Leave out the SIH/PAD prefill step.")
@click.option("--skip-serve", is_flag=True, help="Leave out the HTTP server step.")
@click.option("--skip-sensor", is_flag=True, help="Leave out the sensor path.")
def cmd(ctx, offset, calib, repeats, max_new, kv_budget, kv_ctx, out_dir, skip_bundles, skip_thermal,
        skip_prefill, skip_serve, skip_sensor):
    """The main job on SmolLM2 + KJV and a simulated plant, each step beside its peer."""
    import json
    import os
    import time
    from pathlib import Path

    from zeroedge.errors import UserError

    if ctx < 1024 + 64:
        raise UserError("--ctx must be at least 1088")
    if repeats < 1:
        raise UserError("--repeats must be >= 1")
    if max_new < 2:
        raise UserError("--max-new must be >= 2")
    if kv_ctx < THERMAL_SCORED + 256:
        raise UserError(f"--kv-ctx must be at least {THERMAL_SCORED + 256}")
    if calib is not None and not skip_prefill and not Path(calib).is_file():
        raise UserError(f"calibration artifact not found: {calib}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    rows = []

    def step(fn, *args):
        t = time.perf_counter()
        got = fn(*args)
        for r in got if isinstance(got, list) else [got]:
            r.setdefault("seconds", round(time.perf_counter() - t, 1))     # a step of several rows times each
            r["load_average"] = round(os.getloadavg()[0], 2)                 # other work sharing the CPUs
            rows.append(r)

    if not skip_bundles:
        step(bundle_demo, out, max_new, repeats, offset)
    if not (skip_thermal and skip_prefill):
        m, tok = load_model()
        if not skip_thermal:
            step(thermal_demo, m, tok, kv_ctx, kv_budget, offset)
        if not skip_prefill:
            step(language_demo, m, tok, ctx, offset, calib, repeats, out)
        del m
    if not skip_serve:
        step(serve_demo)
    if not skip_sensor:
        step(sensor_demo, out)
    summary = {"model": MODEL, "rows": rows, "total_s": round(time.perf_counter() - t0, 1), "cpus": os.cpu_count(),
               "load_average_start": round(load0, 2), "load_average_end": round(os.getloadavg()[0], 2),
               "options": {"ctx": ctx, "offset": offset, "repeats": repeats, "max_new": max_new,
                           "kv_budget": kv_budget, "kv_ctx": kv_ctx}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo_table(summary, out / "summary.json")
    return summary


def row(step, figure, peer, quality, **values) -> dict:
    """One line of the summary table: what ran, its figure, the peer measured in the same run, the quality
    cost; `values` are the raw numbers behind them (summary.json)."""
    return {"step": step, "figure": figure, "peer": peer, "quality": quality, "values": values}


def echo_table(summary, path):
    rows = summary["rows"]
    head = ("step", "figure", "peer, same run", "quality cost", "s")
    cells = [(r["step"], r["figure"], r["peer"], r["quality"], f"{r['seconds']:.0f}") for r in rows]
    w = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    line = "  ".join("-" * n for n in w)
    click.echo("")
    click.echo(f"=== zeroedge demo: summary ({MODEL}, CPU, {summary['cpus']} CPUs) ===")
    for c in [head, None, *cells]:
        click.echo(line if c is None else "  ".join(x.ljust(n) if i < 4 else x.rjust(n)
                                                    for i, (x, n) in enumerate(zip(c, w))).rstrip())
    click.echo(f"total {summary['total_s']:.0f} s; load average {summary['load_average_start']:.1f} at the start, "
               f"{summary['load_average_end']:.1f} at the end over {summary['cpus']} CPUs (timings above share the "
               f"CPUs with anything else running); {path}")


def pct(x) -> str:
    return f"{x:+.2%}"


# -- 1. the 4-bit bundle against the fp16 bundle --------------------------------------------------------------
def bundle_demo(out, max_new, repeats, offset) -> dict:
    import statistics

    from zeroedge import texts
    from zeroedge.backends import ortops
    from zeroedge.commands.run import bundle_config
    from zeroedge.weights import tokenizer_for

    kernels = "zeroedge" if ortops.library_path().is_file() else "stock"
    click.echo("")
    click.echo(f"=== zeroedge demo: {MODEL} exported to a 4-bit bundle and an fp16 bundle, decoded by onnxruntime ===")
    if kernels == "stock":
        click.echo("[demo] zeroedge's CPU kernels are not built (scripts/build_ortops): onnxruntime's own operators")
    sess, size, mf = {}, {}, {}
    dirs = {kind: out / "bundles" / f"{MODEL}-{kind}" for kind in ("int4", "fp16")}
    traced = None
    if not any(cached(d, kind, kernels) for kind, d in dirs.items()):
        from zeroedge.export.bundle_writer import TracedGraphs

        traced = TracedGraphs()                               # both bundles from one torch -> ONNX export
    for kind, d in dirs.items():
        sess[kind], mf[kind] = open_bundle(d, kind, kernels, traced)
        size[kind] = sum(f["bytes"] for f in mf[kind]["files"].values())
    tok = tokenizer_for(bundle_config(out / "bundles" / f"{MODEL}-int4"), out / "bundles" / f"{MODEL}-int4", None)
    text, templ = PROMPT, getattr(tok, "chat_template", None) is not None
    if templ:       # the bundled SmolLM2 is an instruct model
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                       add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    for kind in sess:                                         # first-call costs out of the timings
        sess[kind].generate(ids, 4, eos=None)
    tps = {k: [] for k in sess}
    toks = {}
    for r in range(repeats):
        for kind in (("int4", "fp16") if r % 2 == 0 else ("fp16", "int4")):  # interleaved, order alternating
            res = sess[kind].generate(ids, max_new, eos=None)
            tps[kind].append(res.tokens_per_s)
            toks[kind] = res.tokens
        click.echo(f"[demo] run {r + 1}/{repeats}: {max_new} new tokens, 4-bit {tps['int4'][-1]:.1f} tok/s, "
                   f"fp16 {tps['fp16'][-1]:.1f} tok/s")
    same = next((i for i, (a, b) in enumerate(zip(toks["int4"], toks["fp16"])) if a != b), len(toks["int4"]))
    n_pre, n_scored = QUALITY_TOKENS
    kjv = texts.tokens(tok, texts.load_text("kjv", texts.chars_for(n_pre + n_scored + offset)), n_pre + n_scored,
                       offset=offset, what="KJV")
    ppl = {kind: bundle_ppl(sess[kind], kjv, n_pre) for kind in sess}
    sess.clear()                                              # onnxruntime's threads go before the torch steps
    i4, f16 = statistics.median(tps["int4"]), statistics.median(tps["fp16"])
    rise = ppl["int4"] / ppl["fp16"] - 1
    click.echo(f"  prompt{' (in the chat template)' if templ else ''}: {PROMPT!r}")
    click.echo(f"  4-bit: {tok.decode(toks['int4'], skip_special_tokens=True).strip()!r}")
    for kind, name in (("int4", "4-bit"), ("fp16", "fp16")):
        q = mf[kind]["weights"].get("quantization") or {}
        what = (f"int{q.get('bits')} g{q.get('group')} {q.get('zero_point', 'int')} zero point, "
                f"embedding {q.get('embedding_bits')}-bit" if q else "fp16 weights")
        click.echo(f"[{name:>5}] decode {statistics.median(tps[kind]):6.1f} tok/s (median of {repeats}, "
                   f"{min(tps[kind]):.1f}-{max(tps[kind]):.1f}); bundle {size[kind] / 1e6:.1f} MB ({what}); "
                   f"perplexity {ppl[kind]:.3f}")
    click.echo(f"The 4-bit bundle decodes {i4 / f16:.2f}x the fp16 bundle's tokens/s from "
               f"{size['int4'] / size['fp16']:.0%} of its bytes; perplexity {pct(rise)} over {n_scored} KJV tokens "
               f"after a {n_pre}-token prompt (one decode step a token); the first {same} of {len(toks['int4'])} "
               f"greedy tokens are the fp16 bundle's. The bundled SmolLM2 comes as a Q4_1 GGUF: the float zero "
               f"point reproduces its 4-bit grid, so both bundles hold its values.")
    return row("4-bit bundle, decode", f"{i4:.1f} tok/s, {size['int4'] / 1e6:.0f} MB",
               f"fp16 bundle {f16:.1f} tok/s, {size['fp16'] / 1e6:.0f} MB ({i4 / f16:.2f}x)",
               f"ppl {pct(rise)}; first {same}/{len(toks['int4'])} greedy tokens same",
               int4_tokens_per_s=i4, fp16_tokens_per_s=f16, speedup=i4 / f16, int4_runs=tps["int4"],
               fp16_runs=tps["fp16"], new_tokens=max_new, int4_bundle_bytes=size["int4"],
               fp16_bundle_bytes=size["fp16"], int4_ppl=ppl["int4"], fp16_ppl=ppl["fp16"], ppl_rise=rise,
               ppl_scored_tokens=n_scored, greedy_tokens_same=same, cpu_kernels=kernels,
               export_s={k: mf[k]["export"]["seconds"] for k in mf}, bundles=str(out / "bundles"))


def bundle_ppl(session, ids, n_pre) -> float:
    """Perplexity of ids[n_pre:] through the session's bundle runner, each token after all before it: a
    prefill of ids[:n_pre], then one decode step a token (zeroedge eval --bundle's full-KV pass)."""
    import math

    from zeroedge.kv.evaluate import _runner_nll

    r = session.runner
    r.slots, r.policy = len(ids), None                        # a window of every position: exact
    return math.exp(_runner_nll(r, ids, n_pre))


def open_bundle(d, kind, kernels, traced=None):
    """(a serving session over the bundle at d, its manifest): the bundle made by an earlier run when its
    manifest says it is this one, else exported now (traced: export_bundle's TracedGraphs)."""
    from zeroedge.errors import UserError
    from zeroedge.serve.session import ServingSession, open_bundle

    reuse = cached(d, kind, kernels)
    if reuse is not None:
        try:
            click.echo(f"[demo] {d}: the {kind} bundle from an earlier run (delete the folder to export again)")
            return ServingSession(open_bundle(d)), reuse
        except UserError as e:
            click.echo(f"[demo] {d}: not usable ({e}); exporting it again")
    from zeroedge.export.bundle_writer import export_bundle

    opts = dict(weights="int4", zero_point="float") if kind == "int4" else dict(weights="float16")
    click.echo(f"[demo] zeroedge export {MODEL} --weights {kind}"
               f"{' --zero-point float' if kind == 'int4' else ''} --graphs portable --cpu-kernels {kernels} -o {d}")
    mf = export_bundle(MODEL, d, force=True, flavours=("portable",), cpu_kernels=kernels, traced=traced,
                       progress=lambda msg: click.echo(f"[demo]   {msg}"), **opts)
    click.echo(f"[demo]   exported in {mf['export']['seconds']:.1f} s")
    return ServingSession(open_bundle(d)), mf


def cached(d, kind, kernels):
    """The manifest of the bundle at d if it is the one this step exports, else None."""
    import zeroedge
    from zeroedge import bundle as bundle_mod

    if not (d / "manifest.json").is_file():
        return None
    try:
        mf = bundle_mod.read_manifest(d)
        w = mf["weights"]
        ok = (mf["model"]["name"] == MODEL and mf.get("zeroedge_version") == zeroedge.__version__
              and (mf.get("cpu_kernels") or {}).get("kind", "stock") == kernels
              and set(mf.get("graph_files", {})) == {"prefill.portable.onnx", "decode.portable.onnx"}
              and (w["dtype"] == "float16" if kind == "fp16" else
                   w["dtype"] == "int4" and w["quantization"]["zero_point"] == "float"))
    except Exception:             # an unreadable or older manifest: exported again
        return None
    return mf if ok else None


# -- 2. thermal KV against full KV -----------------------------------------------------------------------------
def load_model():
    from zeroedge import weights

    click.echo("")
    click.echo(f"[demo] loading {MODEL} for the torch steps (bundled GGUF, dequantised once to fp32)")
    m, folder = weights.load(MODEL)
    return m, weights.tokenizer(folder)


def thermal_demo(m, tok, kv_ctx, budget, offset) -> dict:
    from zeroedge import texts
    from zeroedge.kv.evaluate import run_eval
    from zeroedge.kv.policy import THERMAL

    click.echo("")
    click.echo(f"=== zeroedge demo: thermal KV at {budget:.0%} hot against full KV, a {kv_ctx}-token KJV passage ===")
    ids = texts.tokens(tok, texts.load_text("kjv", texts.chars_for(kv_ctx + offset)), kv_ctx, offset=offset,
                       what="KJV")
    r = run_eval(m, ids, budget, page_size=THERMAL.page_size, continuation=THERMAL_SCORED)
    dev = r["device_kv_bytes"] / r["full_kv_bytes"]
    mib = 2 ** 20
    click.echo(f"[demo] prompt {r['prefix_tokens']} tokens, then the last {r['scored_tokens']} scored, each after "
               f"every token before it (the serving decoder's policy, step by step; as zeroedge eval --kv-budget)")
    click.echo(f"[ full] perplexity {r['full_kv_ppl']:.3f}; prompt KV {r['full_kv_bytes'] / mib:.2f} MiB")
    click.echo(f"[therm] perplexity {r['thermal_ppl']:.3f} ({pct(r['ppl_rise'])}); hot KV (window pages + key "
               f"summaries) {r['hot_kv_bytes'] / mib:.2f} MiB = {r['hot_fraction']:.1%} of the prompt KV; with its "
               f"{r['cold_store']} cold store in the same DRAM (a Jetson's) {r['device_kv_bytes'] / mib:.2f} MiB = "
               f"{dev:.1%} (`run --kv-spill DIR` puts the cold store in a file)")
    return row(f"thermal KV, {kv_ctx} tokens", f"hot KV {r['hot_fraction']:.1%} of full ({dev:.0%} with "
               f"{r['cold_store']} cold store)", f"full KV (100%) ppl {r['full_kv_ppl']:.2f}",
               f"ppl {pct(r['ppl_rise'])} ({r['thermal_ppl']:.2f})",
               budget=budget, ctx=kv_ctx, prompt_tokens=r["prefix_tokens"], scored_tokens=r["scored_tokens"],
               full_kv_ppl=r["full_kv_ppl"], thermal_ppl=r["thermal_ppl"], ppl_rise=r["ppl_rise"],
               hot_kv_fraction=r["hot_fraction"], device_kv_fraction=dev, hot_kv_bytes=r["hot_kv_bytes"],
               device_kv_bytes=r["device_kv_bytes"], full_kv_bytes=r["full_kv_bytes"], cold_store=r["cold_store"])


# -- 3. SIH/PAD prefill against dense -------------------------------------------------------------------------
def shipped_artifact():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "data" / "smollm2-135m.calib"


def language_demo(m, tok, ctx, offset, calib, repeats, out) -> dict:
    import statistics

    import torch

    from zeroedge import calib_artifact, texts
    from zeroedge.evaluation import continuation_ppl
    from zeroedge.mechanisms.pad import install_artifact, remove

    calib = calib or shipped_artifact()
    meta, tensors = calib_artifact.load(calib)
    calib_artifact.check_model(meta, m.cfg, calib)
    click.echo("")
    click.echo("=== zeroedge demo: SIH/PAD prefill against dense ===")
    ids = torch.tensor([texts.tokens(tok, texts.load_text("kjv"), ctx, offset=offset, what="KJV")])
    click.echo(f"[demo] KJV passage: {ctx} tokens from token {offset}; prefill {ctx - 1024}, "
               f"score the last 1024 (long-document protocol)")

    # wrappers stay installed; inactive (runtime=None) they run the dense FFN unchanged
    rt = install_artifact(m, meta, tensors)

    def run(zero):
        return continuation_ppl(m, ids, 1024, rt if zero else None)

    times = {"dense": [], "zero": []}
    res = {}
    try:
        for r in range(repeats):
            for side in ("dense", "zero"):  # interleaved so load drift hits both
                res[side] = run(side == "zero")
                times[side].append(res[side]["prefill_s"])
            click.echo(f"[demo] run {r + 1}/{repeats}: prefill dense {times['dense'][-1]:.2f} s, zero "
                       f"{times['zero'][-1]:.2f} s; continuation ppl dense {res['dense']['ppl']:.3f}, zero "
                       f"{res['zero']['ppl']:.3f}")
    finally:
        remove(m)
    d, z = res["dense"], res["zero"]

    def stats(xs):
        xs = sorted(xs)
        p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
        return xs[0], statistics.median(xs), statistics.mean(xs), p99

    click.echo("")
    click.echo("=== zeroedge demo: SmolLM2-135M, KJV, CPU fp32 ===")
    for side in ("dense", "zero"):
        mn, med, mean, p99 = stats(times[side])
        click.echo(f"[{side:>5}] prefill {ctx - 1024} tok: min = {mn * 1e3:.1f} ms, median = "
                   f"{med * 1e3:.1f} ms, mean = {mean * 1e3:.1f} ms, p99 = {p99 * 1e3:.1f} ms "
                   f"({repeats} runs)")
    rise = z["ppl"] / d["ppl"] - 1
    speed = statistics.median(times["dense"]) / statistics.median(times["zero"])
    click.echo(f"[dense] continuation ppl = {d['ppl']:.3f}")
    click.echo(f"[ zero] continuation ppl = {z['ppl']:.3f} ({rise:+.2%}); prefill FFN FLOPs skipped "
               f"= {z['ffn_flops_skipped']:.1%} net ({z['ffn_flops_skipped_gross']:.1%} gross)")
    ffn_share = ffn_share_of_prefill(m.cfg, ctx - 1024)
    expect = 1 / (1 - z["ffn_flops_skipped"] * ffn_share)
    ratios = sorted(a / b for a, b in zip(times["dense"], times["zero"]))
    spread = (f"; over the {repeats} interleaved runs the ratio ranged {ratios[0]:.2f}x-{ratios[-1]:.2f}x"
              if repeats > 1 else "; one run only, so this ratio carries the timing noise (--repeats N)")
    click.echo(f"Diagnosis: zero prefill is {speed:.2f}x dense (median of each side{spread}). FFN is "
               f"{ffn_share:.0%} of prefill FLOPs, so skipping {z['ffn_flops_skipped']:.0%} of them predicts "
               f"{expect:.2f}x if everything else were free: the gap is the SIH heads, the compaction and "
               f"CPU timing noise. Quality cost {rise:+.2%} on a passage the calibration never read.")
    plot(out / "demo.png", d, z, times, meta, f"SmolLM2-135M, KJV, {ctx} tokens (prefill {ctx - 1024}, "
         f"last 1024 scored), CPU fp32")
    click.echo(f"[demo] plot: {out / 'demo.png'}")
    dense_s, zero_s = statistics.median(times["dense"]), statistics.median(times["zero"])
    return row(f"SIH/PAD prefill, {ctx - 1024} tokens",
               f"{zero_s:.2f} s, {z['ffn_flops_skipped']:.1%} FFN FLOPs skipped",
               f"dense {dense_s:.2f} s ({speed:.2f}x)", f"ppl {pct(rise)}",
               dense_ppl=d["ppl"], zero_ppl=z["ppl"], ppl_rise=rise, speedup=speed, prefill_s_dense=dense_s,
               prefill_s_zero=zero_s, ffn_flops_skipped=z["ffn_flops_skipped"], prefill_tokens=ctx - 1024,
               runs=repeats, plot=str(out / "demo.png"))


def ffn_share_of_prefill(cfg, T):
    """FFN FLOPs over all decoder FLOPs of a T-token prefill (no lm_head: only the last row)."""
    d, f, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    ffn = 6 * d * f
    proj = 2 * d * (cfg.n_heads * hd * 2 + cfg.n_kv_heads * hd * 2)
    attn = 2 * 2 * cfg.n_heads * hd * T / 2  # causal: on average T/2 keys per query
    return ffn / (ffn + proj + attn)


def plot(path, d, z, times, meta, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import statistics

    import matplotlib.pyplot as plt

    colors = ["#777", "#2a7"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 4.2))
    fig.suptitle(title)
    ppl = [d["ppl"], z["ppl"]]
    bars = ax[0].bar(["dense", "zero"], ppl, color=colors)
    lo, hi = min(ppl), max(ppl)
    pad = max(hi - lo, 0.01 * hi)
    ax[0].set_ylim(lo - 2 * pad, hi + 2 * pad)        # a 1 % difference stays visible
    ax[0].bar_label(bars, labels=[f"{d['ppl']:.3f}", f"{z['ppl']:.3f} ({z['ppl'] / d['ppl'] - 1:+.2%})"])
    ax[0].set_title("continuation perplexity (axis not from 0)")
    med = [statistics.median(times["dense"]), statistics.median(times["zero"])]
    err = [[m - min(times[k]) for m, k in zip(med, times)], [max(times[k]) - m for m, k in zip(med, times)]]
    bars = ax[1].bar(["dense", "zero"], med, color=colors, yerr=err, capsize=6)
    ax[1].bar_label(bars, labels=[f"{v:.2f} s" for v in med], label_type="center", color="white")
    ax[1].set_title(f"prefill time: median, min-max of {len(times['dense'])} runs")
    rates = [lm["skip_rate"] for lm in meta["layers"]]
    ax[2].bar(range(len(rates)), [100 * r for r in rates], color="#2a7")
    ax[2].set_title("FFN tokens skipped per layer (calibration), %")
    ax[2].set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- 4. zeroedge serve: four clients at once, then one at a time ---------------------------------------------
QUESTIONS = ["Write one sentence about the sea.", "Name three colours.", "Why do birds sing?",
             "Give one tip for a new gardener."]
WARM_UP = "Say hello."          # asked once before the timed runs: first-run costs, the chat template's page cached


def serve_demo() -> dict:
    """`zeroedge serve smollm2-135m` on a free loopback port: one warm-up request, then four chat requests
    at once, then the same four one after another (the peer), then SIGTERM."""
    import json
    import socket
    import subprocess
    import sys
    import threading
    import time
    import urllib.request

    from zeroedge.errors import Failure

    click.echo("")
    click.echo("=== zeroedge demo: zeroedge serve (OpenAI-compatible HTTP, four clients at once) ===")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "zeroedge.cli", "serve", MODEL, "--port", str(port),
                          "--max-batch", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while True:
            if p.poll() is not None:
                raise Failure(f"zeroedge serve exited {p.returncode}: {p.stderr.read()[-500:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
            if time.time() - t0 > 300:
                raise Failure("zeroedge serve did not come up in 300 s")

        def ask(i, answers, questions=QUESTIONS):
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": questions[i]}],
                               "max_tokens": 32, "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/chat/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                answers[i] = json.loads(r.read())

        ask(0, [None], [WARM_UP])
        together = [None] * len(QUESTIONS)
        t1 = time.perf_counter()
        ts = [threading.Thread(target=ask, args=(i, together)) for i in range(len(QUESTIONS))]
        [t.start() for t in ts]
        [t.join() for t in ts]
        wall = time.perf_counter() - t1
        alone = [None] * len(QUESTIONS)
        t1 = time.perf_counter()
        for i in range(len(QUESTIONS)):
            ask(i, alone)
        wall_alone = time.perf_counter() - t1
    finally:
        p.terminate()
        p.wait(60)
    if any(a is None for a in together + alone):
        raise Failure("a demo request to zeroedge serve failed")

    def text(a):
        return a["choices"][0]["message"]["content"].strip()

    for q, a in zip(QUESTIONS, together):
        click.echo(f"  > {q}\n    {text(a)}")
    n = sum(a["usage"]["completion_tokens"] for a in together)
    n_alone = sum(a["usage"]["completion_tokens"] for a in alone)
    same = sum(text(a) == text(b) for a, b in zip(together, alone))
    click.echo(f"  {n} tokens for 4 concurrent requests in {wall:.1f} s ({n / wall:.1f} tokens/s together, "
               f"one batch); the same server answers any OpenAI client at {base}/v1")
    click.echo(f"  the same 4 requests one at a time: {n_alone} tokens in {wall_alone:.1f} s "
               f"({n_alone / wall_alone:.1f} tokens/s); {same} of 4 answers identical to the batched ones")
    return row("serve, 4 clients at once", f"{n / wall:.1f} tok/s together",
               f"one at a time {n_alone / wall_alone:.1f} tok/s ({wall_alone / wall:.2f}x the wall time)",
               f"{same}/4 answers as one at a time", tokens=n, seconds_together=wall, tokens_per_s=n / wall,
               tokens_alone=n_alone, seconds_alone=wall_alone, tokens_per_s_alone=n_alone / wall_alone,
               answers_identical=same)


# -- 5. the sensor path, with the PCA monitor on the same runs ---------------------------------------------
def sensor_demo(out) -> list:
    import time

    try:
        from zeroedge.sensor import demo as sd
    except ImportError:
        click.echo("[demo] sensor path not available in this build; skipped")
        return []
    t0 = time.perf_counter()
    click.echo("")
    click.echo("=== zeroedge demo: TEP sensor stream (simulator source, no broker) ===")
    s = sd.run(out)
    for k, v in (s or {}).items():
        click.echo(f"  {k}: {v}")
    click.echo("")
    click.echo("=== zeroedge demo: sensor-fit on one plant run, detection on another run ===")
    t1 = time.perf_counter()
    f = sd.fit_demo(out / "sensor_fit")
    for k, v in f.items():
        click.echo(f"  {k}: {v}")
    t2 = time.perf_counter()
    peer_stream, peer_fit, t_peer = pca_peer(out / "sensor_fit")
    click.echo("")
    click.echo("=== zeroedge demo: the classical PCA T^2 / Q monitor on the same runs (fitted on sensor-fit's normal "
               "run; 99 % control limits from theory, no alarm filter) ===")
    for name, m in (("stream", peer_stream), ("fit run", peer_fit)):
        click.echo(f"  {name + ':':<8} {fmt_det(m)}, false alarms {share(m['far'])} of the samples before the fault")
    stream = row("sensor stream, shipped detector", f"{fmt_det(s)}; {s['readings_per_s']:.0f} readings/s",
                 f"PCA T2/Q {fmt_det(peer_stream)}",
                 f"false alarms {share(s['far'])} (PCA {share(peer_stream['far'])})",
                 fdr=s["fdr"], far=s["far"], delay=s["delay"], readings_per_s=s["readings_per_s"],
                 window_latency_ms_p99=s["window_latency_ms_p99"], predicted_fault=s["predicted_fault"],
                 pca=peer_stream)
    fit = row("sensor-fit, another plant run", fmt_det(f), f"PCA T2/Q {fmt_det(peer_fit)}",
              f"false alarms {share(f['far'])} (PCA {share(peer_fit['far'])})", fdr=f["fdr"], far=f["far"],
              delay=f["delay"], predicted_fault=f["predicted_fault"], pca=peer_fit)
    stream["seconds"], fit["seconds"] = round(t1 - t0 + t_peer[0], 1), round(t2 - t1 + t_peer[1], 1)
    return [stream, fit]


def share(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def fmt_det(m) -> str:
    delay = "none" if m["delay"] is None else f"{m['delay']} samples"
    fdr = "n/a" if m["fdr"] is None else f"{m['fdr']:.2f}"
    return f"FDR {fdr}, delay {delay}"


def pca_peer(fit_dir):
    """The PCA monitor fitted on sensor-fit's normal run, on the demo stream and on sensor-fit's fault run:
    (metrics, metrics) as detection_metrics gives them, and the seconds each took."""
    import time

    import numpy as np

    from zeroedge.sensor import demo as sd
    from zeroedge.sensor.metrics import detection_metrics
    from zeroedge.sensor.pca import PCAMonitor
    from zeroedge.sensor.tep import SAMPLE_H, load_run, simulate

    t0 = time.perf_counter()
    pca = PCAMonitor().fit(load_run(fit_dir / "plant_normal.dat"))
    onset = int(round(sd.ONSET_H / SAMPLE_H))       # both runs: the fault from 4 h on (sensor.demo's defaults)
    stream = simulate(sd.FAULT, sd.SEED, sd.HOURS, sd.ONSET_H)
    on_stream = detection_metrics(np.asarray(pca.alarms(stream)["t2_or_q"]), onset)
    t1 = time.perf_counter()
    on_run = detection_metrics(np.asarray(pca.alarms(load_run(fit_dir / "plant_run.dat"))["t2_or_q"]), onset)
    return on_stream, on_run, (t1 - t0, time.perf_counter() - t1)
