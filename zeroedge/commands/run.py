"""zeroedge run: generate from a prompt through the serving engine (zeroedge.serve.engine), one request
over the serving session's decoder (zeroedge.serve.session) or, with --weights q4, over the batched
4-bit CPU step `zeroedge serve` runs.

    zeroedge run smollm2-135m --prompt "In the beginning" --max-new 32
    zeroedge run smollm2-135m --prompt-file doc.txt --max-new 64 --kv-budget 0.1 --json
    zeroedge run smollm2-135m --prompt-file doc.txt --paths --calib art/ --release-level 3
    zeroedge run smollm2-135m --prompt-file doc.txt --weights q4 --speculative auto   # the 4-bit CPU step
    zeroedge run --backend onnxruntime --bundle bundle/ --prompt "..."
    zeroedge run --backend tensorrt --bundle bundle/ --engines engines/ --prompt "..."

Greedy decoding. The release level gates thermal KV and decode paths per request (L0 off, L1 < 512
tokens, L2 < 4096 tokens at temperature 0, L3 all). --paths asks for the artifact's decode paths:
if they cannot run (no path predictors, another model, a level that excludes the request) the
command fails instead of decoding dense. With --backend onnxruntime the paths are nodes of the
bundle's decode graph (zeroedge export MODEL --calib PATHS_ARTIFACT): such a bundle runs them on
every request, so a request its level excludes is refused. The bundle backends need no MODEL (the
bundle has its shapes and tokenizer); a MODEL given with them is checked against the bundle.
--backend tensorrt serves the engines `zeroedge build BUNDLE -o ENGINES` made from that bundle, on
the GPU they were built for. --device-memory SIZE / --board B (torch backend) cap the device memory:
each request is admitted from a byte forecast (zeroedge.runtime.memory), served with thermal KV when
dense KV would not fit, or refused with both forecasts.
"""
import click

from zeroedge.commands.common import (SectionedCommand, check_model, check_policy_value, examples, fraction_option,
                                     memory_cap, memory_cap_options)
from zeroedge.kv.policy import THERMAL
from zeroedge.weights import resolve_model as resolve, tokenizer_for  # noqa: F401 (used below)


def bundle_config(bundle):
    """What `run` needs of the model a bundle was exported from (name, vocab_size), from its verified
    manifest; torch-free, as the device side must be."""
    from types import SimpleNamespace

    from zeroedge import bundle as bundle_mod
    from zeroedge.errors import UserError

    model = bundle_mod.read_manifest(bundle).get("model")  # the runner verifies the whole bundle
    if not isinstance(model, dict) or not isinstance(model.get("vocab_size"), int):
        raise UserError(f"{bundle}: its manifest has no usable model section; re-export it")
    return SimpleNamespace(name=str(model.get("name") or "bundle"), vocab_size=model["vocab_size"])


# the headings of `zeroedge run --help`
SECTIONS = [
    ("Input and output", ["prompt", "prompt_file", "max_new", "as_json"]),
    ("Backend", ["backend", "bundle", "engines", "plugins", "device", "threads"]),
    ("Thermal KV cache", ["kv_budget", "page_size", "kv_spill", "kv_store_pages", "kv_ahead", "kv_fetch"]),
    ("Weights, decode paths, speculative decoding, release level", ["weights", "calib", "paths", "speculative",
                                                                    "batch_invariant", "release_level"]),
    ("Device memory", ["device_memory", "board"]),
]


@click.command("run", cls=SectionedCommand, sections=SECTIONS, epilog=examples(
    'zeroedge run smollm2-135m --prompt "In the beginning" --max-new 32',
    "zeroedge run --backend onnxruntime --bundle bundle/ --prompt-file doc.txt --kv-budget 10%"))
@click.argument("model", required=False)
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(), help="Read the prompt from a file.")
@click.option("--max-new", type=int, default=32, show_default=True, help="New tokens to generate.")
@fraction_option("--kv-budget", "kv_budget",
                 help="Thermal KV: the fraction of the prompt's KV kept hot, in (0, 1] (new tokens stay hot; "
                      "every backend).")
@click.option("--page-size", type=int, default=None,
              help="Tokens a thermal KV page (default: 8 on the torch backend, its recent window 32 tokens; "
                   "16 on the bundle backends).")
