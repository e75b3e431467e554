"""One verify-and-accept loop that every draft source plugs into.

A *draft source* proposes up to k tokens (optionally with the distribution it drew them from);
the target scores ``[last token] + draft`` in one forward pass, keeps the longest prefix it agrees
with, adds one token of its own and trims the rejected tail off its KV cache. Plain decoding is
the same loop with no draft source.

Layers, as in mlx-lm:
    generate_step   -> yields (token, source) as tokens are accepted
    stream_generate -> yields Response (text segment, token, source)
    generate        -> GenerationResult (text, tokens and every statistic)

Sources and constraints are reusable: the loop calls their ``reset`` before every generation.
The loop times every pass by width and every draft (``cost.PassCost``); the sources read that.
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from cost import PassCost
from cache import Cache, adopt, make_cache

TARGET = "target"  # the source name of tokens the target model chose itself


class ConstraintError(RuntimeError):
    """The target's scores leave no token the constraint allows (every allowed logit is NaN or -inf)."""


@dataclass
class Draft:
    """Tokens a source proposes for the next positions.

    ``probs`` is the (len(tokens), vocab) distribution each token was drawn from; ``None`` means
    a point mass (n-gram copies, forced text). ``expected_speedup`` is what the source expects
    this step to give: tokens emitted (accepted + the target's own) per plain step's time, so 1.0
    is a plain step; ``None`` (no estimate) means the draft is taken as it is.
    """

    tokens: list
    probs: Optional[mx.array] = None
    expected_speedup: Optional[float] = None

    def truncate(self, length: int) -> "Draft":
        """The first ``length`` tokens, with their distributions."""
        if len(self.tokens) <= length:
            return self
        probs = None if self.probs is None else self.probs[:length]
        return Draft(self.tokens[:length], probs, self.expected_speedup)


class DraftSource:
    """Proposes tokens for the loop to verify. Subclasses implement ``propose``; the other
    methods have defaults, so a source overrides only what it uses.

    What a batch (``batch.BatchGenerator``) asks of a source is here too, with defaults that suit
    a source that follows one row on its own: ``batch_refusal``, ``batch_drafter``, ``leave``.
    """

    name = "draft"
    free = False  # True where proposing costs next to nothing (forced text): a batch asks it every step
    # Why a batch cannot ask this source, in one sentence; None: it can.
    batch_refusal: Optional[str] = None
    # An object that drafts for every row sharing it in one call per step, before the rows choose:
    # ``batch_drafter.draft_all([(source, tokens, max_draft), ...], cost, batch_rows)``. None: none.
    batch_drafter = None

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0) -> None:
        """Forget the last generation; the loop calls this before each one.

        ``cost``: the loop's measured verification cost, which adaptive sources read (None: a
        fresh ``PassCost``). ``temp``, ``top_p``: the target's sampling, for sources that draw
        their tokens the same way, so that q is close to p.
        """
        self.cost = cost if cost is not None else PassCost()
        self.temp, self.top_p = temp, top_p

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        """Propose up to ``max_draft`` tokens to follow ``tokens``."""
        raise NotImplementedError

    def forecast_speedup(self) -> Optional[float]:
        """For sources that cost something to ask (a model): the ``expected_speedup`` of the draft
        it would propose now, known before drafting (see ``choose_draft``). None: no forecast."""
        return None

    def update(self, tokens: list, num_proposed: int, num_accepted: int) -> None:
        """Follow along: ``tokens`` is the whole accepted sequence so far;
        ``num_proposed`` is 0 when another source drafted this step."""

    def leave(self) -> None:
        """Its row left the batch: let go of what is kept for it (a shared drafter's cache row)."""

    def locate(self, cache: Cache, row: int) -> None:
        """Where its row is in the target's cache (row ``row`` of ``cache``), told before each step's
        drafting: a source that reads the target's hidden states finds them there (``cache.features``)."""


