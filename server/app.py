"""The HTTP side of the three APIs (chat completions, Responses, Messages): routes on Starlette,
answering from the engine's events.

Handlers parse and tokenize, queue a job and wait for its first event, so that a bad schema or a
full queue is still an HTTP error status rather than an error in the middle of a stream. Then they
either collect the text (a JSON answer) or forward it as server-sent events, each in its API's
terms (formats.py, anthropic_output.py, responses_output.py). Every API's requests share the one
engine, so chat completions, Messages and Responses sent at once decode in one batch.
"""

import asyncio
import functools
import hmac
import time
from dataclasses import dataclass
from typing import Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from batch.row import trace_of
from server.anthropic_input import parse_messages
from server.anthropic_output import ANTHROPIC_STATUS, MessagesFormat, anthropic_error
from server.choices import choice_events, choice_formats, choice_requests, full_answer
from server.engine import Engine
from server.failures import FailureLog
from server.formats import ChatFormat, CompletionFormat
from server.job import Job
from server.protocol import check_prompt, parse_chat, parse_completion
from server.reasoning import EFFORT_BUDGETS
from server.request import ApiError, check_server_settings, invalid, parse_body
from server.responses_input import ResponseStore, parse_responses
from server.responses_output import ResponsesFormat

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
# a context of 8k tokens is ~50 KB of text; this leaves room for tools and schemas
MAX_BODY_BYTES = 16 * 2**20


class ClientGone(Exception):
    pass


def build_app(
    engine: Engine,
    model_id: str,
    context_length=None,
    api_key=None,
    default_max_tokens: int = 512,
    stored_responses: int = 256,
    effort_budgets: dict = EFFORT_BUDGETS,
) -> Starlette:
    """Routes: GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/messages (Anthropic),
    /v1/messages/count_tokens, /v1/responses (OpenAI), GET /health, GET /v1/cache (the prompt
    cache's tiers). ``stored_responses``: how many
    Responses answers are kept for ``previous_response_id`` (the oldest go first);
    ``effort_budgets``: the think-block budget of each effort level (server/reasoning.py)."""
    service = Service(
        engine,
        model_id,
        context_length,
        api_key,
        default_max_tokens,
        {"effort_budgets": effort_budgets},
    )

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def cache(request: Request):
        service.authorize(request)
        return JSONResponse(engine.cache_stats())

    routes = [
        *openai_routes(service),
        Route("/health", health),
        Route("/v1/cache", cache),
        *anthropic_routes(service),
        *responses_routes(service, ResponseStore(stored_responses)),
    ]
    failures = engine.failures
    return Starlette(
        routes=routes,
        exception_handlers={
            ApiError: functools.partial(api_error, failures),
            HTTPException: functools.partial(http_error, failures),
            ClientGone: client_gone,
            Exception: functools.partial(server_error, failures),
        },
    )


@dataclass
class Service:
    """What every route shares: the engine, the model's name and limits, the API key and the
    think-block budgets (``efforts``, passed to the parsers that read an effort level)."""

    engine: Engine
    model_id: str
    context_length: Optional[int]
    api_key: Optional[str]
    default_max_tokens: int
    efforts: dict

    def authorize(self, request: Request):
        if self.api_key is None:
            return
        # OpenAI's SDK sends a bearer token; Anthropic's x-api-key (or a bearer token, as an auth
        # token).
        given = request.headers.get("x-api-key") or request.headers.get(
            "authorization", ""
        ).removeprefix("Bearer ")
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                code="invalid_api_key",
            )

    async def generate(self, request: Request, parse, make_format):
        """One generating request of any API: ``parse`` reads its body, ``make_format`` answers in
        its terms."""
        self.authorize(request)
        body = parse_body(await read_body(request))
        engine = self.engine

        # Tokenizing and compiling a schema take a while: neither on the event loop nor on the
        # worker.
        def parse_and_prepare():
            generation = parse(body, engine.tokenizer, self.model_id, self.default_max_tokens)
            check_prompt(generation, self.context_length, engine.vocab_size)
            check_server_settings(body, engine.quantized["kv_bits"])
            if generation.num_choices > engine.max_batch:
                raise invalid(
                    f"'n' must be at most {engine.max_batch} (this server's --max-batch)", param="n"
                )
            # a constraint per choice: each row walks its own
            return generation, [
                engine.constraint_for(generation) for _ in range(generation.num_choices)
            ]

        generation, prepared = await run_in_threadpool(parse_and_prepare)
        requests = choice_requests(generation)
        formats = choice_formats(make_format, self.model_id, requests)
        labels = [f"{fmt.id} to {request.url.path}" for fmt in formats]
        jobs = engine.submit_together(requests, asyncio.get_running_loop(), prepared, labels)
        try:
            # "start" and the prompt tokens found cached, or an error
            cached = [(await next_event(request, job))[1] for job in jobs][0] or 0
            if generation.stream:
                if len(jobs) == 1:
                    return EventStream(jobs, events(jobs[0], formats[0], cached), engine.failures)
                chunks = choice_events(jobs, formats, cached, generation.include_usage)
                return EventStream(jobs, chunks, engine.failures)
            outcomes = [(await next_event(request, job, skip_text=True))[1] for job in jobs]
            return JSONResponse(full_answer(formats, outcomes))
        except BaseException:  # an error event, a client that left, a cancelled task
            for job in jobs:
                job.cancelled.set()
            raise


