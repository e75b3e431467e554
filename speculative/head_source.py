"""A draft source backed by a trained draft head (speculative/head.py) or a model's MTP layers
(mtp_source.py), for one row or many.

The head reads the target's hidden states at the accepted positions. ``HiddenStateTap`` wraps the
target so the loops run it like any mlx-lm model; on every call it writes the features the head
reads into one more layer of the cache (``FeatureRows``, an ``ExtraRows`` the cache carries without
knowing what it holds), so they roll back, join and leave with the rows.

One ``HeadDrafter`` (a ``drafter.SharedDrafter``) holds the head's cache for every row that drafts
with it, and each row holds a ``DraftHeadSource`` of it. It reads the features of the cache a batch
tells it (``draft_all``), or alone those of the tap's last call.

    tap, drafter = HeadDrafter.create(target)              # run the loops on tap
    generate(tap, tokenizer, prompt, draft_sources=[drafter.source()])     # one row
    gen = BatchGenerator(tap, drafters=[drafter])                          # a batch
    gen.insert(prompts, draft_sources=[[drafter.source()] for _ in prompts])
"""

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from decoder.cache import Cache, ExtraRows, layers_of, make_cache
from decoder.kinds import KVRows
from speculative.adaptive import weight_bytes
from speculative.drafter import ALTERNATIVES, SharedDrafter, SharedSource, draw_rows
from speculative.head import FINAL, body_with_features, logits_from_hidden
from speculative.head_loading import load_head

CATCH_UP_CHUNK = 512  # positions per head call when reading a prompt (as the target's prefill)


class FeatureRows(KVRows, ExtraRows):
    """The target's hidden states per row and position, for a draft head or MTP layers: the tap
    writes each call's features where the model writes its keys, so they filter, extend, realign
    and extract with the rows. A rewind leaves them be, since the next write lands at the model's
    position and drops what lay past it: the accepted tokens of a pass a recurrent row went back
    on keep their features until fed again."""

    def for_rows(self, rows: int) -> "FeatureRows":
        return FeatureRows(rows)

    def extract(self, row: int) -> Optional[tuple]:
        return None if self.keys is None else super().extract(row)

    def arrays(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]

    def write(self, features: mx.array, positions: Optional[Sequence[int]] = None):
        """``features`` (B, L, d) at each row's position ``positions[b]`` (the model's; None: at its
        own end)."""
        for row, position in enumerate(positions or []):
            first, held = self.available(row)
            if first <= position < held:
                self.trim_rows([held - position if b == row else 0 for b in range(self.rows)])
            # the row holds none of the positions before: it starts again there
            elif position != held:
                starts, origins = list(self.starts), list(self.origins)
                starts[row], origins[row] = self.ends[row], self.ends[row] - position
                self._set(starts, self.ends, origins)
        batch, length, _ = features.shape
        self.update_and_fetch(features[:, None], mx.zeros((batch, 1, length, 0), features.dtype))

    def available(self, row: int) -> tuple:
        """``(first, stop)``: the positions row ``row`` holds features for."""
        return self.starts[row] - self.origins[row], self.ends[row] - self.origins[row]

    def read(self, row: int, start: int, stop: int) -> mx.array:
        """Row ``row``'s features at positions ``[start, stop)``, (stop - start, d); ``available``
        says which."""
        origin = self.origins[row]
        return self.keys[row, 0, origin + start : origin + stop]


class HiddenStateTap:
    """The target, writing the features a head reads into the cache's ``FeatureRows`` layer on every
    call: its final hidden states, or the outputs of the layers in ``feature_layers``. Looks like
    the wrapped mlx-lm model (``layers``, ``args`` are the target's); ``make_cache`` adds the
    feature layer."""

    def __init__(self, target, feature_layers=(FINAL,)):
        self.target, self.feature_layers = target, feature_layers
        self.features = None  # the FeatureRows its last call wrote into

    def __getattr__(self, name):
        return getattr(self.target, name)

    def make_cache(self) -> list:
        return make_prompt_cache(self.target) + [FeatureRows(1)]

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        features = cache[-1] if cache and isinstance(cache[-1], FeatureRows) else None
        model_cache = cache[:-1] if features is not None else cache
        positions = model_positions(model_cache, features.rows) if features is not None else None
        hidden, found = body_with_features(self.target, inputs, self.feature_layers, model_cache)
        if features is not None:
            features.write(found, positions)
            self.features = features
        return logits_from_hidden(self.target, hidden)

    def features_of(self, cache: Optional[Cache]) -> Optional["FeatureRows"]:
        """The features ``cache`` keeps (a cache the tap made), or, for None, those of its last
        call (one row alone, which the target just ran)."""
        if cache is None:
            return self.features
        last = cache.layers[-1] if cache.layers else None
        return last if isinstance(last, FeatureRows) else None