class Constraint:
    """A token-level automaton that masks logits (see constrained/)."""

    def reset(self) -> None:
        """Go back to the start state; the loop calls this before each generation."""

    def walk(self, draft: list) -> list:
        """The states before each allowed draft token and after the last allowed one; stops at
        the first token the automaton forbids (so it returns ``allowed + 1`` states)."""
        raise NotImplementedError

    def masks(self, states: list) -> mx.array:
        """Boolean (len(states), vocab) masks of the allowed next tokens."""
        raise NotImplementedError

    def advance(self, tokens: list) -> None:
        """Commit accepted tokens."""
        raise NotImplementedError


@dataclass
class SourceStats:
    proposed: int = 0
    accepted: int = 0
    drafts: int = 0  # verification steps this source drafted for
    # accepted_at[i] / proposed_at[i]: acceptance rate at draft position i
    proposed_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int):
        self.proposed += num_proposed
        self.accepted += num_accepted
        self.drafts += 1
        for position in range(num_proposed):
            if position == len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[position] += 1
            self.accepted_at[position] += position < num_accepted

    def summary(self) -> dict:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / max(self.proposed, 1),
            "mean_accepted_length": self.accepted / max(self.drafts, 1),
            "acceptance_by_position": [
                round(a / p, 4) for a, p in zip(self.accepted_at, self.proposed_at)
            ],
        }


@dataclass
class DecodingStats:
    target_forward_passes: int = 0
    prompt_time: float = 0.0
    sources: dict = field(default_factory=dict)
    pass_cost: Optional[PassCost] = None  # the loop's timings of its passes (set by generate_step)
    finish_reason: Optional[str] = None  # "stop" (EOS) or "length" (max_tokens) once finished

    def source(self, name: str) -> SourceStats:
        return self.sources.setdefault(name, SourceStats())

    @property
    def draft_proposed(self) -> int:
        return sum(s.proposed for s in self.sources.values())

    @property
    def draft_accepted(self) -> int:
        return sum(s.accepted for s in self.sources.values())


def sampling_probs(logits: mx.array, temp: float, top_p: float = 1.0) -> mx.array:
    """Rows of ``logits`` -> the distribution we sample from (temperature, then top-p)."""
    probs = mx.softmax(logits.astype(mx.float32) / temp, axis=-1)
    if top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def accept_draft(logits: mx.array, draft: Draft, temp: float, top_p: float = 1.0) -> tuple:
    """Verify a draft against target ``logits`` of shape (len(draft) + 1, vocab).

    Returns ``(num_accepted, next_token)``: the target's own token follows the
    accepted prefix (a correction on rejection, a bonus token otherwise).

    Greedy: accept while the draft equals the target's argmax.
    Sampling (Leviathan et al., 2023): accept x ~ q with probability
    min(1, p(x) / q(x)); on rejection draw from the residual (p - q)+ / |(p - q)+|.
    A point-mass draft has q(x) = 1, so it is accepted with probability p(x)
    and the residual is p with x removed. Either way the output follows p.
    """
    num_draft = len(draft.tokens)
    if temp == 0:
        # One sync per step: the accept decision needs the values on the host.
        target = mx.argmax(logits, axis=-1).tolist()
        num_accepted = common_prefix_len(draft.tokens, target)
        return num_accepted, target[num_accepted]

    p = sampling_probs(logits, temp, top_p)
    q = None if draft.probs is None else draft.probs.astype(mx.float32)
    num_accepted = 0
    if num_draft:
        positions, tokens = mx.arange(num_draft), mx.array(draft.tokens)
        p_draft = p[positions, tokens]
        q_draft = mx.ones_like(p_draft) if q is None else q[positions, tokens]
        # min(1, p/q) without dividing: accept when u * q < p.
        accepted = (mx.random.uniform(shape=(num_draft,)) * q_draft < p_draft).tolist()
        num_accepted = (accepted + [False]).index(False)
    if num_accepted == num_draft:
        next_probs = p[num_draft]
    else:
        rejected = draft.tokens[num_accepted]
        if q is None:
            residual = p[num_accepted].at[rejected].add(-1.0)
        else:
            residual = p[num_accepted] - q[num_accepted]
        residual = mx.maximum(residual, 0.0)
        # p == q exactly leaves nothing; then p itself is the right distribution.
        next_probs = mx.where(residual.sum() > 0, residual, p[num_accepted])
    next_token = mx.random.categorical(mx.log(next_probs)).item()
    return num_accepted, next_token


