"""Drafting from the target's hidden states (a ``HiddenStateTap``'s), for one row or many: the
template a draft head (draft_head/) and MTP layers (mtp/) fill in.

    tap, drafter = HeadDrafter.create(target)              # run the loops on tap
    generate(tap, tokenizer, prompt, draft_sources=[drafter.source()])     # one row
    gen = BatchGenerator(tap, drafters=[drafter])                          # a batch
    gen.insert(prompts, draft_sources=[[drafter.source()] for _ in prompts])
"""

from typing import Optional

import mlx.core as mx

from decoder.adaptive import weight_bytes
from decoder.cache import Cache, make_cache
from decoder.hidden_states import HiddenStateTap
from decoder.model_drafter import ALTERNATIVES, SharedDrafter, SharedSource, draw_rows

CATCH_UP_CHUNK = 512  # positions per call when reading a prompt (as the target's prefill)


class HiddenStateSource(SharedSource):
    """One row's source on a ``HiddenStateDrafter``: made by its ``source``."""

    @property
    def cache(self) -> Cache:
        """The head's cache (for tests of one row)."""
        return self.drafter.cache

    @property
    def committed(self) -> int:
        """Head cache positions read from true features and accepted tokens."""
        rows = self.drafter.rows
        return self.drafter.committed[rows.index(self)] if self in rows else 0


class HiddenStateDrafter(SharedDrafter):
    """A small model that drafts from the target's hidden states; a subclass names its
    ``source_class`` and how it is loaded.

    Args:
        head, vocab_ids: from ``load_head``; the head scores the tokens ``vocab_ids`` names.
        min_path_confidence: a row stops once its calibrated chance that all its drafted tokens are
            accepted falls below this. Default: a drafted token's cost when adaptive (a further
            token is then worth less than it costs), else 0 (off).
    """

    source_class = HiddenStateSource
    min_tokens = 2  # position p reads (h_p, x_{p+1})
    # As EAGLE-2: as many nodes per depth as other children per node; the wider call is timed.
    tree_width = ALTERNATIVES

    def __init__(
        self,
        tap: HiddenStateTap,
        head,
        vocab_ids: mx.array,
        num_draft: int = 4,
        adaptive: bool = True,
        max_draft: int = 8,
        min_confidence: float = 0.0,
        draft_cost_prior: float = 0.06,
        min_path_confidence: Optional[float] = None,
    ):
        options = dict(num_draft=num_draft, max_draft=max(max_draft, num_draft), adaptive=adaptive)
        super().__init__(self.source_class, options, draft_cost_prior, CATCH_UP_CHUNK)
        self.tap, self.head = tap, head
        self.vocab_ids, self.vocab_list = vocab_ids, vocab_ids.tolist()
        self.vocab_size = tap.target.args.vocab_size
        self.embed = tap.target.model.embed_tokens
        self.min_confidence, self.path_confidence_option = min_confidence, min_path_confidence
        self.committed = []  # per row, positions its cache holds

    @classmethod
    def around(cls, target, head, vocab_ids: mx.array, **kwargs):
        """``(tap, drafter)`` for a loaded ``head``; the cost prior is in bytes read (the head and
        the output rows it scores with), as a 4-bit target reads less than its parameters say."""
        tap = HiddenStateTap(target, head.feature_layers)
        kwargs.setdefault(
            "draft_cost_prior", (weight_bytes(head) + head.output_bytes) / weight_bytes(target)
        )
        return tap, cls(tap, head, vocab_ids, **kwargs)

    def _drop_row(self, index: int):
        del self.committed[index]

    def _path_stop(self, source: HiddenStateSource) -> float:
        if self.path_confidence_option is not None:
            return self.path_confidence_option
        return source.token_cost() if source.length.enabled else 0.0

    def _prepare(self, requests: list, cache) -> tuple:
        """Each row reads the features of positions ``[start, stop)``: position p reads
        (h_p, x_{p+1}), and the target has run up to len(tokens) - 2."""
        features = self.tap.features_of(cache)
        if features is None:
            raise ValueError(
                f"the {self.source_class.name} drafter has no hidden states: run the loop on the "
                "HiddenStateTap its create returned (not the bare model), with a cache it made"
            )
        joining = [source for source, *_ in requests if source not in self.rows]
        if joining:
            self._add_rows(joining, make_cache(self.head, len(joining)))
            self.committed += [0] * len(joining)
        reads = [None] * len(self.rows)
        for source, tokens, _, slot, *_ in requests:
            row, stop = self.rows.index(source), len(tokens) - 1
            committed = 0 if source.fresh else self.committed[row]
            source.fresh = False
            # Nothing new: read the last position again; skip positions without features.
            start = max(min(committed, stop - 1), features.available(slot)[0])
            if start < stop:
                reads[row] = (start, stop, slot, tokens)
        self.cache.rewind(
            [self.cache.held(row) - read[0] if read else 0 for row, read in enumerate(reads)]
        )
        self.committed = [read[1] if read else held for read, held in zip(reads, self.committed)]

        def feed(offset: int, counts: list, width: int) -> mx.array:
            found, tokens = [], []
            for read, n in zip(reads, counts):
                if not n:
                    found.append(None)
                    tokens.append([0] * width)
                    continue
                start, _, slot, text = read
                rows = features.read(slot, start + offset, start + offset + n)
                found.append(mx.pad(rows, [(0, width - n), (0, 0)]))
                tokens.append(text[start + offset + 1 : start + offset + n + 1] + [0] * (width - n))
            example = next(rows for rows in found if rows is not None)
            found = [mx.zeros_like(example) if rows is None else rows for rows in found]
            return self.head(
                mx.stack(found), self.embed(mx.array(tokens, mx.int32)), cache=self.cache.layers
            )

        return [read[1] - read[0] if read else 0 for read in reads], feed

    def _draw(
        self,
        predicted: mx.array,
        sources: list,
        trees: Optional[list] = None,
        contexts: Optional[list] = None,
    ) -> tuple:
        # processors index the target's vocabulary: a head that scores a part of it goes without
        whole = len(self.vocab_list) == self.vocab_size
        return draw_rows(self.head.logits(predicted), sources, trees, contexts if whole else None)

    def _next(self, predicted: mx.array, indices: mx.array) -> mx.array:
        embeddings = self.embed(self.vocab_ids[indices])[:, None]
        return self.head(predicted[:, None], embeddings, cache=self.cache.layers)[:, -1]

    def _tokens(self, indices: list) -> list:
        return [self.vocab_list[index] for index in indices]

    def _q(self, rows: list) -> mx.array:
        """q on the whole vocabulary: zero outside the sub-vocabulary."""
        probs = mx.zeros((len(rows), self.vocab_size), mx.float32)
        probs[:, self.vocab_ids] = mx.stack(rows)
        return probs