@click.option("--kv-spill", "kv_spill", type=click.Path(file_okay=False),
              help="Thermal KV's file tier: a folder (NVMe on a Jetson) for one private file, deleted at the end. "
                   "torch: the whole compressed cold store lives there (no device memory); onnxruntime / "
                   "tensorrt: stored pages beyond --kv-store-pages go there.")
@click.option("--kv-store-pages", "kv_store_pages", type=int, default=0, show_default=True,
              help="onnxruntime / tensorrt, with --kv-spill: stored pages kept in memory before the coldest go "
                   "to the file (besides one packed copy of each window page).")
@click.option("--kv-ahead", "kv_ahead", type=int, default=0, show_default=True,
              help="torch backend, thermal KV: score layer l's pages with the query predicted from layer l-N's "
                   "input, so on CUDA the page refresh runs beside the step (0: each layer's own query; with "
                   "--kv-spill the refreshes stay on the step's path, the host reading pages between layers).")
@click.option("--kv-fetch", "kv_fetch", type=int, default=None,
              help="torch backend, thermal KV: at most N pages swapped into the hot window a refresh, per kv head "
                   f"and layer (default {THERMAL.fetch}; more: closer to full KV, a longer refresh).")
@click.option("--weights", type=click.Choice(["model", "q4"]), default="model", show_default=True,
              help="torch backend on a CPU: q4 = the serving engine's 4-bit step (onnxruntime; the Q4_1 grid, a Q4_1 "
                   "GGUF's own weights; 8-bit LM head), as `zeroedge serve` runs on a CPU; model = the model's "
                   "weights in torch (every other mechanism).")
@click.option("--paths", "paths", is_flag=True, help="Run the decode path predictors (needs --calib).")
@click.option("--calib", type=click.Path(), help="Calibration artifact: its path predictors (for --paths) and "
              "its weights section (4-bit weights, applied to the model; on CUDA decoded by the packed GEMV).")
@click.option("--release-level", type=int, default=3, show_default=True,
              help="0 off, 1 < 512 tokens, 2 < 4096 tokens at temperature 0, 3 all.")
@click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt"]), default="torch",
              show_default=True, help="torch: MODEL in PyTorch; onnxruntime / tensorrt: an exported --bundle.")
