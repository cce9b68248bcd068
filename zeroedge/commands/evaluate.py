"""zeroedge eval: the evaluation contracts other tools call.

  --calib ARTIFACT   SIH/PAD in prefill: dense_ppl, zero_ppl, ffn_flops_skipped, tokens,
                     zero_ppl_all_tokens (long-document protocol, see zeroedge.evaluation)
  --kv-budget F      thermal KV: full_kv_ppl, thermal_ppl, hot_kv_bytes, full_kv_bytes
  --paths            with --calib: decode paths (issue 5) instead of SIH/PAD: dense_ppl, paths_ppl,
                     ffn_bytes_skipped (every token teacher-forced with the paths on)
"""
import click

CONTINUATION = 1024


@click.command("eval")
@click.argument("model")
@click.option("--calib", "calib", type=click.Path(), help="Calibration artifact (SIH/PAD).")
@click.option("--text", "text", required=True, help="A file, or kjv / essays / licenses.")
@click.option("--ctx", type=int, required=True, help="Tokens N: prefill N-1024, score the last 1024.")
@click.option("--offset", type=int, default=0, show_default=True, help="Token offset into the text.")
@click.option("--kv-budget", type=float, help="Thermal KV hot fraction of the prefix KV, in (0, 1].")
@click.option("--page-size", type=int, default=16, show_default=True, help="Thermal KV page size.")
@click.option("--threads", type=int, default=0, help="torch threads (0 = default).")
@click.option("--paths", "paths", is_flag=True,
              help="Evaluate the artifact's decode path predictors (needs --calib).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cmd(model, calib, text, ctx, offset, kv_budget, page_size, threads, as_json, paths=False):
    """Measure what the mechanisms cost on MODEL over --text."""
    import json

    from zeroedge.errors import UserError

    if calib is None and kv_budget is None:
        raise UserError("nothing to evaluate: give --calib ARTIFACT and/or --kv-budget F")
    if ctx <= CONTINUATION + 32:
        raise UserError(f"--ctx must exceed {CONTINUATION + 32} (the last {CONTINUATION} tokens are scored)")
    if kv_budget is not None and not (0 < kv_budget <= 1):
        raise UserError(f"--kv-budget {kv_budget} is out of range: it must be in (0, 1]")
    if offset < 0:
        raise UserError("--offset must be >= 0")
    from zeroedge.texts import check_spec

    check_spec(text)
    meta = None
    if calib is not None:
        from zeroedge import calib_artifact

        meta = calib_artifact.read_meta(calib)  # fail fast, before loading the model
    if paths:
        if meta is None:
            raise UserError("--paths needs --calib ARTIFACT (an artifact with path predictors)")
        if not meta.get("paths"):
            raise UserError(f"{calib} has no decode path predictors (meta section 'paths' is "
                            "missing): re-run zeroedge calibrate with --paths")

    import torch

    from zeroedge import texts, weights

    if threads:
        torch.set_num_threads(threads)
    m, folder = weights.load(model)
    if ctx > m.cfg.max_seq_len:
        raise UserError(f"--ctx {ctx} exceeds the model's context ({m.cfg.max_seq_len})")
    tok = weights.tokenizer(folder)
    ids = texts.tokens(tok, texts.load_text(text), ctx, offset=offset, what=f"text {text}")
    result = {"model": model, "text": text, "ctx": ctx, "tokens": CONTINUATION}
    if meta is not None and paths:
        from zeroedge import calib_artifact
        from zeroedge.paths.evaluate import run_eval as paths_eval

        calib_artifact.check_model(meta, m.cfg, calib)
        result.update(paths_eval(m, ids, meta, calib_artifact.load_tensors(calib),
                                 continuation=CONTINUATION))
    elif meta is not None:
        result.update(zero_eval(m, ids, calib, meta))
    if kv_budget is not None:
        try:
            from zeroedge.kv.evaluate import run_eval
        except ImportError:
            raise UserError("thermal KV is not available in this build (zeroedge.kv missing)") from None
        result.update(run_eval(m, ids, kv_budget, page_size=page_size, continuation=CONTINUATION))
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>24}: {v:.4f}" if isinstance(v, float) else f"{k:>24}: {v}")


def zero_eval(m, ids, calib, meta) -> dict:
    import torch

    from zeroedge import calib_artifact
    from zeroedge.evaluation import all_tokens_ppl, continuation_ppl
    from zeroedge.export.calibrate import load_runtime
    from zeroedge.mechanisms.pad import remove

    calib_artifact.check_model(meta, m.cfg, calib)
    t = torch.tensor([ids])
    dense = continuation_ppl(m, t, CONTINUATION)
    dense_all = all_tokens_ppl(m, t)
    rt = load_runtime(m, meta, calib_artifact.load_tensors(calib))
    try:
        zero = continuation_ppl(m, t, CONTINUATION, rt)
        zero_all = all_tokens_ppl(m, t, rt)
    finally:
        remove(m)
    return {"dense_ppl": dense["ppl"], "zero_ppl": zero["ppl"],
            "ppl_rise": zero["ppl"] / dense["ppl"] - 1,
            "ffn_flops_skipped": zero["ffn_flops_skipped"],
            "ffn_flops_skipped_gross": zero["ffn_flops_skipped_gross"],
            "dense_ppl_all_tokens": dense_all, "zero_ppl_all_tokens": zero_all,
            "prefill_s_dense": dense["prefill_s"], "prefill_s_zero": zero["prefill_s"]}