def model_positions(cache: list, rows: int) -> Optional[list]:
    """Each row's position in the model's cache before a call (where its first input goes); None for
    a model of recurrent layers only, whose layers do not count."""
    layer = next((layer for layer in layers_of(cache) if layer.is_trimmable()), None)
    if layer is None:
        return None
    if hasattr(layer, "origins"):  # the cache layer's rows
        return [end - origin for end, origin in zip(layer.ends, layer.origins)]
    return [layer.offset] * rows  # one row of an mlx-lm cache


class DraftHeadSource(SharedSource):
    """One row's source on a ``HeadDrafter`` (``SharedSource``): made by ``HeadDrafter.source``."""

    name = "draft_head"

    @property
    def cache(self) -> Cache:
        """The head's cache, of this row alone (for tests of one row)."""
        return self.drafter.cache

    @property
    def committed(self) -> int:
        """Head cache positions read from true features and accepted tokens."""
        rows = self.drafter.rows
        return self.drafter.committed[rows.index(self)] if self in rows else 0


class HeadDrafter(SharedDrafter):
    """A draft head (or MTP layers) drafting for one row or many at once.

    Args:
        tap: the ``HiddenStateTap`` the loop runs as its model (its target embeds the tokens).
        head, vocab_ids: from ``load_head``; the head scores with ``head.logits``, over the tokens
            ``vocab_ids`` names.
        source_class: what ``source`` makes (``DraftHeadSource``, or ``MTPSource``).
        num_draft, adaptive, max_draft: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once the head's top probability falls below this.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed.
        min_path_confidence: a row stops drafting once the product of the head's top probabilities
            at the positions drafted so far (the chance that all are accepted, if the head is
            calibrated) falls below this. Default: what a drafted token costs (``token_cost``) when
            adaptive (a further token is then worth less than it costs), else 0 (off).
    """

    min_tokens = 2  # position p reads (h_p, x_{p+1})
    # A tree grows as EAGLE-2's: the model runs from as many nodes per depth as it offers other
    # children per node, so a depth weighs (ALTERNATIVES + 1) * ALTERNATIVES candidates. The
    # copies of its cache rows and the wider call count in its measured time per position.
    tree_width = ALTERNATIVES

    def __init__(
        self,
        tap: HiddenStateTap,
        head,
        vocab_ids: mx.array,
        source_class=DraftHeadSource,
        num_draft: int = 4,
        adaptive: bool = True,
        max_draft: int = 8,
        min_confidence: float = 0.0,
        draft_cost_prior: float = 0.06,
        min_path_confidence: Optional[float] = None,
    ):
        options = dict(num_draft=num_draft, max_draft=max(max_draft, num_draft), adaptive=adaptive)
        super().__init__(source_class, options, draft_cost_prior, CATCH_UP_CHUNK)
        self.tap, self.head = tap, head
        self.vocab_ids, self.vocab_list = vocab_ids, vocab_ids.tolist()
        self.vocab_size = tap.target.args.vocab_size
        self.embed = tap.target.model.embed_tokens
        self.min_confidence, self.path_confidence_option = min_confidence, min_path_confidence
        self.committed = []  # per row, positions its cache holds

    @classmethod
    def create(cls, target, head_dir=None, source_class=DraftHeadSource, **kwargs):
        """Load a head for ``target`` (ours or a published EAGLE head, see ``load_head``); returns
        ``(tap, drafter)``: run the loop on ``tap``."""
        head, vocab_ids = load_head(head_dir, target)
        return cls.around(target, head, vocab_ids, source_class, **kwargs)

    @classmethod
    def around(cls, target, head, vocab_ids: mx.array, source_class=DraftHeadSource, **kwargs):
        """``(tap, drafter)`` for a loaded ``head``. A draft step reads the head and the target's
        output rows it scores with (``output_bytes``), in bytes: a 4-bit target reads less than
        its parameters say."""
        tap = HiddenStateTap(target, head.feature_layers)
        kwargs.setdefault(
            "draft_cost_prior", (weight_bytes(head) + head.output_bytes) / weight_bytes(target)
        )
        return tap, cls(tap, head, vocab_ids, source_class, **kwargs)

    def _drop_row(self, index: int):
        del self.committed[index]

    def _path_stop(self, source: DraftHeadSource) -> float:
        if self.path_confidence_option is not None:
            return self.path_confidence_option
        return source.token_cost() if source.length.enabled else 0.0

    def _prepare(self, requests: list, cache) -> tuple:
        """Rows drafting for the first time join (empty); a source reset for a new generation
        starts over. Each row reads the features of positions ``[start, stop)``: position p reads
        (h_p, x_{p+1}), and the target has run up to len(tokens) - 2."""
        features = self.tap.features_of(cache)
        if features is None:
            raise ValueError(
                "the draft head has no hidden states: run the loop on the HiddenStateTap from "
                "HeadDrafter.create (not the bare model), with a cache it made"
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
            # Nothing new since the last draft: read the last position again. Positions the
            # target's cache has no features for (a prompt cache made without them) are skipped.
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
