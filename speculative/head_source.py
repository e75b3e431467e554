"""A draft source backed by a trained draft head (speculative/head.py) or a model's MTP layers
(mtp_source.py), for one row or many.

The head reads the target's hidden states at the accepted positions. ``HiddenStateTap`` wraps the
target so the loops run it like any mlx-lm model; on every call it writes the features the head
reads into one more layer of the cache (``cache.FeatureRows``), so they roll back, join and leave
with the rows, and the loop tells each row's source where its row is (``DraftSource.locate``).

One ``HeadDrafter`` holds the head's cache for every row that drafts with it, and each row gets a
``DraftHeadSource``, its handle (as ``DraftModel`` and ``DraftModelSource``). Each step
``draft_all`` feeds every drafting row the positions it has not read (right-padded to the longest;
each row then drops its padding), then drafts all rows together, one head call per draft position.

    tap, source = DraftHeadSource.create(target)           # one row: run the loop on tap
    generate(tap, tokenizer, prompt, draft_sources=[source])
    tap, drafter = HeadDrafter.create(target)              # a batch: BatchGenerator(tap, ...)
    gen.insert(prompts, draft_sources=[[drafter.source()] for _ in prompts])
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from decoder.cache import Cache, FeatureRows, layers_of, make_cache
from decoder.cost import PassCost
from decoder.draft import Draft
from speculative.adaptive import Drafter, DrafterHandle, draw_rows, weight_bytes
from speculative.head import FINAL, body_with_features, logits_from_hidden
from speculative.head_loading import load_head

CATCH_UP_CHUNK = 512  # positions per head call when reading a prompt (as the target's prefill)


class HiddenStateTap:
    """The target, writing the features a head reads into the cache's ``FeatureRows`` layer on every
    call: its final hidden states, or the outputs of the layers in ``feature_layers``. Looks like
    the wrapped mlx-lm model (``layers``, ``args`` are the target's); ``make_cache`` adds the
    feature layer."""

    def __init__(self, target, feature_layers=(FINAL,)):
        self.target, self.feature_layers = target, feature_layers

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
        return logits_from_hidden(self.target, hidden)


def model_positions(cache: list, rows: int) -> Optional[list]:
    """Each row's position in the model's cache before a call (where its first input goes); None for
    a model of recurrent layers only, whose layers do not count."""
    layer = next((layer for layer in layers_of(cache) if layer.is_trimmable()), None)
    if layer is None:
        return None
    if hasattr(layer, "origins"):  # the cache layer's rows
        return [end - origin for end, origin in zip(layer.ends, layer.origins)]
    return [layer.offset] * rows  # one row of an mlx-lm cache


class DraftHeadSource(DrafterHandle):
    """One row's handle on a ``HeadDrafter`` (``DrafterHandle``).

    Args:
        tap: the ``HiddenStateTap`` the loop runs as its model.
        head, vocab_ids, num_draft, adaptive, max_draft, min_confidence, draft_cost_prior,
            min_path_confidence: ``HeadDrafter``'s; a source built this way has its own (one row).
    """

    name = "draft_head"

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
        drafter = HeadDrafter(
            tap,
            head,
            vocab_ids,
            type(self),
            num_draft,
            adaptive,
            max_draft,
            min_confidence,
            draft_cost_prior,
            min_path_confidence,
        )
        self._bind(drafter, num_draft, max_draft, adaptive)

    @classmethod
    def create(cls, target, head_dir=None, **kwargs):
        """Load a head for ``target`` (ours or a published EAGLE head, see ``load_head``);
        returns ``(tap, source)``: run the loop on ``tap``."""
        tap, drafter = HeadDrafter.create(target, head_dir, cls, **kwargs)
        return tap, drafter.source()

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        """A new generation: the head reads it from its first position."""
        super().reset(cost, temp, top_p)
        self.fresh, self.features, self.row = True, None, 0

    def locate(self, cache: Cache, row: int):
        self.features, self.row = cache.features, row

    @property
    def min_path_confidence(self) -> float:
        if self.drafter.path_confidence_option is not None:
            return self.drafter.path_confidence_option
        return self.token_cost() if self.length.enabled else 0.0

    @property
    def cache(self) -> Cache:
        """The head's cache, of this row alone (for tests of one row)."""
        return self.drafter.cache

    @property
    def committed(self) -> int:
        """Head cache positions read from true features and accepted tokens."""
        rows = self.drafter.rows
        return self.drafter.committed[rows.index(self)] if self in rows else 0


class HeadDrafter(Drafter):
    """A draft head (or MTP layers) drafting for one row or many at once.

    Args:
        tap: the ``HiddenStateTap`` the loop runs as its model (its target embeds the tokens).
        head, vocab_ids: from ``load_head``; the head scores with ``head.logits``, over the tokens
            ``vocab_ids`` names.
        handle_class: what ``source`` makes (``DraftHeadSource``, or ``MTPSource``).
        num_draft, adaptive, max_draft: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once the head's top probability falls below this.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed.
        min_path_confidence: a row stops drafting once the product of the head's top probabilities
            at the positions drafted so far (the chance that all are accepted, if the head is
            calibrated) falls below this. Default: what a drafted token costs (``token_cost``) when
            adaptive (a further token is then worth less than it costs), else 0 (off).
    """

    def __init__(
        self,
        tap: HiddenStateTap,
        head,
        vocab_ids: mx.array,
        handle_class=DraftHeadSource,
        num_draft: int = 4,
        adaptive: bool = True,
        max_draft: int = 8,
        min_confidence: float = 0.0,
        draft_cost_prior: float = 0.06,
        min_path_confidence: Optional[float] = None,
    ):
        super().__init__(
            handle_class,
            dict(num_draft=num_draft, max_draft=max(max_draft, num_draft), adaptive=adaptive),
            draft_cost_prior,
        )
        self.tap, self.head = tap, head
        self.vocab_ids, self.vocab_list = vocab_ids, vocab_ids.tolist()
        self.vocab_size = tap.target.args.vocab_size
        self.embed = tap.target.model.embed_tokens
        self.min_confidence, self.path_confidence_option = min_confidence, min_path_confidence
        # handles in cache order; per row, positions its cache holds
        self.rows, self.committed = [], []
        self.cache = None

    @classmethod
    def create(cls, target, head_dir=None, handle_class=DraftHeadSource, **kwargs):
        """Load a head for ``target`` (``load_head``); returns ``(tap, drafter)``: run the loop on
        ``tap``."""
        head, vocab_ids = load_head(head_dir, target)
        return cls.around(target, head, vocab_ids, handle_class, **kwargs)

    @classmethod
    def around(cls, target, head, vocab_ids: mx.array, handle_class=DraftHeadSource, **kwargs):
        """``(tap, drafter)`` for a loaded ``head``. A draft step reads the head and the target's
        output
        rows it scores with (``output_bytes``), in bytes: a 4-bit target reads less than its
        parameters say."""
        tap = HiddenStateTap(target, head.feature_layers)
        kwargs.setdefault(
            "draft_cost_prior", (weight_bytes(head) + head.output_bytes) / weight_bytes(target)
        )
        return tap, cls(tap, head, vocab_ids, handle_class, **kwargs)

    def remove(self, handle: DraftHeadSource):
        """The row left the batch."""
        if handle in self.rows:
            index = self.rows.index(handle)
            keep = [i for i in range(len(self.rows)) if i != index]
            del self.rows[index], self.committed[index]
            if keep:
                self.cache.filter(keep)
            else:
                self.cache = None

    def _sync(self, requests: list) -> list:
        """Rows drafting for the first time join (empty); a handle reset for a new generation starts
        over. Returns, per row, the positions ``(start, stop)`` of features it reads now (None where
        it
        does not draft): position p reads (h_p, x_{p+1}), and the target has run up to len(tokens) -
        2."""
        joining = [handle for handle, _, _ in requests if handle not in self.rows]
        if joining:
            new = make_cache(self.head, len(joining))
            if self.cache is None:
                self.cache = new
            else:
                self.cache.extend(new)
            self.rows += joining
            self.committed += [0] * len(joining)
        reads = [None] * len(self.rows)
        for handle, tokens, _ in requests:
            if handle.features is None:
                raise ValueError(
                    "the draft head has no hidden states: run the loop on the HiddenStateTap from "
                    "DraftHeadSource.create (not the bare model), with a cache it made"
                )
            row, stop = self.rows.index(handle), len(tokens) - 1
            committed = 0 if handle.fresh else self.committed[row]
            handle.fresh = False
            # Nothing new since the last draft: read the last position again. Positions the target's
            # cache has no features for (a prompt cache made without them) are skipped: drafts
            # suffer.
            start = max(min(committed, stop - 1), handle.features.available(handle.row)[0])
            if start < stop:
                reads[row] = (start, stop)
        self.cache.rewind(
            [self.cache.held(row) - read[0] if read else 0 for row, read in enumerate(reads)]
        )
        self.committed = [read[0] if read else held for read, held in zip(reads, self.committed)]
        return reads

    def _catch_up(self, requests: list, reads: list) -> mx.array:
        """Feed each drafting row the positions it has not read; returns each row's last prediction
        (R, d)."""
        tokens_of = {id(handle): tokens for handle, tokens, _ in requests}
        longest = max(stop - start for start, stop in filter(None, reads))
        predicted = None
        for offset in range(0, longest, CATCH_UP_CHUNK):
            spans = [
                None
                if read is None or read[0] + offset >= read[1]
                else (read[0] + offset, min(read[1], read[0] + offset + CATCH_UP_CHUNK))
                for read in reads
            ]
            found = {
                row: handle.features.read(handle.row, *span)
                for row, (handle, span) in enumerate(zip(self.rows, spans))
                if span
            }
            lengths = [span[1] - span[0] if span else 0 for span in spans]
            width, example = max(lengths), next(iter(found.values()))
            features = mx.stack(
                [
                    mx.pad(found[row], [(0, width - n), (0, 0)])
                    if n
                    else mx.zeros((width, example.shape[-1]), example.dtype)
                    for row, n in enumerate(lengths)
                ]
            )
            tokens = [
                tokens_of[id(handle)][span[0] + 1 : span[1] + 1] + [0] * (width - n)
                if span
                else [0] * width
                for handle, span, n in zip(self.rows, spans, lengths)
            ]
            out = self.head(features, self.embed(mx.array(tokens)), cache=self.cache.layers)
            self.cache.rewind([width - n for n in lengths])
            last = out[mx.arange(len(self.rows)), mx.array([max(n - 1, 0) for n in lengths])]
            has = mx.array([n > 0 for n in lengths])[:, None]
            predicted = last if predicted is None else mx.where(has, last, predicted)
        self.committed = [read[1] if read else held for read, held in zip(reads, self.committed)]
        return predicted

    def draft_all(self, requests: list, cost: PassCost, batch_rows: int):
        """Draft for every row: ``requests`` holds ``(handle, tokens, max_draft)`` for each of the
        target's rows that drafts with this head; ``batch_rows`` is the target's batch size."""
        self._begin(requests, batch_rows)
        limits = {
            id(handle): max_draft if len(tokens) >= 2 else 0
            for handle, tokens, max_draft in requests
        }
        # next_length counts a paused step, so it is asked once per step.
        requests = [
            (h, t, m)
            for h, t, m in requests
            if limits[id(h)] > 0 and min(h.length.next_length(h.token_cost()), m) > 0
        ]
        if not requests:
            return  # the head catches up in one call when drafting resumes
        tic = cost.clock()
        reads = self._sync(requests)
        if not any(reads):
            return
        lengths = {id(h): min(h.num_draft, m) for h, _, m in requests}
        predicted = self._catch_up(requests, reads)
        drafts, positions = self._chain(
            predicted, [lengths.get(id(h), 0) if read else 0 for h, read in zip(self.rows, reads)]
        )
        self._time(cost, cost.clock() - tic, positions)
        for handle, (tokens, rows) in zip(self.rows, drafts):
            if not tokens:
                continue
            if handle.temp == 0:
                handle.draft = Draft(tokens)
            else:  # q on the whole vocabulary: zero outside the sub-vocabulary
                probs = mx.zeros((len(tokens), self.vocab_size), mx.float32)
                probs[:, self.vocab_ids] = mx.stack(rows)
                handle.draft = Draft(tokens, probs)

    def _chain(self, predicted: mx.array, lengths: list) -> tuple:
        """Draft up to ``lengths[r]`` tokens per row from its prediction, the head reading its own
        output after the first; returns per row ``(tokens, q rows)`` and the positions drafted. One
        sync per
        position: the confidence stops need the values, and the next call the tokens."""
        drafts = [([], []) for _ in self.rows]
        alive, path = [n > 0 for n in lengths], [1.0] * len(self.rows)
        stops = [h.min_path_confidence if n else 0.0 for h, n in zip(self.rows, lengths)]
        fed = 0
        for position in range(max(lengths)):
            indices, confidence, probs = draw_rows(self.head.logits(predicted), self.rows)
            mx.eval(indices, confidence)
            index_list, confidence_list = indices.tolist(), confidence.tolist()
            for row, (tokens, rows) in enumerate(drafts):
                # The top probability, not the drawn token's: whether to draft position i must not
                # depend on the token drawn there, or sampling would no longer be exact.
                path[row] *= confidence_list[row]
                if (
                    alive[row]
                    and position
                    and (path[row] < stops[row] or confidence_list[row] < self.min_confidence)
                ):
                    alive[row] = False
                if alive[row] and position < lengths[row]:
                    tokens.append(self.vocab_list[index_list[row]])
                    rows.append(probs[row])
            if position + 1 == max(lengths) or not any(alive):
                break
            next_embeddings = self.embed(self.vocab_ids[indices])[:, None]
            predicted = self.head(predicted[:, None], next_embeddings, cache=self.cache.layers)[
                :, -1
            ]
            fed += 1
        self.cache.rewind([fed] * len(self.rows))
        return drafts, fed + 1
