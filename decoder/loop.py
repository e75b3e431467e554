"""The verify-and-accept loop: a draft source proposes tokens, the target scores ``[last token] +
draft`` in one pass, keeps the longest prefix it agrees with, adds a token of its own and trims the
rest off its cache. Layered as in mlx-lm: ``generate_step`` yields (token, source),
``stream_generate`` yields ``Response``, ``generate`` returns a ``GenerationResult``.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx

from .cache import Cache, adopt, make_cache
from .draft import Constraint, DraftSource
from .pass_cost import PassCost
from .prefill import Prefill, PrefixStore
from .row import TARGET, DecodingStats, Row
from .sampling import Sampling
from .step import verify_step
from .text import TextStream, encode, eos_ids_of
from .tree_choice import TreeChoice
from .tree_pass import max_nodes_for


def prefill(model, cache: Cache, tokens: list, step_size: int = 512, store=None):
    """Run ``tokens`` into ``cache`` (one row, holding their first ones) in chunks."""
    Prefill(model, [tokens], step_size, cache=cache, store=store).run()


def _open_cache(model, prompt: Sequence[int], prompt_cache: Optional[list], quantized) -> tuple:
    """``(cache, cached)``: the loop's cache of one row and how many of ``prompt``'s first tokens it
    holds already (``prompt_cache`` adopted, or a new cache holding none, ``quantized``: ``(bits,
    group_size, start)`` as ``make_cache`` takes them)."""
    # CacheKindError for a layer drafts cannot be rolled back in
    cache = (
        make_cache(model, 1, None, 4, *quantized) if prompt_cache is None else adopt(prompt_cache)
    )
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    cached = cache.held() if prompt_cache is not None else 0  # tokens of the prompt the cache holds
    if cached is None:
        raise ValueError(
            "a prompt_cache of recurrent layers only cannot tell how many tokens it holds; "
            "pass none"
        )
    if cached >= len(prompt):
        raise ValueError(
            f"prompt_cache holds {cached} tokens; "
            f"it must hold fewer than the prompt's {len(prompt)}"
        )
    return cache, cached


def generate_step(
    prompt: Sequence[int],
    model,
    *,
    eos_token_ids: Sequence[int],
    draft_sources: Sequence[DraftSource] = (),
    constraint: Optional[Constraint] = None,
    sampling: Sampling = Sampling(),
    logits_processors: Optional[Sequence[Callable]] = None,
    sampler: Optional[Callable] = None,
    max_tokens: int = 256,
    stats: Optional[DecodingStats] = None,
    prefill_step_size: int = 512,
    prompt_cache: Optional[list] = None,
    pass_cost: Optional[PassCost] = None,
    tree_nodes: Union[int, str] = 0,
    seed: Optional[int] = None,
    prompt_store: Optional[PrefixStore] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> Iterator[tuple]:
    """Generate tokens with draft-and-verify steps.

    Args:
        prompt: at least one token id.
        model: an mlx-lm model (``model(inputs, cache=cache) -> logits``).
        eos_token_ids: stop after emitting one of these (``()`` for none).
        draft_sources: in priority order (``choose_draft``).
        constraint: a logits mask that advances along accepted tokens.
        sampling: mlx-lm's ``make_sampler``'s settings (``Sampling``); temp 0 is greedy; drafts
            are accepted with ``min(1, p/q)`` against that distribution.
        logits_processors: mlx-lm's ``processor(tokens, logits) -> logits``, applied at every
            position with the tokens before it, draft tokens included.
        sampler: an mlx-lm sampler instead of ``sampling`` (``accept_sampled``).
        max_tokens, stats: stop after this many tokens; statistics filled in as it goes.
        prompt_cache: a ``make_cache(model)`` (or mlx-lm's list, adopted in place) holding the first
            tokens of ``prompt``; only the rest is prefilled.
        pass_cost: the ``PassCost`` the loop times its passes into; pass one to keep it.
        tree_nodes: draft trees of at most this many nodes, ``"auto"`` for as many as the
            sources expect to pay, 0 for chains; call ``enable_trees(model)`` first (a model it
            refuses drafts chains).
        seed: the target draws from ``mx.random.key(seed)``, split each step, not MLX's global
            stream (None), which an mlx-lm ``sampler`` and sampling draft models still use.
        prompt_store: a ``PrefixStore`` (``prompt_store.PromptStore``, on disk): the prompt's
            longest stored prefix is restored, and its new blocks stored.
        kv_bits, kv_group_size, quantized_kv_start: ``make_cache``'s (mlx-lm's start: 5000);
            drafts are verified against that cache: the output is plain decoding's with it.

    Yields:
        ``(token, source_name)`` for each accepted token; ``source_name`` is
        ``TARGET`` for tokens the target chose itself.
    """
    quantized = (kv_bits, kv_group_size, quantized_kv_start)  # (make_cache's)
    cache, cached = _open_cache(model, prompt, prompt_cache, quantized)
    restored = None if prompt_store is None or cached else prompt_store.lookup(prompt)
    if restored is not None:
        cache.fill([restored])
        cached = restored.length
    row = Row(
        prompt,
        eos_token_ids=eos_token_ids,
        draft_sources=draft_sources,
        constraint=constraint,
        sampling=sampling,
        logits_processors=logits_processors,
        sampler=sampler,
        max_tokens=max_tokens,
        stats=stats,
        max_nodes=max_nodes_for(model, tree_nodes) if draft_sources else None,
        seed=seed,
    )
    cost = pass_cost if pass_cost is not None else PassCost()
    row.reset(cost, cache)

    tic = time.perf_counter()
    # The last prompt token is the first input of the loop, like every accepted token after it.
    prefill(model, cache, row.tokens[:-1], prefill_step_size, prompt_store)
    row.cached, row.stats.prompt_cache_tokens = len(row.tokens) - 1, cached
    row.stats.prompt_time = time.perf_counter() - tic

    choice = TreeChoice() if row.max_nodes == 0 else None  # "auto": trees while they pay here
    while row.finish_reason is None:
        step_started, trees = cost.clock(), choice is None or choice.use_trees()
        # The first step's drafting includes the sources' own prefill, so it is not timed.
        room = cache.until_quantized()  # no pass spans quantized_kv_start
        plan = row.plan(cost if row.num_generated else None, trees=trees, room=room)
        step = verify_step(model, cache, [row], [plan], len(plan.draft.tokens) + 1, cost)
        [result] = step.results
        if isinstance(result, Exception):
            raise result
        emitted, sources = row.emit(plan, step.drafts[0], *result)
        if choice and row.num_generated > len(emitted):  # the first step: untimed
            choice.record(trees, len(emitted), cost.agreed(cost.clock() - step_started))
        yield from zip(emitted, sources)


@dataclass
class Response:
    text: str  # the text this token completes (may be empty mid-character)
    token: int
    source: str

    @property
    def from_draft(self) -> bool:
        """Whether a draft source proposed this token (mlx-lm's name for it)."""
        return self.source != TARGET


def stream_generate(
    model, tokenizer, prompt: Union[str, Sequence[int]], **kwargs
) -> Iterator[Response]:
    """Like ``generate_step`` but takes a str or token ids and yields text segments
    (``Response``); stops at the tokenizer's EOS unless ``eos_token_ids`` says otherwise."""
    eos = kwargs.pop("eos_token_ids", None)
    eos = eos_ids_of(tokenizer) if eos is None else set(eos)
    text = TextStream(tokenizer)
    last = kwargs.get("max_tokens", 256)  # generate_step's default
    for count, (token, source) in enumerate(
        generate_step(encode(tokenizer, prompt), model, eos_token_ids=eos, **kwargs), 1
    ):
        # The last token (EOS, or the max_tokens-th) also gives what the stream still holds.
        segment = (
            text.finish()
            if token in eos
            else text.add(token) + (text.finish() if count == last else "")
        )
        yield Response(segment, token, source)


@dataclass
class GenerationResult:
    text: str
    tokens: list
    sources: list  # the source of each token in ``tokens``
    prompt_tokens: int
    generation_tokens: int
    finish_reason: str
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    stats: DecodingStats

    def report(self) -> str:
        """mlx-lm's statistics lines, then target passes and drafts."""
        passes = self.stats.target_forward_passes
        per_token = passes / max(self.generation_tokens, 1)
        lines = [
            "=" * 10,
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec"
            + (f" ({cached} restored)" if (cached := self.stats.prompt_cache_tokens) else ""),
            f"Generation: {self.generation_tokens} tokens, "
            f"{self.generation_tps:.3f} tokens-per-sec",
            f"Peak memory: {self.peak_memory_gb:.3f} GB",
            f"Target forward passes: {passes} ({per_token:.3f} per token)",
        ]
        if self.stats.sources:
            proposed, accepted = self.stats.draft_proposed, self.stats.draft_accepted
            lines.append(
                f"Drafted: {proposed} tokens, accepted: {accepted} "
                f"({accepted / max(proposed, 1):.1%})"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "target_forward_passes": self.stats.target_forward_passes,
            "forward_passes_per_token": self.stats.target_forward_passes
            / max(self.generation_tokens, 1),
            "draft_proposed": self.stats.draft_proposed,
            "draft_accepted": self.stats.draft_accepted,
            "acceptance_rate": self.stats.draft_accepted / max(self.stats.draft_proposed, 1),
            "draft_sources": {name: s.summary() for name, s in self.stats.sources.items()},
            "generation_tps": self.generation_tps,
            "prompt_tps": self.prompt_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "finish_reason": self.finish_reason,
            "verification_cost": self.stats.pass_cost.summary() if self.stats.pass_cost else None,
            "prompt_cache_tokens": self.stats.prompt_cache_tokens,
        }


def generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    verbose: bool = False,
    on_token=None,
    **kwargs,
) -> GenerationResult:
    """Run ``stream_generate`` to the end.

    Args:
        prompt: a str (chat template applied when the tokenizer has one) or token ids.
        verbose: print the text as it comes, then mlx-lm-style statistics.
        on_token: called with each ``Response``.
        kwargs: ``generate_step``'s (draft_sources, constraint, sampling, max_tokens, ...).
    """
    # token ids from here on, which stream_generate passes through
    prompt = encode(tokenizer, prompt)
    stats = kwargs.pop("stats", None) or DecodingStats()
    mx.reset_peak_memory()
    tokens, sources, segments = [], [], []
    if verbose:
        print("=" * 10)
    tic = time.perf_counter()
    first_token_time = None
    for response in stream_generate(model, tokenizer, prompt, stats=stats, **kwargs):
        if first_token_time is None:
            first_token_time = time.perf_counter()
        tokens.append(response.token)
        sources.append(response.source)
        segments.append(response.text)
        if verbose:
            print(response.text, end="", flush=True)
        if on_token is not None:
            on_token(response)
    end = time.perf_counter()
    first_token_time = first_token_time or end
    # As in mlx-lm: prompt speed is prefill time; generation speed counts tokens after the first.
    decode_time = end - first_token_time
    result = GenerationResult(
        text="".join(segments),
        tokens=tokens,
        sources=sources,
        prompt_tokens=len(prompt),
        generation_tokens=len(tokens),
        finish_reason=stats.finish_reason,
        prompt_tps=len(prompt) / max(first_token_time - tic, 1e-9),
        generation_tps=(len(tokens) - 1) / decode_time
        if len(tokens) > 1 and decode_time > 0
        else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        stats=stats,
    )
    if verbose:
        print()
        print(result.report())
    return result
