"""HTTP API of the orchestrator: OpenAI-compatible ``/v1``, sessions, swarm state, metrics, dashboard."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from petals_chain.orchestrator.core import Generation, Orchestrator, RequestError, Unavailable
from petals_chain.orchestrator.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_PROMPT_CHARS = 1_000_000


class _Base(pydantic.BaseModel):
    # Unknown fields are ignored (as OpenAI-compatible servers do) so tools that send extras keep working.
    model_config = pydantic.ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class SamplingFields(_Base):
    """Sampling fields shared by every generation endpoint."""

    max_tokens: Optional[int] = pydantic.Field(default=None, ge=1)
    temperature: float = pydantic.Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(default=0, ge=0, le=100_000)
    repetition_penalty: float = pydantic.Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = pydantic.Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = pydantic.Field(default=0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = pydantic.Field(default=None, ge=0, le=2**63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = pydantic.Field(default=None, max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = pydantic.Field(default=1, ge=1)
    user: Optional[str] = None

    @pydantic.field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LEN} characters")
        return v

    def sampling(self, limit_tokens: int, default_max_tokens: int) -> tuple[SamplingParams, bool]:
        if self.presence_penalty or self.frequency_penalty:
            raise RequestError("presence_penalty and frequency_penalty are not supported; use repetition_penalty",
                               param="presence_penalty")
        explicit = self.max_tokens is not None
        max_tokens = self.max_tokens if explicit else default_max_tokens
        if max_tokens > limit_tokens:
            raise RequestError(f"max_tokens must be at most {limit_tokens}", param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos), explicit


class CompletionRequest(SamplingFields):
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ContentPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[ContentPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: Optional[int] = pydantic.Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    tools: Optional[list[Any]] = None


class SessionOpenRequest(_Base):
    max_length: Optional[int] = pydantic.Field(default=None, ge=2)


class SessionGenerateRequest(SamplingFields):
    prompt: Optional[str] = None
    input_ids: Optional[list[int]] = None
    add_special_tokens: Optional[bool] = None


def _error(status: int, message: str, *, type_: str | None = None, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    if type_ is None:
        type_ = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable"}.get(status, "server_error")
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param,
                                                               "code": code}})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(orch: Orchestrator) -> FastAPI:
    """The FastAPI app over ``orch`` (the caller runs ``orch.start()``/``stop()`` in the server's loop)."""
    app = FastAPI(title="petals-chain orchestrator", version="0.1.0")
    app.state.orch = orch
    cfg = orch.cfg

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _error(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable):
        return _error(503, str(exc), code="swarm_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body') or 'body'}: {e.get('msg')}"
                        for e in errs[:5])
        return _error(400, f"invalid request: {msg}", param=".".join(loc) or None, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    def check_model(name: str) -> None:
        if name not in (orch.model_id, orch.prefix, cfg.model):
            raise RequestError(f"the model {name!r} does not exist; this swarm serves {orch.model_id!r}", status=404,
                               param="model", code="model_not_found")

    def sampling(req: SamplingFields, max_tokens: Optional[int] = None) -> tuple[SamplingParams, bool]:
        if max_tokens is not None:
            req.max_tokens = max_tokens
        if req.n > cfg.max_n:
            raise RequestError(f"n must be at most {cfg.max_n}", param="n")
        return req.sampling(cfg.max_tokens_limit, default_max_tokens=16)

    # ---- info ----------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz():
        body = {"ok": True, "ready": orch.ready, "chains": len(orch.dispatch.chains),
                "queue_length": orch.dispatch.queue_length, "uptime_s": time.time() - orch.started_at}
        return JSONResponse(body, status_code=200)

    @app.get("/api/v1/swarm")
    async def swarm():
        from petals_chain.dashboard.app import json_safe

        return JSONResponse(json_safe(orch.swarm_json()))

    @app.get("/metrics")
    async def metrics():
        orch.update_gauges()
        return Response(generate_latest(orch.stats.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": orch.model_id, "object": "model", "created": int(orch.started_at),
                                            "owned_by": "petals-chain", "max_model_len": cfg.max_length}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return {"id": orch.model_id, "object": "model", "created": int(orch.started_at), "owned_by": "petals-chain",
                "max_model_len": cfg.max_length}

    # ---- generation helpers --------------------------------------------------------------------
    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def extras(gens: list[Generation]) -> dict:
        return {"petals_chain": [{"wait_s": g.wait_s, "service_s": g.service_s, "chain": g.chain,
                                  "failovers": g.failovers, "token_ids": g.token_ids} for g in gens]}

    async def run_n(prompt_ids: list[int], params: SamplingParams, explicit: bool, n: int) -> list[Generation]:
        jobs = []
        for i in range(n):
            p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + i,
                                  "stop": list(params.stop)})
            jobs.append(orch.generate(list(prompt_ids), p, explicit_max_tokens=explicit))
        return list(await asyncio.gather(*jobs))

    async def unless_disconnected(request: Request, coro):
        """Await ``coro``; if the client goes away first, cancel it (its chain and server slots are freed)."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise RequestError("the client disconnected", status=499, code="client_disconnected")
        finally:
            if not task.done():
                task.cancel()

    def stream_response(prompt_ids: list[int], params: SamplingParams, explicit: bool, n: int,
                        chunk: Any, include_usage: bool, gen_fn=None) -> StreamingResponse:
        """SSE: ``chunk(index, text, finish_reason)`` builds each event's object."""
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int):
            async def emit(text: str, _tok: int):
                await queue.put(("delta", i, text))

            p = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + i,
                                  "stop": list(params.stop)})
            try:
                if gen_fn is not None:
                    g = await gen_fn(p, emit)
                else:
                    g = await orch.generate(list(prompt_ids), p, explicit_max_tokens=explicit, emit=emit)
                await queue.put(("done", i, g))
            except (RequestError, Unavailable) as e:
                await queue.put(("error", i, e))
            except Exception as e:  # noqa: BLE001 - reported to the client in the stream
                logger.exception("generation failed")
                await queue.put(("error", i, e))

        async def events() -> AsyncIterator[str]:
            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            done = 0
            completion = 0
            prompt_tokens = len(prompt_ids)
            try:
                first = chunk(0, None, None, first=True)
                if first is not None:
                    for i in range(n):
                        yield _sse(chunk(i, None, None, first=True))
                while done < n:
                    kind, i, val = await queue.get()
                    if kind == "delta":
                        yield _sse(chunk(i, val, None))
                    elif kind == "done":
                        done += 1
                        completion += len(val.token_ids)
                        prompt_tokens = val.prompt_tokens
                        yield _sse(chunk(i, "", val.finish_reason))
                    else:
                        done += 1
                        status = getattr(val, "status", 503 if isinstance(val, Unavailable) else 500)
                        yield _sse({"error": {"message": str(val), "type": "server_error" if status >= 500 else
                                              "invalid_request_error", "param": None, "code": getattr(val, "code", None)}})
                if include_usage:
                    u = chunk(0, "", None)
                    u["choices"] = []
                    u["usage"] = usage(prompt_tokens, completion)
                    yield _sse(u)
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def prompt_ids_of(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise RequestError("the prompt is too long", param="prompt", status=413)
            return [orch.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            return [orch.encode(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            return [list(x) for x in prompt]
        raise RequestError("prompt must be a non-empty string, list of strings, token ids or lists of token ids",
                           param="prompt")

    # ---- /v1/completions -----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        if req.logprobs:
            raise RequestError("logprobs are not supported", param="logprobs")
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise RequestError("best_of is not supported", param="best_of")
        prompts = prompt_ids_of(req.prompt)
        if len(prompts) * req.n > cfg.max_n:
            raise RequestError(f"at most {cfg.max_n} completions per request (prompts x n)", param="n")
        params, explicit = sampling(req)
        for ids in prompts:  # validate every prompt before any work starts
            if not ids:
                raise RequestError("the prompt is empty", param="prompt")
            orch.check_ids(ids)
            orch._resolve_max_tokens(SamplingParams(**{**params.__dict__}), len(ids), cfg.max_length, explicit)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            if len(prompts) != 1:
                raise RequestError("streaming supports one prompt per request", param="prompt")
            echo_text = orch.tokenizer.decode(prompts[0], skip_special_tokens=True) if req.echo else None

            def chunk(i, text, finish, first=False):
                if first:
                    if echo_text is None:
                        return None
                    text = echo_text
                return {"id": cid, "object": "text_completion", "created": created, "model": orch.model_id,
                        "choices": [{"text": text or "", "index": i, "logprobs": None, "finish_reason": finish}]}

            include = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(prompts[0], params, explicit, req.n, chunk, include)
        results = await unless_disconnected(
            request, asyncio.gather(*(run_n(ids, params, explicit, req.n) for ids in prompts)))
        choices, gens = [], []
        for p_idx, (ids, group) in enumerate(zip(prompts, results)):
            for g in group:
                text = g.text
                if req.echo:
                    text = orch.tokenizer.decode(ids, skip_special_tokens=True) + text
                choices.append({"text": text, "index": len(choices), "logprobs": None,
                                "finish_reason": g.finish_reason})
                gens.append(g)
        prompt_tokens = sum(len(ids) for ids in prompts)
        completion = sum(len(g.token_ids) for g in gens)
        return {"id": cid, "object": "text_completion", "created": created, "model": orch.model_id,
                "choices": choices, "usage": usage(prompt_tokens, completion), **extras(gens)}

    # ---- /v1/chat/completions ------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        if req.logprobs:
            raise RequestError("logprobs are not supported", param="logprobs")
        if req.tools:
            raise RequestError("tools are not supported", param="tools")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
            raise RequestError("the messages are too long", param="messages", status=413)
        ids = orch.encode_chat(messages)
        params, explicit = sampling(req, req.max_completion_tokens if req.max_completion_tokens is not None else None)
        orch.check_ids(ids)
        orch._resolve_max_tokens(SamplingParams(**{**params.__dict__}), len(ids), cfg.max_length, explicit)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            def chunk(i, text, finish, first=False):
                delta = {"role": "assistant", "content": ""} if first else ({} if finish else {"content": text or ""})
                return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": orch.model_id,
                        "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

            include = bool(req.stream_options and req.stream_options.include_usage)
            return stream_response(ids, params, explicit, req.n, chunk, include)
        gens = await unless_disconnected(request, run_n(ids, params, explicit, req.n))
        choices = [{"index": i, "message": {"role": "assistant", "content": g.text}, "logprobs": None,
                    "finish_reason": g.finish_reason} for i, g in enumerate(gens)]
        return {"id": cid, "object": "chat.completion", "created": created, "model": orch.model_id,
                "choices": choices, "usage": usage(len(ids), sum(len(g.token_ids) for g in gens)), **extras(gens)}

    # ---- multi-turn sessions -------------------------------------------------------------------
    @app.post("/api/v1/sessions")
    async def open_session(req: Optional[SessionOpenRequest] = None):
        s = orch.open_session(req.max_length if req is not None else None)
        return {"session_id": s.id, "max_length": s.max_length, "model": orch.model_id}

    def session_info(s) -> dict:
        return {"session_id": s.id, "max_length": s.max_length, "tokens": len(s.history), "turns": s.turns,
                "chain": s.holder.chain_names, "created": s.created, "failovers": s.holder.failovers}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        return session_info(orch.get_session(session_id))

    @app.delete("/api/v1/sessions/{session_id}")
    async def close_session(session_id: str):
        await orch.close_session(session_id)
        return {"session_id": session_id, "closed": True}

    @app.post("/api/v1/sessions/{session_id}/generate")
    async def session_generate(session_id: str, req: SessionGenerateRequest):
        s = orch.get_session(session_id)
        if req.n != 1:
            raise RequestError("sessions generate one sequence at a time (n=1)", param="n")
        if (req.prompt is None) == (req.input_ids is None):
            raise RequestError("give exactly one of prompt (text) or input_ids", param="prompt")
        if req.prompt is not None:
            if len(req.prompt) > MAX_PROMPT_CHARS:
                raise RequestError("the prompt is too long", param="prompt", status=413)
            special = req.add_special_tokens if req.add_special_tokens is not None else not s.history
            new_ids = orch.encode(req.prompt, add_special_tokens=special)
        else:
            new_ids = list(req.input_ids)
        params, explicit = sampling(req)
        orch.check_ids(new_ids)
        if s.lock.locked():
            raise RequestError("this session is already generating", status=409, code="session_busy")
        orch._resolve_max_tokens(SamplingParams(**{**params.__dict__}), len(s.history) + len(new_ids), s.max_length,
                                 explicit)
        if req.stream:
            def chunk(i, text, finish, first=False):
                if first:
                    return None
                return {"session_id": s.id, "text": text or "", "finish_reason": finish}

            async def gen_fn(p, emit):
                return await orch.session_generate(s, new_ids, p, explicit_max_tokens=explicit, emit=emit)

            return stream_response(new_ids, params, explicit, 1, chunk, False, gen_fn=gen_fn)
        g = await orch.session_generate(s, new_ids, params, explicit_max_tokens=explicit)
        return {"session_id": s.id, "text": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                "usage": usage(g.prompt_tokens, len(g.token_ids)), "wait_s": g.wait_s, "service_s": g.service_s,
                "chain": g.chain, "failovers": g.failovers, "tokens": len(s.history)}

    # ---- dashboard -----------------------------------------------------------------------------
    try:
        from petals_chain.dashboard import mount_dashboard

        mount_dashboard(app, "/")
    except Exception as e:  # noqa: BLE001 - the API works without the page
        logger.warning("dashboard page unavailable (%s); serving a link page at /", e)

        @app.get("/", response_class=PlainTextResponse)
        async def index():
            return (f"petals-chain orchestrator for {orch.model_id}\n"
                    "GET /api/v1/swarm  GET /v1/models  POST /v1/completions  POST /v1/chat/completions  GET /metrics\n")

    # Bounded queue, per-client limits and body size (429/413 with Retry-After): limits.py.
    from petals_chain.orchestrator.limits import install_limits

    install_limits(app, orch)
    return app
