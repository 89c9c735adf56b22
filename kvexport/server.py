"""`kvexport serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the scheduler.

Routes: POST /v1/completions, POST /v1/chat/completions (plain, or server-sent events with
`stream: true`), GET /v1/models, GET /health, GET /metrics (Prometheus text format).
Faults: a full queue answers 429 with Retry-After; a bad request 400 naming the field (`param`);
a request longer than the model's context (max_seq) is refused before it is queued; a client that disconnects frees
its row at the scheduler's next step; SIGTERM stops admission, lets running requests finish, then
exits. See docs/serving.md.
"""

import asyncio
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.scheduler import Event, QueueFullError, Scheduler, SchedulerClosedError

MAX_STOP = 4  # OpenAI's limit on stop sequences
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


# --- request validation (by hand: every 400 names its field) ------------------------------------
def _num(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(name, f"must be a number, got {json.dumps(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {json.dumps(v)}")
    if v < lo:
        raise _bad(name, f"must be >= {lo}, got {v}")
    return v


@dataclass
class Params:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    extra: dict[str, Any] = field(default_factory=dict)


def parse_params(body: Mapping[str, Any], *, chat: bool) -> Params:
    for name, allowed in (("n", (None, 1)), ("best_of", (None, 1)), ("echo", (None, False)),
                          ("logprobs", (None, False, 0)), ("top_logprobs", (None, 0)), ("suffix", (None, "")),
                          ("tools", (None, [])), ("logit_bias", (None, {})),
                          ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0))):
        v = body.get(name)
        if not any(v == a and type(v) is type(a) for a in allowed if a is not None) and v is not None:
            raise _bad(name, f"{json.dumps(v)} is not supported by this server (only the default)")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, None if chat else 16, 1)
    seed = _int(body, "seed", None, -(2**63))
    if seed is not None and seed < 0:
        seed = seed & (2**64 - 1)  # numpy seeds are non-negative; keep every int64 distinct
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = list(stop)
    else:
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    if any(s == "" for s in stops):
        raise _bad("stop", "stop strings must not be empty")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise _bad("stream_options", "must be an object")
    include_usage = bool((opts or {}).get("include_usage", False))
    return_ids = body.get("return_token_ids", False)  # extension (as vLLM's): the choice lists its token ids
    if not isinstance(return_ids, bool):
        raise _bad("return_token_ids", "must be a boolean")
    ignore_eos = body.get("ignore_eos", False)  # extension (as vLLM's): run to max_tokens (benchmarks)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "must be a boolean")
    if opts is not None and not stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    return Params(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=_int(body, "top_k", 0, 0) or 0,
                  seed=seed, stop=stops, stream=stream, include_usage=include_usage,
                  extra={"return_token_ids": return_ids, "ignore_eos": ignore_eos})


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None and m.get("role") == "assistant":
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({**{k: v for k, v in m.items() if isinstance(k, str)}, "content": content})
    return out


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "must not be empty")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        raise _bad("prompt", "one prompt per request (send several requests; they are batched together)")
    raise _bad("prompt", "must be a non-empty string or a list of token ids")


