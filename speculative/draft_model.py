"""A draft source backed by a small model that shares the target's vocabulary, for one row or many.

One ``DraftModel`` holds the draft model's cache (``cache.Cache``) for every row that drafts with
it, and each row gets a ``DraftModelSource``, its handle, for its list of sources. One row is the
batch at B = 1: ``DraftModelSource(model, vocab_size)`` makes its own ``DraftModel``.

    source = DraftModelSource.create(small, small_tokenizer, target, tokenizer)   # one row
    drafter = DraftModel.create(small, small_tokenizer, target, tokenizer)         # a batch
    gen.insert(prompts, draft_sources=[[drafter.source()] for _ in prompts])

A row joins when it first drafts. Each step ``draft_all`` drafts for every row at once (a batch
calls it before the rows choose, as each handle's ``batch_drafter``; alone, ``propose`` calls it):
a catch-up pass feeds each row the tokens accepted since its last draft (right-padded to the
longest; each row then drops its own padding, and first what it holds past the accepted text), then
one pass per draft position drafts all rows together. After drafting, each row's cache holds
exactly its accepted tokens, so verification needs no rollback here.
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from decoder.cache import CacheKindError, architecture, make_cache
from decoder.cost import PassCost
from decoder.draft import Draft
from decoder.prefill import prefill_rows
from decoder.text import output_size
from speculative.adaptive import Drafter, DrafterHandle, draw_rows, weight_bytes
from t5 import T5Decoder, is_encoder_decoder


class VocabularyMismatch(ValueError):
    """The draft and target tokenizers disagree (the message is shown to the user)."""


def check_same_vocabulary(draft_tokenizer, target_tokenizer, draft_size: int, target_size: int):
    """Refuse a pair whose tokenizers differ: the draft's token ids would mean other text."""
    # token string -> id: Hugging Face tokenizers and our T5Tokenizer both offer it.
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if len(draft_vocab) != len(target_vocab):
        raise VocabularyMismatch(
            f"the draft tokenizer has {len(draft_vocab)} tokens, the target's "
            f"{len(target_vocab)}; a draft model must share the target's vocabulary"
        )
    differing = [token for token, index in target_vocab.items() if draft_vocab.get(token) != index]
    if differing:
        raise VocabularyMismatch(
            f"the draft and target tokenizers disagree on {len(differing)} tokens (e.g. {differing[0]!r}); "
            "a draft model must share the target's vocabulary"
        )
    # Embedding tables may be padded past the tokenizer (Qwen2.5-7B vs -0.5B): those rows are never
    # text.
    if min(draft_size, target_size) < len(target_vocab):
        raise VocabularyMismatch(
            f"the draft model has {draft_size} output tokens and the target {target_size}, "
            f"fewer than the {len(target_vocab)} tokens of their tokenizer"
        )


class DraftModelSource(DrafterHandle):
    """One row's handle on a ``DraftModel`` (``DrafterHandle``).

    Args:
        model: the draft (mlx-lm model, or ``T5Decoder``): a one-row source with its own
        ``DraftModel``.
        vocab_size, num_draft, adaptive, max_draft, min_confidence, draft_cost_prior:
        ``DraftModel``'s.
    """

    name = "draft_model"

    def __init__(
        self,
        model,
        vocab_size: int,
        num_draft: int = 4,
        adaptive: bool = True,
        max_draft: int = 12,
        min_confidence: float = 0.5,
        draft_cost_prior: float = 0.1,
    ):
        drafter = DraftModel(
            model, vocab_size, num_draft, max_draft, adaptive, min_confidence, draft_cost_prior
        )
        self._bind(drafter, num_draft, max_draft, adaptive)

    @classmethod
    def create(
        cls,
        draft_model,
        draft_tokenizer,
        target_model,
        target_tokenizer,
        encoder_input: Optional[list] = None,
        **kwargs,
    ) -> "DraftModelSource":
        """A one-row source: ``DraftModel.create``'s checks, and a T5 draft wrapped for a T5
        target."""
        if is_encoder_decoder(draft_model):
            if encoder_input is None:
                raise VocabularyMismatch("a T5 draft model needs a T5 target model")
            draft_model = T5Decoder(draft_model, encoder_input)
        return DraftModel.create(
            draft_model, draft_tokenizer, target_model, target_tokenizer, **kwargs
        ).source()

    def reset(self, cost: Optional[PassCost] = None, temp: float = 0.0, top_p: float = 1.0):
        """A new generation: its cache row is kept, and reused up to what it shares with the new
        prompt."""
        super().reset(cost, temp, top_p)
        self.fresh = True


