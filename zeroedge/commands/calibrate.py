"""zeroedge calibrate: fit SIH heads and anchors, gate thresholds on held-out text, write the artifact."""
import click

from zeroedge.commands.common import check_model, fraction_option, output_option


@click.command("calibrate")
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
@click.option("--json", "as_json", is_flag=True, help="Print the quality summary as JSON.")
def cmd(model, texts_, budget, output, tokens, seq_len, continuation, train_seqs, gate_seqs,
        anchor_rank, seed, importance_samples, gate_steps, with_paths, paths_costs, as_json):
    """Calibrate MODEL (smollm2-135m or a path) on --text and write ARTIFACT (-o)."""
    import json
    import sys
    from pathlib import Path

    from zeroedge.errors import UserError

    b = budget
    if continuation >= seq_len or seq_len < 64 or continuation < 1:
        raise UserError(f"--continuation ({continuation}) must be in [1, seq-len) and --seq-len >= 64")
    if anchor_rank < 0:
        raise UserError("--anchor-rank must be >= 0")
    from zeroedge.texts import check_spec

    for t in texts_:
        check_spec(t)  # fail before loading anything heavy
    check_model(model)
    out = Path(output)
    if out.exists() and not (out / "calib.json").is_file():
        raise UserError(f"{out} exists and is not a calibration artifact; refusing to overwrite it")

    import torch

    from zeroedge import calib_artifact, texts, weights
    from zeroedge.export.calibrate import BudgetError, CalibConfig, calibrate

    m, folder = weights.load(model)
    tok = weights.tokenizer(folder)
    need = seq_len * 2  # at least one training and one held-out sequence
    lists = []
    for t in texts_:
        raw = texts.load_text(t)
        ids = tok.encode(raw[: 8 * tokens], add_special_tokens=False)[:tokens]
        if len(ids) < need * 2:
            raise UserError(f"text {t} has {len(ids)} tokens; calibration needs at least "
                            f"{need * 2} for {seq_len}-token training and held-out sequences")
        lists.append(ids)
    torch.manual_seed(seed)
    cfg = CalibConfig(budget=b, seq_len=seq_len, continuation=continuation, train_seqs=train_seqs,
                      gate_seqs=gate_seqs, anchor_rank=anchor_rank, seed=seed,
                      importance_samples=importance_samples, gate_steps=gate_steps,
                      log=lambda s: print(s, file=sys.stderr))
    budget_errors = (BudgetError,)
    if with_paths:
        from zeroedge.export.paths_calibrate import PathBudgetError, PathsConfig, calibrate_paths

        budget_errors += (PathBudgetError,)
    step = "prefill (SIH/PAD)"
    try:   # the one place a budget that cannot be met becomes a user error (nothing is written)
        meta, tensors, _ = calibrate(m, lists, cfg)
        if with_paths:
            step = "decode paths"
            pcfg = PathsConfig(seq_len=min(1024, seq_len), train_seqs=min(2, train_seqs),
                               gate_seqs=min(2, gate_seqs), costs=paths_costs)
            meta["paths"], ptensors = calibrate_paths(m, lists, b, log=cfg.log, cfg=pcfg)
            tensors.update(ptensors)
    except budget_errors as e:
        raise UserError(f"{step}: {e}; nothing written (try a larger --budget)") from None
    meta["texts"] = list(texts_)
    calib_artifact.save(out, meta, tensors)
    q = meta["quality"]
    if as_json:
        click.echo(json.dumps({"artifact": str(out), **q}))
    else:
        click.echo(f"wrote {out}: held-out ppl {q['dense_ppl']:.3f} -> {q['zero_ppl']:.3f} "
                   f"({q['ppl_rise']:+.2%}, budget {b:.2%}), prefill FFN FLOPs skipped "
                   f"{q['ffn_flops_skipped']:.1%} net of anchors")