# --- metrics ------------------------------------------------------------------------------------
class HttpCounters:
    def __init__(self) -> None:
        self.responses: dict[int, int] = {}

    def count(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1


def prometheus(sched: Scheduler, http: HttpCounters, model: str) -> str:
    import psutil

    st = sched.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, v in samples:
            lines.append(f"{name}{labels} {v:.6g}" if isinstance(v, float) else f"{name}{labels} {v}")

    lab = f'{{model="{model}"}}'
    metric("kvexport_queue_depth", "gauge", "Requests waiting for a cache row.", [(lab, sched.queue_depth)])
    metric("kvexport_running_rows", "gauge", "Cache rows serving a request now.", [(lab, sched.running)])
    metric("kvexport_max_batch", "gauge", "Cache rows (requests decoded together).", [(lab, sched.max_batch)])
    metric("kvexport_draining", "gauge", "1 once shutdown began: no new request is admitted.",
           [(lab, int(sched.closing))])
    metric("kvexport_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [(lab, st.prompt_tokens)])
    metric("kvexport_generation_tokens_total", "counter", "Tokens generated.", [(lab, st.generated_tokens)])
    metric("kvexport_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
           [(lab, round(st.tokens_per_second(), 3))])
    metric("kvexport_decode_steps_total", "counter", "Decode steps (one engine call for every running row).",
           [(lab, st.steps)])
    metric("kvexport_prefill_chunks_total", "counter", "Prefill chunks run.", [(lab, st.prefill_chunks)])
    metric("kvexport_requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{model="{model}",finish_reason="{k}"}}', v) for k, v in sorted(st.finished.items())])
    metric("kvexport_requests_rejected_total", "counter", "Requests refused before admission, by reason.",
           [(f'{{model="{model}",reason="{k}"}}', v) for k, v in sorted(st.rejected.items())])
    metric("kvexport_http_responses_total", "counter", "HTTP responses, by status code.",
           [(f'{{code="{k}"}}', v) for k, v in sorted(http.responses.items())])
    for name, h, help_ in (("kvexport_time_to_first_token_seconds", st.ttft, "Time from arrival to first token."),
                           ("kvexport_inter_token_latency_seconds", st.itl, "Time between two tokens of a request.")):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} histogram")
        for le, c in h.cumulative():
            lines.append(f'{name}_bucket{{model="{model}",le="{le}"}} {c}')
        lines.append(f"{name}_sum{lab} {h.sum:.6g}")
        lines.append(f"{name}_count{lab} {h.count}")
    metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.",
           [("", psutil.Process().memory_info().rss)])
    return "\n".join(lines) + "\n"


class _CountStatus:
    """Pure ASGI middleware (streams pass through untouched): counts responses by status code."""

    def __init__(self, app: Any, counters: HttpCounters):
        self.app, self.counters = app, counters

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counters.count(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counters.count(500)
            raise


# --- the app ------------------------------------------------------------------------------------
def create_app(scheduler: Scheduler, *, model_name: str, chat_template: Any = None) -> Any:
    """The FastAPI app over a started scheduler (its lifespan closes the scheduler on shutdown)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    from kvexport.chat import encode_chat

    engine = scheduler.engine
    http = HttpCounters()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.close(wait=False)  # running requests have finished: uvicorn waited for them
        await asyncio.to_thread(scheduler.close, wait=True, timeout=30)

    app = FastAPI(title="kvexport", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.http = http

    app.add_middleware(_CountStatus, counters=http)

    @app.exception_handler(ApiError)
    async def api_error(_req: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal(_req: Request, e: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body(),
                            status_code=500)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except Exception as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", param=None) from e
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")
        return body

    def submit(ids: list[int], p: Params, param: str, sink: Any) -> Any:
        room = engine.limit - len(ids)  # max_seq, or past it where every layer slides on a ring
        max_tokens = p.max_tokens if p.max_tokens is not None else room
        if room < 1 or max_tokens > room:
            field = param if room < 1 or p.max_tokens is None else "max_tokens"
            raise ApiError(400, f"{field}: this model's maximum context length is {engine.limit} tokens; the "
                           f"request has {len(ids)} prompt tokens and asks for {max_tokens} more", param=field,
                           code="context_length_exceeded")
        try:
            return scheduler.submit(ids, max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                    seed=p.seed, stop=p.stop, sink=sink, ignore_eos=p.extra.get("ignore_eos", False))
        except QueueFullError as e:
            raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except SchedulerClosedError as e:
            raise ApiError(503, str(e), kind="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ContextOverflowError as e:
            raise ApiError(400, str(e), param=param, code="context_length_exceeded") from e
        except InputError as e:
            raise ApiError(400, str(e)) from e

    async def run(request: Request, ids: list[int], p: Params, param: str, chat: bool) -> Any:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:  # on the scheduler's thread
            loop.call_soon_threadsafe(events.put_nowait, ev)

        req = submit(ids, p, param, sink)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())

        def usage() -> dict[str, int]:
            n = len(req.token_ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if not p.stream:
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(events.get(), 0.25)
                    except TimeoutError:
                        if await request.is_disconnected():
                            req.cancel()
                            raise ApiError(499, "client closed the request") from None
                        continue
                    if ev.finish_reason is not None:
                        break
            finally:
                if not req.done:
                    req.cancel()
            if ev.finish_reason == "error":
                raise ApiError(500, f"the engine failed on this request: {ev.error}", kind="server_error")
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": req.text, "refusal": None}
            else:
                choice["text"] = req.text
            if p.extra.get("return_token_ids"):
                choice["prompt_token_ids"], choice["token_ids"] = list(ids), list(req.token_ids)
            return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_name,
                                 "system_fingerprint": None, "choices": [choice], "usage": usage()})

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {} if delta is None else {"content": delta}
                if first:
                    d = {"role": "assistant", "content": "", "refusal": None}
                c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                       "created": now, "model": model_name, "system_fingerprint": None,
                                       "choices": [c]}
            if p.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

        async def sse() -> AsyncIterator[str]:
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    ev = await events.get()
                    if ev.finish_reason == "error":
                        err = ApiError(500, f"the engine failed on this request: {ev.error}", kind="server_error")
                        yield f"data: {json.dumps(err.body())}\n\n"
                        return
                    if ev.finish_reason is not None:
                        if ev.text:
                            yield chunk(ev.text, None)
                        yield chunk(None if chat else "", ev.finish_reason)
                        break
                    if ev.text:
                        yield chunk(ev.text, None)
                if p.include_usage:
                    payload = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": now, "model": model_name, "system_fingerprint": None, "choices": [],
                               "usage": usage()}
                    yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not req.done:
                    req.cancel()  # the client left (or the server is going down): free the row

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        prompt = _prompt(body)
        p = parse_params(body, chat=False)
        try:
            ids = engine._as_ids(prompt)
        except InputError as e:
            raise _bad("prompt", str(e)) from e
        return await run(request, ids, p, "prompt", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await body_of(request)
        msgs = _messages(body)
        p = parse_params(body, chat=True)
        if chat_template is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json's chat_template or "
                           "chat_template.jinja); use /v1/completions", param="messages")
        try:
            ids = encode_chat(engine, chat_template, msgs)
        except InputError as e:
            raise _bad("messages", str(e)) from e
        if not ids:
            raise _bad("messages", "the chat template rendered an empty prompt")
        return await run(request, ids, p, "messages", chat=True)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kvexport", "max_model_len": engine.limit}]}

    @app.get("/health")
    async def health() -> Any:
        if scheduler.closing:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": scheduler.running, "queued": scheduler.queue_depth}

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(prometheus(scheduler, http, model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(artifact: str, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, max_queue: int = 64,
          prefill_chunk: int = 64, prefill_budget: int | None = None, threads: int | None = None,
          model_name: str | None = None,
          load_options: dict[str, Any] | None = None, log_level: str = "info") -> int:
    """Load the artifact and serve it until SIGINT/SIGTERM (then: no new request, running ones finish)."""
    try:
        import uvicorn
    except ImportError as e:
        raise InputError("kvexport serve needs FastAPI and uvicorn: pip install 'kvexport[serve]'") from e
    from pathlib import Path

    import kvexport
    from kvexport.chat import engine_template

    engine = kvexport.load(artifact, **({"threads": threads} if threads else {}), **(load_options or {}))
    name = model_name or Path(artifact).name.removesuffix(".kvx")
    sched = Scheduler(engine, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                      prefill_budget=prefill_budget)
    app = create_app(sched, model_name=name, chat_template=engine_template(engine))
    how = "in one engine call per decode step" if sched.rows.batched else "one after another (no batching gain)"
    print(f"kvexport serve: {name}, {sched.max_batch} rows decoded {how}", flush=True)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            sched.close(wait=False)  # stop admitting at once; uvicorn lets the running responses finish
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None,
                            access_log=False)
    server = _Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; after a graceful SIGTERM
    # the process should exit 0, not die of the re-raised signal
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
