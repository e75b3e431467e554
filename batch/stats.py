"""What a ``BatchGenerator`` counts (``BatchStats``): its passes and their widths, the prompt
tokens it took and prefilled, the tokens it generated, and the time each took; ``summary`` is how
``batch_generate``'s ``BatchResult`` reports them.
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from decoder.pass_cost import PassCost


@dataclass
class BatchStats:
    passes: int = 0  # [B, W] verification passes
    # W -> passes of that width (what the policy chose)
    widths: Counter = field(default_factory=Counter)
    row_passes: int = 0  # sum over passes of the rows in them
    prompt_tokens: int = 0
    # the tokens the model ran to prefill them: a prompt that rows share counts once, a cached
    # prefix not at all
    prefilled_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    decode_time: float = 0.0

    def summary(self, cost: Optional[PassCost] = None) -> dict:
        return {
            "passes": self.passes,
            "width_histogram": dict(sorted(self.widths.items())),
            "passes_per_token": self.row_passes / max(self.generation_tokens, 1),
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generation_tokens": self.generation_tokens,
            "prompt_tps": self.prompt_tokens / max(self.prompt_time, 1e-9),
            "generation_tps": self.generation_tokens / max(self.decode_time, 1e-9),
            "verification_cost": cost.summary() if cost is not None else None,
        }
