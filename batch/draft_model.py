"""A draft model for a batch: every row's draft in one ``[R, 1]`` call per draft position.

``speculative.draft_model.DraftModelSource`` drafts one sequence with its own cache. Here one
``BatchDraftModel`` holds one cache of many rows (``cache.Cache``) for all the rows that
draft with it, and each row gets a ``SharedDraftSource`` for its list of sources:

    drafter = BatchDraftModel(small_model, vocab_size=target.args.vocab_size)
    gen.insert(prompts, draft_sources=[[PromptLookupSource(), drafter.source()] for _ in prompts])

A row joins when it first drafts. Before the rows choose their drafts, the generator calls
``draft_all`` once a step (it is each handle's ``batch_drafter``): a catch-up pass feeds
each row the tokens accepted since its last draft (right-padded to the longest; each row then
drops its own padding), and then one pass per draft position drafts all rows together. After
drafting, every row's draft cache holds exactly its accepted tokens, so verification needs no
rollback here: what was accepted is fed at the next catch-up, with the target's token.
"""

import time
from typing import Optional

import mlx.core as mx

from batch.cache import prefill_rows
from cost import PassCost
from cache import CacheKindError, architecture, make_cache
from decoder import Draft, DraftSource, sampling_probs
from speculative.adaptive import AdaptiveLength, weight_bytes
from speculative.draft_model import check_same_vocabulary, output_size


class SharedDraftSource(DraftSource):
    """One row's handle on a ``BatchDraftModel``: ``DraftModelSource``'s adaptive length and
    pausing, with ``propose`` returning what ``draft_all`` drafted for this row."""

    name = "draft_model"

    def __init__(self, drafter: "BatchDraftModel", num_draft: int, max_draft: int, adaptive: bool):
        self.drafter = self.batch_drafter = drafter
        self.length = AdaptiveLength(num_draft, max_draft, enabled=adaptive)
        self.draft = None  # from the last draft_all, until proposed
        self.reset()

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        super().reset(cost, temp, top_p)
        self.length.reset()
        self.draft = None

    def token_cost(self) -> float:
        """Drafting and verifying one token, as a fraction of the batch's plain pass (measured)."""
        return self.drafter.draft_cost(self.cost) + self.cost.token_cost(self.drafter.batch_rows)

    def forecast_speedup(self) -> Optional[float]:
        return self.length.expected_speedup(self.token_cost()) if self.length.enabled else None

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        draft, self.draft = self.draft, None
        if draft is None or max_draft <= 0:
            return None
        return draft.truncate(max_draft)

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self.length.record(num_proposed, num_accepted)

    def leave(self):
        self.drafter.remove(self)


