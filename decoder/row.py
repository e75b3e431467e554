"""One sequence being decoded, shared by every loop (``Row``: its draft, its accept rule, what its
cache keeps, what it emits), and the statistics of how the drafts fared. The step that runs many
rows through one pass is ``decoder.step``."""

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import mlx.core as mx

from .accept import accept_path
from .cache import Cache
from .constrain import constrain_draft, constrain_tree
from .draft import Constraint, ConstraintError, Draft, DraftSource, choose_draft
from .pass_cost import PassCost
from .processors import process_logits
from .sampling import Sampling
from .tree import kept_slots, path_to

TARGET = "target"  # the source name of tokens the target model chose itself


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
    prompt_cache_tokens: int = 0  # of the prompt, restored from a cache instead of prefilled
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


class Plan(NamedTuple):
    """A row's step before the pass: its draft, the source that offered it, the constraint's
    masks."""

    draft: Draft  # cut to what the constraint allows
    source: Optional[DraftSource]
    masks: Optional[mx.array]  # (len(draft) + 1, vocab), or None without a constraint


MAX_PENDING = 16  # accepted tokens to feed again past which a row drafts nothing


class Row:
    """One sequence being decoded: ``plan`` -> ``decoder.step.verify_step`` (``process``,
    ``accept``, ``commit``) -> ``emit``, in ``generate_step`` and in ``batch.BatchGenerator``."""

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        eos_token_ids: Sequence[int] = (),
        draft_sources: Sequence[DraftSource] = (),
        constraint: Optional[Constraint] = None,
        sampling: Sampling = Sampling(),
        logits_processors: Sequence[Callable] = (),
        sampler: Optional[Callable] = None,
        max_tokens: int = 256,
        stats: Optional[DecodingStats] = None,
        max_nodes: Optional[int] = None,
        seed: Optional[int] = None,
    ):
        self.tokens = list(prompt)  # prompt and accepted tokens, grown in place
        self.sources, self.constraint = list(draft_sources), constraint
        self.sampling, self.sampler = sampling, sampler
        self.logits_processors = list(logits_processors or ())
        self.max_tokens, self.eos_token_ids = max_tokens, set(eos_token_ids)
        self.stats = stats if stats is not None else DecodingStats()
        self.num_generated = 0
        self.cached = 0  # how many of the tokens the loop's cache holds (the loop keeps this)
        self.finish_reason = self.stats.finish_reason = None if max_tokens > 0 else "length"
        # Draft trees of at most this many nodes (0: as many as pay); None: chains. A user sampler
        # verifies chains only.
        self.max_nodes = max_nodes if sampler is None else None
        self.path = []  # the nodes of the last draft the row accepted (``accept``)
        # The row's own random stream (split each sampled step), so that its draws do not depend
        # on the other rows of a batch; None: MLX's global stream.
        self.key = None if seed is None else mx.random.key(seed)

    def reset(self, cost: PassCost, cache: Optional[Cache] = None):
        """Start the sources and the constraint over, before the first step; ``cache``: the one-row
        loop's, for its sources' drafters."""
        # With an mlx-lm sampler, q plays no part in acceptance: model sources draft greedily.
        # Otherwise they draw from the processed, truncated distribution, as the target does.
        sampling, processors = self.sampling, self.logits_processors
        if self.sampler is not None:
            sampling, processors = Sampling(), ()
        for source in self.sources:
            source.reset(sampling, processors, cost)
            if cache is not None and source.drafter is not None:
                source.drafter.use_cache(cache)  # a head reads that cache's hidden states
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
        """The most draft tokens a step can use: the target adds one of its own, within
        max_tokens."""
        return self.max_tokens - self.num_generated - 1

    def nodes_this_step(self, trees: bool) -> Optional[int]:
        """The ``max_nodes`` a draft asks for this step: the row's, or a chain (None) on a step
        that ``TreeChoice`` gave to chains."""
        return self.max_nodes if trees else None

    def plan(
        self,
        cost: Optional[PassCost] = None,
        sources: Optional[Sequence[DraftSource]] = None,
        trees: bool = True,
        room: Optional[int] = None,
    ) -> Plan:
        """This step's draft, cut to what the constraint allows, and the constraint's masks.
        ``sources``: the ones to ask (default: all the row's); ``cost`` times each ``propose``
        (None: not timed); ``trees`` False: a chain this step (``TreeChoice``); ``room``: the most
        tokens the pass may feed (``Cache.until_quantized``), a chain then."""
        sources = self.sources if sources is None else sources
        if len(self.tokens) - self.cached > MAX_PENDING:
            sources = []  # a plain pass keeps all it feeds, where a rejected draft would add more
        max_nodes, max_draft = self.nodes_this_step(trees), self.max_draft
        if room is not None:  # the pass feeds the pending token and the draft
            max_nodes, max_draft = None, min(max_draft, room - 1)
            sources = sources if max_draft > 0 else []
        draft, source = choose_draft(sources, self.tokens, max_draft, cost, max_nodes)
        masks = None
        if self.constraint is not None:
            if draft.parents is None:
                draft, masks = constrain_draft(self.constraint, draft)
            else:  # each node masked after its own path; forced text drafted below each leaf
                draft, masks = constrain_tree(self.constraint, draft, max_draft)
            if not draft.tokens:
                source = None
        return Plan(draft, source, masks)

    def process(self, logits: mx.array, draft: Draft) -> mx.array:
        """The pass's (width, vocab) logits of this row, its draft's positions through its logits
        processors (``process_logits``); positions past them are padding, left as they are."""
        if not self.logits_processors:
            return logits
        scored = len(draft.tokens) + 1
        if draft.parents is None:
            processed = process_logits(
                self.logits_processors, self.tokens, draft.tokens, logits[:scored]
            )
        else:  # each node after the tokens of its own path
            paths = [[]] + [path_to(draft.parents, node) for node in range(len(draft.tokens))]
            processed = mx.concatenate(
                [
                    process_logits(
                        self.logits_processors,
                        self.tokens + draft.path_tokens(path),
                        [],
                        logits[index : index + 1],
                    )
                    for index, path in enumerate(paths)
                ]
            )
        return (
            mx.concatenate([processed, logits[scored:]]) if logits.shape[0] > scored else processed
        )

    @property
    def greedy(self) -> bool:
        """Whether the row accepts by the argmax alone (temperature 0, no mlx-lm sampler)."""
        return self.sampler is None and self.sampling.temp == 0

    def accept(self, logits: mx.array, draft: Draft, argmax: Optional[list] = None) -> tuple:
        """``(num_accepted, next_token)`` from the (len(draft) + 1, vocab) logits of the draft's
        positions (masked), by the row's rule (``accept_path``); ``argmax``: their argmax, where
        the step has it on the host already."""
        key = self._step_key() if self.sampler is None and not self.greedy else None
        self.path, next_token = accept_path(logits, draft, self.sampling, self.sampler, argmax, key)
        return len(self.path), next_token

    @property
    def scored_at(self) -> int:
        """After ``accept``: the pass position whose scores gave the target's own token (after the
        last accepted node; of a chain, the number accepted)."""
        return self.path[-1] + 1 if self.path else 0

    def _step_key(self) -> Optional[mx.array]:
        """This sampled step's key from the row's own stream (None: MLX's global stream)."""
        if self.key is None:
            return None
        self.key, step_key = mx.random.split(self.key)
        return step_key

    def kept(self, draft: Draft) -> Optional[list]:
        """After ``accept`` of a tree: the pass slots the row keeps, in order (its pending tokens
        and accepted path), for ``Cache.compact``; None for a chain. Before ``commit``."""
        if draft.parents is None:
            return None
        return kept_slots(len(self.pending), self.path)

    def commit(self, cache: Cache, pass_width: int, num_drafted: int, num_accepted: int) -> tuple:
        """``(trim, restore)``: how many of the pass's last tokens the row's cache drops and whether
        it goes back to its checkpoint (its accepted tokens are then fed again). Before ``emit``."""
        fed = len(self.tokens) - self.cached
        if cache.must_restore(num_drafted, num_accepted):
            return pass_width, True
        self.cached += fed + num_accepted
        return pass_width - fed - num_accepted, False

    def forbidden(self, num_accepted: int) -> ConstraintError:
        """The error for a step whose own token the constraint forbids (all scores -inf)."""
        return ConstraintError(
            f"the model gave no allowed token a usable score (NaN or -inf) "
            f"at generated token {self.num_generated + num_accepted + 1}"
        )

    def emit(self, plan: Plan, draft: Draft, num_accepted: int, next_token: int) -> tuple:
        """Commit a verified step; returns ``(tokens, sources)`` emitted. ``draft`` is what was
        verified (``plan.draft``, or less where the batch's width cut it)."""
        drafted_by = plan.source if draft.tokens else None
        self.stats.target_forward_passes += 1
        emitted = draft.path_tokens(self.path[:num_accepted]) + [next_token]
        # Up to EOS or max_tokens: accepted tokens past that are neither emitted nor counted.
        stop = next(
            (i + 1 for i, token in enumerate(emitted) if token in self.eos_token_ids), len(emitted)
        )
        emitted = emitted[: min(stop, self.max_tokens - self.num_generated)]
        num_accepted, num_proposed = min(num_accepted, len(emitted)), len(draft.tokens)
        if drafted_by is not None:
            self.stats.source(drafted_by.name).record(num_proposed, num_accepted)
        sources = [drafted_by.name if i < num_accepted else TARGET for i in range(len(emitted))]
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
                proposed = num_proposed if source is drafted_by else 0
                source.update(self.tokens, proposed, num_accepted if proposed else 0)
        self.stats.finish_reason = self.finish_reason
        return emitted, sources
