"""zeroedge eval: the evaluation contracts other tools call.

  --calib ARTIFACT   SIH/PAD in prefill: dense_ppl, zero_ppl, ffn_flops_skipped, per_layer_skip, tokens,
                     zero_ppl_all_tokens (long-document protocol, see zeroedge.evaluation)
  --scorer S         with an SIH artifact: the prompt tokens ranked by random / norm / oracle instead, as
                     many a layer as SIH skips on the text: zero_ppl is S's, sih_zero_ppl SIH's (same run);
                     left out: the artifact's own ranking (scorer in the JSON)
  --kv-budget F      thermal KV (F = 10% or 0.1): full_kv_ppl, thermal_ppl, hot_kv_bytes, full_kv_bytes
  --paths            with --calib: decode paths instead of SIH/PAD: dense_ppl, paths_ppl,
                     ffn_bytes_skipped (every token teacher-forced with the paths on)
  --device-memory SIZE / --board B   what `zeroedge run` would serve at --ctx under that cap on a
                     bf16 device with a compressed cold store (zeroedge.runtime.memory): device_memory
                     (cap, dense and thermal forecasts, served, cold_store); dense KV that does not fit
                     is evaluated as thermal KV (--kv-budget, else 10 %; int8 cold store, int4 if int8
                     does not fit); nothing fits: exit 2
  an artifact with a weights section (zeroedge calibrate --weights): dense_ppl (the model as loaded),
                     weights_ppl (its weights quantized as the artifact says, zeroedge.quant.apply),
                     weights_ppl_rise, weights (the scheme), weight_bytes, weight_bytes_fp16; then
                     every other mechanism above runs on the quantized model, so zero_ppl's and
                     paths_ppl's ppl_rise is over weights_ppl (SIH/PAD is skipped when the artifact
                     has no SIH layers)

Without --json it prints a short table (perplexities, % and MiB); --json prints the keys above.
"""
import click

from zeroedge.commands.common import (check_model, check_policy_value, ctx_option, examples, fraction_option,
                                     memory_cap, memory_cap_options)
from zeroedge.kv.policy import THERMAL

CONTINUATION = 1024
SCORERS = ("sih", "random", "norm", "oracle")     # SIH/PAD's token rankings (--scorer)


@click.command("eval", epilog=examples(
    "zeroedge eval smollm2-135m --text kjv --ctx 4096 --kv-budget 10%",
    "zeroedge eval smollm2-135m --calib smol.calib --text licenses --ctx 4096 --json"))
@click.argument("model")
@click.option("--calib", "calib", type=click.Path(), help="Calibration artifact (SIH/PAD).")
@click.option("--text", "text", required=True, help="A file, or kjv / essays / licenses.")
@ctx_option("Tokens N: prefill N-1024, score the last 1024.", required=True)
@click.option("--offset", type=int, default=0, show_default=True, help="Token offset into the text.")
@fraction_option("--kv-budget", "kv_budget", help="Thermal KV hot fraction of the prefix KV, in (0, 1].")
@click.option("--page-size", type=int, default=None,
              help="Tokens a thermal KV page (default 8; the recent window stays 32 tokens).")
@click.option("--kv-ahead", "kv_ahead", type=int, default=0, show_default=True,
              help="With thermal KV (--kv-budget, or a cap that serves it): the torch decoder's policy with pages "
                   "scored from the query predicted N layers ahead (`run --kv-ahead N`; 0: each layer's own query).")
@click.option("--kv-fetch", "kv_fetch", type=int, default=None,
              help="With thermal KV: the torch decoder's policy with at most N pages swapped into the window a "
                   f"refresh, per kv head and layer (`run --kv-fetch N`; default {THERMAL.fetch}).")
@click.option("--threads", type=int, default=0, help="torch threads (0 = default).")
@click.option("--bundle", type=click.Path(),
              help="With --kv-budget: the thermal policy of this exported bundle's onnxruntime runner (what "
                   "`run --backend onnxruntime` serves, pages of 16 unless --page-size), not the torch decoder's.")
@click.option("--paths", "paths", is_flag=True,
              help="Evaluate the artifact's decode path predictors (needs --calib).")
@click.option("--scorer", type=click.Choice(SCORERS), default=None,
              help="With --calib: the token ranking of SIH/PAD. Left out: the artifact's own (sih unless it "
                   "was calibrated with --scorer). With an SIH artifact, random / norm (lowest FFN-input norm) / "
                   "oracle (first-order importance from a backward pass on the text itself): each artifact layer "
                   "skips as many prompt rows as SIH does on this text, those this scorer ranks lowest, beside "
                   "SIH in the same run.")
