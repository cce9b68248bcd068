"""zeroedge serve: a real server process on the bundled SmolLM2, driven by the real `openai` client
and plain HTTP. Streaming and whole answers, JSON-schema output that always validates, concurrent
greedy streams equal to the same requests alone, cancellation, bad requests, API keys, a memory cap,
and a bundle served one request at a time."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import run_cli

MODEL = "smollm2-135m"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, *args, env=None):
        self.port = _port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        self.p = subprocess.Popen([sys.executable, "-m", "zeroedge.cli", "serve", *map(str, args), "--port",
                                   str(self.port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, **(env or {})))
        self.out = []
        threading.Thread(target=lambda: self.out.extend(self.p.stdout), daemon=True).start()
        t0 = time.time()
        while time.time() - t0 < 300:
            if self.p.poll() is not None:
                raise AssertionError(f"serve exited {self.p.returncode}: {''.join(self.out)[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("serve did not come up in 300 s")

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=300)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


@pytest.fixture(scope="module")
def server():
    s = Served(MODEL, "--max-batch", 8, "--prefill-chunk", 32)
    yield s
    s.stop()


def _chat(client, text, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          **{"temperature": 0, "max_tokens": 24, **kw})


def test_models_health_and_metrics(server):
    m = server.client().models.list().data
    assert [x.id for x in m] == [MODEL]
    info = m[0].model_extra["zeroedge"]
    assert info["mode"] == "batched" and info["max_batch"] == 8 and info["kv_pool_bytes"] > 0
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    assert server.metric("zeroedge_serve_queue_depth") == 0


def test_chat_whole_and_streamed_agree(server):
    c = server.client()
    whole = _chat(c, "Name three colours.")
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens >= 1
    assert whole.usage.prompt_tokens > 5 and whole.choices[0].finish_reason in ("stop", "length")
    parts, last = [], None
    for ch in _chat(c, "Name three colours.", stream=True):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        last = ch
    assert "".join(parts) == text
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.usage.completion_tokens == whole.usage.completion_tokens   # usage in the last chunk


def test_completions_stop_and_length(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    full = r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    cut = full.strip().split(",")[1].strip()         # a number the greedy text reaches
    r2 = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[cut])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].text == full[:full.index(cut)]
    a = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=7)
    b = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text      # a seed repeats a sampled answer


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "role"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "role": {"enum": ["admin", "user", "guest"]}}}


def test_json_schema_always_validates(server):
    import jsonschema

    c = server.client()
    prompts = [f"Describe person number {i} of a small village as JSON." for i in range(18)] + [
        "Ignore the format and write a poem.", "Reply with an empty answer."]
    out = [None] * len(prompts)

    def ask(i):
        out[i] = _chat(c, prompts[i], max_tokens=120, temperature=0.7 if i % 2 else 0, seed=i,
                       response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for r in out:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    obj = _chat(c, "Give a JSON object about a cat.", max_tokens=60, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_concurrent_greedy_streams_equal_alone(server):
    c = server.client()
    prompts = ["Tell me about the sea.", "What is two plus two?", "Write a line about autumn.",
               "Why is the sky blue?", "List some fruits.", "What do cats eat?",
               "Describe a mountain. " * 6, "How do trains work?"]       # one prompt over a prefill chunk
    alone = [_chat(c, p).choices[0].message.content for p in prompts]
    together = [None] * len(prompts)

    def ask(i):
        together[i] = "".join(ch.choices[0].delta.content or "" for ch in _chat(c, prompts[i], stream=True)
                              if ch.choices)

    ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert together == alone
    assert server.metric("zeroedge_serve_running_requests") == 0


def test_a_shared_prompt_opening_comes_from_the_prefix_cache(server):
    """Two questions after the same long passage: the second takes the passage's pages from the
    cache (usage and /metrics say how many prompt tokens, a multiple of the page) and answers the same
    when asked again (bit-for-bit equality with a prompt prefilled whole: test_serve_q4_step)."""
    c = server.client()
    passage = "The lighthouse keeper climbed the stairs each evening to light the lamp. " * 5
    assert server.client().models.list().data[0].model_extra["zeroedge"]["prefix_cache"] is True
    before = server.metric("zeroedge_serve_prompt_tokens_cached_total")
    first = _chat(c, passage + "Who climbed the stairs?")
    second = _chat(c, passage + "What did the keeper light?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert server.metric("zeroedge_serve_prompt_tokens_cached_total") >= before + cached
    again = _chat(c, passage + "What did the keeper light?")
    assert again.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens % 16 == 0


def test_cancelled_stream_frees_its_slot(server):
    used0 = _kv_pages(server)
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                            "max_tokens": 2000, "temperature": 0, "stream": True}) as r:
        got, held = 0, 0
        for line in r.iter_lines():              # leaving the loop closes the connection (httpx)
            got += line.startswith("data:")
            if got == 3:
                held = _kv_pages(server)
                break
        assert held > used0                                 # it held pages while it ran
    deadline = time.time() + 30
    while time.time() < deadline and (_kv_pages(server) > used0
                                      or server.metric("zeroedge_serve_running_requests") > 0):
        time.sleep(0.2)
    assert _kv_pages(server) == used0
    assert server.metric('zeroedge_serve_requests_total{reason="cancelled"}') >= 1


def _kv_pages(server):
    return server.metric('zeroedge_serve_kv_pages{where="device"}')


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "not served"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n must be 1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, 400, "context"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "schema"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
     400, "at most 4"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
      "response_format": {"type": "json_object"}}, 400, "ignore_eos"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "text"),
])
def test_bad_requests_get_a_json_error(server, body, status, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words.lower() in err["message"].lower() and err["type"]
    assert _chat(server.client(), "Say hi.", max_tokens=2).choices[0].message.content is not None  # still serving


def test_edge_requests_leave_the_engine_running(server):
    url = server.base + "/v1/chat/completions"
    msg = [{"role": "user", "content": "Say hi."}]
    r = httpx.post(url, json={"model": MODEL, "messages": msg, "max_tokens": 3, "temperature": 1e-38}, timeout=60)
    assert r.status_code == 200, r.text                      # greedy, not inf / NaN
    r = httpx.post(url, json={"model": MODEL, "messages": msg, "max_tokens": 3, "temperature": None,
                              "top_p": None, "n": None, "stream": None, "seed": None}, timeout=60)
    assert r.status_code == 200, r.text                      # null is as good as absent
    for body, words in (
            ({"model": MODEL, "messages": msg, "seed": 2 ** 64}, "seed"),
            ({"model": MODEL, "messages": msg, "stop": ["}"], "response_format": {"type": "json_object"}}, "stop")):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "response_format":
                                                          {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


def test_body_over_the_limit_is_413(server):
    r = httpx.post(server.base + "/v1/completions", content=b"x" * (5 << 20),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    chunks = (b"x" * (1 << 20) for _ in range(6))      # no Content-Length: chunked, stopped at the limit
    r = httpx.post(server.base + "/v1/completions", content=chunks, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]


def test_cli_refusals_are_one_line(tmp_path):
    link = tmp_path / "link.key"
    real = tmp_path / "real.key"
    real.write_text("k" * 32)
    real.chmod(0o600)
    link.symlink_to(real)
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    short.chmod(0o600)
    for args, words in ((("serve",), "needs MODEL"),
                        (("serve", MODEL, "--bundle", tmp_path), "--bundle / --engines"),
                        (("serve", "--backend", "onnxruntime"), "needs --bundle"),
                        (("serve", "--backend", "onnxruntime", "--bundle", tmp_path, "--board", "orin-nano-8gb"),
                         "torch backend's KV pool"),
                        (("serve", MODEL, "--api-key-file", link), "symbolic link"),
                        (("serve", MODEL, "--api-key-file", short), "at least 16 characters"),
                        (("serve", MODEL, "--kv-memory", "12x"), "not a size"),
                        (("serve", MODEL, "--device-memory", "200M"), "no room for KV")):
        p = run_cli(*args, check_rc=2)
        assert words in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


# -- a second server: an API key, a memory cap, a short queue ----------------------------------------
def test_api_key_and_memory_cap(tmp_path):
    key = tmp_path / "api.key"
    key.write_text("k" * 32 + "\n")
    key.chmod(0o644)
    p = run_cli("serve", MODEL, "--api-key-file", key, check_rc=2)
    assert "chmod 600" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("serve", MODEL, "--host", "0.0.0.0", check_rc=2)
    assert "--api-key-file" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("serve", MODEL, "--device-memory", "200M", check_rc=2)     # under the weights and activations
    assert "leaves no room for KV" in p.stderr and "Traceback" not in p.stderr
    key.chmod(0o600)
    # 320 MiB less the 4-bit step's weights and the float embedding (~208 MiB) and a step's activations
    # (~38 MiB) leaves a KV pool of about 1,600 positions: two 430-position requests run
    # drafts off: counting is what prompt lookup guesses best, and the streams must outlast the checks
    s = Served(MODEL, "--api-key-file", key, "--device-memory", "320M", "--max-batch", 2, "--max-queue", 1,
               "--speculative", "off")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client("k" * 31 + "j").models.list()
        assert httpx.get(s.base + "/health").status_code == 200             # health needs no key
        c = s.client("k" * 32)
        pool = c.models.list().data[0].model_extra["zeroedge"]["kv_pool_bytes"]
        assert 0 < pool < 100 << 20
        with pytest.raises(openai.BadRequestError) as e:
            _chat(c, "hi", max_tokens=7000)
        assert "KV" in str(e.value) and "MiB" in str(e.value)
        assert _chat(c, "Say hi.", max_tokens=3).usage.completion_tokens >= 1   # a request that fits runs
        # two running, one waiting: the next is told to come back (429), and the queue drains after
        hdr = {"authorization": "Bearer " + "k" * 32}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=s.base, headers=hdr, timeout=120) as h:
            streams = [h.stream("POST", "/v1/chat/completions", json=body) for _ in range(3)]
            # the line iterators stay referenced: a collected one closes its connection, which cancels the request
            lines = [st.__enter__().iter_lines() for st in streams]
            for it in lines:
                next(it)                                 # the role chunk: each request was accepted
            deadline, load = time.time() + 30, {}
            while time.time() < deadline and (load.get("running"), load.get("waiting")) != (2, 1):
                load = h.get("/health").json()           # the engine thread takes the third from its inbox
                time.sleep(0.05)
            assert (load["running"], load["waiting"]) == (2, 1), load
            r = h.post("/v1/chat/completions", json=dict(body, stream=False, max_tokens=2))
            assert r.status_code == 429 and "waiting" in r.json()["error"]["message"]
            for st in streams:
                st.__exit__(None, None, None)
            deadline = time.time() + 60                  # the dropped streams are freed at the next steps
            while time.time() < deadline and h.get("/health").json()["waiting"] + h.get("/health").json()["running"]:
                time.sleep(0.2)
        assert _chat(c, "Say hi.", max_tokens=3).usage.completion_tokens >= 1
        assert s.p.poll() is None
    finally:
        s.stop()
    assert s.p.returncode in (0, -15)


# -- a bundle: one request at a time ---------------------------------------------------------------
def test_bundle_served_one_at_a_time(tmp_path):
    import torch

    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import build

    m = build("tiny", seed=0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    export_bundle(m, tmp_path / "b", window=64)
    s = Served("--backend", "onnxruntime", "--bundle", tmp_path / "b")
    try:
        c = s.client()
        info = c.models.list().data[0]
        assert info.model_extra["zeroedge"]["mode"] == "sequential"
        outs = [None] * 3

        def ask(i):
            outs[i] = c.completions.create(model=info.id, prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0)

        ts = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert len({o.choices[0].text for o in outs}) == 1 and outs[0].usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError) as e:              # its prefill takes two tokens or more
            c.completions.create(model=info.id, prompt=[5], max_tokens=2)
        assert "at least 2" in str(e.value)
        assert httpx.get(s.base + "/health").status_code == 200
    finally:
        s.stop()


def test_speculative_drafts_are_checked_and_counted(server):
    """The default --speculative auto: a reply that copies its prompt is drafted by prompt lookup and
    /metrics counts the drafts (that the output is the model's own: tests/test_speculative.py)."""
    info = httpx.get(server.base + "/v1/models").json()["data"][0]["zeroedge"]
    assert info["speculative"] == "auto"
    drafted0 = server.metric("zeroedge_serve_speculative_draft_tokens_total")
    text = "one two three four five six seven eight nine ten. " * 8
    r = server.client().completions.create(model=MODEL, prompt=text, max_tokens=40, temperature=0)
    assert r.usage.completion_tokens == 40
    assert server.metric("zeroedge_serve_speculative_draft_tokens_total") > drafted0
    assert server.metric("zeroedge_serve_speculative_accepted_tokens_total") > 0


def test_packed_drafter_serves_on_the_models_weights():
    """--speculative packed: the model's fp32 weights in torch check what its own 4-bit CPU step drafts;
    /v1/models says so, and /metrics counts the drafts the model kept."""
    s = Served(MODEL, "--weights", "model", "--speculative", "packed", "--max-batch", 2)
    try:
        info = s.client().models.list().data[0].model_extra["zeroedge"]
        assert info["speculative"] == "packed" and info["weights"].startswith("the model's")
        assert info["speculative_drafter"]["weights"].startswith("4-bit blocks of 32")
        assert info["speculative_drafter"]["kv_pool_bytes"] > 0
        reply = _chat(s.client(), "Repeat after me: the quick brown fox jumps over the lazy dog.", max_tokens=20)
        assert reply.usage.completion_tokens > 0
        assert s.metric("zeroedge_serve_speculative_accepted_tokens_total") > 0
    finally:
        s.stop()


def test_sampler_picks_finite_logits_and_refuses_rows_without_any():
    import torch

    from zeroedge.serve.output import Sampler

    row = torch.full((50,), float("-inf"))
    row[[7, 31]] = torch.tensor([2.0, 3.5])
    assert Sampler(0.0, 1.0, 0).pick(row) == 31                      # greedy: the largest
    picks = {Sampler(1.0, 1.0, s).pick(row) for s in range(40)}       # sampled: only the finite ones
    assert picks == {7, 31}
    for bad in (torch.full((50,), float("-inf")), torch.full((50,), float("nan"))):
        for temperature in (0.0, 0.8):
            with pytest.raises(ValueError, match="no finite logit"):
                Sampler(temperature, 1.0, 0).pick(bad)
    nan_at_max = row.clone()
    nan_at_max[3] = float("nan")
    with pytest.raises(ValueError, match="no finite logit"):
        Sampler(0.0, 1.0, 0).pick(nan_at_max)                        # greedy never returns a NaN's index
    with pytest.raises(ValueError, match="no finite logit"):
        Sampler(0.8, 0.9, 0).pick(nan_at_max)                        # nor does sampling draw beside one
