"""`zeroedge sensor-fit NORMAL_FILE... [--faults FILE...] -o BUNDLE`: fit the sensor detector to a plant."""
import click

from zeroedge.commands.common import examples, output_option


@click.command("sensor-fit", epilog=examples(
    "zeroedge sensor-fit normal.dat -o plant.sensor",
    "zeroedge sensor-fit normal.dat --faults d01.dat --faults d02.dat -o plant.sensor"))
@click.argument("normal_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--faults", "fault_files", multiple=True, type=click.Path(dir_okay=False),
              help="A labelled fault run (faulty from its first sample); repeat, or list several after one "
                   "--faults. The class comes from the name dNN.dat (d01.dat = fault_01) or --label.")
@click.option("--label", "labels", multiple=True, metavar="FILE=N",
              help="The fault class of a --faults file whose name does not say it (N or fault_NN); repeatable.")
@click.option("--far", type=float, default=0.02, show_default=True,
              help="Target false-alarm rate on normal runs the fit has not seen (set on out-of-fold scores).")
@click.option("--window", type=int, default=32, show_default=True, help="Frames of context per decision.")
@output_option("The sensor bundle folder to write.", dest="out", old_out=True, metavar="BUNDLE")
@click.option("--force", is_flag=True, help="Replace an existing -o folder.")
@click.option("--max-steps", type=int, default=3000, show_default=True,
              help="Fine-tuning steps at most (early stopping usually ends sooner).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="CPU threads for torch.")
@click.option("--allow-constant", is_flag=True,
              help="Accept channels that are constant in the normal data (scaled to 1 % of their value).")
@click.option("--json", "as_json", is_flag=True, help="Print the fit summary as one JSON object.")
def cmd(normal_files, fault_files, labels, far, window, out, force, max_steps, seed, threads, allow_constant,
        as_json):
    """Fit the sensor detector to a plant from its own runs: normalisation from NORMAL_FILE(s)
    (52 columns, one row per sample; a file stored transposed is transposed back), with --faults a
    fine-tune of the shipped detector on the CPU (early stopping on the held-out tail of every file),
    and the alarm threshold for the target --far on out-of-fold scores: four folds, each fitted
    without one normal run (or a block of it) and a block of every fault file, score what they did
    not see; gates on the PCA residual Q (window mean) and on each channel alone (held still, moving
    more, or sitting further off its mean than in the normal data) may take part of the --far budget
    where they find more of the held-out faults. Writes a sensor bundle that zeroedge daemon, deploy
    and sensor-eval take like the shipped one; its manifest records the files, their hashes, the
    split, the FAR chosen, the out-of-fold figures and the evidence behind them."""
    import json
    import sys

    from zeroedge.errors import UserError
    from zeroedge.sensor import fit as F

    if max_steps < 0:
        raise UserError("--max-steps must be >= 0")
    if threads < 1:
        raise UserError("--threads must be >= 1")
    # a --faults value may be followed by more files (`--faults d01.dat d02.dat ...`): click hands
    # those over as NORMAL_FILE arguments after the first --faults; sys.argv tells which they were
    normal, faults = _split_args(list(normal_files), list(fault_files), sys.argv)
    log = (lambda s: click.echo(s, err=True))
    man = F.fit(normal, faults, labels, far=far, window=window, out=out, force=force, max_steps=max_steps,
                seed=seed, threads=threads, allow_constant=allow_constant, log=log)
    s = man["sensor"]
    summary = {"bundle": str(out), "window": s["window"], "threshold": s["alarm"]["threshold"],
               "ema_alpha": s["alarm"]["ema_alpha"], "q_limit": s["alarm"].get("q_limit"),
               "spread_limit": s["alarm"].get("spread_limit"), "level_limit": s["alarm"].get("level_limit"),
               "still_gate": s["alarm"].get("still_gate"), "far_target": far,
               "held_out_far": s["fit"]["validation"]["far"], "held_out_fdr": s["fit"]["validation"]["fdr"],
               "held_out_far_upper_95": s["alarm"]["val_far_evidence"]["far_upper"],
               "far_target_supported": s["alarm"]["val_far_evidence"]["supported"],
               "unobservable": s["fit"]["unobservable_classes"], "seconds": s["fit"]["seconds"]}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"sensor bundle -> {out}: threshold {summary['threshold']:.6f}, EMA alpha {summary['ema_alpha']}, "
                   + ("" if summary["q_limit"] is None else f"Q gate {summary['q_limit']:.3f}, ")
                   + "".join(f"{n} gate {summary[n + '_limit']:.3f}, " for n in ("spread", "level")
                             if summary[n + "_limit"] is not None)
                   + ("still gate, " if summary["still_gate"] else "")
                   + f"held-out FAR {summary['held_out_far']:.3f} (95 % bound {summary['held_out_far_upper_95']:.3f}"
                   + ("" if summary["far_target_supported"] else f", above the {far} target") + ")"
                   + ("" if summary["held_out_fdr"] is None else f", held-out FDR {summary['held_out_fdr']:.3f}"))


def _split_args(normal, faults, argv):
    """Files given positionally after a --faults option belong to --faults (so `--faults d01.dat
    d02.dat ... d21.dat` works as the shell-friendly form)."""
    argv = list(argv)
    try:
        first = next(i for i, a in enumerate(argv) if a == "--faults" or a.startswith("--faults="))
    except StopIteration:
        return normal, faults
    after = set()
    i = first
    while i < len(argv):
        a = argv[i]
        if a == "--":
            break
        if a.startswith("-"):
            if a in ("--faults", "--label", "--far", "--window", "-o", "--output", "--out", "--max-steps", "--seed",
                     "--threads"):
                i += 2
                continue
            i += 1
            continue
        after.add(a)
        i += 1
    from pathlib import Path

    from zeroedge.sensor.fit import label_from_name

    moved = [f for f in normal if f in after and label_from_name(Path(f)) != 0]
    kept = [f for f in normal if f not in after]
    return kept, faults + moved