@memory_cap_options("What `zeroedge run` would serve at --ctx under this device memory cap (e.g. 8G): "
                    "dense, thermal KV, or exit 2.")
@click.option("--cold-in-file", "cold_in_file", is_flag=True,
              help="With a cap: forecast as `run --kv-spill DIR` serves, the cold store in a file (no device "
                   "memory; the same codes, so the same perplexity).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cmd(model, calib, text, ctx, offset, kv_budget, page_size, threads, as_json, paths=False,
        device_memory=None, board=None, bundle=None, cold_in_file=False, kv_ahead=0, kv_fetch=None, scorer=None):
    """Measure what the mechanisms cost on MODEL over --text."""
    import json

    cap = memory_cap(device_memory, board)
    _check_args(calib, ctx, offset, kv_budget, page_size, threads, bundle, cap, kv_ahead, kv_fetch)
    if scorer is not None and (calib is None or paths):
        from zeroedge.errors import UserError

        raise UserError("--scorer ranks SIH/PAD's prompt tokens: it needs --calib ARTIFACT (and not --paths)")
    if cold_in_file and cap is None:
        from zeroedge.errors import UserError

        raise UserError("--cold-in-file goes with a cap (--device-memory SIZE or --board B)")
    check_model(model)                                   # a missing model: refused before torch loads
    from zeroedge.texts import check_spec

    check_spec(text)
    meta, cal = _read_calib(calib, paths)
    if scorer is not None and not cal.skip_layers:
        from zeroedge.errors import UserError

        raise UserError(f"--scorer {scorer}: {calib} skips no prompt rows (it has no SIH/PAD layers)")
    if scorer is not None and scorer != cal.sih.scorer != "sih":
        from zeroedge.errors import UserError

        raise UserError(f"--scorer {scorer}: {calib} ranks by {cal.sih.scorer} (calibrate --scorer "
                        f"{cal.sih.scorer}); peers are compared at an SIH artifact's row counts")
    scorer = scorer or (cal.sih.scorer if cal is not None else "sih")
    m, ids = _load_tokens(model, text, ctx, offset, threads)
    result = {"model": model, "text": text, "ctx": ctx, "tokens": CONTINUATION}
    if cap is not None:
        result["device_memory"] = served_under(m.cfg, ctx, cap, kv_budget, cold_in_file)
        if result["device_memory"]["served"] == "thermal" and kv_budget is None:
            kv_budget = result["device_memory"]["thermal_budget"]
    if meta is not None:
        _calib_evals(result, m, ids, calib, meta, cal, paths, ctx, scorer)
    if kv_budget is not None:
        _thermal_eval(result, m, ids, kv_budget, page_size, threads, bundle, ctx, kv_ahead, kv_fetch)
    if as_json:
        click.echo(json.dumps(result))
    else:
        for line in table(result, calib=calib, paths=paths):
            click.echo(line)


def _check_args(calib, ctx, offset, kv_budget, page_size, threads, bundle, cap, kv_ahead=0, kv_fetch=None):
    """The checks of the options that need no model: a UserError at the first that fails."""
    from zeroedge.errors import UserError

    for flag, value in (("--kv-ahead", kv_ahead or None), ("--kv-fetch", kv_fetch)):     # given (ahead 0: off)
        if value is None:
            continue
        check_policy_value(flag, value)
        if bundle is not None:
            raise UserError(f"{flag} is the torch decoder's policy; a bundle's runner scores and fetches pages "
                            "its own way")
        if kv_budget is None and cap is None:
            raise UserError(f"{flag} needs thermal KV: give --kv-budget F (or a cap)")

    if calib is None and kv_budget is None and cap is None:
        raise UserError("nothing to evaluate: give --calib ARTIFACT, --kv-budget F and/or --device-memory SIZE")
    if ctx <= CONTINUATION + 32:
        raise UserError(f"--ctx must exceed {CONTINUATION + 32} (the last {CONTINUATION} tokens are scored)")
    if offset < 0:
        raise UserError("--offset must be >= 0")
    if page_size is not None and page_size < 1:
        raise UserError(f"--page-size must be >= 1 (got {page_size})")
    if threads < 0:
        raise UserError("--threads must be >= 0")
    if bundle is not None:
        from pathlib import Path

        if kv_budget is None:
            raise UserError("--bundle evaluates a bundle runner's thermal KV: give --kv-budget F")
        if cap is not None:
            raise UserError("--bundle and a device memory cap do not combine: the cap is the torch backend's")
        if not Path(bundle).is_dir():
            raise UserError(f"bundle not found: {bundle}")


