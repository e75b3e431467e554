"""``batch_generate``: prompts in, texts out, every prompt decoded in one ``BatchGenerator``.

result = batch_generate(model, tokenizer, ["Hello", "Write a haiku"], max_tokens=64)
print(result.texts, result.stats.summary(result.pass_cost))
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from batch.generator import BatchGenerator
from batch.stats import BatchStats
from decoder.pass_cost import PassCost
from decoder.text import encode, eos_ids_of


@dataclass
class BatchResult:
    texts: list
    tokens: list  # per prompt
    sources: list  # per prompt, the source of each token
    finish_reasons: list
    errors: list  # per prompt: None, or the one line that ended it
    row_stats: list  # per prompt: DecodingStats
    stats: BatchStats
    pass_cost: PassCost
    peak_memory_gb: float

    def to_json(self) -> dict:
        return {
            "texts": self.texts,
            "finish_reasons": self.finish_reasons,
            "errors": self.errors,
            **self.stats.summary(self.pass_cost),
            "peak_memory_gb": self.peak_memory_gb,
        }


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    pass_cost: Optional[PassCost] = None,
    prefill_step_size: int = 512,
    prefill_batch_size: int = 8,
    max_batch: Optional[int] = None,
    max_width: Optional[int] = None,
    **options,
) -> BatchResult:
    """Generate for every prompt (a str, chat template applied, or token ids) in one batch.

    ``options`` are ``BatchGenerator.insert``'s, one value or one per prompt; EOS is the
    tokenizer's unless ``eos_token_ids`` says otherwise.
    """
    options.setdefault("eos_token_ids", eos_ids_of(tokenizer))
    generator = BatchGenerator(
        model,
        prefill_step_size=prefill_step_size,
        prefill_batch_size=prefill_batch_size,
        max_batch=max_batch,
        max_width=max_width,
        pass_cost=pass_cost,
    )
    mx.reset_peak_memory()
    uids = generator.insert([encode(tokenizer, prompt) for prompt in prompts], **options)
    tokens, sources = {uid: [] for uid in uids}, {uid: [] for uid in uids}
    finish, errors, stats = {}, {}, {}
    while responses := generator.next():
        for response in responses:
            tokens[response.uid] += response.tokens
            sources[response.uid] += response.sources
            if response.finish_reason is not None:
                finish[response.uid], errors[response.uid] = response.finish_reason, response.error
                stats[response.uid] = response.stats
    eos = set(options["eos_token_ids"])
    texts = [tokenizer.decode([t for t in tokens[uid] if t not in eos]) for uid in uids]
    return BatchResult(
        texts,
        [tokens[u] for u in uids],
        [sources[u] for u in uids],
        [finish[u] for u in uids],
        [errors[u] for u in uids],
        [stats[u] for u in uids],
        generator.stats,
        generator.cost,
        mx.get_peak_memory() / 1e9,
    )
