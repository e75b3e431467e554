"""A randomized soak of the server (#59): concurrent random valid requests over chat completions,
completions, Responses and Messages, against servers on tiny models that draft with prompt lookup,
a draft head, a draft model and MTP layers, with ``--tree-nodes`` auto, 0 and a count.

Each request mixes what a client may send: every sampling control, ``n``, streaming, logprobs,
stop strings, a JSON Schema, a regex, tools, thinking budgets (on a thinking template); some
streaming clients hang up early. A few requests are invalid on purpose and must get their 400.

``soak(server, requests, seed)`` checks, request by request:
- every answer is a 200, or the 400 an invalid request is documented to get;
- a JSON Schema or regex answer that ended by itself follows its constraint;
- a sampled token with logprobs passes its own filters (within top_k, above min_p);
- after the round: each greedy request sent again alone gives the same text, the server still
  answers, and nothing is left open (rows, queue places, drafters' rows), RSS bounded.

tests/test_soak.py runs it bounded for the suite; ``python -m benchmarks.soak`` runs it longer.
"""

import gc
import json
import math
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import mlx.core as mx

from tests import tiny_server

NOTICE = (
    "Notice: the museum opens at 9 and closes at 17. Tickets cost 8 pounds for adults and 4 "
    "pounds for children. The cafe is on the second floor. Dogs are not allowed. "
)
WORDS = "ab 12 20 name: am na tickets museum cafe floor dogs open close adults children".split()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|[0-9]{1,3})"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_price",
        "description": "The price of a ticket",
        "parameters": {
            "type": "object",
            "properties": {"who": {"type": "string", "enum": ["adult", "child"]}},
            "required": ["who"],
        },
    },
}
# What each server drafts with, its trees, and its chat template (server/__main__.py's flags).
SERVERS = {
    "lookup": dict(tree_nodes="auto", template="hermes"),
    "head": dict(tree_nodes=0, template="thinking"),
    "draft_model": dict(tree_nodes=4, template="plain"),
    "mtp": dict(tree_nodes="auto", template="plain"),
}


def build_engine(kind: str, tmp: Path):
    """The engine of a ``SERVERS`` server: a tiny target and what drafts for it."""
    from decoder.hidden_states import output_rows
    from decoder.pass_cost import PassCost
    from draft_head import HeadDrafter
    from draft_head.head import DraftHead, head_args
    from draft_model import DraftModel
    from loading.target import load_mlx_lm
    from mtp import MTPDrafter
    from prompt_lookup import PromptLookupSource
    from server.engine import Engine
    from tests.helpers import tiny_llama
    from tests.mtp_fixtures import write_checkpoint

    template = SERVERS[kind]["template"]
    thinking = "optional" if template == "thinking" else None
    tokenizer = tiny_server.tokenizer(hermes=template == "hermes", thinking=thinking)
    vocab = len(tokenizer._tokenizer)
    target = tiny_llama(vocab_size=vocab, num_layers=2, hidden_size=32, seed=3, sharp=3.0)
    model, drafters = target, []
    if kind == "head":
        mx.random.seed(7)
        vocab_ids = mx.arange(0, vocab)
        head = DraftHead(head_args(target.args), output_rows(target, vocab_ids))
        mx.eval(head.parameters())
        model, drafter = HeadDrafter.around(target, head, vocab_ids)
        drafters.append(drafter)
    elif kind == "draft_model":
        draft = tiny_llama(vocab_size=vocab, num_layers=1, hidden_size=32, seed=3, sharp=3.0)
        drafters.append(DraftModel.create(draft, tokenizer, target, tokenizer))
    elif kind == "mtp":
        path = tmp / "mtp"
        write_checkpoint(path, "deepseek_v3", seed=1, vocab_size=vocab, tokenizer=tokenizer)
        target = load_mlx_lm(path)[0]
        model, drafter = MTPDrafter.create(target, path)
        drafters.append(drafter)

    def make_sources():
        lookup = [PromptLookupSource()] if kind in ("lookup", "head") else []
        return lookup + [drafter.source() for drafter in drafters]

    engine = Engine(
        model,
        tokenizer,
        vocab,
        make_sources,
        max_batch=6,
        max_queue=64,
        prompt_cache_bytes=2**21,
        # Passes timed at zero seconds: rows draft whenever their sources offer, however loaded
        # the machine is, so the soak exercises drafting.
        pass_cost=PassCost(clock=lambda: 0.0),
        drafters=drafters,
        tree_nodes=SERVERS[kind]["tree_nodes"],
    )
    return engine, tokenizer