def accept_sampled(logits: mx.array, draft: Draft, sampler: Callable) -> tuple:
    """``accept_draft`` for any mlx-lm sampler (``logprobs -> token``), as mlx-lm verifies drafts.

    Draw the target's own token at every position in one call and accept the draft
    while it equals them. Each emitted token is then a draw of ``sampler`` given the
    tokens before it, so the output follows the sampler exactly; a stochastic sampler
    accepts less often than ``min(1, p/q)`` would.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    # One sync per step, as in the greedy branch of accept_draft.
    target = sampler(logprobs).tolist()
    num_accepted = common_prefix_len(draft.tokens, target)
    return num_accepted, target[num_accepted]


def prefill(model, cache: Cache, tokens: list, step_size: int = 512):
    """Run ``tokens`` through ``model`` into ``cache`` (one row) in chunks (bounded attention memory)."""
    for start in range(0, len(tokens), step_size):
        model(mx.array(tokens[start : start + step_size])[None], cache=cache.layers)
        mx.eval(cache.arrays())


def choose_draft(draft_sources: Sequence[DraftSource], tokens: list, max_draft: int,
                 cost: Optional[PassCost] = None) -> tuple:
    """Pick this step's draft; returns ``(draft, drafter)``. Sources are in priority order,
    cheap ones first.

    The first non-empty draft wins, unless it comes with an ``expected_speedup``: then a later
    source that forecasts more (``forecast_speedup``, known before it drafts) drafts instead,
    as SuffixDecoding chooses per step between a cheap copy and a model. The choice never
    depends on tokens drawn this step, so every draft is still drawn from the ``probs`` it
    reports. Each ``propose`` is timed into ``cost``.
    """
    chosen, drafter = Draft([]), None
    if max_draft <= 0:
        return chosen, drafter
    for source in draft_sources:
        if drafter is not None:
            forecast = source.forecast_speedup()
            if chosen.expected_speedup is None or forecast is None or forecast <= chosen.expected_speedup:
                break
        tic = cost.clock() if cost is not None else 0.0
        draft = source.propose(tokens, max_draft)
        if draft is not None and draft.tokens:
            if cost is not None:
                cost.record_draft(source.name, cost.clock() - tic, len(draft.tokens))
            chosen, drafter = draft.truncate(max_draft), source
            if draft.expected_speedup is None:
                break
    return chosen, drafter


def constrain_draft(constraint: Constraint, draft: Draft) -> tuple:
    """Cut ``draft`` to what ``constraint`` allows; returns ``(draft, allowed)``, the
    (len(draft) + 1, vocab) masks of every position the target scores.

    A draft drawn from probabilities q keeps its first forbidden token: the mask gives it
    p = 0, so the target rejects it and samples the residual (p - q)+, as speculative
    sampling requires. Cutting it off would sample from p instead, which skews the output
    whenever q puts mass on forbidden tokens (a draft model knows nothing of the regex).
    The row after it is never used; it repeats the last one. A point-mass draft (q = 1)
    is cut: its residual is p either way. The rule lives here so no constraint repeats it.
    """
    states = constraint.walk(draft.tokens)
    num_allowed = len(states) - 1
    allowed = constraint.masks(states)
    if num_allowed < len(draft.tokens):
        if draft.probs is None:
            draft = draft.truncate(num_allowed)
        else:
            draft = draft.truncate(num_allowed + 1)
            allowed = mx.concatenate([allowed, allowed[-1:]])
    return draft, allowed


def check_masks(allowed: mx.array, vocab_size: int):
    """Refuse a constraint built for another vocabulary than the model scores."""
    if allowed.shape[-1] != vocab_size:
        raise ValueError(f"the constraint masks {allowed.shape[-1]} tokens but the model scores "
                         f"{vocab_size}: build it with this model's tokenizer and vocab_size")


def mask_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """``logits`` with every token the constraint forbids, or that scored NaN, at -inf.
    A NaN score is no score: it must not win an argmax or poison a softmax."""
    check_masks(allowed, logits.shape[-1])
    return mx.where(allowed & ~mx.isnan(logits), logits, -mx.inf)


class Plan(NamedTuple):
    """A row's step before the pass: its draft, the source that offered it, the constraint's masks."""

    draft: Draft  # cut to what the constraint allows (a batch may cut it further to the pass's width)
    drafter: Optional[DraftSource]
    masks: Optional[mx.array]  # (len(draft) + 1, vocab), or None without a constraint


# Tokens waiting to be fed again after a recurrent layer went back to its checkpoint (cache/):
# past this many a row drafts nothing until they are in the cache.
MAX_PENDING = 16


class Row:
    """One sequence being decoded: its tokens, draft sources, constraint and sampling, and the
    step they share, ``plan`` -> (the loop's pass) -> ``accept`` -> ``emit``.

    ``generate_step`` drives one row; ``batch.BatchGenerator`` drives many through one pass.
    What differs between them, the cache and the pass, stays with each loop.
    """

    def __init__(self, prompt: Sequence[int], *, eos_token_ids: Sequence[int] = (),
                 draft_sources: Sequence[DraftSource] = (), constraint: Optional[Constraint] = None,
                 temp: float = 0.0, top_p: float = 1.0, sampler: Optional[Callable] = None, max_tokens: int = 256,
                 stats: Optional[DecodingStats] = None):
        self.tokens = list(prompt)  # prompt and accepted tokens; grown in place (sources follow this list)
        self.sources, self.constraint = list(draft_sources), constraint
        self.temp, self.top_p, self.sampler = temp, top_p, sampler
        self.max_tokens, self.eos_token_ids = max_tokens, set(eos_token_ids)
        self.stats = stats if stats is not None else DecodingStats()
        self.num_generated = 0
        self.cached = 0  # how many of the tokens the loop's cache holds (the loop keeps this)
        # "stop" or "length" once finished
        self.finish_reason = self.stats.finish_reason = None if max_tokens > 0 else "length"

    def locate(self, cache: Cache, slot: int):
        """Tell the sources where this row is in the loop's cache (``DraftSource.locate``)."""
        for source in self.sources:
            source.locate(cache, slot)

    def reset(self, cost: PassCost):
        """Start the sources and the constraint over, before the first step."""
        # With an mlx-lm sampler, q plays no part in acceptance: model sources draft greedily.
        sampled = self.sampler is None
        for source in self.sources:
            source.reset(cost, self.temp if sampled else 0.0, self.top_p if sampled else 1.0)
        if self.constraint is not None:
            self.constraint.reset()
        self.stats.pass_cost = cost

    @property
    def pending(self) -> list:
        """Accepted tokens the cache does not hold, the next pass's first inputs: the last one, or
        more after a recurrent layer went back to its checkpoint (``Row.commit``)."""
        return self.tokens[self.cached :]

    @property
    def max_draft(self) -> int:
        """The most draft tokens a step can use: the target adds one of its own, within max_tokens."""
        return self.max_tokens - self.num_generated - 1

    def plan(self, cost: Optional[PassCost] = None, sources: Optional[Sequence[DraftSource]] = None) -> Plan:
        """This step's draft, cut to what the constraint allows, and the constraint's masks.
        ``sources``: the ones to ask (default: all the row's); ``cost`` times each ``propose``
        (None: not timed)."""
        sources = self.sources if sources is None else sources
        if len(self.tokens) - self.cached > MAX_PENDING:
            sources = []  # a plain pass keeps all it feeds, where a rejected draft would add more
        draft, drafter = choose_draft(sources, self.tokens, self.max_draft, cost)
        masks = None
        if self.constraint is not None:
            draft, masks = constrain_draft(self.constraint, draft)
            if not draft.tokens:
                drafter = None
        return Plan(draft, drafter, masks)

    def accept(self, logits: mx.array, draft: Draft, argmax: Optional[list] = None) -> tuple:
        """``(num_accepted, next_token)`` from the (len(draft) + 1, vocab) logits of the draft's
        positions (masked); ``argmax``: their argmax, where the loop has it on the host already."""
        if self.sampler is not None:
            return accept_sampled(logits, draft, self.sampler)
        if self.temp == 0 and argmax is not None:  # accept_draft's greedy rule
            num_accepted = common_prefix_len(draft.tokens, argmax)
            return num_accepted, argmax[num_accepted]
        return accept_draft(logits, draft, self.temp, self.top_p)

    def commit(self, pass_width: int, num_drafted: int, num_accepted: int, recurrent: bool) -> tuple:
        """What this row's cache keeps of a ``pass_width``-wide pass in which it fed its ``pending``
        tokens and ``num_drafted`` draft tokens: returns ``(trim, restore)``, how many of the pass's
        last tokens it drops (``Cache.rewind``) and whether its recurrent layers go back to their
        checkpoint (a draft token was rejected: the accepted ones are then fed again, as ``pending``).
        Call it before ``emit``; it counts what the cache then holds (``cached``)."""
        fed = len(self.tokens) - self.cached
        if recurrent and num_accepted < num_drafted:
            return pass_width, True
        self.cached += fed + num_accepted
        return pass_width - fed - num_accepted, False

    def forbidden(self, num_accepted: int) -> ConstraintError:
        """The error for a step whose own token the constraint forbids: no allowed token had a
        usable score (the argmax or sample of an all -inf row)."""
        return ConstraintError(f"the model gave no allowed token a usable score (NaN or -inf) "
                               f"at generated token {self.num_generated + num_accepted + 1}")

    def emit(self, plan: Plan, draft: Draft, num_accepted: int, next_token: int) -> tuple:
        """Commit a verified step; returns ``(tokens, sources)`` emitted. ``draft`` is what was
        verified (``plan.draft``, or less where the batch's width cut it)."""
        drafter = plan.drafter if draft.tokens else None
        self.stats.target_forward_passes += 1
        emitted = draft.tokens[:num_accepted] + [next_token]
        # Emit up to EOS or max_tokens; accepted draft tokens past that are neither emitted nor counted.
        stop = next((i + 1 for i, token in enumerate(emitted) if token in self.eos_token_ids), len(emitted))
        emitted = emitted[: min(stop, self.max_tokens - self.num_generated)]
        num_accepted, num_proposed = min(num_accepted, len(emitted)), len(draft.tokens)
        if drafter is not None:
            self.stats.source(drafter.name).record(num_proposed, num_accepted)
        sources = [drafter.name if i < num_accepted else TARGET for i in range(len(emitted))]
        self.tokens += emitted
        self.num_generated += len(emitted)
        if emitted[-1] in self.eos_token_ids:
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_tokens:
            self.finish_reason = "length"
        else:
            if self.constraint is not None:
                self.constraint.advance(emitted)
            for source in self.sources:
                proposed = num_proposed if source is drafter else 0
                source.update(self.tokens, proposed, num_accepted if proposed else 0)
        self.stats.finish_reason = self.finish_reason
        return emitted, sources


def verify_pass(model, cache: Cache, rows: Sequence["Row"], drafts: Sequence[Draft], width: int,
                slots: Optional[Sequence[int]] = None) -> tuple:
    """One pass of the target over each row's ``pending + draft``, right-padded to the longest.

    Args:
        cache: holds the rows (row b in cache row ``slots[b]``; the cache rows no row uses are fed
            padding, scored and never read). Its recurrent layers are checkpointed first when a row drafts.
        width: how many positions of each row to score: its last pending token and its draft.

    Returns:
        ``(logits, pass_width)``: logits ``(len(rows), width, vocab)``, lazy (the caller's sync runs the pass).
    """
    pending = [row.pending for row in rows]
    fed = [len(tokens) + len(draft.tokens) for tokens, draft in zip(pending, drafts)]
    pass_width = max(fed)
    inputs, lengths = [[0] * pass_width for _ in range(cache.rows)], [1] * cache.rows
    for slot, tokens, draft, count in zip(range(len(rows)) if slots is None else slots, pending, drafts, fed):
        inputs[slot], lengths[slot] = tokens + draft.tokens + [0] * (pass_width - count), count
    if any(draft.tokens for draft in drafts):
        cache.checkpoint()
    cache.prepare(lengths, pass_width)
    logits = model(mx.array(inputs), cache=cache.layers)
    cache.finalize()
    if cache.rows > len(rows):
        logits = logits[mx.array(slots)]
    if any(len(tokens) > 1 for tokens in pending):  # each row's draft positions start after its pending tokens
        positions = mx.minimum(mx.array([len(p) - 1 for p in pending])[:, None] + mx.arange(width), pass_width - 1)
        logits = mx.take_along_axis(logits, positions[..., None], axis=1)
    return logits, pass_width


def generate_step(
    prompt: Sequence[int],
    model,
    *,
    eos_token_ids: Sequence[int],
    draft_sources: Sequence[DraftSource] = (),
    constraint: Optional[Constraint] = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    sampler: Optional[Callable] = None,
    max_tokens: int = 256,
    stats: Optional[DecodingStats] = None,
    prefill_step_size: int = 512,
    prompt_cache: Optional[list] = None,
    pass_cost: Optional[PassCost] = None,
    kv_cache: Optional[list] = None,
) -> Iterator[tuple]:
    """Generate tokens with draft-and-verify steps.

    Args:
        prompt: at least one token id.
        model: an mlx-lm model (``model(inputs, cache=cache) -> logits``).
        eos_token_ids: stop after emitting one of these (``eos_ids_of(tokenizer)``; ``()`` for none).
        draft_sources: tried in order each step; the first non-empty draft is verified, or a
            later model's when it forecasts a larger speed-up (see ``choose_draft``).
        constraint: optional logits mask that advances along accepted tokens.
        temp, top_p: 0 temperature is greedy; drafts are accepted with ``min(1, p/q)``.
        sampler: an mlx-lm sampler (``make_sampler(...)``) to use instead of ``temp``/``top_p``;
            drafts are then accepted when they equal its draws (``accept_sampled``).
        max_tokens: stop after this many generated tokens.
        stats: filled in as decoding proceeds (forward passes, per-source counts, finish_reason).
        prompt_cache: a ``cache.make_cache(model)`` (or mlx-lm's ``make_prompt_cache`` list, whose
            layers are replaced in place by ``cache.adopt``) that already holds the first tokens of
            ``prompt`` (kept by the caller across turns); only the rest is prefilled. Without it
            every call starts empty. (``kv_cache`` is the same argument under its old name.)
        pass_cost: the verification-cost model the loop times its passes into and the sources
            read (``cost.PassCost``); pass one to keep its measurements across generations.

    Yields:
        ``(token, source_name)`` for each accepted token; ``source_name`` is
        ``TARGET`` for tokens the target chose itself.
    """
    row = Row(prompt, eos_token_ids=eos_token_ids, draft_sources=draft_sources, constraint=constraint, temp=temp,
              top_p=top_p, sampler=sampler, max_tokens=max_tokens, stats=stats)
    cost = pass_cost if pass_cost is not None else PassCost()
    prompt_cache = prompt_cache if prompt_cache is not None else kv_cache
    # CacheKindError for a layer drafts cannot be rolled back in
    cache = make_cache(model) if prompt_cache is None else adopt(prompt_cache)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    cached = cache.held() if prompt_cache is not None else 0  # tokens of the prompt the cache holds
    if cached is None:
        raise ValueError("a prompt_cache of recurrent layers only cannot tell how many tokens it holds; "
                         "pass none")
    if cached >= len(prompt):
        raise ValueError(f"prompt_cache holds {cached} tokens; it must hold fewer than the prompt's {len(prompt)}")
    row.reset(cost)
    row.locate(cache, 0)

    tic = time.perf_counter()
    # The last prompt token is the first input of the loop, like every accepted token after it.
    prefill(model, cache, row.tokens[cached:-1], prefill_step_size)
    row.cached = len(row.tokens) - 1
    row.stats.prompt_time = time.perf_counter() - tic

    while row.finish_reason is None:
        # The first step's drafting includes the sources' own prefill, so it is not timed.
        plan = row.plan(cost if row.num_generated else None)
        draft = plan.draft
        tic = cost.clock()
        logits, pass_width = verify_pass(model, cache, [row], [draft], len(draft.tokens) + 1)
        logits = logits[0] if plan.masks is None else mask_logits(logits[0], plan.masks)
        num_accepted, next_token = row.accept(logits, draft)
        # The accept decision synced the pass: its time is the pass's cost at this width.
        cost.record(cost.clock() - tic, width=pass_width)
        if plan.masks is not None and not plan.masks[num_accepted, next_token].item():  # evaluated with the logits
            raise row.forbidden(num_accepted)
        trim, restore = row.commit(pass_width, len(draft.tokens), num_accepted, bool(cache.recurrent))
        cache.rewind([trim], [0] if restore else [])
        emitted, sources = row.emit(plan, draft, num_accepted, next_token)
        yield from zip(emitted, sources)


def eos_ids_of(tokenizer) -> set:
    """The ids that end generation: mlx-lm's wrapper has a set, other tokenizers one id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return {ids} if isinstance(ids, int) else set(ids)


def output_size(model, tokenizer) -> int:
    """The width of the model's logits (its config's vocab_size, else the tokenizer's size)."""
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None) or len(tokenizer.get_vocab())