def _read_calib(calib, paths):
    """(meta, Calibration) of the --calib artifact, or (None, None) without one; read before the model
    loads so a bad artifact fails fast. --paths: the artifact must have path predictors."""
    from zeroedge.errors import UserError

    meta = cal = None
    if calib is not None:
        from zeroedge import calib_artifact

        meta = calib_artifact.read_meta(calib)  # fail fast, before loading the model
        cal = calib_artifact.Calibration.from_meta(meta, calib)
    if paths:
        if meta is None:
            raise UserError("--paths needs --calib ARTIFACT (an artifact with path predictors)")
        calib_artifact.read(calib).require_paths()
    return meta, cal


def _stage(msg):
    """Progress on stderr: --json keeps stdout clean."""
    click.echo(f"[eval] {msg}", err=True)


def _load_tokens(model, text, ctx, offset, threads):
    """(the model, the ctx token ids of --text from --offset); torch is imported here."""
    import torch

    from zeroedge import texts, weights
    from zeroedge.errors import UserError

    if threads:
        torch.set_num_threads(threads)
    _stage(f"loading {model}")
    m, folder = weights.load(model)
    if ctx > m.cfg.max_seq_len:
        raise UserError(f"--ctx {ctx} exceeds the model's context ({m.cfg.max_seq_len})")
    tok = weights.tokenizer(folder)
    ids = texts.tokens(tok, texts.load_text(text, texts.chars_for(ctx + offset)), ctx, offset=offset,
                       what=f"text {text}")
    return m, ids


def _calib_evals(result, m, ids, calib, meta, cal, paths, ctx, scorer=None):
    """The artifact's evaluations into result: its weights section first (the model stays quantized),
    then decode paths (--paths) or SIH/PAD (skipped when an artifact with weights has no SIH layers)."""
    if cal.weights is not None:
        _stage(f"weights {cal.weights.describe()}: dense and quantized perplexity (2 passes)")
        result.update(weights_eval(m, ids, calib, meta))
    if paths:
        _stage(f"decode paths: dense and paths perplexity over {ctx} tokens (teacher-forced)")
        from zeroedge import calib_artifact
        from zeroedge.paths.evaluate import run_eval as paths_eval

        calib_artifact.check_model(meta, m.cfg, calib)
        result.update(paths_eval(m, ids, meta, calib_artifact.load_tensors(calib),
                                 continuation=CONTINUATION))
    elif cal.has_sih or cal.weights is None:
        scorer = scorer or cal.sih.scorer
        own = scorer == cal.sih.scorer
        _stage(f"SIH/PAD: dense and zero passes over {ctx} tokens "
               + ("(5 passes)" if own else f"(3 passes; SIH and {scorer} at the same row counts)"))
        result.update({k: v for k, v in zero_eval(m, ids, calib, meta, scorer).items()
                       if not (cal.weights is not None and k == "dense_ppl")})


def _thermal_eval(result, m, ids, kv_budget, page_size, threads, bundle, ctx, kv_ahead=0, kv_fetch=None):
    """Thermal KV at kv_budget into result: the torch decoder's policy (with the cold store the device
    memory cap chose, if any), or with --bundle the bundle's onnxruntime runner's."""
    from zeroedge.errors import UserError

    try:
        from zeroedge.kv.evaluate import run_eval
    except ImportError:
        raise UserError("thermal KV is not available in this build (zeroedge.kv missing)") from None
    _stage(f"thermal KV: full-KV prefill of {ctx - CONTINUATION} tokens, then the methods over the last "
           f"{CONTINUATION}")
    if bundle is not None:
        from zeroedge.kv.evaluate import run_bundle_eval
        from zeroedge.serve.session import open_bundle

        runner = open_bundle(bundle, threads=threads or None, model_cfg=m.cfg)
        result.update(run_bundle_eval(runner, ids, kv_budget, CONTINUATION, page_size))
    else:
        opts = {"cold": result["device_memory"]["cold_store"]} if "device_memory" in result else {}
        if kv_fetch is not None:
            opts["fetch"] = kv_fetch
        result.update(run_eval(m, ids, kv_budget, page_size=page_size or THERMAL.page_size,
                               continuation=CONTINUATION, ahead=kv_ahead, **opts))


