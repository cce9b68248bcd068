"""zeroedge calibrate: fit SIH heads and anchors, gate thresholds on held-out text, write the artifact.

With --weights int4|int8 the model's linear layers are quantized first (group-wise, onnxruntime
MatMulNBits' numerics; --method awq searches activation-aware scales on the same texts, rtn does not),
and the SIH/PAD (and --paths) calibrations then run on the fake-quantized model, so their thresholds
see the weights the bundle ships; one artifact holds both sections. --weights-only skips SIH/PAD."""
import click

from zeroedge.calib_artifact import SCORERS
from zeroedge.commands.common import check_model, examples, fraction_option, output_option


@click.command("calibrate", epilog=examples(
    "zeroedge calibrate smollm2-135m --text kjv --text essays --budget 2% --train-seqs 8 --gate-seqs 4 -o smol.calib",
    "zeroedge calibrate smollm2-135m --text kjv --weights int4 --weights-only -o smol-int4.calib"))
@click.argument("model")
@click.option("--text", "texts_", multiple=True, required=True,
              help="Calibration text: a file, or kjv / essays / licenses. Repeat to mix texts.")
@fraction_option("--budget", "budget", default="1%", help="Max held-out perplexity rise.")
@output_option("Artifact directory to write.", metavar="ARTIFACT")
@click.option("--tokens", default=24000, show_default=True, help="Tokens read from each text.")
@click.option("--seq-len", default=2048, show_default=True)
@click.option("--continuation", default=512, show_default=True)
@click.option("--train-seqs", default=3, show_default=True, type=click.IntRange(min=1),
              help="Training sequences (SIH heads, anchors).")
@click.option("--gate-seqs", default=2, show_default=True, type=click.IntRange(min=1),
              help="Held-out sequences the quality gate measures.")
@click.option("--anchor-rank", default=16, show_default=True, help="0 = plain skipping (zero output).")
@click.option("--seed", default=0, show_default=True)
@click.option("--importance-samples", default=16, show_default=True,
              help="(layer, token) pairs for the forward-perturbation check of importance (0 = off).")
@click.option("--gate-steps", default=7, show_default=True,
              help="Binary-search steps of the quality gate (each one held-out pass).")
@click.option("--paths", "with_paths", is_flag=True,
              help="Also calibrate decode FFN paths within the same budget.")
@click.option("--paths-costs", type=click.Choice(["first_order", "measured"]), default="first_order",
              show_default=True,
              help="Per-layer path costs: first-order estimates, or each layer measured alone "
                   "(slower; better allocation, benchmarks/paths.md).")
@click.option("--weights", "wbits", type=click.Choice(["int4", "int8"]),
              help="Quantize the linear layers' weights (group-wise, weight-only) before calibrating.")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="With --weights: weights per scale along the input dimension.")
@click.option("--symmetric/--asymmetric", default=False, show_default=True,
              help="With --weights: symmetric grid (no zero point) or scale + zero point.")
@click.option("--zero-point", "zero_point", type=click.Choice(["int", "float"]), default="int", show_default=True,
              help="With --weights int4 asymmetric: int (onnxruntime's quantizer) or float (a min/max grid "
                   "with an fp16 minimum: Q4_1's form, which reproduces a Q4_1 GGUF such as the bundled "
                   "SmolLM2's exactly).")
@click.option("--method", type=click.Choice(["awq", "rtn"]), default="awq", show_default=True,
              help="With --weights: activation-aware scale search (AWQ) or plain round-to-nearest.")
@click.option("--embedding", type=click.Choice(["int8", "int4", "keep"]), default="int8", show_default=True,
              help="With --weights: the embedding (and tied LM head) int8 or int4 (symmetric, groups along "
                   "the hidden size), or kept. int4 reads half the LM head's bytes a decode step on a GPU, "
                   "costs more perplexity, and serves on the torch path only (export refuses it).")
@click.option("--weights-only", is_flag=True,
              help="With --weights: write the weights section only (no SIH/PAD prefill calibration).")
@click.option("--scorer", type=click.Choice(SCORERS), default="sih", show_default=True,
              help="The prompt-token ranking the quality gate's rates skip by: the SIH heads (what the bundles' "
                   "plugins run), or the FFN input's norm or a random draw, to measure what the learned "
                   "ranking buys at the same budget (`eval` measures such an artifact; `export` refuses it).")
@fraction_option("--max-rate", "max_rate", default="90%",
                 help="The largest share of a layer's prompt tokens the gate may skip (the last layer, whose "
                      "prompt output nothing reads, skips them all). Lower makes the gate spread the skipping over "
                      "more layers.")