@dataclass
class Response:
    text: str  # the text this token completes (may be empty mid-character)
    token: int
    source: str

    @property
    def from_draft(self) -> bool:
        """Whether a draft source proposed this token (mlx-lm's name for it)."""
        return self.source != TARGET


class TextStream:
    """Text segments for a growing list of tokens, in constant time per token.

    Decoding the whole output again for every token is quadratic. Instead decode a
    window, the tokens of the last segment plus the new ones, and print what the new
    tokens add to the old ones' text; the old ones give the new ones their context
    (a leading space, the rest of a character). A window whose text ends in a partial
    UTF-8 character ("\\ufffd") grows until the character is complete. Any tokenizer
    with ``decode(ids) -> str`` works: mlx-lm's, T5's sentencepiece, plain Hugging Face.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = []
        self.window_start = 0  # first token of the last printed segment
        self.printed_end = 0  # tokens before this are printed

    def add(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is still partial)."""
        self.tokens.append(token)
        window = self.tokens[self.window_start:]
        text = self.tokenizer.decode(window)
        if text.endswith("\ufffd"):
            return ""
        printed = self.tokenizer.decode(window[: self.printed_end - self.window_start])
        self.window_start, self.printed_end = self.printed_end, len(self.tokens)
        return text[len(printed):]

    def finish(self) -> str:
        """The text still held at the end (a byte run that never became a character, shown as
        ``decode`` shows it), so that the segments add up to ``decode`` of all the tokens."""
        if self.printed_end == len(self.tokens):
            return ""
        window = self.tokens[self.window_start:]
        text = self.tokenizer.decode(window)
        printed = self.tokenizer.decode(window[: self.printed_end - self.window_start])
        self.window_start = self.printed_end = len(self.tokens)
        return text[len(printed):]


