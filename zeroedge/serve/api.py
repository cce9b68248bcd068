"""The OpenAI-compatible HTTP API (FastAPI on uvicorn; server-sent events by sse-starlette).

  POST /v1/chat/completions   messages rendered with the model's own chat template
  POST /v1/completions        a prompt string (or one list of token ids)
  GET  /v1/models             the model and how it is served (batched or one request at a time)
  GET  /health                200 while the engine runs, 503 once it stopped
  GET  /metrics               Prometheus

Every error is an OpenAI-style body {"error": {"message", "type", "code", "param"}} with a 4xx / 5xx
status; the server goes on serving the others. With an API key every route but /health needs
`Authorization: Bearer KEY` (compared in constant time).
"""

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from zeroedge.serve.plan import Refused, Sampling


# -- request bodies ---------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")   # clients send fields the server does not use (user, metadata, ...)

    # null is as good as absent (the OpenAI spec marks these nullable); the defaults are applied in
    # Server.sampling and _unsupported
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=-2**63, lt=2**64)
    stop: Union[str, List[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[Dict[str, Any]] = None   # usage always comes in the last chunk
    logprobs: Optional[Union[bool, int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None
    ignore_eos: Optional[bool] = None   # an extension (llama.cpp, vLLM): generate max_tokens whatever comes


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[Dict[str, Any]], None] = None


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Optional[str] = None
    schema_: Dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class _ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[_JsonSchema] = None


class ChatBody(_Body):
    messages: List[_Message] = Field(min_length=1)
    response_format: Optional[_ResponseFormat] = None
    tools: Optional[List[Any]] = None
    functions: Optional[List[Any]] = None


class CompletionBody(_Body):
    prompt: Union[str, List[str], List[int]]
    echo: bool = False
    suffix: Optional[str] = None


# -- errors -----------------------------------------------------------------------------------------
def error_body(message: str, status: int, code: Optional[str] = None, param: Optional[str] = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def _unsupported(body: _Body, chat: bool) -> Optional[str]:
    """A field whose meaning the server does not implement, set to something other than its default:
    refused, never silently ignored."""
    if body.n not in (None, 1):
        return "n must be 1"
    if body.logprobs:
        return "logprobs are not supported"
    if body.presence_penalty or body.frequency_penalty:
        return "presence_penalty and frequency_penalty are not supported (give 0)"
    if body.logit_bias:
        return "logit_bias is not supported"
    if chat and (body.tools or body.functions):
        return "tools / functions are not supported"
    if not chat and (body.echo or body.suffix):
        return "echo and suffix are not supported"
    if not chat and getattr(body, "response_format", None) is not None:
        return "response_format is for /v1/chat/completions"
    rf = getattr(body, "response_format", None)
    if chat and body.stop and rf is not None and rf.type != "text":
        return "stop cannot go with a JSON response_format (a stop string could cut the JSON)"
    return None


class Server:
    """What the routes need: the engine, its planner, the tokenizer and the server's limits."""

    def __init__(self, engine, planner, tokenizer, lltok, metrics, model_name: str, info: dict,
                 api_key: Optional[str] = None, max_queue: int = 64, max_prompt_tokens: Optional[int] = None,
                 default_max_tokens: int = 256, max_body_bytes: int = 4 << 20):
        self.engine, self.planner, self.tok, self.lltok = engine, planner, tokenizer, lltok
        self.metrics, self.model_name, self.info = metrics, model_name, info
        self.api_key, self.max_queue = api_key, max_queue
        self.max_prompt_tokens = max_prompt_tokens or planner.ctx
        self.default_max_tokens, self.max_body_bytes = default_max_tokens, max_body_bytes
        self.created = int(time.time())

    # -- a request into a plan ------------------------------------------------------------------
    def sampling(self, body: _Body, n_prompt: int) -> Sampling:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise Refused("stop takes at most 4 strings", param="stop")
        mt = body.max_completion_tokens or body.max_tokens
        if mt is None:                        # until the context ends, at most the server's default
            mt = max(1, min(self.default_max_tokens, self.planner.ctx - n_prompt))
        return Sampling(int(mt), 1.0 if body.temperature is None else float(body.temperature),
                        1.0 if body.top_p is None else float(body.top_p), body.seed, tuple(stop))

    def prompt_ids(self, body) -> List[int]:
        if isinstance(body, ChatBody):
            msgs = []
            for m in body.messages:
                c = m.content
                if isinstance(c, list):       # content parts: text only
                    if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in c):
                        raise Refused("message content parts must be {\"type\": \"text\", \"text\": ...}",
                                      param="messages")
                    c = "".join(p["text"] for p in c)
                msgs.append({"role": "system" if m.role == "developer" else m.role, "content": c or ""})
            if getattr(self.tok, "chat_template", None) is None:
                raise Refused(f"{self.model_name} has no chat template: use /v1/completions")
            try:
                text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            except Exception as e:                # noqa: BLE001 - the template's own complaint
                raise Refused(f"the chat template refused the messages: {e}", param="messages") from None
            ids = self.tok.encode(text, add_special_tokens=False)
        elif isinstance(body.prompt, str) or (isinstance(body.prompt, list) and body.prompt
                                               and all(isinstance(p, str) for p in body.prompt)):
            ps = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if len(ps) != 1:
                raise Refused("prompt must be one string (batches of prompts are not supported)", param="prompt")
            ids = self.tok.encode(ps[0], add_special_tokens=False)
        else:
            ids = list(body.prompt)
            vocab = self.info["vocab_size"]
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise Refused(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise Refused(f"the prompt has {len(ids)} tokens; the server takes at most {self.max_prompt_tokens}",
                          code="context_length_exceeded", param="messages" if isinstance(body, ChatBody) else "prompt")
        return ids

    def grammar(self, body) -> Optional[str]:
        rf = getattr(body, "response_format", None)
        if rf is None or rf.type == "text":
            return None
        if self.lltok is None:
            raise Refused("response_format needs the model's tokenizer files and llguidance "
                          "(pip install 'zeroedge[serve]')", param="response_format")
        import llguidance

        if rf.type == "json_object":
            schema = {"type": "object"}
        elif rf.json_schema is None:
            raise Refused("response_format json_schema needs a json_schema object", param="response_format")
        else:
            schema = rf.json_schema.schema_
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                          defaults={"whitespace_flexible": False})
        ok, err = _validate(llguidance, g)
        if not ok:
            raise Refused(f"response_format: the JSON schema is not usable: {err}", param="response_format")
        return g


def _validate(llguidance, grammar: str):
    """(usable, llguidance's complaints)."""
    try:
        is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as e:                         # noqa: BLE001 - llguidance's own message
        return False, str(e)
    return not is_error, "; ".join(str(m) for m in msgs)


def create_app(server: Server):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="zeroedge serve", docs_url=None, redoc_url=None, openapi_url=None)
    S = server

    def fail(message, status, code=None, param=None):
        if S.metrics is not None:
            S.metrics.rejected.labels(str(status)).inc()
        return JSONResponse(error_body(message, status, code, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "the body is not valid JSON"
        return fail(f"{where}: {msg}" if where else msg, 400, "invalid_request", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return fail(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(request, exc):              # a bug: this request fails, the server goes on
        import logging

        logging.getLogger("zeroedge.serve").exception("internal error on %s", request.url.path)
        return fail("internal error (the server's log has the details)", 500, "internal_error")

    class Guard:
        """Pure ASGI (BaseHTTPMiddleware would hide a client's disconnect from the streams): the API
        key on every route but /health, and the body limit from Content-Length."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            status = None
            if S.api_key is not None and scope["path"] != "/health":
                want = ("Bearer " + S.api_key).encode()
                if not hmac.compare_digest(headers.get("authorization", "").encode("latin-1"), want):
                    status, msg, code = 401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key"
            size = headers.get("content-length")
            if status is None and size is not None and (not size.isdigit() or int(size) > S.max_body_bytes):
                status, msg, code = 413, f"the body is over {S.max_body_bytes} bytes", "request_too_large"
            if status is None:
                return await self.inner(scope, receive, send)
            await fail(msg, status, code)(scope, receive, send)

    app.add_middleware(Guard)

    @app.get("/health")
    async def health():
        ok = S.engine.alive()
        body = {"status": "ok" if ok else "error", **S.engine.load(), "mode": S.info["mode"]}
        if not ok:
            body["error"] = S.engine.error or "the engine is not running"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(S.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": S.model_name, "object": "model", "created": S.created,
                                            "owned_by": "zeroedge", "zeroedge": S.info}]}

    async def _body(request: Request, cls):
        raw = bytearray()
        async for part in request.stream():     # a body without Content-Length stops at the limit too
            raw += part
            if len(raw) > S.max_body_bytes:
                raise Refused(f"the body is over {S.max_body_bytes} bytes", 413, "request_too_large")
        raw = bytes(raw)
        try:
            return cls.model_validate_json(raw)
        except Exception as e:                   # pydantic.ValidationError: the first complaint
            errs = getattr(e, "errors", lambda: [])()
            first = errs[0] if errs else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            msg = "the body is not valid JSON" if first.get("type") == "json_invalid" else first.get("msg", str(e))
            raise Refused(f"{where}: {msg}" if where else msg) from None

    async def _run(request: Request, cls, chat: bool):
        try:
            body = await _body(request, cls)
            if body.model != S.model_name:
                raise Refused(f"model {body.model!r} is not served here (this server serves {S.model_name!r})",
                              404, "model_not_found")
            why = _unsupported(body, chat)
            if why:
                raise Refused(why)
            # tokenising, the chat template and a schema's compilation run beside the event loop,
            # which keeps serving the streams meanwhile
            ids = await asyncio.to_thread(S.prompt_ids, body)
            grammar = await asyncio.to_thread(S.grammar, body) if chat else None
            plan = S.planner.plan(ids, S.sampling(body, len(ids)), grammar, ignore_eos=bool(body.ignore_eos))
            if not S.engine.alive():
                raise Refused(f"the engine stopped: {S.engine.error}", 503, "engine_stopped")
            if S.engine.queued() >= S.max_queue:
                raise Refused(f"{S.max_queue} requests are already waiting; retry later", 429, "queue_full")
        except Refused as e:
            return fail(str(e), e.status, e.code, e.param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:                 # the event loop has closed (shutdown)
                pass

        seq = S.engine.submit(plan, sink)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            # on SIGTERM running streams get up to 25 s to finish (uvicorn waits 30)
            return EventSourceResponse(_stream(seq, events, rid, created, chat), ping=15, shutdown_grace_period=25)
        return await _whole(request, seq, events, rid, created, chat)

    async def _next(events, request=None):
        """The next engine event; None when the client went away (checked every second, events or
        not) or the engine died without a word."""
        last = time.monotonic()
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                ev = None
            if request is not None and time.monotonic() - last >= 1.0:
                last = time.monotonic()
                if await request.is_disconnected():
                    return None
            if ev is not None:
                return ev
            if not S.engine.alive() and events.empty():
                return ("error", f"the engine stopped: {S.engine.error or 'the server is shutting down'}")

    async def _whole(request, seq, events, rid, created, chat):
        parts = []
        while True:
            ev = await _next(events, request)
            if ev is None:
                S.engine.cancel(seq)
                return Response(status_code=499)
            if ev[0] == "text":
                parts.append(ev[1])
            elif ev[0] == "error":
                return fail(ev[1], 503 if "engine stopped" in ev[1] else 400 if ev[1].startswith("response_format")
                            else 500)
            else:
                _, reason, usage = ev
                text = "".join(parts)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                           "logprobs": None} if chat else
                          {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
                return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                        "model": S.model_name, "choices": [choice], "usage": usage}

    async def _stream(seq, events, rid, created, chat):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, reason=None, usage=None):
            c = ({"index": 0, "delta": delta or {}, "finish_reason": reason, "logprobs": None} if chat else
                 {"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": reason, "logprobs": None})
            d = {"id": rid, "object": obj, "created": created, "model": S.model_name, "choices": [c]}
            if usage is not None:
                d["usage"] = usage
            return {"data": json.dumps(d)}

        done = False
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while True:
                ev = await _next(events)
                if ev[0] == "text":
                    yield chunk({"content": ev[1]})
                elif ev[0] == "error":
                    done = True
                    yield {"data": json.dumps(error_body(ev[1], 503))}
                    break
                else:
                    done = True
                    yield chunk(None, ev[1], ev[2])
                    break
            yield {"data": "[DONE]"}
        finally:
            if not done:                         # the client went away: free its slot at the next step
                S.engine.cancel(seq)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _run(request, ChatBody, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _run(request, CompletionBody, False)

    return app