@click.option("--json", "as_json", is_flag=True, help="Print the quality summary as JSON.")
def cmd(model, texts_, budget, output, tokens, seq_len, continuation, train_seqs, gate_seqs,
        anchor_rank, seed, importance_samples, gate_steps, with_paths, paths_costs, as_json,
        wbits=None, group="128", symmetric=False, method="awq", embedding="int8", weights_only=False,
        zero_point="int", scorer="sih", max_rate=0.9):
    """Calibrate MODEL (smollm2-135m or a path) on --text and write ARTIFACT (-o)."""
    import sys

    out = _check_args(model, texts_, output, seq_len, continuation, anchor_rank, wbits, symmetric, zero_point)
    if not 0.1 <= max_rate <= 0.9:
        from zeroedge.errors import UserError

        raise UserError(f"--max-rate must be between 10% and 90% (the gate's rates are 10%, 20%, ..., 90%), "
                        f"got {max_rate:.0%}")
    if weights_only and scorer != "sih":
        from zeroedge.errors import UserError

        raise UserError("--scorer ranks SIH/PAD's prompt tokens: --weights-only calibrates no SIH/PAD")

    import torch

    from zeroedge import calib_artifact, weights
    from zeroedge.export.calibrate import CalibConfig, skip_rates

    m, folder = weights.load(model)
    lists = _token_lists(weights.tokenizer(folder), texts_, tokens, seq_len)
    torch.manual_seed(seed)
    cfg = CalibConfig(budget=budget, seq_len=seq_len, continuation=continuation, train_seqs=train_seqs,
                      gate_seqs=gate_seqs, anchor_rank=anchor_rank, seed=seed,
                      importance_samples=importance_samples, gate_steps=gate_steps, scorer=scorer,
                      rates=skip_rates(max_rate), log=lambda s: print(s, file=sys.stderr))
    wmeta, tensors = None, {}
    if wbits:
        wmeta, tensors = quantize_weights(m, lists, cfg, int(wbits[3:]), int(group), symmetric, method,
                                          embedding, seed, zero_point)
    meta = _calibrate_sections(m, lists, cfg, tensors, weights_only, with_paths, paths_costs)
    meta["texts"], meta["tokens_per_text"] = list(texts_), tokens
    if wmeta is not None:
        meta["weights"] = wmeta
    calib_artifact.save(out, meta, tensors)
    _echo_quality(out, meta["quality"], wmeta, budget, as_json)