def encode(tokenizer, prompt: Union[str, Sequence[int], Sequence[dict]], system: Optional[str] = None,
           **template_options) -> list:
    """Token ids for ``prompt``, the one place a chat template is applied.

    Args:
        prompt: a str, a list of chat messages (``{"role": ..., "content": ...}``) or token ids.
            A str goes through the chat template when the tokenizer has one (as in mlx-lm's CLI),
            else it is encoded as is; messages go through it, or without one ``plain_chat``;
            token ids pass through.
        system: a system message put first (ignored for raw text and token ids).
        template_options: for the template, e.g. ``tools=[...]``.
    """
    if isinstance(prompt, str):
        if not has_chat_template(tokenizer):
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    elif not (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)):
        return list(prompt)  # token ids
    messages = ([{"role": "system", "content": system}] if system else []) + list(prompt)
    if not has_chat_template(tokenizer):
        return tokenizer.encode(plain_chat(messages))
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_options)


def has_chat_template(tokenizer) -> bool:
    """Whether ``apply_chat_template`` has a template to apply (mlx-lm's wrapper also counts a tokenizer
    class that renders chats itself; T5's and plain tokenizers may have neither attribute)."""
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


# Roles as mlx_lm.server writes a chat for a tokenizer without a chat template.
PLAIN_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}


