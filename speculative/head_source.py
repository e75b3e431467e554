"""A draft source backed by a trained draft head (speculative/head.py).

The head needs the target's hidden states at the accepted positions. ``HiddenStateTap`` wraps the
target so the loop runs it like any mlx-lm model, and keeps the hidden states of each call, keyed
by position. The loop stays untouched: it only sees a model and a draft source.

    tap, source = DraftHeadSource.create(target)
    generate(tap, tokenizer, prompt, draft_sources=[source])
"""

from typing import Optional

import mlx.core as mx
from cache import adopt, layers_of
from cost import PassCost
from decoder import Draft, sampling_probs
from speculative.adaptive import AdaptiveSource, weight_bytes
from speculative.head import FINAL, body_with_features, logits_from_hidden
from speculative.head_loading import load_head

CATCH_UP_CHUNK = 512  # positions per head call when reading a prompt (as the target's prefill)


class HiddenStateTap:
    """The target, keeping the features a head reads from every call (batch size 1): its final hidden states,
    or the outputs of the layers in ``feature_layers``. Looks like the wrapped mlx-lm model (``layers``,
    ``args``, ``make_cache`` are the target's), so ``make_prompt_cache`` and ``trim_prompt_cache`` still work."""

    def __init__(self, target, feature_layers=(FINAL,)):
        self.target, self.feature_layers = target, feature_layers
        self.chunks = []  # (first position, (n, k * d) features), contiguous and in order

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        # The first layer that counts its tokens: a hybrid model's first layers may be recurrent.
        start = next((layer.offset for layer in layers_of(cache) if layer.is_trimmable()), 0) if cache else 0
        hidden, features = body_with_features(self.target, inputs, self.feature_layers, cache)
        # A call at ``start`` overwrites what rejected drafts left at ``start`` and after.
        self.chunks = [(first, rows[: start - first]) for first, rows in self.chunks if first < start]
        self.chunks.append((start, features[0]))
        return logits_from_hidden(self.target, hidden)

    def take(self, start: int, stop: int) -> mx.array:
        """Features at positions [start, stop); then forgets all but the last of them."""
        if not self.chunks or self.chunks[0][0] > start or self.chunks[-1][0] + self.chunks[-1][1].shape[0] < stop:
            raise ValueError("the draft head has no hidden states for these positions: run the loop on the "
                             "HiddenStateTap from DraftHeadSource.create (not the bare model), with a fresh kv_cache")
        taken = [rows[max(start - first, 0) : stop - first] for first, rows in self.chunks
                 if first < stop and first + rows.shape[0] > start]
        keep = stop - 1  # free the features before it
        self.chunks = [(max(first, keep), rows[max(keep - first, 0):]) for first, rows in self.chunks
                       if first + rows.shape[0] > keep]
        return mx.concatenate(taken) if len(taken) > 1 else taken[0]