@contextmanager
def serving(engine):
    """The app on ``engine`` under uvicorn, in a thread of this process, for the block: yields its
    base URL. The engine stops on every way out."""
    import uvicorn

    from server.app import build_app

    app = build_app(engine, "tiny", context_length=4096)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()
        engine.worker.join(timeout=30)
        sock.close()


@dataclass
class Request:
    path: str
    body: dict
    expect: int = 200  # 400 for a request that is invalid on purpose
    hang_up: bool = False  # a streaming client that leaves after its first event
    greedy: bool = False


def sampling(rng: random.Random, api: str) -> dict:
    """Random sampling controls that ``api`` takes; {} or temperature 0 for a greedy request."""
    if rng.random() < 0.35:
        return {"temperature": 0}
    body = {"temperature": rng.choice([0.7, 0.9, 1.0])}
    if rng.random() < 0.4:
        body["top_p"] = rng.choice([0.8, 0.95])
    if api in ("chat", "completions", "messages") and rng.random() < 0.4:
        body["top_k"] = rng.choice([1, 3, 8])
    if api in ("chat", "completions"):
        body["seed"] = rng.randrange(1000)
        if rng.random() < 0.3:
            body["min_p"] = rng.choice([0.05, 0.2])
        if rng.random() < 0.2:
            body.update(xtc_probability=0.5, xtc_threshold=0.1)
        for name in ("presence_penalty", "frequency_penalty"):
            if rng.random() < 0.2:
                body[name] = rng.choice([-0.5, 0.5, 1.5])
        if rng.random() < 0.2:
            body["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            body["logit_bias"] = {str(rng.randrange(256)): rng.choice([-100, 5])}
    return body


def user_text(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 10)))
    return (NOTICE if rng.random() < 0.6 else "") + words


def random_request(rng: random.Random, template: str) -> Request:
    """One valid request (or, one time in twelve, an invalid one) of a random API."""
    api = rng.choice(["chat", "chat", "completions", "responses", "messages"])
    max_tokens = rng.randrange(1, 24)
    body = sampling(rng, api)
    greedy = body.get("temperature") == 0
    stream = rng.random() < 0.4
    if api == "chat":
        body.update(messages=[{"role": "user", "content": user_text(rng)}], max_tokens=max_tokens)
        if rng.random() < 0.3:
            body["n"] = 2
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 3, 8]))
        shape = rng.random()
        if shape < 0.15:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            }
        elif shape < 0.25:
            body["guided_regex"] = REGEX
        elif shape < 0.4 and template == "hermes":
            body.update(tools=[TOOL], tool_choice=rng.choice(["auto", "required"]))
        if template == "thinking" and rng.random() < 0.5:
            body[rng.choice(["reasoning_effort", "thinking_token_budget"])] = rng.choice(
                ["low", "minimal"]
            )
            if "thinking_token_budget" in body:
                body["thinking_token_budget"] = rng.randrange(1, 8)
        path = "/v1/chat/completions"
    elif api == "completions":
        body.update(prompt=user_text(rng), max_tokens=max_tokens)
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 3, 5])
        if rng.random() < 0.15:
            body["guided_regex"] = REGEX
        path = "/v1/completions"
    elif api == "responses":
        body.update(input=user_text(rng), max_output_tokens=max(max_tokens, 16))
        if rng.random() < 0.2:
            body["text"] = {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}
        if template == "thinking" and rng.random() < 0.4:
            body["reasoning"] = {"effort": "minimal"}
        path = "/v1/responses"
    else:
        body.update(
            messages=[{"role": "user", "content": user_text(rng)}],
            max_tokens=max_tokens,
            model="tiny",
        )
        if template == "thinking" and rng.random() < 0.4:
            body["thinking"] = {"type": "enabled", "budget_tokens": rng.randrange(1, 8)}
        if template == "hermes" and rng.random() < 0.2:
            body["tools"] = [{**TOOL["function"], "input_schema": TOOL["function"]["parameters"]}]
            del body["tools"][0]["parameters"]
        path = "/v1/messages"
    if api in ("chat", "completions") and rng.random() < 0.25:
        body["stop"] = [rng.choice(["12", "am", ".", "\n"])]
    if api == "messages" and rng.random() < 0.25:
        body["stop_sequences"] = [rng.choice(["12", "am", "."])]
    body.setdefault("model", "tiny")
    if stream:
        body["stream"] = True
    request = Request(path, body, greedy=greedy, hang_up=stream and rng.random() < 0.25)
    if rng.random() < 1 / 12:  # invalid on purpose: the documented 400
        field_name, value = rng.choice([("temperature", -1), ("top_p", 2), ("max_tokens", -5)])
        if api == "responses" and field_name == "max_tokens":
            field_name = "max_output_tokens"
        body[field_name] = value
        request.expect, request.hang_up = 400, False
    return request