def plain_chat(messages: Sequence[dict]) -> str:
    """Chat messages as plain text, for a tokenizer without a chat template (as mlx_lm.server renders
    them): a line per message after its role, then ``ASSISTANT:`` for the answer."""
    lines = "".join(f"{PLAIN_ROLES.get(m['role'], '')}{m.get('content') or ''}\n" for m in messages)
    return (lines + PLAIN_ROLES["assistant"]).rstrip()


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], **kwargs) -> Iterator[Response]:
    """Like ``generate_step`` but takes a str or token ids and yields text segments
    (``Response``); stops at the tokenizer's EOS unless ``eos_token_ids`` says otherwise."""
    eos = kwargs.pop("eos_token_ids", None)
    eos = eos_ids_of(tokenizer) if eos is None else set(eos)
    text = TextStream(tokenizer)
    last = kwargs.get("max_tokens", 256)  # generate_step's default
    for count, (token, source) in enumerate(generate_step(encode(tokenizer, prompt), model, eos_token_ids=eos,
                                                          **kwargs), 1):
        # The last token (EOS, or the max_tokens-th) also gives what the stream still holds.
        segment = text.finish() if token in eos else text.add(token) + (text.finish() if count == last else "")
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
        lines = ["=" * 10,
                 f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec",
                 f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
                 f"Peak memory: {self.peak_memory_gb:.3f} GB",
                 f"Target forward passes: {passes} ({passes / max(self.generation_tokens, 1):.3f} per token)"]
        if self.stats.sources:
            proposed, accepted = self.stats.draft_proposed, self.stats.draft_accepted
            lines.append(f"Drafted: {proposed} tokens, accepted: {accepted} ({accepted / max(proposed, 1):.1%})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "target_forward_passes": self.stats.target_forward_passes,
            "forward_passes_per_token": self.stats.target_forward_passes / max(self.generation_tokens, 1),
            "draft_proposed": self.stats.draft_proposed,
            "draft_accepted": self.stats.draft_accepted,
            "acceptance_rate": self.stats.draft_accepted / max(self.stats.draft_proposed, 1),
            "draft_sources": {name: s.summary() for name, s in self.stats.sources.items()},
            "generation_tps": self.generation_tps,
            "prompt_tps": self.prompt_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "finish_reason": self.finish_reason,
            "verification_cost": self.stats.pass_cost.summary() if self.stats.pass_cost else None,
        }


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], verbose: bool = False, on_token=None,
             **kwargs) -> GenerationResult:
    """Run ``stream_generate`` to the end.

    Args:
        prompt: a str (chat template applied when the tokenizer has one) or token ids.
        verbose: print the text as it comes, then mlx-lm-style statistics.
        on_token: called with each ``Response``.
        kwargs: ``generate_step``'s (draft_sources, constraint, temp, sampler, max_tokens, ...).
    """
    prompt = encode(tokenizer, prompt)  # token ids from here on, which stream_generate passes through
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
        generation_tps=(len(tokens) - 1) / decode_time if len(tokens) > 1 and decode_time > 0 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        stats=stats,
    )
    if verbose:
        print()
        print(result.report())
    return result
