"""A draft source backed by a small model that shares the target's vocabulary, for one row or many.

One ``DraftModel`` (a ``decoder.model_drafter.SharedDrafter``) holds the draft model's cache for
every row that drafts with it, and each row holds a ``DraftModelSource`` of it in its list of
sources.

    drafter = DraftModel.create(small, small_tokenizer, target, tokenizer)
    source = drafter.source()                                   # one row: draft_sources=[source]
    gen = BatchGenerator(target, drafters=[drafter])            # a batch: a source per row
    gen.insert(prompts, draft_sources=[[drafter.source()] for _ in prompts])

A row joins when it first drafts (its prompt prefilled), and first drops what its cache holds past
the accepted text; after drafting, each row's cache holds exactly its accepted tokens, so
verification needs no rollback here.

A tree row drafts its greedy chain with the model's other choices as leaves beside it
(``tree_width`` 1): growing the tree below them, as a head does, would copy every layer's cache
rows per frontier node at each depth, which has not been measured to pay.
"""

import sys
from typing import Optional

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from decoder.adaptive import weight_bytes
from decoder.cache import CacheKindError, architecture, make_cache
from decoder.model_drafter import SharedDrafter, SharedSource, draw_rows
from decoder.prefill import Prefill, PrefixStore
from decoder.text import output_size


def is_t5(model) -> bool:
    """Whether ``model`` is a T5 from t5/. Such a model was loaded by t5/, so t5 is imported already
    if it is one: a Llama-family pair never imports T5 (or sentencepiece)."""
    t5 = sys.modules.get("t5")
    return t5 is not None and t5.is_encoder_decoder(model)


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
            f"the draft and target tokenizers disagree on {len(differing)} tokens "
            f"(e.g. {differing[0]!r}); "
            "a draft model must share the target's vocabulary"
        )
    # Embedding tables may be padded past the tokenizer (Qwen2.5-7B vs -0.5B): those rows are never
    # text.
    if min(draft_size, target_size) < len(target_vocab):
        raise VocabularyMismatch(
            f"the draft model has {draft_size} output tokens and the target {target_size}, "
            f"fewer than the {len(target_vocab)} tokens of their tokenizer"
        )


class DraftModelSource(SharedSource):
    """One row's source on a ``DraftModel`` (``SharedSource``): made by ``DraftModel.source``."""

    name = "draft_model"


class DraftModel(SharedDrafter):
    """A small model sharing the target's vocabulary, drafting for one row or many at once.

    Args:
        model: the draft model (an mlx-lm model, or ``T5Decoder``).
        vocab_size: the target's output size; draft distributions are padded or cut to it.
        num_draft, max_draft, adaptive: each row's ``AdaptiveLength``.
        min_confidence: a row stops drafting once its top probability falls below this.
        draft_cost_prior: one draft position as a fraction of a target pass, until timed
            (``create`` sets it from the weight bytes).
        prompt_store: a ``PrefixStore`` for the draft model's own cache (``prompt_store``'s
            ``PromptStore`` of this model): a row restores its prompt's stored prefix.
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
        prompt_store: Optional[PrefixStore] = None,
    ):
        # its rows roll back by trimming, which a recurrent state cannot
        if make_cache(model).recurrent:
            raise CacheKindError(
                f"{architecture(model)}: a draft model with recurrent layers cannot roll back "
                "its drafts"
            )
        options = dict(num_draft=num_draft, max_draft=max(max_draft, num_draft), adaptive=adaptive)
        super().__init__(DraftModelSource, options, draft_cost_prior, prefill_step_size)
        self.model, self.vocab_size = model, vocab_size
        self.min_confidence, self.prompt_store = min_confidence, prompt_store
        self.texts, self.counts = [], []  # per row: its cache holds texts[row][: counts[row]]

    @classmethod
    def create(
        cls,
        draft_model,
        draft_tokenizer,
        target_model,
        target_tokenizer,
        encoder_input: Optional[list] = None,
        **kwargs,
    ) -> "DraftModel":
        """Check the pair shares a vocabulary (``VocabularyMismatch`` otherwise) and build it; a T5
        draft is wrapped in ``T5Decoder`` for a T5 target's ``encoder_input``."""
        if is_t5(draft_model):
            if encoder_input is None:
                raise VocabularyMismatch("a T5 draft model needs a T5 target model")
            from t5 import T5Decoder

            draft_model = T5Decoder(draft_model, encoder_input)
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

    def _drop_row(self, index: int):
        del self.texts[index], self.counts[index]

    def _join(self, requests: list):
        """Prefill the rows drafting for the first time (as one batch) and merge them in."""
        joining = [(source, tokens) for source, tokens, *_ in requests if source not in self.rows]
        if not joining:
            return
        prompts = [tokens[:-1] for _, tokens in joining]
        store = self.prompt_store
        cached = [None if store is None else store.lookup(tokens) for _, tokens in joining]
        # Drafts are one-token calls rolled back together: a sliding layer keeps that many more.
        rollback = self.options["max_draft"] + 1
        cache = Prefill(
            self.model, prompts, self.chunk_size, cached, max_rollback=rollback, store=store
        ).run()
        self._add_rows([source for source, _ in joining], cache)
        self.texts += [tokens for _, tokens in joining]
        self.counts += [len(prompt) for prompt in prompts]

    def _prepare(self, requests: list, cache) -> tuple:
        """Each drafting row's cache back to the longest prefix it shares with its tokens, less the
        last token where it holds them all (fed again for its logits). Only a source reset for a
        new generation may hold another text; where a sliding window dropped what it would go back
        to, its row is prefilled again."""
        tokens_of = {id(source): tokens for source, tokens, *_ in requests}
        for source in [s for s in self.rows if s.fresh and id(s) in tokens_of]:
            row, tokens = self.rows.index(source), tokens_of[id(source)]
            common = common_prefix_len(self.texts[row][: self.counts[row]], tokens)
            if self.counts[row] - min(common, len(tokens) - 1) > self.cache.can_trim(row):
                self.leave(source)
                self._join([(source, tokens, 0, 0)])
        trims, pending = [], []
        for row, source in enumerate(self.rows):
            tokens, count = tokens_of.get(id(source)), self.counts[row]
            if tokens is None:  # not drafting this step
                trims.append(0)
                pending.append([])
                continue
            # A row's tokens only grow while it decodes: what the cache holds is a prefix of them.
            keep = common_prefix_len(self.texts[row][:count], tokens) if source.fresh else count
            source.fresh, keep = False, min(keep, len(tokens) - 1)
            trims.append(count - keep)
            pending.append(tokens[keep:])
            self.texts[row], self.counts[row] = tokens, len(tokens)
        self.cache.rewind(trims)

        def feed(start: int, counts: list, width: int) -> mx.array:
            chunk = [p[start : start + n] + [0] * (width - n) for p, n in zip(pending, counts)]
            return self.model(mx.array(chunk, mx.int32), cache=self.cache.layers)

        return [len(p) for p in pending], feed

    def _draw(
        self,
        logits: mx.array,
        sources: list,
        trees: Optional[list] = None,
        contexts: Optional[list] = None,
    ) -> tuple:
        """From (R, V) logits, padded or cut to the target's vocabulary."""
        size = logits.shape[-1]
        if size > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        elif size < self.vocab_size:  # padding rows of the target are never proposed
            logits = mx.pad(logits, [(0, 0), (0, self.vocab_size - size)], constant_values=-mx.inf)
        return draw_rows(logits, sources, trees, contexts)

    def _next(self, logits: mx.array, indices: mx.array) -> mx.array:
        return self.model(indices[:, None], cache=self.cache.layers)[:, -1]