@dataclass
class Outcome:
    request: Request
    status: int
    texts: list = field(default_factory=list)  # per choice
    finish: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # per choice, OpenAI's chat/completions entries
    error: str = ""


def send(client: httpx.Client, base: str, request: Request) -> Outcome:
    """Send ``request``; a hang-up reads the first event and closes the connection."""
    url = base + request.path
    if request.body.get("stream"):
        with client.stream("POST", url, json=request.body) as response:
            if response.status_code != 200 or request.hang_up:
                outcome = Outcome(request, response.status_code)
                if request.hang_up:
                    next(response.iter_lines(), None)
                else:
                    outcome.error = response.read().decode()[:300]
                return outcome
            events = [
                json.loads(line[5:])
                for line in response.iter_lines()
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")
            ]
        return read_stream(request, events)
    response = client.post(url, json=request.body)
    outcome = Outcome(request, response.status_code)
    if response.status_code != 200:
        outcome.error = response.text[:300]
        return outcome
    return read_answer(outcome, response.json())


def read_answer(outcome: Outcome, body: dict) -> Outcome:
    path = outcome.request.path
    if path == "/v1/chat/completions":
        for choice in body["choices"]:
            message = choice["message"]
            calls = message.get("tool_calls") or []
            outcome.texts.append(
                (message.get("content") or "")
                + "".join(c["function"]["name"] + c["function"]["arguments"] for c in calls)
            )
            outcome.finish.append(choice["finish_reason"])
            outcome.logprobs.append((choice.get("logprobs") or {}).get("content"))
    elif path == "/v1/completions":
        for choice in body["choices"]:
            outcome.texts.append(choice["text"])
            outcome.finish.append(choice["finish_reason"])
    elif path == "/v1/responses":
        texts = [
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
        ]
        outcome.texts.append("".join(texts))
        outcome.finish.append(body["status"])
    else:
        outcome.texts.append("".join(b.get("text", "") for b in body["content"]))
        outcome.finish.append(body["stop_reason"])
    return outcome


def read_stream(request: Request, events: list) -> Outcome:
    """A finished stream's text per choice (errors in the stream fail the request)."""
    outcome = Outcome(request, 200)
    texts, finish = {}, {}
    for event in events:
        if "error" in event or event.get("type") == "error":
            outcome.status, outcome.error = 500, json.dumps(event)[:300]
        for choice in event.get("choices") or []:
            index = choice.get("index", 0)
            delta = choice.get("delta") or {}
            piece = choice.get("text") if "text" in choice else delta.get("content")
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                piece = (piece or "") + (function.get("name") or "") + function.get("arguments", "")
            texts[index] = texts.get(index, "") + (piece or "")
            if choice.get("finish_reason"):
                finish[index] = choice["finish_reason"]
        if event.get("type") == "response.output_text.delta":
            texts[0] = texts.get(0, "") + event["delta"]
        if event.get("type") == "content_block_delta" and "text" in event["delta"]:
            texts[0] = texts.get(0, "") + event["delta"]["text"]
    outcome.texts = [texts[i] for i in sorted(texts)]
    outcome.finish = [finish.get(i) for i in sorted(texts)]
    return outcome


def problems_of(outcome: Outcome) -> list:
    """What is wrong with one answer (empty: nothing)."""
    request, body = outcome.request, outcome.request.body
    if request.hang_up:
        return [] if outcome.status == 200 else [f"status {outcome.status}: {outcome.error}"]
    if outcome.status != request.expect:
        return [f"status {outcome.status}, expected {request.expect}: {outcome.error}"]
    problems = []
    schema = body.get("response_format", {}).get("json_schema", {}).get("schema")
    schema = schema or body.get("text", {}).get("format", {}).get("schema")
    for text, finish in zip(outcome.texts, outcome.finish):
        if finish not in ("stop", "completed", "end_turn"):
            continue  # cut by max_tokens or a stop string: nothing to check
        if schema is not None and "stop" not in body:
            import jsonschema

            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as error:
                problems.append(f"{text!r} breaks the schema: {error}")
        if body.get("guided_regex") and "stop" not in body:
            if not re.fullmatch(REGEX, text):
                problems.append(f"{text!r} does not match {REGEX}")
    for entries in outcome.logprobs:
        problems += filter_problems(body, entries or [])
    return problems


