"""A ragged verification pass: the dense layers run on the rows' real tokens only.

A ``[B, W]`` pass holds row b's last token and its ``lengths[b] - 1`` draft tokens, padded to
``W``. The padding is work for nothing: on a CPU a matmul costs about as much per row of its input
as the whole model per token. Here every token-wise layer (the projections, the MLP, the norms and
the output head) runs on the ``N = sum(lengths)`` real tokens packed into one ``[N, dim]`` array,
and only attention, which needs each row's own cache and positions, sees the padded ``[B, W]``
layout:

    packed [N, dim]  --q/k/v proj-->  gathered to [B, W]  --RoPE, cache, attention-->  [B, W]
                     <--o_proj, MLP--  packed again [N, dim]

So a row may draft 4 tokens while the others draft none, at little more than the cost of 4 more
tokens. Padded slots are filled with copies of their row's last real token: their keys land past
the row's real ones (no real query sees them; causal), and the step trims them with the rejected
drafts. Measured (SmolLM2-135M, 8 rows, 2-core CPU, OpenBLAS): 8 more tokens spread over 2 rows
as ``[8, 5]`` cost 93 ms, against 83 ms for ``[8, 2]`` and 146 ms for a full ``[8, 5]``.

The packed tokens are padded (with copies of the first) to a multiple of ``PACK_MULTIPLE``:
matmul kernels work on tiles of rows, and measured here a ``[12, 576]`` input costs more than a
``[16, 576]`` one (OpenBLAS, 2-core CPU: 9-15 rows took 1.0-1.3x the time of 16). So a ragged
pass computes ``computed_tokens(rows, width, real)`` tokens, never more than the padded pass would.

Only mlx-lm's Llama layout is packed (``can_pack``); other models get the padded pass.
"""

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention


def can_pack(model) -> bool:
    """Whether ``ragged_logits`` knows ``model``'s layers: mlx-lm's Llama, full attention only."""
    inner = getattr(model, "model", None)
    return isinstance(inner, llama.LlamaModel) and inner.swa_idx is None


PACK_MULTIPLE = 8


def computed_tokens(rows: int, width: int, real: int) -> int:
    """The tokens a pass of ``rows`` x ``width`` slots with ``real`` real ones computes: the real
    ones rounded up to ``PACK_MULTIPLE``, or every slot when that is no more (a padded pass)."""
    return min(rows * width, -(-real // PACK_MULTIPLE) * PACK_MULTIPLE)


def ragged_logits(model, inputs: mx.array, lengths: Sequence[int], cache: list) -> mx.array:
    """Logits ``[B, W, vocab]`` of ``inputs`` (``[B, W]``), of which row b's first ``lengths[b]``
    tokens are real; the scores at padded positions are meaningless. Writes ``W`` slots per row
    into ``cache`` (a list of ``RaggedKVCache``), as the padded pass does."""
    batch, width = inputs.shape
    real = [b * width + w for b in range(batch) for w in range(lengths[b])]
    pack = mx.array(real + real[:1] * (computed_tokens(batch, width, len(real)) - len(real)))
    # Each slot of the [B, W] layout reads a packed token: its own, or its row's last real one.
    first = [sum(lengths[:b]) for b in range(batch)]
    unpack = mx.array([first[b] + min(w, lengths[b] - 1) for b in range(batch) for w in range(width)])
    inner = model.model
    h = inner.embed_tokens(inputs.reshape(-1)[pack])
    mask = cache[0].make_mask(width)
    for layer, layer_cache in zip(inner.layers, cache):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), pack, unpack, batch, width, mask, layer_cache)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)
    logits = inner.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
    return logits[unpack].reshape(batch, width, -1)


def _attention(attention, x, pack, unpack, batch, width, mask, cache):
    """mlx-lm's Llama attention, with the projections on packed tokens."""
    def heads(projected, count):
        return projected[unpack].reshape(batch, width, count, -1).transpose(0, 2, 1, 3)
    queries = heads(attention.q_proj(x), attention.n_heads)
    keys = heads(attention.k_proj(x), attention.n_kv_heads)
    values = heads(attention.v_proj(x), attention.n_kv_heads)
    queries = attention.rope(queries, offset=cache.offset)
    keys = attention.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attention.scale, mask=mask)
    output = output.transpose(0, 2, 1, 3).reshape(batch * width, -1)
    return attention.o_proj(output[pack])