def weights_eval(m, ids, calib, meta) -> dict:
    """dense_ppl of m as loaded, then m's weights quantized in place (the artifact's weights section)
    and weights_ppl: the last CONTINUATION tokens after a prefill of the rest, as everywhere here."""
    import torch

    from zeroedge import calib_artifact
    from zeroedge.evaluation import continuation_ppl
    from zeroedge.quant.apply import apply_artifact, weight_bytes

    calib_artifact.check_model(meta, m.cfg, calib)
    t = torch.tensor([ids])
    dense = continuation_ppl(m, t, CONTINUATION)["ppl"]
    section = apply_artifact(m, meta, calib_artifact.load_tensors(calib), where=str(calib))
    q = continuation_ppl(m, t, CONTINUATION)["ppl"]
    return {"dense_ppl": dense, "weights_ppl": q, "weights_ppl_rise": q / dense - 1, "weights": section.describe(),
            "weight_bytes": weight_bytes(m.cfg, section)["total"], "weight_bytes_fp16": weight_bytes(m.cfg)["total"]}


def served_under(cfg, ctx: int, cap: int, kv_budget=None, cold_in_file: bool = False) -> dict:
    """What the torch serving session would do with a ctx-token prompt under the cap, on a bf16 device
    with a compressed cold store (a Jetson's: int8, int4 when int8 does not fit; in a file with
    cold_in_file, as `run --kv-spill`): the forecasts with the session's headroom, and "dense" or
    "thermal"; a UserError when nothing fits."""
    from zeroedge.errors import UserError
    from zeroedge.runtime.memory import HEADROOM, request_bytes

    budget = kv_budget or 0.1
    dense, int8, int4 = (int(request_bytes(cfg, 2, ctx, 1, **kw)["peak"] * (1 + HEADROOM))
                         for kw in ({}, *(dict(budget=budget, cold=c, cold_shares_memory=True,
                                               cold_in_file=cold_in_file) for c in ("int8", "int4"))))
    out = {"cap": cap, "dense_forecast": dense, "thermal_forecast": int8, "thermal_int4_forecast": int4,
           "thermal_budget": budget, "dtype": "bf16", "cold_store": "int8", "cold_in_file": cold_in_file}
    if dense <= cap:
        return dict(out, served="dense")
    if int8 <= cap or int4 <= cap:
        return dict(out, served="thermal", cold_store="int8" if int8 <= cap else "int4")
    raise UserError(f"a {ctx}-token prompt does not fit the {cap / 2**30:.2f} GiB device memory cap: dense KV needs "
                    f"{dense / 2**30:.2f} GiB, thermal KV at {budget:.0%} hot {int8 / 2**30:.2f} GiB (int8 cold "
                    f"store) or {int4 / 2**30:.2f} GiB (int4)")


def zero_eval(m, ids, calib, meta, scorer: str | None = None) -> dict:
    """SIH/PAD as the artifact ships it (dense, zero, zero in chunks, all tokens) when `scorer` is the
    artifact's own ranking (None: the same); with another, that ranking at the very per-layer row
    counts SIH skips on this text (dense, SIH, scorer)."""
    import torch

    from zeroedge import calib_artifact
    from zeroedge.bundle import DEFAULT_PREFILL_CHUNK
    from zeroedge.evaluation import all_tokens_ppl, continuation_ppl
    from zeroedge.mechanisms.pad import chunk_on_blocks, install_artifact, installed_policies, remove

    calib_artifact.check_model(meta, m.cfg, calib)
    own = calib_artifact.Calibration.from_meta(meta, str(calib)).sih.scorer
    scorer = scorer or own
    t = torch.tensor([ids])
    tensors = calib_artifact.load_tensors(calib)
    dense = continuation_ppl(m, t, CONTINUATION)
    rt = install_artifact(m, meta, tensors)
    rt.record_masks = scorer == own
    try:
        zero = continuation_ppl(m, t, CONTINUATION, rt)
        out = {"scorer": scorer, "dense_ppl": dense["ppl"], "per_layer_skip": zero["per_layer_skip"],
               "prefill_s_dense": dense["prefill_s"]}
        if scorer != own:
            return {**out, **_ranked_eval(m, t, meta, tensors, rt, zero, dense["ppl"], scorer)}
        one_pass_masks = dict(rt.masks)
        # the prefill in chunks, as exported bundles run it (SIH: the scores carried between them)
        chunk = chunk_on_blocks(DEFAULT_PREFILL_CHUNK, installed_policies(m))
        chunked = continuation_ppl(m, t, CONTINUATION, rt, chunk=chunk)
        same = one_pass_masks.keys() == rt.masks.keys() and all(
            torch.equal(one_pass_masks[i], rt.masks[i]) for i in one_pass_masks)
        rt.record_masks = False
        zero_all = all_tokens_ppl(m, t, rt)
    finally:
        remove(m)
    return {**out, "zero_ppl": zero["ppl"], "ppl_rise": zero["ppl"] / dense["ppl"] - 1,
            "ffn_flops_skipped": zero["ffn_flops_skipped"],
            "ffn_flops_skipped_gross": zero["ffn_flops_skipped_gross"],
            "zero_ppl_chunked": chunked["ppl"], "chunk": chunk, "chunked_same_skips": same,
            "dense_ppl_all_tokens": all_tokens_ppl(m, t), "zero_ppl_all_tokens": zero_all,
            "prefill_s_zero": zero["prefill_s"]}