@click.option("--bundle", type=click.Path(), help="Exported bundle (onnxruntime and tensorrt backends).")
@click.option("--engines", type=click.Path(), help="TensorRT engines of --bundle (zeroedge build BUNDLE -o DIR).")
@click.option("--plugins", type=click.Path(), help="tensorrt: the plugin library, when the engines were built "
              "without it inside (zeroedge build --no-serialize-plugins).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="torch backend device.")
@click.option("--threads", type=int, default=0, help="CPU threads (0 = default).")
@memory_cap_options("torch backend: a device memory cap (e.g. 8G): a request whose forecast does not fit is "
                    "served with thermal KV if that fits, else refused; on CUDA the allocator is held to it.")
@click.option("--speculative", type=click.Choice(["auto", "off", "ngram", "packed"]), default="off", show_default=True,
              help="torch backend, dense decoder: tokens drafted by n-gram lookup in the prompt and the text so "
                   "far (auto, ngram) or by the model's own weights in 4 bits (packed: the 4-bit CPU step with --weights "
                   "model on a CPU; on CUDA the packed GEMV step), checked by the model in one step (the output is the model's own). auto, packed: a draft "
                   "only where its measured acceptance and costs pay; ngram: whenever the lookup finds one.")
@click.option("--batch-invariant", "batch_invariant", is_flag=True,
              help="torch backend on CUDA, dense decoder, the model's weights: every product in a kernel that computes "
                   "a row alike for any number of rows, and each step as a check of one token, so --speculative "
                   "gives the tokens plain decoding gives, bit for bit (without it a check's bf16 products may round "
                   "otherwise than the step's and part at a near-tie).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cmd(model, prompt, prompt_file, max_new, kv_budget, page_size, kv_spill, kv_store_pages, kv_ahead, kv_fetch,
        weights, paths, calib, release_level, backend, bundle, engines, plugins, device, threads, device_memory, board,
        speculative, batch_invariant, as_json):
    """Generate greedily from MODEL with the mechanisms the release level allows."""
    from zeroedge.errors import UserError

    prompt = _read_prompt(prompt, prompt_file)
    if weights == "q4":
        _check_q4(backend, device, kv_budget, page_size, kv_spill, kv_ahead, kv_fetch, paths, calib,
                  device_memory is not None or board is not None)
    _check_options(model, max_new, page_size, paths, calib, release_level, backend, bundle, engines, plugins,
                   threads)
    if speculative == "packed" and weights == "q4":
        raise UserError("--speculative packed drafts with the 4-bit step for the model's float weights: give "
                        "--weights model (or --speculative auto with --weights q4)")
    if speculative != "off" and backend != "torch":
        raise UserError(f"--speculative {speculative}: the {backend} backend's step gives the last position's "
                        "logits only (use the torch backend, or --speculative off)")
    capped = device_memory is not None or board is not None
    if batch_invariant and (backend != "torch" or weights == "q4" or kv_budget is not None or paths or calib
                            or capped):
        raise UserError("--batch-invariant runs the torch backend's dense decoder on the model's own weights: "
                        "no --weights q4, --kv-budget, --paths, --calib or memory cap")
    spill = _spill_options(kv_spill, kv_store_pages, kv_budget, backend, capped)
    if kv_ahead:
        spill["ahead"] = _policy_option("--kv-ahead", kv_ahead, kv_budget, backend, capped)
    if kv_fetch is not None:
        spill["fetch"] = _policy_option("--kv-fetch", kv_fetch, kv_budget, backend, capped)
    budget = kv_budget
    cap = memory_cap(device_memory, board)
    if cap is not None and backend != "torch":
        raise UserError("--device-memory / --board cap the torch backend; for a bundle, `zeroedge plan BUNDLE "
                        "--board B --ctx N` forecasts its runtime")
    if cap is not None:                  # before torch is imported: its allocator reads the setting once
        import os

        from zeroedge.runtime.memory import cap_allocator

        cap_allocator(os.environ)

    # -- model, session, request -----------------------------------------------------------------
    if model is None:
        m, cfg, folder = None, bundle_config(bundle), None
    else:
        m, cfg, folder = resolve(model, need_weights=backend == "torch")
    tok = tokenizer_for(cfg, bundle if backend != "torch" else None, folder)
    ids = tok.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"the tokenizer gives ids outside the model's vocabulary ({cfg.vocab_size})")
    from zeroedge.serve.session import ServingSession, open_bundle

    eos = getattr(tok, "eos_token_id", None)
    if weights == "q4":
        _echo(model, cfg, tok, backend, run_q4(m, ids, max_new, eos, speculative, threads), None, as_json,
              asked_kv=False, asked_paths=False)
        return
    if backend == "torch":
        import torch

        if threads:
            torch.set_num_threads(threads)
        dev = "cuda" if device == "auto" and torch.cuda.is_available() else device
        dev = "cpu" if dev == "auto" else dev
        if dev == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device here")
        if batch_invariant and dev != "cuda":
            raise UserError("--batch-invariant runs on CUDA (its kernels are Triton's)")
        m = m.to(dev)
    source = m if backend == "torch" else open_bundle(bundle, backend, engines, plugins, threads or None,
                                                      model_cfg=cfg if model is not None else None)
    sess = ServingSession(source, kv_budget=budget, page_size=page_size, artifact=calib,
                          release_level=release_level, device_memory=cap, thermal_opts=spill,
                          on_alert=lambda s: click.echo(f"zeroedge: alert: {s}", err=True), invariant=batch_invariant)
    res = sess.generate(ids, max_new, paths=True if paths else None, eos=eos, speculative=speculative)
    _echo(model, cfg, tok, backend, res, sess.metrics, as_json, asked_kv=budget is not None, asked_paths=bool(paths))


def _echo(model, cfg, tok, backend, res, metrics, as_json, asked_kv, asked_paths):
    """The text on stdout and the summary on stderr, or one JSON object."""
    import json

    text = tok.decode(res.tokens, skip_special_tokens=True)
    if as_json:
        out = {"model": model or cfg.name, "backend": backend, "text": text, **res.to_dict()}
        if metrics is not None:
            out["metrics"] = metrics
        click.echo(json.dumps(out))
        return
    click.echo(text)
    for line in summary(res, asked_kv=asked_kv, asked_paths=asked_paths):
        click.echo(line, err=True)


