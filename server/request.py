"""What every API's parser shares: ``GenerationRequest``, what the engine takes, already checked;
``ApiError``, an OpenAI-shaped error that says what is wrong; and the checks of single fields that
raise it (``typed``, ``number``, ``check_fields_and_model``).
"""

import json
from dataclasses import dataclass, field
from typing import Optional

from constrained.thinking import Thinking
from decoder.sampling import Sampling, SamplingError
from decoder.text import eos_ids_of
from server.tools import ToolUse

# Accepted and ignored: bookkeeping on OpenAI's side, which changes nothing in the output. A field
# that would change it is read, or a 400 that names it.
IGNORED = {
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
}
# mlx_lm.server's sampling extras beside OpenAI's temperature and top_p: fields of ``Sampling`` of
# the same names, defaults and ranges (docs/sampling.md).
SAMPLING_CONTROLS = ("top_k", "min_p", "xtc_probability", "xtc_threshold")
# OpenAI's penalties and mlx_lm.server's context sizes beside logit_bias, for
# make_logits_processors: field -> (default, low, high, whether an integer).
PROCESSOR_CONTROLS = {
    "presence_penalty": (0.0, -2.0, 2.0, False),  # OpenAI's ranges
    "frequency_penalty": (0.0, -2.0, 2.0, False),
    "repetition_penalty": (0.0, 0.0, 100.0, False),  # 0: off, as in mlx_lm.server
    "repetition_context_size": (20, 0, 2**31 - 1, True),  # 0: the whole context
    "presence_context_size": (20, 0, 2**31 - 1, True),
    "frequency_context_size": (20, 0, 2**31 - 1, True),
}
MAX_LOGIT_BIAS = 100  # OpenAI's range: [-100, 100]
# Fields that name how the server was started, not what to generate: a request may state them
# (to be sure of what answers it), and gets a 400 where the server differs.
SERVER_SETTINGS = {"kv_bits"}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` and ``{"error": {"message", "type", "param",
    "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        error_type: Optional[str] = None,
        headers: Optional[dict] = None,
        trace: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}
        self.trace = trace  # the traceback of the fault behind a 5xx, for the server's log
        self.logged = False  # whether the server's log has it (server/failures.py)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """What the engine needs: token ids and decoding options, already checked."""

    prompt: list
    max_tokens: int
    sampling: Sampling = Sampling()  # checked when built (``read_sampling``)
    seed: Optional[int] = None
    stop: list = field(default_factory=list)
    regex: Optional[str] = None  # the output must fully match it (guided_regex)
    # JSON text of the schema the output must follow (response_format, forced tools)
    schema: Optional[str] = None
    grammar: Optional[str] = None  # guided_grammar, when constrained/grammar.py is present
    # Lark for text and tool calls in the template's syntax (tools.py)
    tool_grammar: Optional[str] = None
    # how tool calls are read out of the output; None: it is all text
    tools: Optional[ToolUse] = None
    messages: Optional[list] = None  # the chat messages the prompt came from (Responses keeps them)
    stream: bool = False
    include_usage: bool = False
    num_choices: int = 1  # OpenAI's n: rows decoded from the one prompt (server/choices.py)
    # None: none; k: each token's logprob and the k most likely tokens
    logprobs: Optional[int] = None
    # on a thinking model: its markers, where the prompt left it, the budget
    thinking: Optional[Thinking] = None
    # make_logits_processors' arguments: logit_bias and PROCESSOR_CONTROLS
    processors: dict = field(default_factory=dict)
    # Responses' include of reasoning.encrypted_content (server/responses_input.py)
    opaque_reasoning: bool = False

    def logits_processors(self) -> list:
        """mlx-lm's logits processors for this request's one row."""
        from decoder.processors import make_logits_processors

        return make_logits_processors(**self.processors)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise invalid(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def typed(body: dict, name: str, kinds, default=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a number here.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise invalid(f"'{name}' must be {what}, not {json.dumps(value)[:40]}", param=name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = typed(body, name, (int, float), default, "a number")
    if not low <= value <= high:  # also False for NaN and infinities (Python's json reads them)
        raise invalid(f"'{name}' must be between {low} and {high}", param=name)
    return value


def integer_or_number(body: dict, name: str, bounds: tuple):
    """A field of ``PROCESSOR_CONTROLS``, checked against its range."""
    default, low, high, integral = bounds
    if integral:
        value = typed(body, name, (int,), default, "an integer")
        if not low <= value <= high:
            raise invalid(f"'{name}' must be an integer between {low} and {high}", param=name)
        return value
    return float(number(body, name, default, low, high))


def read_sampling(body: dict, tokenizer, controls=SAMPLING_CONTROLS, **settings) -> Sampling:
    """The request's ``Sampling``, built and checked once: ``settings`` as the API's own fields
    gave them (its temperature and top_p, in its ranges), and the ``controls`` of ``body``
    (mlx_lm.server's extras, ``Sampling``'s fields of the same names, defaults and ranges). XTC
    never removes a newline or EOS, as in mlx_lm.server."""
    for name in controls:
        default = getattr(Sampling, name)  # as a JSON type: an integer or a number
        if isinstance(default, int):
            settings[name] = typed(body, name, (int,), default, "an integer")
        else:
            settings[name] = typed(body, name, (int, float), default, "a number")
    if settings.get("xtc_probability", 0) > 0:
        newline = tokenizer.encode("\n", add_special_tokens=False)
        settings["xtc_special_tokens"] = tuple(newline) + tuple(sorted(eos_ids_of(tokenizer)))
    try:
        return Sampling(**settings)
    except SamplingError as error:
        raise invalid(f"'{error.setting}' must be {error.bound}", param=error.setting) from None


def read_processors(body: dict) -> dict:
    """``make_logits_processors``' arguments: OpenAI's penalties, mlx_lm.server's context sizes
    and ``logit_bias``."""
    processors = {
        name: integer_or_number(body, name, bounds) for name, bounds in PROCESSOR_CONTROLS.items()
    }
    bias = typed(body, "logit_bias", (dict,), None, "an object of token ids to numbers")
    if bias:
        processors["logit_bias"] = dict(_logit_bias(key, value) for key, value in bias.items())
    return processors


def _logit_bias(key: str, value) -> tuple:
    """One entry of ``logit_bias``: (token id, bias in [-100, 100])."""
    if not key.strip().isdigit():
        raise invalid(
            f"'logit_bias' keys must be token ids, not {json.dumps(key)[:40]}", param="logit_bias"
        )
    fine = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not fine or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
        raise invalid(
            f"'logit_bias' values must be numbers between -{MAX_LOGIT_BIAS} and {MAX_LOGIT_BIAS}",
            param="logit_bias",
        )
    return int(key), float(value)


def check_fields_and_model(body: dict, allowed: set, model_id: str, ignored: set = IGNORED):
    """Refuse a field the API does not know (OpenAI refuses them too; ``ignored`` ones are accepted)
    and a model this server does not serve."""
    unknown = sorted(set(body) - allowed - ignored - SERVER_SETTINGS)
    if unknown:
        raise invalid(f"unrecognized request argument: {unknown[0]}", param=unknown[0])
    model = typed(body, "model", (str,), model_id, "a string")
    if model != model_id:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{model_id}'",
            param="model",
            code="model_not_found",
        )


def check_server_settings(body: dict, kv_bits: Optional[int]):
    """Refuse a request whose ``kv_bits`` (4, 8, or null for an unquantized cache) is not the
    server's ``--kv-bits``: a cache's width is fixed when the server starts."""
    if "kv_bits" not in body:
        return
    asked = body["kv_bits"]
    if asked is not None and (isinstance(asked, bool) or asked not in (4, 8)):
        raise invalid("'kv_bits' must be 4, 8 or null (an unquantized cache)", param="kv_bits")
    if asked != kv_bits:
        raise invalid(
            f"'kv_bits': this server keeps its KV cache {_width(kv_bits)} (its --kv-bits), and a "
            f"request cannot change that; this one asked for {_width(asked)}",
            param="kv_bits",
        )


def _width(bits: Optional[int]) -> str:
    return "unquantized" if bits is None else f"at {bits} bits"
