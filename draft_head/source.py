"""The draft head's source: a ``HiddenStateDrafter`` (decoder/hidden_drafter.py) with a head
loaded by ``load_head``, ours or a published EAGLE head, for one row or many.

    tap, drafter = HeadDrafter.create(target)              # run the loops on tap
    generate(tap, tokenizer, prompt, draft_sources=[drafter.source()])     # one row
    gen = BatchGenerator(tap, drafters=[drafter])                          # a batch
"""

from decoder.hidden_drafter import HiddenStateDrafter, HiddenStateSource
from draft_head.loading import load_head


class DraftHeadSource(HiddenStateSource):
    """One row's source on a ``HeadDrafter``: made by ``HeadDrafter.source``."""

    name = "draft_head"


class HeadDrafter(HiddenStateDrafter):
    """A draft head drafting for one row or many; the options (``num_draft``, ``adaptive``, ...)
    are ``HiddenStateDrafter``'s."""

    source_class = DraftHeadSource

    @classmethod
    def create(cls, target, head_dir=None, **kwargs):
        """Load a head for ``target`` (ours or a published EAGLE head, see ``load_head``); returns
        ``(tap, drafter)``: run the loop on ``tap``."""
        head, vocab_ids = load_head(head_dir, target)
        return cls.around(target, head, vocab_ids, **kwargs)