def _check_q4(backend, device, kv_budget, page_size, kv_spill, kv_ahead, kv_fetch, paths, calib, capped):
    """--weights q4 is the serving engine's batched 4-bit CPU step: dense KV, no artifact, no cap."""
    from zeroedge.errors import UserError

    if backend != "torch":
        raise UserError(f"--weights q4 is the torch backend's 4-bit CPU step; --backend {backend} runs its bundle's "
                        "weights")
    if device == "cuda":
        raise UserError("--weights q4 runs on the CPU (onnxruntime); on CUDA give --calib ARTIFACT with a weights "
                        "section (the packed GEMV)")
    others = [flag for flag, given in (("--kv-budget", kv_budget is not None), ("--page-size", page_size is not None),
                                       ("--kv-spill", kv_spill is not None), ("--kv-ahead", bool(kv_ahead)),
                                       ("--kv-fetch", kv_fetch is not None), ("--paths", paths),
                                       ("--calib", calib is not None), ("--device-memory / --board", capped)) if given]
    if others:
        raise UserError(f"--weights q4 decodes with dense KV and no artifact: {', '.join(others)} run on "
                        "--weights model")


def run_q4(m, ids, max_new, eos, speculative, threads):
    """One request through the serving engine's batched backend on the 4-bit CPU step (the backend
    `zeroedge serve` runs on a CPU), its KV pool the request's own pages -> a Result."""
    import torch

    from zeroedge.serve.backends import pool_bytes, position_bytes
    from zeroedge.serve.engine import Engine
    from zeroedge.serve.plan import Plan, Sampling
    from zeroedge.serve.session import Report, result_of
    from zeroedge.serve.setup import batched_backend

    cfg, n = m.cfg, len(ids) + max_new
    if n > cfg.max_seq_len:
        from zeroedge.errors import UserError

        raise UserError(f"{len(ids)} prompt + {max_new} new tokens exceed the model's context ({cfg.max_seq_len})")
    m = m.to("cpu", torch.float32).eval()
    per_pos = position_bytes(cfg, 4)
    kv = pool_bytes(cfg, n)
    b, linears, _ = batched_backend(m, "q4", threads or torch.get_num_threads(), 1, 128, kv, None, n)
    plan = Plan(list(ids), Sampling(max_new, 0.0), n, kv, eos=() if eos is None else (int(eos),))
    mech = {"weights": linears.description, "weights_decode": f"the serving engine's 4-bit step ({linears.kernels} "
            "onnxruntime kernels)", "thermal_kv": False, "thermal_kv_reason": "--weights q4 (dense KV)",
            "paths": False, "paths_reason": "--weights q4"}
    if speculative != "off":
        mech["speculative"] = speculative
    seq = Engine(b, speculative=speculative).run(plan)
    detail = {"decoder": type(linears).__name__, "backend": "torch", "device": "cpu"}
    return result_of(seq, eos, Report(mech, kv, n * per_pos, 0, detail))


def _read_prompt(prompt, prompt_file) -> str:
    from pathlib import Path

    from zeroedge.errors import UserError

    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        p = Path(prompt_file)
        if not p.is_file():
            raise UserError(f"prompt file not found: {prompt_file}")
        try:
            prompt = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{prompt_file}: unreadable ({e})") from None
    if not prompt:
        raise UserError("the prompt is empty")
    return prompt


def _policy_option(flag: str, value: int, kv_budget, backend, capped: bool) -> int:
    """--kv-ahead N / --kv-fetch N, checked: the torch decoder's thermal policy (kv.policy.ThermalSettings)."""
    from zeroedge.errors import UserError

    check_policy_value(flag, value)
    if backend != "torch":
        raise UserError(f"{flag} is the torch decoder's thermal policy (the bundle runners score and fetch pages "
                        "their own way)")
    if kv_budget is None and not capped:
        raise UserError(f"{flag} needs thermal KV: give --kv-budget F (or a cap, --device-memory / --board)")
    return value


