"""A draft, the protocols of the sources that propose it (``DraftSource``, ``Drafter``) and the
constraints that mask it, and the choice among the sources' drafts (docs/decoder.md)."""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx

from .pass_cost import PassCost
from .sampling import Sampling


class ConstraintError(RuntimeError):
    """No token the constraint allows has a usable score (NaN or -inf)."""


@dataclass
class Draft:
    """Tokens for the next positions. ``probs``: the (len(tokens), vocab) distributions they were
    drawn from, None for a point mass (copies, forced text). ``expected_speedup``: tokens emitted
    per plain step's time the source expects (None: take the draft as it is)."""

    tokens: list
    probs: Optional[mx.array] = None
    expected_speedup: Optional[float] = None
    # A tree (``decoder.tree``): token i follows token ``parents[i]`` (-1: the row's last token),
    # an earlier one. None: a chain. A tree's tokens are point masses (probs None).
    parents: Optional[list] = None
    # A tree's: each token's chance of being accepted, as its source estimates it (the width
    # policy of a batch reads it).
    chances: Optional[list] = None

    def __post_init__(self):
        # An empty draft is a chain of length 0 everywhere: no tree path is entered without nodes.
        if not self.tokens:
            self.parents = self.chances = None

    def truncate(self, length: int) -> "Draft":
        """The first ``length`` tokens (of a tree: still a tree), with their distributions."""
        if len(self.tokens) <= length:
            return self
        probs = None if self.probs is None else self.probs[:length]
        parents = None if self.parents is None else self.parents[:length]
        chances = None if self.chances is None else self.chances[:length]
        return Draft(self.tokens[:length], probs, self.expected_speedup, parents, chances)

    def first_branch(self) -> list:
        """The tokens of a tree's first child at each depth (of a chain: its tokens)."""
        if self.parents is None:
            return self.tokens
        branch, node = [], -1
        for index, parent in enumerate(self.parents):
            if parent == node:
                branch.append(self.tokens[index])
                node = index
        return branch

    def path_tokens(self, path: Sequence[int]) -> list:
        """The tokens of ``path``, node indices into a tree (of a chain: its first tokens)."""
        return [self.tokens[node] for node in path]


class DraftSource:
    """Proposes tokens for one row: a subclass implements ``propose`` and overrides what it uses."""

    name = "draft"
    drafter = None  # the ``Drafter`` drafting for this row with others, or None: it drafts alone

    def reset(
        self,
        sampling: Sampling = Sampling(),
        processors: Sequence = (),
        cost: Optional[PassCost] = None,
    ) -> None:
        """Before each generation: the target's ``sampling`` and logits ``processors`` (a source
        that samples draws as the target does, so that q is close to p) and the loop's ``cost``."""
        self.sampling, self.processors = sampling, tuple(processors)
        self.cost = cost if cost is not None else PassCost()

    def propose(
        self, tokens: list, max_draft: int, max_nodes: Optional[int] = None
    ) -> Optional[Draft]:
        """Tokens to follow ``tokens``: a chain of up to ``max_draft``, or where ``max_nodes`` is a
        count (0: as many as pay) a tree (``Draft.parents``) of that many, ``max_draft`` deep. A
        source of chains may ignore it: the loop cuts a chain to fit (``choose_draft``)."""
        raise NotImplementedError

    def forecast_speedup(self) -> Optional[float]:
        """The ``expected_speedup`` of the draft it would propose now (``choose_draft``)."""
        return None

    def update(self, tokens: list, num_proposed: int, num_accepted: int) -> None:
        """Follow the accepted ``tokens``; ``num_proposed`` is 0 when another source drafted."""


class DraftRequest(NamedTuple):
    """A row asking its source's ``Drafter`` for a draft; ``slot``: its row in the target's cache,
    ``max_nodes``: a tree's (``Row.max_nodes``)."""

    source: DraftSource
    tokens: list
    max_draft: int
    slot: int = 0
    max_nodes: Optional[int] = None


class Drafter:
    """A model drafting for many rows in one call (``model_drafter.SharedDrafter``), each row
    holding one of its sources; a loop calls ``draft_all``, then the sources propose what it
    drafted."""

    prompt_store = None  # a PrefixStore of the cache of its own model (a draft model's)

    def owns(self, source: DraftSource) -> bool:
        return source.drafter is self

    def draft_all(self, requests: Sequence[DraftRequest], cost: PassCost, batch_rows: int, cache):
        """Draft for every row in ``requests``, from the target's ``cache`` of ``batch_rows``."""
        raise NotImplementedError

    def use_cache(self, cache) -> None:
        """The one-row loop's cache, which a source asked alone drafts against."""

    def leave(self, source: DraftSource) -> None:
        """``source``'s row left: what the drafter keeps for it goes."""


class Constraint:
    """A token-level automaton that masks logits (see constrained/)."""

    def reset(self) -> None:
        """Back to the start state, before each generation."""

    def walk(self, draft: list) -> list:
        """The states before each draft token up to the first forbidden one, and after the last
        allowed one (``allowed + 1`` states)."""
        raise NotImplementedError

    def masks(self, states: list) -> mx.array:
        """Boolean (len(states), vocab) masks of the allowed next tokens."""
        raise NotImplementedError

    def advance(self, tokens: list) -> None:
        """Commit accepted tokens."""
        raise NotImplementedError

    def forced_after(self, path: list) -> list:
        """The tokens that must follow draft tokens ``path``, as the model writes them ([] where
        none are known): a tree drafts them below a leaf."""
        return []


def choose_draft(
    draft_sources: Sequence[DraftSource],
    tokens: list,
    max_draft: int,
    cost: Optional[PassCost] = None,
    max_nodes: Optional[int] = None,
) -> tuple:
    """``(draft, source)``: the first non-empty draft of the sources (in priority order), unless
    a later source forecasts a larger ``expected_speedup`` before drafting. The choice never
    depends on tokens drawn this step, so each draft still follows its ``probs``. ``max_nodes``:
    allow trees of that many nodes (``DraftSource.propose``); None: chains."""
    chosen, chosen_source = Draft([]), None
    if max_draft <= 0:
        return chosen, chosen_source
    longest_chain = min(max_draft, max_nodes) if max_nodes else max_draft  # within a tree's budget
    for source in draft_sources:
        if chosen_source is not None:
            forecast = source.forecast_speedup()
            if (
                chosen.expected_speedup is None
                or forecast is None
                or forecast <= chosen.expected_speedup
            ):
                break
        tic = cost.clock() if cost is not None else 0.0
        draft = source.propose(tokens, max_draft, max_nodes)
        if draft is not None and draft.tokens:
            chosen = draft if draft.parents is not None else draft.truncate(longest_chain)
            chosen_source = source
            if cost is not None:
                cost.record_draft(source.name, cost.clock() - tic, len(chosen.tokens))
            if draft.expected_speedup is None:
                break
    return chosen, chosen_source