class DraftHeadSource(AdaptiveSource):
    """Drafts tokens with a draft head that reads the target's hidden states.

    Args:
        tap: the ``HiddenStateTap`` the loop runs as its model.
        head, vocab_ids: from ``load_head``; the head scores with ``head.logits``, over the tokens
            ``vocab_ids`` names.
        num_draft, adaptive, max_draft, draft_cost_prior: see ``AdaptiveSource``.
        min_confidence: stop a draft once the head's top probability falls below this.
        min_path_confidence: stop a draft once the product of the head's top probabilities at
            the positions drafted so far (the chance that all are accepted, if the head is
            calibrated) falls below this. Default: what a drafted token costs (``token_cost``) when
            adaptive (a further token is then worth less than it costs), else 0 (off).
    """

    name = "draft_head"
    batch_refusal = ("the draft head cannot draft for a batch (it reads one sequence's hidden states); "
                     "use prompt lookup or a DraftModel, or decode it alone")

    def __init__(self, tap: HiddenStateTap, head, vocab_ids: mx.array, num_draft: int = 4, adaptive: bool = True,
                 max_draft: int = 8, min_confidence: float = 0.0, draft_cost_prior: float = 0.06,
                 min_path_confidence: Optional[float] = None):
        super().__init__(num_draft, max_draft, adaptive, draft_cost_prior)
        self.tap, self.head = tap, head
        self.vocab_ids, self.vocab_list = vocab_ids, vocab_ids.tolist()
        self.vocab_size = tap.target.args.vocab_size
        self.embed = tap.target.model.embed_tokens
        self.min_confidence = min_confidence
        self.path_confidence_option = min_path_confidence
        self.reset()

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        """A new generation: forget the features, the head's cache and the draft length."""
        super().reset(cost, temp, top_p)
        self.tap.chunks = []
        self.cache = adopt(self.head.make_cache())  # the cache layer at one row: checked rollbacks
        self.committed = 0  # head cache positions read from true features and accepted tokens

    @classmethod
    def create(cls, target, head_dir=None, **kwargs):
        """Load a head for ``target`` (ours or a published EAGLE head, see ``load_head``);
        returns ``(tap, source)``: run the loop on ``tap``."""
        head, vocab_ids = load_head(head_dir, target)
        tap = HiddenStateTap(target, head.feature_layers)
        # A draft step reads the head and the target's output rows it scores with (``output_bytes``; none
        # for EAGLE-3). Counted in bytes: a 4-bit target reads far less than its parameter count says.
        kwargs.setdefault("draft_cost_prior", (weight_bytes(head) + head.output_bytes) / weight_bytes(target))
        return tap, cls(tap, head, vocab_ids, **kwargs)

    @property
    def min_path_confidence(self) -> float:
        if self.path_confidence_option is not None:
            return self.path_confidence_option
        return self.token_cost() if self.length.enabled else 0.0

    def _rewind(self):
        """Drop the head's cache entries for drafted positions (read from its own predictions)."""
        self.cache.rewind([self.cache.held() - self.committed])

    def _catch_up(self, tokens: list) -> mx.array:
        """Feed the head every accepted position it has not read; returns its last prediction. Position
        p reads (h_p, x_{p+1}); the target has run positions up to len(tokens) - 2."""
        stop = len(tokens) - 1
        if self.committed == stop:  # nothing new since the last draft: re-read the last position
            self.committed -= 1
            self._rewind()
        features = self.tap.take(self.committed, stop)
        for start in range(0, stop - self.committed, CATCH_UP_CHUNK):
            first = self.committed + start
            chunk = features[start : start + CATCH_UP_CHUNK][None]
            next_tokens = mx.array(tokens[first + 1 : first + 1 + chunk.shape[1]])[None]
            predicted = self.head(chunk, self.embed(next_tokens), cache=self.cache.layers)
        self.committed = stop
        return predicted[0, -1]

    def _distribution(self, predicted: mx.array) -> mx.array:
        """Scores over the sub-vocabulary: q when sampling; when greedy, the softmax only if the
        confidence stop needs it (the logits have the same argmax)."""
        logits = self.head.logits(predicted[None])[0]
        if self.temp > 0:
            return sampling_probs(logits[None], self.temp, self.top_p)[0]
        confidence_needed = self.min_confidence > 0 or self.min_path_confidence > 0
        return mx.softmax(logits.astype(mx.float32)) if confidence_needed else logits

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        num_draft = min(self.length.next_length(self.token_cost()), max_draft) if len(tokens) >= 2 else 0
        if num_draft == 0:
            return None  # the head catches up in one batched call when drafting resumes
        self._rewind()
        predicted = self._catch_up(tokens)
        min_path_confidence = self.min_path_confidence
        indices, rows, path_confidence = [], [], 1.0
        # Without the path-confidence stop the whole draft is one lazy graph: each step feeds the
        # last sub-vocabulary index back without a host round trip, and one sync reads them all.
        for position in range(num_draft):
            probs = self._distribution(predicted)
            index = mx.argmax(probs) if self.temp == 0 else mx.random.categorical(mx.log(probs))
            if min_path_confidence > 0:  # one sync per step, so no step is computed in vain
                # The top probability, not the drawn token's: whether to draft position i must not
                # depend on the token drawn there, or sampling would no longer be exact.
                path_confidence *= probs.max().item()
                if position and path_confidence < min_path_confidence:
                    break
            indices.append(index)
            rows.append(probs)
            if position + 1 < num_draft:
                next_embedding = self.embed(self.vocab_ids[index].reshape(1, 1))
                predicted = self.head(predicted[None, None], next_embedding, cache=self.cache.layers)[0, -1]
        rows, indices = mx.stack(rows), mx.stack(indices).tolist()
        length = len(indices)
        if self.min_confidence > 0:  # stop where the head's top probability falls below it (keep one)
            confidence = rows.max(axis=-1).tolist()
            length = next((i for i in range(1, length) if confidence[i] < self.min_confidence), length)
        draft = [self.vocab_list[i] for i in indices[:length]]
        if self.temp == 0:
            return Draft(draft)
        # q on the whole vocabulary: zero outside the sub-vocabulary.
        probs = mx.zeros((length, self.vocab_size), mx.float32)
        probs[:, self.vocab_ids] = rows[:length]
        return Draft(draft, probs)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self._rewind()
        super().update(tokens, num_proposed, num_accepted)