class DraftModel(Drafter):
    """A small model sharing the target's vocabulary, drafting for one row or many at once.

    Args:
        model: the draft model (an mlx-lm model, or ``T5Decoder``).
        vocab_size: the target's output size; draft distributions are padded or cut to it.
        num_draft, max_draft, adaptive: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once its top probability falls below this.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed
            (``create`` sets it from the weight bytes).
    """

    def __init__(
        self,
        model,
        vocab_size: int,
        num_draft: int = 4,
        max_draft: int = 12,
        adaptive: bool = True,
        min_confidence: float = 0.5,
        draft_cost_prior: float = 0.1,
        prefill_step_size: int = 512,
    ):
        # its rows roll back by trimming, which a recurrent state cannot
        if make_cache(model).recurrent:
            raise CacheKindError(
                f"{architecture(model)}: a draft model with recurrent layers cannot roll back "
                "its drafts"
            )
        super().__init__(
            DraftModelSource,
            dict(num_draft=num_draft, max_draft=max(max_draft, num_draft), adaptive=adaptive),
            draft_cost_prior,
        )
        self.model, self.vocab_size = model, vocab_size
        self.min_confidence = min_confidence
        self.prefill_step_size = prefill_step_size
        self.rows = []  # handles, in cache order
        self.texts, self.counts = [], []  # per row: its cache holds texts[row][: counts[row]]
        self.cache = None

    @classmethod
    def create(
        cls, draft_model, draft_tokenizer, target_model, target_tokenizer, **kwargs
    ) -> "DraftModel":
        """Check the pair shares a vocabulary (``VocabularyMismatch`` otherwise) and build it."""
        target_size = output_size(target_model, target_tokenizer)
        check_same_vocabulary(
            draft_tokenizer,
            target_tokenizer,
            output_size(draft_model, draft_tokenizer),
            target_size,
        )
        kwargs.setdefault(
            "draft_cost_prior", weight_bytes(draft_model) / weight_bytes(target_model)
        )
        return cls(draft_model, target_size, **kwargs)

    def remove(self, handle: DraftModelSource):
        """The row left the batch."""
        if handle in self.rows:
            index = self.rows.index(handle)
            keep = [i for i in range(len(self.rows)) if i != index]
            del self.rows[index], self.texts[index], self.counts[index]
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
        # Drafts are one-token calls rolled back together: a sliding layer keeps that many more.
        cache = prefill_rows(
            self.model, prompts, self.prefill_step_size, max_rollback=self.options["max_draft"] + 1
        )
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.extend(cache)
        self.rows += [handle for handle, _ in joining]
        self.texts += [tokens for _, tokens in joining]
        self.counts += [len(prompt) for prompt in prompts]

    def _sync(self, tokens_of: dict) -> list:
        """Each drafting row's cache back to the longest prefix it shares with its tokens, less the
        last token where it holds them all (fed again for its logits); returns what each row feeds.
        Only a handle reset for a new generation may hold another text; where a sliding window
        dropped what it would go back to, its row is prefilled again."""
        for handle in [h for h in self.rows if h.fresh and id(h) in tokens_of]:
            row, tokens = self.rows.index(handle), tokens_of[id(handle)]
            common = common_prefix_len(self.texts[row][: self.counts[row]], tokens)
            if self.counts[row] - min(common, len(tokens) - 1) > self.cache.can_trim(row):
                self.remove(handle)
                self._add_rows([(handle, tokens, 0)])
        trims, pending = [], []
        for row, handle in enumerate(self.rows):
            tokens, count = tokens_of.get(id(handle)), self.counts[row]
            if tokens is None:  # not drafting this step
                trims.append(0)
                pending.append([])
                continue
            # The row's tokens list only grows while it decodes: what the cache holds is a prefix of
            # it.
            keep = common_prefix_len(self.texts[row][:count], tokens) if handle.fresh else count
            handle.fresh, keep = False, min(keep, len(tokens) - 1)
            trims.append(count - keep)
            pending.append(tokens[keep:])
            self.texts[row], self.counts[row] = tokens, len(tokens)
        self.cache.rewind(trims)
        return pending

    def _distributions(self, logits: mx.array) -> tuple:
        """Per row: the token drawn, its confidence, and q (None for greedy rows), from (R, V)
        logits."""
        size = logits.shape[-1]
        if size > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif size < self.vocab_size:  # padding rows of the target are never proposed
            logits = mx.pad(logits, [(0, 0), (0, self.vocab_size - size)], constant_values=-mx.inf)
        return draw_rows(logits, self.rows)

    def draft_all(self, requests: list, cost: PassCost, batch_rows: int):
        """Draft for every row: ``requests`` holds ``(handle, tokens, max_draft)`` for each of the
        target's rows that drafts with this model; ``batch_rows`` is the target's batch size."""
        self._begin(requests, batch_rows)
        self._add_rows(requests)
        tokens_of = {id(handle): tokens for handle, tokens, _ in requests}
        limits = {id(handle): max_draft for handle, _, max_draft in requests}
        # next_length counts a paused step, so it is asked once per step.
        lengths = [
            min(h.length.next_length(h.token_cost()), limits[id(h)])
            if limits.get(id(h), 0) > 0
            else 0
            for h in self.rows
        ]
        if not any(lengths):
            return  # the caches catch up at the next draft
        tic = cost.clock()
        pending = self._sync(tokens_of)
        longest = max(len(p) for p in pending)
        logits = None
        for start in range(0, longest, self.prefill_step_size):  # catch up, chunked like a prefill
            chunk = [p[start : start + self.prefill_step_size] for p in pending]
            width = max(len(c) for c in chunk)
            out = self.model(
                mx.array([c + [0] * (width - len(c)) for c in chunk]), cache=self.cache.layers
            )
            self.cache.rewind([width - len(c) for c in chunk])
            last = mx.array([max(len(c) - 1, 0) for c in chunk])
            step_logits = out[mx.arange(len(chunk)), last]
            has = mx.array([len(c) > 0 for c in chunk])[:, None]
            logits = step_logits if logits is None else mx.where(has, step_logits, logits)

        drafts, rows, alive = (
            [[] for _ in self.rows],
            [[] for _ in self.rows],
            [n > 0 for n in lengths],
        )
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
        self._time(cost, cost.clock() - tic, fed + 1)  # the last position's values were synced
        for handle, draft, row in zip(self.rows, drafts, rows):
            sampled = bool(row) and row[0] is not None
            handle.draft = Draft(draft, mx.stack(row) if sampled else None) if draft else None
