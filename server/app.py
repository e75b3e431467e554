"""The HTTP side: OpenAI routes on Starlette, answering from the engine's events.

Handlers parse and tokenize, queue a job and wait for its first event, so that a bad schema or a
full queue is still an HTTP error status rather than an error in the middle of a stream. Then they
either collect the text (a JSON answer) or forward it as server-sent events.
"""

import asyncio
import hmac
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from server.engine import Engine, Job, Outcome
from server.protocol import ApiError, check_prompt, parse_body, parse_chat, parse_completion

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
MAX_BODY_BYTES = 16 * 2**20  # a context of 8k tokens is ~50 KB of text; this leaves room for tools and schemas


class ClientGone(Exception):
    pass


def build_app(engine: Engine, model_id: str, context_length=None, api_key=None,
              default_max_tokens: int = 512) -> Starlette:
    """Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health."""

    def authorize(request: Request):
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "mlx-decoding"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def chat_completions(request: Request):
        return await generate(request, parse_chat, ChatFormat(model_id))

    async def completions(request: Request):
        return await generate(request, parse_completion, CompletionFormat(model_id))

    async def generate(request: Request, parse, fmt):
        authorize(request)
        body = parse_body(await read_body(request))

        # Tokenizing and compiling a schema take a while: neither on the event loop nor on the worker.
        def parse_and_prepare():
            generation = parse(body, engine.tokenizer, model_id, default_max_tokens)
            check_prompt(generation, context_length, engine.vocab_size)
            return generation, engine.constraint_for(generation)

        generation, prepared = await run_in_threadpool(parse_and_prepare)
        fmt.tools, fmt.tool_wrapped = generation.tool_names, generation.tool_wrapped
        job = engine.submit(generation, asyncio.get_running_loop(), prepared)
        try:
            await next_event(request, job)  # "start", or the error that came first
            if generation.stream:
                return EventStream(job, fmt, generation.include_usage)
            event = await next_event(request, job, skip_text=True)
            return JSONResponse(fmt.full(event[1]))
        except BaseException:  # an error event, a client that left, a cancelled task
            job.cancelled.set()
            raise

    return Starlette(
        routes=[Route("/v1/models", models), Route("/health", health),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"])],
        exception_handlers={ApiError: api_error, HTTPException: http_error, ClientGone: client_gone,
                            Exception: server_error})


async def read_body(request: Request) -> bytes:
    """The body, refused once it passes MAX_BODY_BYTES (before it all sits in memory)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left while sending: nothing to answer, nothing to log
        raise ClientGone() from None
    return b"".join(chunks)


async def next_event(request: Request, job: Job, skip_text: bool = False) -> tuple:
    """The job's next event (with ``skip_text``, the next one that is not text); raises its error,
    or ClientGone when the client disconnects meanwhile. The client is checked every
    DISCONNECT_POLL_S, also while events keep coming (text arrives faster than that)."""
    checked = time.monotonic()
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            kind = payload = None
        if time.monotonic() - checked >= DISCONNECT_POLL_S:
            if await request.is_disconnected():
                raise ClientGone() from None
            checked = time.monotonic()
        if kind == "error":
            raise payload
        if kind is not None and not (skip_text and kind == "text"):
            return kind, payload


class EventStream(StreamingResponse):
    """Server-sent events that stop the job however the response ends. Starlette cancels the
    response when the client disconnects (ASGI spec 2.3, as uvicorn reports), even before the
    first byte, when a ``finally`` in the generator would not run."""

    def __init__(self, job: Job, fmt, include_usage: bool):
        super().__init__(events(job, fmt, include_usage), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()  # a no-op once the job is done


async def events(job: Job, fmt, include_usage: bool):
    yield sse(fmt.chunk(role=True))
    while True:
        kind, payload = await job.events.get()
        if kind == "text":
            yield sse(fmt.chunk(text=payload[0], logprobs=payload[1]))
        elif kind == "error":  # the status line is sent already: say it in the stream
            yield sse(payload.body())
            break
        else:
            yield sse(fmt.chunk(outcome=payload))
            if include_usage:
                yield sse(fmt.usage_chunk(payload))
            break
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def usage(outcome: Outcome) -> dict:
    """OpenAI's token counts; ``decoding`` is our extension: the target's forward passes and the drafts."""
    stats = outcome.stats
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "decoding": {"target_forward_passes": stats.target_forward_passes,
                         "draft_proposed": stats.draft_proposed, "draft_accepted": stats.draft_accepted,
                         "prompt_time_s": round(stats.prompt_time, 4)}}


class ChatFormat:
    """chat.completion objects and chat.completion.chunk events; a forced tool call's output becomes
    ``tool_calls`` (sent as one delta at the end when streaming, without its tokens' logprobs).
    ``logprobs`` is ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""

    def __init__(self, model_id: str):
        self.model_id, self.tools, self.tool_wrapped = model_id, None, False
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def _tool_message(self, outcome: Outcome) -> tuple:
        """(message fields, finish_reason) for the generated text."""
        if self.tools is None or outcome.finish_reason != "stop":
            return {"content": outcome.text}, outcome.finish_reason
        if not self.tool_wrapped:  # a named function: the text is its arguments
            name, arguments = self.tools[0], outcome.text
        else:  # "required": {"name": ..., "arguments": {...}}
            try:
                call = json.loads(outcome.text)
            except json.JSONDecodeError:  # cut short by a stop string
                return {"content": outcome.text}, outcome.finish_reason
            name, arguments = call["name"], json.dumps(call["arguments"])
        tool_call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": name, "arguments": arguments}}
        return {"content": None, "tool_calls": [tool_call]}, "tool_calls"

    def full(self, outcome: Outcome) -> dict:
        fields, finish_reason = self._tool_message(outcome)
        message = {"role": "assistant", **fields}
        return self._object("chat.completion", [{"index": 0, "message": message, "finish_reason": finish_reason,
                                                 "logprobs": self._logprobs(outcome.logprobs)}], usage=usage(outcome))

    @staticmethod
    def _logprobs(entries) -> dict:
        if entries is None:
            return None

        def described(token, raw, logprob):
            return {"token": token, "logprob": logprob, "bytes": raw}

        return {"content": [{**described(e.token, e.bytes, e.logprob), "top_logprobs": [described(*t) for t in e.top]}
                            for e in entries], "refusal": None}

    def chunk(self, role: bool = False, text: str = None, outcome: Outcome = None, logprobs=None) -> dict:
        if role:
            delta, finish_reason = {"role": "assistant", "content": ""}, None
        elif outcome is None:
            if self.tools is not None:  # arguments arrive whole at the end
                return self._object("chat.completion.chunk", [])
            delta, finish_reason = {"content": text}, None
        else:
            delta, finish_reason = {}, outcome.finish_reason
            if self.tools is not None:
                fields, finish_reason = self._tool_message(outcome)
                if "tool_calls" in fields:
                    delta = {"tool_calls": [{"index": 0, **fields["tool_calls"][0]}]}
                else:
                    delta = {"content": outcome.text}
        return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                                       "logprobs": self._logprobs(logprobs)}])

    def usage_chunk(self, outcome: Outcome) -> dict:
        return self._object("chat.completion.chunk", [], usage=usage(outcome))