def openai_routes(service: Service) -> list:
    """GET /v1/models, POST /v1/chat/completions and /v1/completions."""

    async def models(request: Request):
        service.authorize(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": service.model_id,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "mlx-decoding",
                    }
                ],
            }
        )

    async def chat_completions(request: Request):
        return await service.generate(
            request, functools.partial(parse_chat, **service.efforts), ChatFormat
        )

    async def completions(request: Request):
        return await service.generate(request, parse_completion, CompletionFormat)

    return [
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def anthropic_routes(service: Service) -> list:
    """POST /v1/messages and /v1/messages/count_tokens."""

    async def messages(request: Request):
        return await service.generate(
            request, functools.partial(parse_messages, **service.efforts), MessagesFormat
        )

    async def count_tokens(request: Request):
        service.authorize(request)
        body = parse_body(await read_body(request))
        generation = await run_in_threadpool(
            parse_messages,
            body,
            service.engine.tokenizer,
            service.model_id,
            1,
            counting=True,
            **service.efforts,
        )
        return JSONResponse({"input_tokens": len(generation.prompt)})

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


def responses_routes(service: Service, store: ResponseStore) -> list:
    """POST /v1/responses, with the ``store`` of answers a later request continues
    (``previous_response_id``)."""

    async def responses(request: Request):
        return await service.generate(
            request,
            functools.partial(parse_responses, store=store, **service.efforts),
            functools.partial(ResponsesFormat, store=store),
        )

    return [Route("/v1/responses", responses, methods=["POST"])]


async def read_body(request: Request) -> bytes:
    """The body, refused once it passes MAX_BODY_BYTES (before it all sits in memory)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(
                    413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB"
                )
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

    def __init__(self, jobs: list, body, failures: FailureLog):
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.jobs = jobs  # the request's, one per choice
        self.failures = failures

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except Exception as error:  # a fault while streaming: the status was sent, the log says it
            message = f"internal error while streaming: {type(error).__name__}: {error}"
            self.failures.record(self.jobs[0].label, ApiError(500, message, trace=trace_of(error)))
            raise
        finally:
            for job in self.jobs:
                job.cancelled.set()  # a no-op once the job is done


async def events(job: Job, fmt, cached: int):
    """The format's events for the job's, and its pings while none come for ``fmt.ping_s``."""
    for event in fmt.start(cached):
        yield event
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.events.get(), fmt.ping_s)
        except asyncio.TimeoutError:
            for event in fmt.ping():
                yield event
            continue
        answer = (
            fmt.text(*payload)
            if kind == "text"
            else fmt.failed(payload)
            if kind == "error"
            else fmt.done(payload)
        )
        for event in answer:
            yield event
        if kind != "text":
            return


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """The error in the shape of the API the request called."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(
            anthropic_error(error),
            status_code=ANTHROPIC_STATUS.get(error.status, error.status),
            headers=error.headers,
        )
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def answer_failure(failures: FailureLog, request: Request, error: ApiError) -> JSONResponse:
    """The error, in the log unless the engine logged it with the request's id already."""
    if not error.logged:
        failures.record(f"a request to {request.url.path}", error)
    return error_response(request, error)


async def api_error(failures: FailureLog, request: Request, error: ApiError):
    return answer_failure(failures, request, error)


async def http_error(failures: FailureLog, request: Request, error: HTTPException):
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return answer_failure(failures, request, ApiError(error.status_code, message, error_type=kind))


async def client_gone(request: Request, error: ClientGone):
    return JSONResponse({}, status_code=499)  # nobody reads it; the connection is closed


async def server_error(failures: FailureLog, request: Request, error: Exception):
    message = f"internal error: {type(error).__name__}: {error}"
    return answer_failure(failures, request, ApiError(500, message, trace=trace_of(error)))
