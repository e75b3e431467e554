"""A draft model for a batch: every row's draft in one ``[R, 1]`` call per draft position.

``speculative.draft_model.DraftModelSource`` drafts one sequence with its own cache. Here one
``BatchDraftModel`` holds one ragged cache (``batch_cache.RaggedKVCache``) for all the rows that
draft with it, and each row gets a ``DraftModelRow`` for its list of sources:

    drafter = BatchDraftModel(small_model, vocab_size=target.args.vocab_size)
    gen.insert(prompts, draft_sources=[[PromptLookupSource(), drafter.source()] for _ in prompts])

Before the rows choose their drafts, the engine calls ``draft_all`` once: a catch-up pass feeds
each row the tokens accepted since its last draft (right-padded to the longest; each row then
drops its own padding), and then one pass per draft position drafts all rows together. After
drafting, every row's draft cache holds exactly its accepted tokens, so verification needs no
rollback here: what was accepted is fed at the next catch-up, with the target's token.
"""

from typing import Optional

import mlx.core as mx

from batch_cache import prefill_rows, trim_rows
from decoder import Draft, sampling_probs
from speculative.adaptive import AdaptiveLength


class DraftModelRow:
    """One row's handle on a ``BatchDraftModel`` (a draft source with ``DraftModelSource``'s
    adaptive length); ``propose`` returns what ``draft_all`` drafted for this row."""

    name = "draft_model"

    def __init__(self, drafter: "BatchDraftModel", num_draft: int, max_draft: int, draft_token_cost: float,
                 adaptive: bool):
        self.drafter = drafter
        self.length = AdaptiveLength(num_draft, max_draft, draft_token_cost, enabled=adaptive)
        self.temp, self.top_p = 0.0, 1.0
        self.draft = None  # from the last draft_all, until proposed

    def reset(self, cost=None, temp: float = 0.0, top_p: float = 1.0):
        self.temp, self.top_p = temp, top_p
        self.length.reset()
        self.drafter.join(self)

    def forecast_speedup(self) -> Optional[float]:
        return self.length.expected_speedup() if self.length.enabled else None

    def propose(self, tokens: list, max_draft: int) -> Optional[Draft]:
        draft, self.draft = self.draft, None
        if draft is None or max_draft <= 0:
            return None
        if len(draft.tokens) > max_draft:
            draft = Draft(draft.tokens[:max_draft], None if draft.probs is None else draft.probs[:max_draft])
        return draft

    def update(self, tokens: list, num_proposed: int, num_accepted: int):
        self.length.record(num_proposed, num_accepted)


class BatchDraftModel:
    """A small model sharing the target's vocabulary, drafting for many rows at once.

    Args:
        model: the draft model (an mlx-lm model).
        vocab_size: the target's output size; draft distributions are padded or cut to it.
        num_draft, max_draft, adaptive, draft_token_cost: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once its top probability falls below this.
    """

    def __init__(self, model, vocab_size: int, num_draft: int = 4, max_draft: int = 12, adaptive: bool = True,
                 min_confidence: float = 0.5, draft_token_cost: float = 0.1, prefill_step_size: int = 512):
        self.model, self.vocab_size = model, vocab_size
        self.options = dict(num_draft=num_draft, max_draft=max_draft, draft_token_cost=draft_token_cost,
                            adaptive=adaptive)
        self.min_confidence = min_confidence
        self.prefill_step_size = prefill_step_size
        self.rows = []  # handles, in cache order
        self.cached = []  # per row: how many of its tokens the cache holds
        self.joining = []
        self.cache = None

    def source(self) -> DraftModelRow:
        """A handle for one row's ``draft_sources``."""
        return DraftModelRow(self, **self.options)

    def join(self, handle: DraftModelRow):
        if handle not in self.rows and handle not in self.joining:
            self.joining.append(handle)

    def remove(self, handle: DraftModelRow):
        if handle in self.joining:
            self.joining.remove(handle)
        if handle in self.rows:
            index = self.rows.index(handle)
            keep = [i for i in range(len(self.rows)) if i != index]
            del self.rows[index], self.cached[index]
            if keep:
                for layer in self.cache:
                    layer.filter(keep)
            else:
                self.cache = None

    def _admit(self, tokens_of: dict):
        joining = [handle for handle in self.joining if id(handle) in tokens_of]
        self.joining = [handle for handle in self.joining if id(handle) not in tokens_of]
        if not joining:
            return
        prompts = [tokens_of[id(handle)][:-1] for handle in joining]
        cache = prefill_rows(self.model, prompts, self.prefill_step_size)
        if self.cache is None:
            self.cache = cache
        else:
            for layer, new_layer in zip(self.cache, cache):
                layer.extend(new_layer)
        self.rows += joining
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

    def draft_all(self, requests: list):
        """Draft for every row; ``requests`` holds ``(handle, tokens, max_draft)`` per row."""
        tokens_of = {id(handle): tokens for handle, tokens, _ in requests}
        limits = {id(handle): max_draft for handle, _, max_draft in requests}
        self._admit(tokens_of)
        if not self.rows:
            return
        # paused() counts a skipped step, so it is asked once per step.
        wanted = [limits.get(id(h), 0) > 0 and not h.length.paused() for h in self.rows]
        lengths = [min(h.length.num_draft, limits[id(h)]) if w else 0 for h, w in zip(self.rows, wanted)]
        if not any(lengths):
            return  # the caches catch up at the next draft
        refeed = [int(cached == len(tokens_of[id(h)])) for h, cached in zip(self.rows, self.cached)]
        trim_rows(self.cache, refeed)  # a row with nothing new re-feeds its last token for its logits
        pending = [tokens_of[id(h)][cached - again:] for h, cached, again in zip(self.rows, self.cached, refeed)]
        longest = max(len(p) for p in pending)
        logits = None
        for start in range(0, longest, self.prefill_step_size):  # catch up, chunked like a prefill
            chunk = [p[start : start + self.prefill_step_size] for p in pending]
            width = max(len(c) for c in chunk)
            out = self.model(mx.array([c + [0] * (width - len(c)) for c in chunk]), cache=self.cache)
            trim_rows(self.cache, [width - len(c) for c in chunk])
            last = mx.array([max(len(c) - 1, 0) for c in chunk])
            step_logits = out[mx.arange(len(chunk)), last]
            has = mx.array([len(c) > 0 for c in chunk])[:, None]
            logits = step_logits if logits is None else mx.where(has, step_logits, logits)
        self.cached = [len(tokens_of[id(h)]) for h in self.rows]

        drafts, rows, alive = [[] for _ in self.rows], [[] for _ in self.rows], list(wanted)
        fed = 0
        for position in range(max(lengths)):
            tokens, confidence, probs = self._distributions(logits)
            # One sync per draft position: the next pass and the early stop need the values.
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
            logits = self.model(tokens[:, None], cache=self.cache)[:, -1]
            fed += 1
        trim_rows(self.cache, [fed] * len(self.rows))
        for handle, draft, row in zip(self.rows, drafts, rows):
            sampled = bool(row) and row[0] is not None
            handle.draft = Draft(draft, mx.stack(row) if sampled else None) if draft else None
