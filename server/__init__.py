"""A server of three APIs -- OpenAI chat completions, OpenAI Responses and Anthropic Messages -- on
one engine: structured outputs, tool calls, lossless speculation.

    python -m server [--prompt-lookup] [--draft-model DIR] [--draft-head [DIR_OR_REPO]] [--api-key
    KEY]

- ``request.py``: ``GenerationRequest``, what the engine takes; the OpenAI-shaped ``ApiError``; the
  checks of single fields.
- ``protocol.py``: OpenAI's request bodies -> a checked ``GenerationRequest`` (``prepare_chat``:
  messages and tools -> prompt and constraint, for every API); ``chat_messages.py``: a chat
  message checked, and messages as a chat template takes them.
- ``anthropic_input.py`` and ``anthropic_output.py``: Anthropic's Messages, its parser and its
  format; ``responses_input.py`` and ``responses_output.py``: OpenAI's Responses, its parser and
  its format;
  ``formats.py``: chat completions' and completions' formats.
- ``tools.py``: tool calls in the model's own syntax: the grammar that constrains them, the reader
  that takes them out of the text.
- ``harmony.py``: GPT-OSS's harmony messages read as answer text and tool calls.
- ``engine.py``: one worker thread decodes every request in one batch (``batch.BatchGenerator``)
  from a bounded queue, and keeps the KV cache across turns; ``job.py``: a request on it, the
  events its handler awaits and the ``Outcome`` it ends with.
- ``constraints.py``: each request's constraint, built on the HTTP side, each pattern once.
- ``failures.py``: a line in the log for every failed request (its id, API, error; the traceback
  once per kind); ``logprob_names.py``: logprobs in OpenAI's terms.
- ``app.py``: the routes, JSON answers and server-sent events. docs/server.md says what each API
  takes.

``logprobs`` (chat: ``logprobs``/``top_logprobs`` up to 20; completions: legacy ``logprobs: N``)
are the target's log-softmax at temperature 1 before top_p, as ``mlx_lm.server`` reports them,
taken from the verify pass at each token's position (``batch.TokenLogprobs``), so they are the same
whether a token was drafted or not (by any source, a draft head or MTP layers too); under a
constraint they are of the masked distribution.

Why Starlette and uvicorn: the server needs streaming responses and to notice a client that has
left, and little else. Starlette's ``StreamingResponse`` cancels the response's generator when the
client disconnects and ``Request.is_disconnected()`` covers the wait before the first byte;
uvicorn is the ASGI server it is tested with. Both are small, typed, well kept, and what
FastAPI (and so vLLM's and many other OpenAI-compatible servers) runs on. ``mlx_lm.server`` uses
the standard library's ``http.server`` instead, which serves one connection per thread and
only learns of a disconnect when a write fails.
"""