class CompletionFormat:
    """text_completion objects; streamed chunks have the same shape with a piece of the text. Legacy
    ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict of the top ones
    and the chosen token, as OpenAI's), ``text_offset`` (where each token's string starts, counted
    over the completion's tokens from 0, across chunks when streaming)."""

    def __init__(self, model_id: str):
        self.model_id, self.tools, self.tool_wrapped = model_id, None, False
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.text_offset = 0

    def _object(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": choices, **extra}

    def full(self, outcome: Outcome) -> dict:
        return self._object([{"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason,
                              "logprobs": self._logprobs(outcome.logprobs)}], usage=usage(outcome))

    def _logprobs(self, entries) -> dict:
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{token: logprob for token, _, logprob in e.top},
                                  e.token: e.logprob} for e in entries],
                "text_offset": offsets}

    def chunk(self, role: bool = False, text: str = None, outcome: Outcome = None, logprobs=None) -> dict:
        finish_reason = None if outcome is None else outcome.finish_reason
        return self._object([{"index": 0, "text": text or "", "finish_reason": finish_reason,
                              "logprobs": self._logprobs(logprobs)}])

    def usage_chunk(self, outcome: Outcome) -> dict:
        return self._object([], usage=usage(outcome))


async def api_error(request: Request, error: ApiError):
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def http_error(request: Request, error: HTTPException):
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {error.detail}", "type": kind,
                                   "param": None, "code": None}}, status_code=error.status_code)


async def client_gone(request: Request, error: ClientGone):
    return JSONResponse({}, status_code=499)  # nobody reads it; the connection is closed


async def server_error(request: Request, error: Exception):
    return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}: {error}").body(), status_code=500)
