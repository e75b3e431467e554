"""A draft source from a model's own multi-token-prediction layers (mtp.py).

An MTP module reads what a draft head reads, the target's last hidden state at t and the embedding
of x_{t+1}, so it drafts through ``DraftHeadSource``: the ``HiddenStateTap`` hands it the target's
hidden states without the loop knowing, its own KV cache is trimmed back to the accepted tokens
after every step, and for k > 1 it reads its own output in place of the target's (as vLLM chains
an MTP layer). Drafts are drawn from the MTP's distribution, so sampling stays exact.

    tap, source = MTPSource.create(target, model_dir)
    generate(tap, tokenizer, prompt, draft_sources=[source])
"""

import mlx.core as mx

from speculative.adaptive import weight_bytes
from speculative.head_source import DraftHeadSource, HiddenStateTap
from speculative.mtp import load_mtp


class MTPSource(DraftHeadSource):
    """Drafts with the target's MTP layer; ``DraftHeadSource``'s options (``num_draft``, ``adaptive``, ...)."""

    name = "mtp"
    batch_refusal = ("MTP drafts cannot draft for a batch yet (they read one sequence's hidden states); "
                     "decode one sequence at a time")

    @classmethod
    def create(cls, target, model_dir, **kwargs):
        """Load the MTP layer of the model in ``model_dir`` (``target`` is that model); returns
        ``(tap, source)``: run the loop on ``tap``. ``NoMTPWeights``/``MTPError`` as ``load_mtp`` says."""
        mtp = load_mtp(model_dir, target)
        tap = HiddenStateTap(target, mtp.feature_layers)
        # A draft step reads the MTP layer and the output matrix it scores with (the target's, for Qwen3-Next).
        kwargs.setdefault("draft_cost_prior", (weight_bytes(mtp) + mtp.output_bytes) / weight_bytes(target))
        return tap, cls(tap, mtp, mx.arange(target.args.vocab_size), **kwargs)