def filter_problems(body: dict, entries: list) -> list:
    """A sampled token outside its own top_k or under its min_p (logprobs are of the processed
    distribution at temperature 1, which the filters read). mlx-lm's XTC runs before top_k: once
    it drops the top tokens, top_k keeps the next ones."""
    problems = []
    for entry in entries:
        top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
        k = 0 if body.get("xtc_probability") else body.get("top_k", 0)
        if k and len(top) >= k and entry["logprob"] < top[k - 1] - 1e-4:
            problems.append(f"{entry['token']!r} is outside top_k {k}")
        min_p = body.get("min_p", 0)
        if min_p and top and math.exp(entry["logprob"] - top[0]) < min_p - 1e-4:
            problems.append(f"{entry['token']!r} is under min_p {min_p}")
    return problems


def rss_bytes() -> int:
    """This process's resident memory, less what MLX keeps of freed buffers for reuse (how much
    that is depends on how the round's rows happened to batch, not on a leak)."""
    gc.collect()
    mx.clear_cache()
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def open_rows(engine) -> dict:
    """What the engine still holds for requests: it must all be back to zero after a round."""
    return {
        "replies": len(engine.replies),
        "rows": len(engine.generator),
        "queued": engine.jobs.qsize(),
        "places taken": engine.places._initial_value - engine.places._value,
        "drafter rows": sum(len(drafter.rows) for drafter in engine.drafters),
    }


def soak(
    kind: str, tmp: Path, requests: int, seed: int, rounds: int = 1, workers: int = 10
) -> dict:
    """One server of ``SERVERS``: ``rounds`` of ``requests`` random requests from ``workers``
    threads, then each greedy one again alone. Returns a report: counts, time, problems (each a
    line), what stayed open, and the RSS growth over the last round (the first ones warm the
    caches)."""
    engine, _ = build_engine(kind, tmp)
    rng = random.Random(f"{kind}-{seed}")  # each server its own requests
    problems, outcomes, elapsed, alone_checked = [], [], 0.0, 0
    with serving(engine) as base, httpx.Client(timeout=120) as client:
        for round_index in range(rounds):
            batch = [random_request(rng, SERVERS[kind]["template"]) for _ in range(requests)]
            rss_before, start = rss_bytes(), time.perf_counter()
            with ThreadPoolExecutor(max_workers=workers) as pool:
                answers = list(pool.map(lambda r: send(client, base, r), batch))
            elapsed += time.perf_counter() - start
            for index, outcome in enumerate(answers, start=len(outcomes)):
                problems += [
                    f"request {index} {outcome.request.path}: {p}" for p in problems_of(outcome)
                ]
            outcomes += answers
            wait_closed(engine)
            rss_growth = rss_bytes() - rss_before
        for index, outcome in enumerate(outcomes):  # the batch is idle now: each greedy alone
            request = outcome.request
            if request.greedy and not request.hang_up and outcome.status == 200:
                again = send(client, base, Request(request.path, request.body))
                alone_checked += 1
                if again.texts[:1] != outcome.texts[:1]:
                    problems.append(
                        f"request {index} {request.path}: greedy {outcome.texts[:1]!r} in the "
                        f"batch, {again.texts[:1]!r} alone"
                    )
        health = client.get(base + "/health").status_code
        left = {name: count for name, count in wait_closed(engine).items() if count}
    statuses = {}
    for outcome in outcomes:
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    return {
        "server": kind,
        "requests": len(outcomes),
        "statuses": statuses,
        "hung_up": sum(outcome.request.hang_up for outcome in outcomes),
        "greedy_checked_alone": alone_checked,
        "seconds": round(elapsed, 2),
        "problems": problems,
        "health": health,
        "left_open": left,
        "rss_growth_mib": round(rss_growth / 2**20, 1),
        "failures_logged": engine.failures.count,
    }


def wait_closed(engine, timeout: float = 10) -> dict:
    """``open_rows`` once all are closed (hung-up rows are noticed within a poll), or at the
    timeout."""
    deadline = time.monotonic() + timeout
    while any(open_rows(engine).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_rows(engine)
