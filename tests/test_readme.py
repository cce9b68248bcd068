"""The README cannot rot: every quick-start line runs (or, where it needs a Jetson or a broker, is
parsed by the real CLI), every figure of the results table equals what its raw file says, and every
repository path the README and the guides name exists."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click

from conftest import REPO

README = REPO / "README.md"
# lines that need what CI cannot have (a Jetson over SSH, an MQTT broker and a sensor bundle in /opt):
# parsed by the CLI with every option and path it names; the commands themselves run in
# tests/test_deploy.py and tests/test_daemon.py against sshd and mosquitto on 127.0.0.1
PARSE_ONLY = {"deploy", "daemon"}


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def quickstart_lines() -> list[list[str]]:
    block = re.search(r"```\n(.*?)```", _section("Quick start"), re.S).group(1)
    lines = []
    for raw in block.splitlines():
        words = shlex.split(raw, comments=True)
        if words:
            lines.append(words)
    return lines


def test_quickstart_is_zeroedge_commands_only():
    lines = quickstart_lines()
    assert len(lines) >= 8 and all(words[0] == "zeroedge" for words in lines)
    names = {words[1] for words in lines}
    assert {"run", "serve", "export", "build", "plan", "deploy", "daemon"} <= names


def _parse(words: list[str], cwd: Path):
    """What `zeroedge WORDS` would do up to calling the command: every option and argument converted
    (paths checked) by the real CLI, nothing run."""
    from zeroedge.cli import cli

    args = [str(REPO / w) if not (cwd / w).exists() and (REPO / w).exists() else w for w in words[2:]]
    cmd = cli.get_command(click.Context(cli), words[1])
    assert cmd is not None, words[1]
    cmd.make_context(words[1], args)


def _serve_answers(words: list[str]):
    """`zeroedge serve ...` comes up and answers a chat request from the openai client."""
    from test_serve import Served

    server = Served(*words[2:])
    try:
        reply = server.client().chat.completions.create(
            model=words[2], max_tokens=8, messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    finally:
        server.stop()


def test_quickstart_runs(tmp_path, rtx, plugin_lib, monkeypatch):
    """In order, in an empty folder: each line exits 0 (serve answers a chat request), and the
    deploy / daemon lines parse."""
    monkeypatch.setenv("ZEROEDGE_PLUGINS_LIB", str(plugin_lib))
    for words in quickstart_lines():
        name = words[1]
        if name in PARSE_ONLY:
            monkeypatch.chdir(tmp_path)
            _parse(words, tmp_path)
        elif name == "serve":
            _serve_answers(words)
        else:
            r = subprocess.run([sys.executable, "-m", "zeroedge.cli", *words[1:]], cwd=tmp_path,
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"{shlex.join(words)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_named_paths_exist():
    """Every repository path the README, the guides and the benchmark index name is there."""
    pages = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
    missing = []
    pattern = re.compile(r"`((?:docs|benchmarks|zeroedge|scripts|tests|plugins|ortops|device_tests|export)/"
                         r"[\w./-]+)`|\]\(((?:docs|benchmarks)/[\w./-]+)\)")
    for page in pages:
        for m in pattern.finditer(page.read_text()):
            rel = (m.group(1) or m.group(2)).rstrip(".")
            if "<" in rel or "*" in rel:
                continue
            base = REPO if page.parent.name != "benchmarks" or rel.startswith("benchmarks/") else page.parent
            if not (base / rel).exists() and not (REPO / rel).exists():
                missing.append(f"{page.relative_to(REPO)}: {rel}")
    assert not missing, "\n".join(missing)


# --- the results table -------------------------------------------------------------------------------
# One check per row, keyed by the row's first cell: it reads the row's raw file(s) and returns every
# figure the row's result / peer / quality cells may show, formatted as the README shows it. The test
# asserts that each of those figures is in the row and that the row shows no other figure.
RESULTS = REPO / "benchmarks" / "results"
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?![\w.-])")  # not 128K, 0c1e570, 4-bit


def _load(rel: str):
    path = RESULTS / rel
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def _f(x: float, digits: int) -> str:
    return f"{x:,.{digits}f}"


def _pct(x: float, digits: int = 2) -> str:
    """A relative change as the README writes it: +1.14, −0.09 (the cell adds the %)."""
    s = f"{100 * x:+.{digits}f}"
    return s.replace("-", "−")


def _range(xs, digits: int) -> str:
    lo, hi = min(xs), max(xs)
    return _f(lo, digits) if _f(lo, digits) == _f(hi, digits) else f"{_f(lo, digits)}–{_f(hi, digits)}"


def _serve_cpu_clients():
    d = _load("serve/cpu_smollm2_q4_clients.json")

    def per(server, clients):
        return [r["tokens_per_s"] for r in d["rows"] if r["server"] == server and r["clients"] == clients]

    figures = []
    for clients in (1, 4, 16):
        figures += [_range(per("zeroedge", clients), 1), _range(per("llama-server", clients), 1)]
        rounds = {r["round"]: r["tokens_per_s"] for r in d["rows"] if r["clients"] == clients and r["server"] == "zeroedge"}
        figures.append(_range([rounds[r["round"]] / r["tokens_per_s"] for r in d["rows"]
                               if r["clients"] == clients and r["server"] == "llama-server"], 2))   # per round
    figures += [_range([r["ttft_p99_s"] for r in d["rows"] if r["server"] == server and r["clients"] == 16], 2)
                for server in ("zeroedge", "llama-server")]
    q = {r["text"]: r["q4_rise"] for r in _load("serve/quality_smollm2_cpu_weights.json")["rows"]}
    return figures + [_pct(q["kjv"]), _pct(q["licenses"])]


def _serve_gpu_batch():
    d = _load("serve/gpu_llama1b_8k_batches.json")
    row = {r["batch"]: r for r in d["rows"] if r["variant"] == "graph"}    # what `zeroedge serve` runs
    hot = {r["batch"]: r for r in d["rows"] if r["variant"] == "thermal"}  # `zeroedge serve --kv-budget`
    unfused = next(r for r in d["rows"] if r["variant"] == "thermal-unfused" and r["batch"] == 16)
    q = _load("serve/thermal_quality_smollm2_cpu_4096.json")
    rises = {r["text"]: r for r in q["rows"]}
    assert q["budget"] == d["kv_budget"]
    return [_f(row[16]["tokens_per_s"], 0), _f(row[64]["tokens_per_s"], 0),
            _f(d["dense_decoder_tokens_per_s"], 0), _f(row[16]["x_dense_decoder"], 2),
            _f(row[64]["x_dense_decoder"], 2), _f(row[16]["x_roofline_batch1"], 2), _f(row[64]["x_roofline_batch1"], 2),
            _f(100 * d["kv_budget"], 0), _f(hot[16]["tokens_per_s"], 0), _f(hot[64]["tokens_per_s"], 0),
            _f(hot[16]["x_dense_decoder"], 2), _f(hot[64]["x_dense_decoder"], 2),
            _f(hot[16]["roofline_x_dense_batch1"], 1), _f(hot[64]["roofline_x_dense_batch1"], 1),
            _f(unfused["tokens_per_s"], 0), _f(unfused["x_dense_decoder"], 2)] + [
            _pct(rises[t][k]) for k in ("engine_rise", "run_rise") for t in ("kjv", "essays", "licenses")]


def _speculative_serve_cpu():
    rows = {r["task"]: r for r in _load("speculative/ngram_smollm2_cpu_q4.json")["rows"]}
    assert all(r["auto_identical"] and r["ngram_identical"] for r in rows.values())     # "the same tokens"
    return [_f(rows["summarise"]["auto_speedup"], 2), _f(rows["extract"]["auto_speedup"], 2),
            _range([rows[t]["auto_speedup"] for t in ("kjv", "essays", "licenses")], 2),
            _range([r["off_tok_s"] for r in rows.values()], 1)]


def _speculative_gpu():
    d = _load("speculative/gpu_llama1b_8k.json")
    ms, out = d["ms"], []
    for path in ("run", "engine"):
        sp = {t: r[path]["speedup"] for t, r in d["ngram"].items()}
        out += [_f(sp["summarise"], 2), _f(sp["extract"], 2), _range([sp[t] for t in ("kjv", "essays", "licenses")], 2)]
    for path in ("run", "engine"):
        out += [_range([ms[f"{path}_verify"][str(k)] / ms[f"{path}_plain_step"] for k in range(2, 10)], 2),
                _f(ms[f"{path}_plain_step"], 2),
                _f(max(r["speedup"] for r in d["packed"]["rows"] if r["head"] == "draft_vocab" and r["path"] == path), 2)]
    shipped = d["replayed"]["min_confidence_shipped"]
    for on in ("traces", "long"):
        out += [_f(r["speedup"], 2) for path in ("run", "engine") for r in d["replayed"]["rows"]
                if r["on"] == on and r["path"] == path and r["min_confidence"] == shipped]
    return out + [_f(ms["packed_drafter_step_draft_vocab_window"], 2)]


def _speculative_gpu_real():
    rows = {r["task"]: r for r in _load("speculative/smollm2_gpu_run_decoder.json")["rows"]}
    lookup = ("kjv", "essays", "licenses")
    return [_f(rows["summarise"]["auto"]["speedup"], 2), _f(rows["extract"]["auto"]["speedup"], 2),
            _f(rows["summarise"]["ngram"]["speedup"], 2), _range([rows[t]["auto"]["speedup"] for t in lookup], 2),
            _range([r["packed"]["speedup"] for r in rows.values()], 2),
            _range([r["off_tok_s"] for r in rows.values()], 0),
            _range([r["auto"]["tokens_as_off_before_a_difference"] for r in rows.values()], 0),
            str(rows["summarise"]["new_tokens"])]


def _speculative_gpu_invariant():
    run = {r["task"]: r for r in _load("speculative/smollm2_gpu_run_decoder_batch_invariant.json")["rows"]}
    eng = {r["task"]: r for r in _load("speculative/smollm2_gpu_engine_batch_invariant.json")["rows"]}
    default = {r["task"]: r for r in _load("speculative/smollm2_gpu_run_decoder_default_beside_invariant.json")["rows"]}
    assert all(r[m]["tokens_as_off_before_a_difference"] == r["new_tokens"]         # "every reply ... equal"
               for d in (run, eng) for r in d.values() for m in r if isinstance(r[m], dict))
    steps = {(s["path"], s["invariant"], s["batch"]): s["step_ms"]
             for s in _load("speculative/batch_invariant_decode_steps_h100.json")["decode_steps_llama1b_shape"]}
    batches = [b for p, inv, b in steps if p == "serve's engine step" and inv]

    def cost(path, b):
        return _pct(steps[(path, True, b)] / steps[(path, False, b)] - 1, 0)

    lookup = ("kjv", "essays", "licenses")
    out = []
    for d in (run, eng):
        out += [_f(d["summarise"]["auto"]["speedup"], 2), _f(d["extract"]["auto"]["speedup"], 2),
                _range([d[t]["auto"]["speedup"] for t in lookup], 2)]
    return out + [_range([r["off_tok_s"] for r in run.values()], 0),
                  _range([r["auto"]["speedup"] for r in default.values()], 2),
                  _range([r["auto"]["tokens_as_off_before_a_difference"] for r in default.values()], 0),
                  str(run["summarise"]["new_tokens"]), cost("run's dense decoder", 1),
                  cost("serve's engine step", min(batches)), cost("serve's engine step", max(batches)),
                  str(min(batches)), str(max(batches))]


def _speculative_run_cpu():
    rows = {r["task"]: r for r in _load("speculative/drafters_smollm2_cpu_run_decoder.json")["rows"]}
    assert all(r[f"{m}_identical"] for r in rows.values() for m in ("auto", "packed"))   # "the same tokens"
    check = _load("speculative/verify_cost_smollm2_cpu.json")["products"]
    lookup = ("kjv", "essays", "licenses")
    return [_f(rows["summarise"]["packed_speedup"], 2), _f(rows["extract"]["packed_speedup"], 2),
            _range([rows[t]["packed_speedup"] for t in lookup], 2),
            _range([r["packed_acceptance_rate"] for r in rows.values()], 2),
            _f(rows["summarise"]["auto_speedup"], 2), _f(rows["extract"]["auto_speedup"], 2),
            _range([rows[t]["auto_speedup"] for t in lookup], 2),
            _range([int(r) - 1 for r in check["columns (W @ x^T)"]["verify_steps"] if int(r) <= 9], 0),
            _range([v for r, v in check["columns (W @ x^T)"]["verify_steps"].items() if int(r) <= 9], 2),
            _range([v for r, v in check["rows (x @ W^T)"]["verify_steps"].items() if int(r) <= 9], 2),
            _range([r["off_tok_s"] for r in rows.values()], 1),
            _range([r["q4_speedup"] for r in rows.values()], 1),
            _range([r["q4_tokens_before_first_difference"] for r in rows.values()], 0),
            _range([r["off_prefill_s"] for r in rows.values()], 2),
            _range([r["packed_prefill_s"] for r in rows.values()], 2)]


def _sih_pad():
    rows = _load("prefill/sih_rank_rule_frontier_smollm2_cpu.json")["rows"]
    gated = {(r["text"], r["scorer"]): r for r in rows if r["setting"] == "gated"}
    before = {}                                          # the first peer: the threshold-rule artifact
    for r in rows:
        if r["setting"] == "calibrated" and r["scorer"] == "sih":
            before.setdefault(r["text"], r)
    texts = list(dict.fromkeys(t for t, _ in gated))
    return ([_f(100 * gated[t, "sih"]["ffn_skipped"], 1) for t in texts]
            + [_pct(gated[t, scorer]["rise"]) for scorer in ("sih", "random", "norm", "oracle") for t in texts]
            + [_f(100 * before[t]["ffn_skipped"], 1) for t in texts] + [_pct(before[t]["rise"]) for t in texts]
            + [_f(100 * json.loads((REPO / "zeroedge/data/smollm2-135m.calib/calib.json").read_text())
                     ["quality"]["budget"], 0)])                       # the shipped artifact's budget


def _sih_chunked():
    rows = _load("prefill/chunked_prefill_sih_smollm2_ort_cpu.json")["rows"]
    chunked = next(r for r in rows if r["context"] == 8192 and r["chunk"] == 512)
    one = next(r for r in rows if r["context"] == 8192 and r["chunk"] is None)
    assert chunked["max_abs_logit_diff_vs_one_pass"] == 0                # "bit-identical"
    plans = _load("prefill/plan_sih_smollm2_orin_nano_8gb_8k.json")["plans"]
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    assert plans["chunks of 512 (the bundle's)"]["fits"]
    return [mib(chunked["peak_rss_bytes"]), _f(chunked["tok_s"], 0),
            mib(plans["chunks of 512 (the bundle's)"]["memory"]["activations"]),
            mib(one["peak_rss_bytes"]), _f(one["tok_s"], 0), mib(plans["one pass"]["memory"]["activations"])]


def _sensor_alarm():
    d = _load("sensor/detect_tep_test_runs.json")
    s = d["summary"]["1-21 excl. 3, 9, 15"]
    return [_f(s["model"]["fdr"], 3), _f(d["far"]["model"], 3), _f(d["summary"]["1-21"]["model"]["fdr"], 3),
            _f(s["pca_t2_or_q"]["fdr"], 3), _f(d["far"]["pca_t2_or_q"], 3)]


def _sensor_fit_unseen():
    d = _load("sensor/fit_unseen_runs.json")
    reps = d["replicates"].values()

    def mean(fit, key):
        return _f(sum(r[fit]["summary"][key] if fit != "pca" else r["pca_summary"]["t2"][key] for r in reps)
                  / len(reps), 3)

    keys = ("fdr_excl_3_9_15", "far_fault_runs", "far_d00_te")
    braatz = d["braatz_fit"]["manifest"]
    return ([mean("current", k) for k in keys] + [mean(d["compare"], k) for k in keys] + [mean("pca", k) for k in keys]
            + [_f(braatz["out_of_fold_fdr"], 3), _f(braatz["predicted_far"], 3)])


def _thermal_row(rows, ctx, **setting):
    return next(r for r in rows if r["ctx"] == ctx and all(r.get(k) == v for k, v in setting.items()))


def _thermal_fast():
    rows = _load("thermal_kv/speed_h200_llama1b_32k_128k_random_compiled.json")["rows"]
    t = _thermal_row(rows, 131072, decoder="thermal", budget=0.075, ahead=1, refresh_every=1)
    dense = _thermal_row(rows, 131072, decoder="dense")
    q = {r["text"]: r["ppl_rise_pct"] for r in _load("thermal_kv/quality_smollm2_cpu_small_budgets.json")["rows"]
         if r["ctx"] == 4096 and r["budget"] == 0.075 and r["options"] == {"fetch": 8, "ahead": 1}}
    return [_f(t["tok_s"] / dense["tok_s"], 2), _f(t["tok_s"], 1), _f(dense["tok_s"], 1),
            _f(100 * t["device_kv_frac"], 1), _f(100 * t["with_cold_on_device_frac"], 1),
            *("+" + _f(q[x], 2) for x in ("kjv", "essays", "licenses"))]


def _thermal_default():
    rows = _load("thermal_kv/speed_h200_llama1b_32k_128k_random.json")["rows"]
    figures = []
    for ctx in (131072, 32768):
        t = _thermal_row(rows, ctx, decoder="thermal", budget=0.1, ahead=0, refresh_every=1)
        dense = _thermal_row(rows, ctx, decoder="dense")
        figures += [_f(t["tok_s"] / dense["tok_s"], 2), _f(dense["tok_s"], 1)]
        if ctx == 131072:
            figures.append(_f(100 * t["device_kv_frac"], 1))
    q = {r["text"]: r["ppl_rise"] for r in _load("thermal_kv/quality_smollm2_cpu_4096_default_ahead_fetch4.json")
         if r["setting"] == "default, int8 cold"}
    return figures + [_pct(q[x]) for x in ("kjv", "essays", "licenses")]


def _thermal_orin_nano_cap():
    rows = {r["mode"]: r for r in _load("thermal_kv/memory_h200_orin_nano_cap_llama1b_dense_earlier.json")["rows"]}
    file, dense = rows["thermal int8 file"]["largest_prompt"], rows["dense"]["largest_prompt"]
    return [_f(file, 0), _f(dense, 0), _f(file / dense, 2)]


def _thermal_peers():
    lines = _load("thermal_kv/quality_smollm2_cpu_peers_pages16.jsonl")

    def rise(method, budget, tag=""):
        full = next(r for r in lines if r["text"] == "essays" and r["ctx"] == 4096 and r["method"] == "full")
        r = next(r for r in lines if r["text"] == "essays" and r["ctx"] == 4096 and r["method"] == method
                 and r["budget"] == budget and r["tag"] == tag)
        return r, _pct(r["ppl"] / full["ppl"] - 1)

    r, x = rise("thermal", 0.1, "r32b3")
    figures = [x, _f(100 * r["hot_fraction"], 1)]
    for method in ("streaming", "h2o", "snapkv"):
        r, x = rise(method, 0.1)
        figures += [x, _f(100 * r["hot_fraction"], 1)]
    return figures


def _weights_cpu_llama():
    d = _load("weights/cpu_int4_bundle_vs_llamacpp.json")
    sm, ppl = d["summary"], d["perplexity"]["contexts"]
    figures = []
    for key in ("decode_tok_s_median",):
        for side in ("zeroedge", "llama-bench fa off", "llama-bench fa on"):
            figures += [_f(sm[side][t][key], 1) for t in ("512", "2048")]
    figures += [_f(d["decode_ratio_of_medians"][t]["zeroedge_over_best_llama_bench"], 2) for t in ("512", "2048")]
    for side in ("zeroedge_rise_over_fp32_pct", "llama_fa_off_rise_over_fp32_pct"):
        figures += [_pct(ppl[t][side] / 100) for t in ("512", "2048")]
    return figures


def _weights_h200(weights: str, scheme: str, inputs, digits: int):
    def check():
        rows = _load("weights/h200_decode_int4_vs_bf16.json")["decode"]
        q4 = next(r for r in rows if r["ctx"] == 8192 and r["weights"] == weights)
        bf16 = next(r for r in rows if r["ctx"] == 8192 and r["weights"] == "bf16")
        source = "smollm2_ppl_int8_inputs_cpu.json" if inputs else "smollm2_ppl_by_scheme_cpu.json"
        q = next(r for r in _load(f"weights/{source}")["rows"]
                 if r["scheme"] == scheme and r.get("inputs") == inputs)
        return [_f(q4["tok_s"], 1), _f(q4["tok_s"] / bf16["tok_s"], 2), _f(bf16["tok_s"], 1),
                *(_pct(q["rise"][x], digits) for x in ("kjv", "essays", "licenses"))]
    return check


ROW_CHECKS = {
    "thermal KV, 128K, 7.5 % hot, `--kv-ahead 1`": _thermal_fast,
    "thermal KV, default (10 % hot), 128K / 32K": _thermal_default,
    "thermal KV, largest prompt under an Orin Nano 8 GB cap": _thermal_orin_nano_cap,
    "thermal KV against eviction peers, essays, 4096": _thermal_peers,
    "4-bit bundle decode, 512 / 2048 tokens of context": _weights_cpu_llama,
    "4-bit decode, the Q4_1 grid (groups of 32), 8K": _weights_h200(
        "int4-g32-fzp/int8-inputs", "int4 g32 asym float-zp RTN, embedding int8", "int8", 2),
    "4-bit everything (groups of 128, int4 embedding), 8K": _weights_h200(
        "int4-g128-sym-e4/int8-inputs", "int4 g128 sym RTN, embedding int4", None, 1),
    "`serve`, 1 / 4 / 16 clients": _serve_cpu_clients,
    "`serve`, batch 16 / 64, 8K context": _serve_gpu_batch,
    "speculative decoding (prompt lookup), `serve`'s engine, batch 1": _speculative_serve_cpu,
    "speculative decoding (prompt lookup), `run` and `serve`'s engine, GPU, 8K context": _speculative_gpu,
    "speculative decoding (prompt lookup; the model's own 4-bit step), `run`'s fp32 decoder": _speculative_run_cpu,
    "speculative decoding (prompt lookup; the model's own 4-bit step), `run`'s decoder, GPU, real weights":
        _speculative_gpu_real,
    "speculative decoding with `--batch-invariant`, `run`'s decoder and `serve`'s engine, GPU, real weights":
        _speculative_gpu_invariant,
    "SIH + PAD prefill, 4096-token passages": _sih_pad,
    "SIH + PAD bundle prefill in chunks of 512, 8192 tokens (onnxruntime)": _sih_chunked,
    "sensor alarm, tep-studio test runs": _sensor_alarm,
    "`sensor-fit` on a plant's own runs, then runs it never saw": _sensor_fit_unseen,
}


def results_rows() -> list[list[str]]:
    rows = []
    for line in _section("Results").splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_results_table_matches_raw_files():
    header, *rows = results_rows()
    assert header[:8] == ["what", "hardware", "weights", "result", "peer, same run", "quality cost, same setting",
                          "command", "raw file"], header
    checked = set()
    for row in rows:
        what, hardware, _, result, peer, quality, command, raw = row[:8]
        if result.startswith("not measured"):
            assert "Jetson" in hardware or "Jetson" in what, row
            continue
        assert what in ROW_CHECKS, f"no check for the README row {what!r}"
        for rel in re.findall(r"`([^`]+\.jsonl?)`", raw):
            assert (RESULTS / rel).is_file(), rel
        assert command.strip("`"), what
        expected = ROW_CHECKS[what]()
        shown = " ".join((result, peer, quality))
        found = NUMBER.findall(shown)
        for figure in expected:
            for part in figure.split("–"):
                assert part in found, f"{what}: {part} (from the raw file) is not in {shown!r}"
        allowed = {p for f in expected for p in f.split("–")}
        extra = [n for n in found if n not in allowed]
        assert not extra, f"{what}: {extra} in {shown!r} come from no raw file"
        checked.add(what)
    assert checked == set(ROW_CHECKS), set(ROW_CHECKS) - checked