def _spill_options(kv_spill, store_pages, kv_budget, backend, capped: bool) -> dict:
    """--kv-spill / --kv-store-pages -> the thermal policy's options, the folder checked now."""
    from zeroedge.errors import UserError
    from zeroedge.kv.policy import check_cold_path

    if kv_spill is None:
        if store_pages:
            raise UserError("--kv-store-pages goes with --kv-spill DIR")
        return {}
    if not kv_spill.strip():
        raise UserError("--kv-spill needs a folder (got an empty path)")
    if backend == "torch":
        if store_pages:
            raise UserError("--kv-store-pages is for --backend onnxruntime or tensorrt (the torch decoder "
                            "keeps its whole cold store in the --kv-spill file)")
        if kv_budget is None and not capped:
            raise UserError("--kv-spill needs thermal KV: give --kv-budget F (or a cap, --device-memory / --board)")
        return {"spill_dir": check_cold_path(kv_spill)}
    if kv_budget is None:
        raise UserError("--kv-spill needs thermal KV: give --kv-budget F")
    if store_pages < 0:
        raise UserError(f"--kv-store-pages must be >= 0 (got {store_pages})")
    return {"spill_dir": check_cold_path(kv_spill), "store_pages": store_pages}


def _check_options(model, max_new, page_size, paths, calib, release_level, backend, bundle, engines, plugins,
                   threads):
    """Every check that needs no model, before any work."""
    from pathlib import Path

    from zeroedge.errors import UserError
    from zeroedge.kv.policy import LEVELS

    if max_new < 1:
        raise UserError(f"--max-new must be >= 1 (got {max_new})")
    if page_size is not None and page_size < 1:
        raise UserError(f"--page-size must be >= 1 (got {page_size})")
    if release_level not in LEVELS:
        raise UserError(f"--release-level must be 0, 1, 2 or 3 (got {release_level})")
    if backend == "torch" and model is None:
        raise UserError("give MODEL (a bundled name, a preset, an HF folder or a .gguf file), or run an "
                        "exported bundle with --backend onnxruntime --bundle DIR")
    if paths and calib is None and backend == "torch":
        raise UserError("--paths needs --calib ARTIFACT (made by zeroedge calibrate --paths)")
    if paths and release_level == 0:
        raise UserError("--paths asked for but --release-level 0 turns every mechanism off")
    if calib is not None:
        if backend != "torch":
            raise UserError(f"--calib is for the torch backend: --backend {backend} runs the decode "
                            "paths its bundle was exported with (zeroedge export MODEL --calib ARTIFACT)")
        from zeroedge import calib_artifact

        cal = calib_artifact.read(calib)
        if paths or cal.weights is None:
            cal.require_paths()
    if backend != "torch":
        if bundle is None:
            raise UserError(f"--backend {backend} needs --bundle DIR (made by zeroedge export)")
        if not Path(bundle).is_dir():
            raise UserError(f"bundle not found: {bundle}")
    elif bundle is not None:
        raise UserError("--bundle is for --backend onnxruntime or tensorrt")
    if backend == "tensorrt":
        if engines is None:
            raise UserError(f"--backend tensorrt needs --engines DIR (made by zeroedge build {bundle} -o DIR)")
    elif engines is not None or plugins is not None:
        raise UserError("--engines and --plugins are for --backend tensorrt")
    if threads < 0:
        raise UserError("--threads must be >= 0")
    if model is not None:
        check_model(model, presets=True)       # a missing model path: refused before torch loads


def summary(res, asked_kv: bool, asked_paths: bool) -> list:
    """The text output's lines after the generated text (stderr): tokens, speed, the mechanisms and,
    for one asked for but not used, why; device KV in MiB and % of full."""
    mech = res.mechanisms
    used = [k for k in ("sih_pad", "thermal_kv", "paths") if mech.get(k)] or ["dense"]
    full = res.full_kv_bytes
    share = f" ({res.device_kv_bytes / full:.0%})" if full else ""
    lines = [f"[run] {len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s, mechanisms: {'+'.join(used)}, "
             f"device KV {res.device_kv_bytes / 2**20:,.2f} MiB of {full / 2**20:,.2f} MiB{share}"]
    for k, asked, name in (("thermal_kv", asked_kv, "thermal KV"), ("paths", asked_paths, "decode paths")):
        if asked and not mech.get(k) and mech.get(f"{k}_reason"):
            lines.append(f"[run] {name} not used: {mech[f'{k}_reason']}")
    lines += [f"[run] not applied: {what}" for what in mech.get("not_applied", [])]
    return lines