class BatchDraftModel:
    """A small model sharing the target's vocabulary, drafting for many rows at once.

    Args:
        model: the draft model (an mlx-lm model).
        vocab_size: the target's output size; draft distributions are padded or cut to it.
        num_draft, max_draft, adaptive: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once its top probability falls below this.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed
            (``create`` sets it from the weight bytes).
    """

    FORGET = 0.9  # weight of the past in the running mean of a draft position's time

    def __init__(self, model, vocab_size: int, num_draft: int = 4, max_draft: int = 12, adaptive: bool = True,
                 min_confidence: float = 0.5, draft_cost_prior: float = 0.1, prefill_step_size: int = 512):
        if make_cache(model).recurrent:  # its rows roll back by trimming, which a recurrent state cannot
            raise CacheKindError(f"{architecture(model)}: a draft model with recurrent layers cannot draft for a batch")
        self.model, self.vocab_size = model, vocab_size
        self.options = dict(num_draft=num_draft, max_draft=max_draft, adaptive=adaptive)
        self.min_confidence = min_confidence
        self.draft_cost_prior = draft_cost_prior
        self.prefill_step_size = prefill_step_size
        self.rows = []  # handles, in cache order
        self.cached = []  # per row: how many of its tokens the cache holds
        self.cache = None
        self.batch_rows = 1  # rows in the target's batch at the last draft
        self.position_time = None  # [weight, mean seconds] of one draft position for all rows

    @classmethod
    def create(cls, draft_model, draft_tokenizer, target_model, target_tokenizer, **kwargs) -> "BatchDraftModel":
        """Check the pair shares a vocabulary (``VocabularyMismatch`` otherwise) and build it."""
        target_size = output_size(target_model, target_tokenizer)
        check_same_vocabulary(draft_tokenizer, target_tokenizer, output_size(draft_model, draft_tokenizer),
                              target_size)
        kwargs.setdefault("draft_cost_prior", weight_bytes(draft_model) / weight_bytes(target_model))
        return cls(draft_model, target_size, **kwargs)

    def draft_cost(self, cost: PassCost) -> float:
        """One draft position (a pass of the draft model over all its rows) as a fraction of the
        target's plain pass over the batch: both measured, or the prior until they are."""
        target = cost.seconds(1, self.batch_rows)
        if self.position_time is None or not target:
            return self.draft_cost_prior
        return self.position_time[1] / target

    def _time(self, seconds: float, positions: int):
        weight, mean = self.position_time or (0.0, 0.0)
        weight = self.FORGET * weight + 1
        self.position_time = (weight, mean + (seconds / positions - mean) / weight)

    def source(self) -> SharedDraftSource:
        """A handle for one row's ``draft_sources``."""
        return SharedDraftSource(self, **self.options)

    def remove(self, handle: SharedDraftSource):
        """The row left the batch."""
        if handle in self.rows:
            index = self.rows.index(handle)
            keep = [i for i in range(len(self.rows)) if i != index]
            del self.rows[index], self.cached[index]
            if keep:
                self.cache.filter(keep)
            else:
                self.cache = None

    def _add_rows(self, requests: list):
        """Prefill the rows drafting for the first time (as one batch) and merge them in."""
        joining = [(handle, tokens) for handle, tokens, _ in requests if handle not in self.rows]
        if not joining:
            return
        prompts = [tokens[:-1] for _, tokens in joining]
        cache = prefill_rows(self.model, prompts, self.prefill_step_size)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows += [handle for handle, _ in joining]
        self.cached += [len(prompt) for prompt in prompts]

    def _distributions(self, logits: mx.array) -> tuple:
        """Per row: the token drawn, its confidence, and q (None for greedy rows), from (R, V) logits."""
        size = logits.shape[-1]
        if size > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif size < self.vocab_size:  # padding rows of the target are never proposed
            logits = mx.pad(logits, [(0, 0), (0, self.vocab_size - size)], constant_values=-mx.inf)
        greedy = mx.softmax(logits.astype(mx.float32), axis=-1)
        tokens, confidence = mx.argmax(greedy, axis=-1), mx.max(greedy, axis=-1)
        probs = [None] * len(self.rows)
        settings = {(h.temp, h.top_p) for h in self.rows if h.temp > 0}
        for temp, top_p in settings:  # rows sampling alike are drawn together
            members = [i for i, h in enumerate(self.rows) if (h.temp, h.top_p) == (temp, top_p)]
            group = sampling_probs(logits[mx.array(members)], temp, top_p)
            drawn = mx.random.categorical(mx.log(group))
            index = mx.array(members)
            tokens[index], confidence[index] = drawn.astype(tokens.dtype), group.max(axis=-1)
            for position, member in enumerate(members):
                probs[member] = group[position]
        return tokens, confidence, probs

    def draft_all(self, requests: list, cost: PassCost, batch_rows: int):
        """Draft for every row: ``requests`` holds ``(handle, tokens, max_draft)`` for each of the
        target's rows that drafts with this model; ``batch_rows`` is the target's batch size."""
        self.batch_rows = batch_rows
        for handle in self.rows:
            handle.draft = None  # a draft the rows did not take last step is stale now
        self._add_rows(requests)
        tokens_of = {id(handle): tokens for handle, tokens, _ in requests}
        limits = {id(handle): max_draft for handle, _, max_draft in requests}
        # next_length counts a paused step, so it is asked once per step.
        lengths = [min(h.length.next_length(h.token_cost()), limits[id(h)]) if limits.get(id(h), 0) > 0 else 0
                   for h in self.rows]
        if not any(lengths):
            return  # the caches catch up at the next draft
        tic = time.perf_counter()
        refeed = [int(cached == len(tokens_of[id(h)])) for h, cached in zip(self.rows, self.cached)]
        self.cache.rewind(refeed)  # a row with nothing new re-feeds its last token for its logits
        pending = [tokens_of[id(h)][cached - again:] for h, cached, again in zip(self.rows, self.cached, refeed)]
        longest = max(len(p) for p in pending)
        logits = None
        for start in range(0, longest, self.prefill_step_size):  # catch up, chunked like a prefill
            chunk = [p[start : start + self.prefill_step_size] for p in pending]
            width = max(len(c) for c in chunk)
            out = self.model(mx.array([c + [0] * (width - len(c)) for c in chunk]), cache=self.cache.layers)
            self.cache.rewind([width - len(c) for c in chunk])
            last = mx.array([max(len(c) - 1, 0) for c in chunk])
            step_logits = out[mx.arange(len(chunk)), last]
            has = mx.array([len(c) > 0 for c in chunk])[:, None]
            logits = step_logits if logits is None else mx.where(has, step_logits, logits)
        self.cached = [len(tokens_of[id(h)]) for h in self.rows]

        drafts, rows, alive = [[] for _ in self.rows], [[] for _ in self.rows], [n > 0 for n in lengths]
        fed = 0
        for position in range(max(lengths)):
            tokens, confidence, probs = self._distributions(logits)
            # One sync per draft position: the next pass and the early stop need the values.
            mx.eval(tokens, confidence)
            token_list, confidence_list = tokens.tolist(), confidence.tolist()
            for b in range(len(self.rows)):
                if not alive[b] or position >= lengths[b]:
                    alive[b] = False
                elif drafts[b] and confidence_list[b] < self.min_confidence:
                    alive[b] = False
                else:
                    drafts[b].append(token_list[b])
                    rows[b].append(probs[b])
            if position + 1 == max(lengths) or not any(alive):
                break
            logits = self.model(tokens[:, None], cache=self.cache.layers)[:, -1]
            fed += 1
        self.cache.rewind([fed] * len(self.rows))
        self._time(time.perf_counter() - tic, fed + 1)  # the last position's values were synced
        for handle, draft, row in zip(self.rows, drafts, rows):
            sampled = bool(row) and row[0] is not None
            handle.draft = Draft(draft, mx.stack(row) if sampled else None) if draft else None