def _check_args(model, texts_, output, seq_len, continuation, anchor_rank, wbits, symmetric, zero_point):
    """The checks that need no torch, made before anything heavy loads: a UserError at the first that
    fails; returns the artifact's Path."""
    from pathlib import Path

    from zeroedge.errors import UserError

    if continuation >= seq_len or seq_len < 64 or continuation < 1:
        raise UserError(f"--continuation ({continuation}) must be in [1, seq-len) and --seq-len >= 64")
    if anchor_rank < 0:
        raise UserError("--anchor-rank must be >= 0")
    ctx = click.get_current_context()
    wopts = [f"--{n.replace('_', '-')}" for n in ("group", "symmetric", "method", "embedding", "weights_only",
                                                  "zero_point")
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if wbits is None and wopts:
        raise UserError(f"{', '.join(wopts)} only apply with --weights int4|int8")
    if zero_point == "float" and (wbits != "int4" or symmetric):
        raise UserError("--zero-point float is for an asymmetric int4 grid (--weights int4, no --symmetric)")
    from zeroedge.texts import check_spec

    for t in texts_:
        check_spec(t)  # fail before loading anything heavy
    check_model(model)
    out = Path(output)
    if out.exists() and not (out / "calib.json").is_file():
        raise UserError(f"{out} exists and is not a calibration artifact; refusing to overwrite it")
    return out


def _token_lists(tok, texts_, tokens, seq_len) -> list:
    """The first --tokens token ids of each text; a text too short for a training and a held-out
    sequence is a UserError."""
    from zeroedge import texts
    from zeroedge.errors import UserError

    need = seq_len * 2  # at least one training and one held-out sequence
    lists = []
    for t in texts_:
        raw = texts.load_text(t)
        ids = tok.encode(raw[: 8 * tokens], add_special_tokens=False)[:tokens]
        if len(ids) < need * 2:
            raise UserError(f"text {t} has {len(ids)} tokens; calibration needs at least "
                            f"{need * 2} for {seq_len}-token training and held-out sequences")
        lists.append(ids)
    return lists


def _calibrate_sections(m, lists, cfg, tensors, weights_only, with_paths, paths_costs) -> dict:
    """The artifact's meta: SIH/PAD (an empty section with --weights-only), then decode paths with
    --paths; their tensors go into tensors. A budget that cannot be met is a UserError (nothing written)."""
    from zeroedge.errors import UserError
    from zeroedge.export.calibrate import BudgetError, calibrate

    budget_errors = (BudgetError,)
    if with_paths:
        from zeroedge.export.paths_calibrate import PathBudgetError, PathsConfig, calibrate_paths

        budget_errors += (PathBudgetError,)
    step = "prefill (SIH/PAD)"
    try:   # the one place a budget that cannot be met becomes a user error (nothing is written)
        if weights_only:
            meta = {"model": {"name": m.cfg.name, "config": m.cfg.to_dict()}, "sih": {}, "layers": [],
                    "pruned_heads": {}, "quality": {}}
        else:
            meta, ptensors, _ = calibrate(m, lists, cfg)
            tensors.update(ptensors)
        if with_paths:
            step = "decode paths"
            pcfg = PathsConfig(seq_len=min(1024, cfg.seq_len), train_seqs=min(2, cfg.train_seqs),
                               gate_seqs=min(2, cfg.gate_seqs), costs=paths_costs)
            meta["paths"], ptensors = calibrate_paths(m, lists, cfg.budget, log=cfg.log, cfg=pcfg)
            tensors.update(ptensors)
    except budget_errors as e:
        raise UserError(f"{step}: {e}; nothing written (try a larger --budget)") from None
    return meta


def _echo_quality(out, q, wmeta, budget, as_json):
    """The summary: the artifact's quality q (and its weights section's, if any) as JSON or as text."""
    import json

    from zeroedge import calib_artifact

    wq = wmeta["quality"] if wmeta else None
    if as_json:
        click.echo(json.dumps({"artifact": str(out), **q, **({"weights": wq} if wq else {})}))
        return
    if wq:
        click.echo(f"weights {calib_artifact.weights_section(wmeta).describe()}: held-out ppl "
                   f"{wq['heldout_ppl_fp']:.3f} -> {wq['heldout_ppl']:.3f} ({wq['ppl_rise']:+.2%}), "
                   f"{wq['bytes'] / 2**20:,.1f} MiB of weights ({wq['bytes_fp16'] / 2**20:,.1f} MiB as fp16)")
    if "zero_ppl" in q:
        click.echo(f"wrote {out}: held-out ppl {q['dense_ppl']:.3f} -> {q['zero_ppl']:.3f} "
                   f"({q['ppl_rise']:+.2%}, budget {budget:.2%}), prefill FFN FLOPs skipped "
                   f"{q['ffn_flops_skipped']:.1%} net of anchors" + (" (on the quantized model)" if wq else "")
                   + (f", tokens ranked by {q['scorer']}" if q.get("scorer", "sih") != "sih" else ""))
    else:
        click.echo(f"wrote {out}")


def quantize_weights(m, lists, cfg, bits, group, symmetric, method, embedding, seed, zero_point="int"):
    """Quantize m in place (AWQ search first when asked); returns (meta["weights"], its tensors).
    Quality: held-out perplexity before and after, on the SIH gate's held-out sequences."""
    import torch

    from zeroedge import calib_artifact
    from zeroedge.export.awq import AwqConfig, search
    from zeroedge.export.calibrate import heldout_ppl, split_sequences
    from zeroedge.quant import apply as qa
    from zeroedge.quant.groupwise import Scheme

    _, held = split_sequences(lists, cfg)
    P = cfg.seq_len - cfg.continuation
    fp = heldout_ppl(m, held, P)
    extra, tensors, scales = {}, {}, None
    if method == "awq":
        scales, alphas, report = search(m, lists, Scheme(bits, group, symmetric, zero_point),
                                        AwqConfig(seed=seed, seq_len=min(512, cfg.seq_len), log=cfg.log))
        tensors = {f"layers.{i}.awq.{g}": t for i, sc in scales.items() for g, t in sc.items()}
        extra["awq"] = {"alpha": alphas, **report}
    if zero_point == "float":
        extra["zero_point"] = "float"
    w = calib_artifact.weights_meta(bits, group, symmetric, method,
                                    qa.embedding_group(m.cfg.dim) if embedding != "keep" else None,
                                    embedding_bits=4 if embedding == "int4" else 8, **extra)
    section = calib_artifact.weights_section(w)
    qa.apply(m, section, scales)
    torch.manual_seed(seed)
    q = heldout_ppl(m, held, P)
    w["quality"] = {"heldout_ppl_fp": fp, "heldout_ppl": q, "ppl_rise": q / fp - 1,
                    "bytes": qa.weight_bytes(m.cfg, section)["total"],
                    "bytes_fp16": qa.weight_bytes(m.cfg, None, 2)["total"]}
    cfg.log(f"[weights] {section.describe()}: held-out ppl {fp:.3f} -> {q:.3f} ({q / fp - 1:+.2%})")
    return w, tensors