def _ranked_eval(m, t, meta, tensors, sih_rt, sih, dense, scorer) -> dict:
    """--scorer random / norm / oracle: the tokens each artifact layer skips chosen by that scorer, as
    many per layer as SIH skipped in the pass `sih` (its runtime `sih_rt`), the same anchors."""
    from zeroedge.evaluation import continuation_ppl, first_order_importance, ranked_at_counts
    from zeroedge.mechanisms.pad import artifact_policies, install, remove

    remove(m)
    prefix = t.shape[1] - CONTINUATION
    skipped = {i: st[1] - st[0] for i, st in sih_rt.stats.items()}
    policies, rt = artifact_policies(meta, tensors)
    oracle = None
    if scorer == "oracle":
        _stage("oracle: one forward and backward pass for the first-order importance of every prompt token")
        oracle = first_order_importance(m, t, prefix, {i: p.anchor for i, p in policies.items()})
    install(m, ranked_at_counts(policies, rt, skipped, prefix, scorer, oracle), rt)
    try:
        ranked = continuation_ppl(m, t, CONTINUATION, rt)
    finally:
        remove(m)
    return {"zero_ppl": ranked["ppl"], "ppl_rise": ranked["ppl"] / dense - 1,
            "sih_zero_ppl": sih["ppl"], "sih_ppl_rise": sih["ppl"] / dense - 1,
            "ffn_flops_skipped": ranked["ffn_flops_skipped"],
            "ffn_flops_skipped_gross": ranked["ffn_flops_skipped_gross"],
            "prefill_s_zero": ranked["prefill_s"]}


ALL_TOKENS_NOTE = ("every token scored in one pass with the mechanisms on at every position, the scored",
                   "ones too: a stricter test than the line above (zero_ppl_all_tokens in --json)")


def _mib(n) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _ppl(label, a_name, a, b_name, b) -> str:
    return f"  {label:<30} {a_name} {a:.3f}   {b_name} {b:.3f}   ({b / a - 1:+.2%})"


