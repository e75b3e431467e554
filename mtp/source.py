"""A draft source from a model's own multi-token-prediction layers (model.py), for one row or many.

An MTP module reads what a draft head reads, the target's last hidden state at t and the embedding
of x_{t+1}, so it drafts as a head does, through a ``HiddenStateDrafter``
(decoder/hidden_drafter.py): the ``HiddenStateTap`` keeps the target's hidden states in its cache,
the MTP layer's own KV cache keeps only the accepted tokens' positions after every step, and for
k > 1 it reads its own output in place of the target's (as vLLM chains an MTP layer). Drafts are
drawn from the MTP's distribution, so sampling stays exact.

    tap, drafter = MTPDrafter.create(target, model_dir)         # run the loops on tap
    generate(tap, tokenizer, prompt, draft_sources=[drafter.source()])     # one row
    gen = BatchGenerator(tap, drafters=[drafter])                          # a batch
"""

import mlx.core as mx

from decoder.hidden_drafter import HiddenStateDrafter, HiddenStateSource
from mtp.model import load_mtp, text_model


class MTPSource(HiddenStateSource):
    """One row's source on an ``MTPDrafter``: made by ``MTPDrafter.source``."""

    name = "mtp"


class MTPDrafter(HiddenStateDrafter):
    """A ``HiddenStateDrafter`` that drafts with the target's MTP layer; the options
    (``num_draft``, ``adaptive``, ...) are ``HiddenStateDrafter``'s."""

    source_class = MTPSource

    @classmethod
    def create(cls, target, model_dir, **kwargs):
        """Load the MTP layer of the model in ``model_dir`` (``target`` is that model); returns
        ``(tap, drafter)``: run the loop on ``tap``. ``NoMTPWeights``/``MTPError`` as ``load_mtp``
        says."""
        target = text_model(target)  # Qwen3.5's language model, out of mlx-lm's multimodal wrapper
        mtp = load_mtp(model_dir, target)
        # A draft step reads the MTP layer and the output matrix it scores with (the target's, for
        # Qwen3-Next).
        return cls.around(target, mtp, mx.arange(target.args.vocab_size), **kwargs)
