"""Each request's constraint (its regex, JSON schema, grammar or tools), built on the HTTP side by
constrained/build.py, as main.py builds its flags'.

Compiling a new schema takes long enough that, on the worker, it would stall every running stream,
so the HTTP side builds each request's constraint before it queues the request. The costly part,
the token index or compiled grammar, is built once per distinct pattern and kept (least recently
used first out); every request gets fresh constraint objects on it, as rows never share one.
"""

import threading
from collections import OrderedDict
from concurrent.futures import Future

from constrained.build import ConstraintBuilder, compile_pattern
from server.protocol import GenerationRequest, invalid

MAX_CACHED_CONSTRAINTS = 32  # token indexes are ~1 MB each; a client reuses few schemas


class RequestConstraints:
    """The built constraints of one model's vocabulary, shared by every HTTP thread.

    Args:
        vocab_size: the model's (the masks' width); ``cache_dir``: where regex token indexes are
            kept.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_dir=None):
        self.builder = ConstraintBuilder(tokenizer, vocab_size, cache_dir)
        # (kind, pattern) -> ("regex", token index) or ("grammar", compiled grammar)
        self.built = OrderedDict()
        # (kind, pattern) -> Future, while the first request that needs it builds it
        self.building = {}
        self.lock = threading.Lock()  # HTTP threads build constraints side by side

    def for_request(self, request: GenerationRequest) -> tuple:
        """A fresh (constraint, forced-text source) for the request's regex, schema or grammar, or
        (None, None). The first request that needs a pattern builds it while later ones wait for
        it. On a thinking model it starts after the think block, which a budget bounds
        (server/reasoning.py). Safe from any thread, and no MLX call: the HTTP side calls it off the
        worker."""
        given = [
            ("regex", request.regex),
            ("schema", request.schema),
            ("tools", request.tool_grammar),
            ("grammar", request.grammar),
        ]
        key = next(((kind, pattern) for kind, pattern in given if pattern is not None), None)
        return self.builder.fresh(None if key is None else self._built(key), request.thinking)

    def _built(self, key: tuple) -> tuple:
        """``self.built[key]``, building it (or waiting for the thread that builds it) if missing.
        A refusal is not kept: the requests waiting for that build get it, a later one tries
        again."""
        with self.lock:
            if key in self.built:
                self.built.move_to_end(key)
                return self.built[key]
            future = self.building.get(key)
            building = future is None
            if building:
                future = self.building[key] = Future()
        if not building:
            return future.result()
        try:
            built = self.build(*key)
        except BaseException as error:
            with self.lock:
                del self.building[key]
            future.set_exception(error)
            raise
        with self.lock:
            del self.building[key]
            self.built[key] = built
            if len(self.built) > MAX_CACHED_CONSTRAINTS:
                self.built.popitem(last=False)
        future.set_result(built)
        return built

    def build(self, kind: str, pattern: str) -> tuple:
        """``ConstraintBuilder.index`` of the pattern, compiled as main.py compiles --regex,
        --json-schema and --grammar; a refusal is a 400 naming the field."""
        from constrained import GrammarError, RegexError

        what, param = {
            "regex": ("regex", "guided_regex"),
            "grammar": ("grammar", "guided_grammar"),
            "schema": ("JSON schema", "response_format"),
            "tools": ("tools' schemas", "tools"),  # text and calls in the template's syntax
        }[kind]
        try:
            # a schema: llguidance, else the built-in compiler (a note in the log says so)
            compiled = compile_pattern("grammar" if kind == "tools" else kind, pattern)
            return self.builder.index(*compiled)
        except (GrammarError, RegexError) as error:
            raise invalid(f"the {what} is not supported: {error}", param) from None