def table(r: dict, calib=None, paths=False) -> list:
    """The text output of `zeroedge eval`: a few lines with units; the keys are --json's."""
    n = r["ctx"] - r["tokens"]
    out = [f"{r['model']} on {r['text']}: {r['ctx']} tokens, prefill {n}, the last {r['tokens']} scored"]
    if "weights_ppl" in r:
        out += ["", f"weights {r['weights']} ({calib})",
                _ppl(f"perplexity, last {r['tokens']} tokens", "dense", r["dense_ppl"], "quantized", r["weights_ppl"]),
                f"  {'weights':<30} {_mib(r['weight_bytes'])} ({_mib(r['weight_bytes_fp16'])} as fp16); the "
                "mechanisms below run on the quantized model"]
    if "zero_ppl" in r:
        base = r["weights_ppl"] if "weights_ppl" in r else r["dense_ppl"]
        ranked = "sih_zero_ppl" in r
        out += ["", f"SIH/PAD in prefill ({calib})" + (f", tokens ranked by {r['scorer']} at SIH's per-layer "
                                                       "row counts" if ranked else ""),
                _ppl(f"perplexity, last {r['tokens']} tokens", "dense", base, r.get("scorer", "zero"), r["zero_ppl"]),
                *([_ppl("", "dense", base, "sih", r["sih_zero_ppl"])] if ranked else []),
                *([f"  {'prefill in chunks of ' + str(r['chunk']):<30} zero {r['zero_ppl_chunked']:.3f}   "
                   + ("the same rows skipped as in one pass" if r["chunked_same_skips"]
                      else "OTHER ROWS SKIPPED THAN IN ONE PASS")] if "zero_ppl_chunked" in r else []),
                *([_ppl("perplexity, all tokens", "dense", r["dense_ppl_all_tokens"], "zero", r["zero_ppl_all_tokens"]),
                   *(f"  {'':<30} {line}" for line in ALL_TOKENS_NOTE)] if "zero_ppl_all_tokens" in r else []),
                f"  {'prefill FFN FLOPs skipped':<30} {r['ffn_flops_skipped']:.1%} net of anchors "
                f"({r['ffn_flops_skipped_gross']:.1%} gross)",
                f"  {'prefill time':<30} dense {r['prefill_s_dense'] * 1e3:,.0f} ms   zero {r['prefill_s_zero'] * 1e3:,.0f} ms"]
    if "paths_ppl" in r:
        out += ["", f"decode paths ({calib})",
                _ppl(f"perplexity, last {r['paths_scored_tokens']} tokens", "dense", r["dense_ppl"], "paths",
                     r["paths_ppl"]),
                f"  {'decode FFN bytes skipped':<30} {r['ffn_bytes_skipped']:.1%} net of predictors "
                f"({r['ffn_bytes_skipped_gross']:.1%} gross), {r['paths_sparse_layers']} sparse layer(s), "
                f"{r['paths_channels_kept']:.1%} of channels kept"]
    if "device_memory" in r:
        d = r["device_memory"]
        out += ["", f"device memory cap {_mib(d['cap'])} ({d['dtype']} device, {d['cold_store']} cold store)",
                f"  {'forecast':<30} dense {_mib(d['dense_forecast'])}   thermal at {d['thermal_budget']:.0%} hot "
                f"{_mib(d['thermal_forecast'])}: run serves it {d['served']}"]
    if "thermal_ppl" in r and "policy" in r:                 # a bundle runner's policy (--bundle)
        out += ["", f"thermal KV of the bundle runner (--kv-budget {r['budget']:.0%} of the prompt, pages of "
                    f"{r['page_size']} tokens)",
                _ppl(f"perplexity, last {r['scored_tokens']} tokens", "full KV", r["full_kv_ppl"], "thermal",
                     r["thermal_ppl"]),
                f"  {'KV window':<30} {_mib(r['hot_kv_bytes'])} ({r['window_slots']} slots) of "
                f"{_mib(r['full_kv_bytes'])}; {r['pages_migrated']} pages migrated",
                f"  {'time':<30} {r['seconds']:.1f} s"]
    elif "thermal_ppl" in r:
        o = r.get("options") or {}
        ahead = f", pages scored {o['ahead']} layer(s) ahead" if o.get("ahead") else ""
        fetch = f", at most {o['fetch']} fetched a refresh" if o.get("fetch") else ""
        out += ["", f"thermal KV (--kv-budget {r['budget']:.0%}, pages of {r['page_size']} tokens{fetch}{ahead})",
                _ppl(f"perplexity, last {r['scored_tokens']} tokens", "full KV", r["full_kv_ppl"], "thermal",
                     r["thermal_ppl"]),
                f"  {'prefix KV on the device':<30} {_mib(r['hot_kv_bytes'])} of {_mib(r['full_kv_bytes'])} "
                f"({r['hot_fraction']:.1%}; budget {r['budget']:.0%})",
                f"  {'':<30} hot pages {_mib(r['hot_page_bytes'])} ({r['hot_pages_per_head']} per head, "
                f"{o.get('sink_pages', 0)} sink + {o.get('recent_pages', 0)} recent always kept)",
                f"  {'':<30} + key summaries {_mib(r['summary_bytes'])}"
                + (": the fixed pages and the summaries can exceed the budget" if r["hot_fraction"] > r["budget"]
                   else "")]
        if r.get("tail_tokens"):
            out.append(f"  {'':<30} prefix of {r['prefix_tokens']} tokens in whole pages; the {r['tail_tokens']} "
                       "after it are read as a prompt's tail (kept hot, not scored)")
        out.append(f"  {'time':<30} {r['seconds']:.1f} s")
    return out
