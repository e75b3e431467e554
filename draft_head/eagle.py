"""Published EAGLE draft heads (SafeAILab/EAGLE layouts) as MLX modules for mlx-lm targets.

Both published layouts plug into ``DraftHeadSource`` like our own head (head.py); ``load_head``
(loading.py) reads their directories: ``config.json``, a Llama config of the head, and the
weights.

- **EAGLE-1/2** (arXiv 2401.15077, 2406.16858): ``fc`` maps [embedding; h_t] (2d -> d, with bias)
  where h_t is the target's last hidden state after its final norm; then Llama decoder layers
  ``layers.N`` (the first has no input norm, its input is already mixed); the prediction goes to the
  target's own LM head.
- **EAGLE-3** (arXiv 2503.01840; config has ``draft_vocab_size``): the target's features are the
  inputs of its layers 2, L//2 and L-3 (low, middle, top), concatenated; ``fc`` reduces them (3d ->
  d, no bias). One decoder layer ``midlayer`` attends over [input_layernorm(embedding);
  hidden_norm(h)] (q, k and v read 2d), its residual is h. The head scores ``lm_head(norm(h))`` over
  a pruned draft vocabulary; draft index i is target token ``i + d2t[i]``. Its own predictions (d
  wide) skip ``fc``.
"""

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from decoder.hidden_states import FINAL


def eagle3_feature_layers(num_layers: int) -> list:
    """The target layers whose *outputs* an EAGLE-3 head reads: the reference collects the
    inputs of layers 2, L//2 and L-3, i.e. the outputs of the layers just before them."""
    return [index - 1 for index in (2, num_layers // 2, num_layers - 3)]


class Eagle1Head(nn.Module):
    """EAGLE-1/2: fc over [embedding; h] and Llama decoder layers; the target's LM head scores.
    ``target_logits`` is that LM head as a function (hidden states -> logits over the whole
    vocabulary, quantized or not), and ``output_bytes`` what it reads; ``load_head`` hands both."""

    feature_layers = [FINAL]

    def __init__(
        self,
        args: llama.ModelArgs,
        bias: bool = True,
        target_logits: Callable = None,
        output_bytes: int = 0,
    ):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=bias)
        self.layers = [llama.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.layers[0].input_layernorm = nn.Identity()  # absent from the published weights
        # A function, not a module: the target's weights stay out of the head's parameters.
        self.target_logits, self.output_bytes = target_logits, output_bytes

    def __call__(self, features, next_embeddings, cache=None, mask=None):
        """(B, L, d) features at t and embeddings of x_{t+1} -> (B, L, d) predicted h_{t+1}."""
        cache = cache or [None] * len(self.layers)
        x = self.fc(mx.concatenate([next_embeddings, features], axis=-1))
        mask = create_attention_mask(x, cache[0]) if mask is None else mask
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, mask, cache=layer_cache)
        return x

    def logits(self, predicted: mx.array) -> mx.array:
        """(..., d) predicted h_{t+1} -> (..., vocab) scores from the target's own LM head."""
        return self.target_logits(predicted)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads [embedding; hidden] (2d wide)."""

    def __init__(self, args: llama.ModelArgs):
        super().__init__()
        size = args.hidden_size
        self.self_attn = attention = llama.Attention(args)
        for name, heads in (
            ("q_proj", attention.n_heads),
            ("k_proj", attention.n_kv_heads),
            ("v_proj", attention.n_kv_heads),
        ):
            setattr(attention, name, nn.Linear(2 * size, heads * attention.head_dim, bias=False))
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(size, eps=args.rms_norm_eps)

    def __call__(self, embeddings, hidden, mask=None, cache=None):
        mixed = mx.concatenate(
            [self.input_layernorm(embeddings), self.hidden_norm(hidden)], axis=-1
        )
        hidden = hidden + self.self_attn(mixed, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """EAGLE-3: fused low/middle/top features, one ``midlayer``, its own draft-vocabulary head."""

    output_bytes = 0  # it scores with its own lm_head, one of its parameters

    def __init__(self, args: llama.ModelArgs, draft_vocab_size: int, feature_layers: list):
        super().__init__()
        self.args, self.feature_layers = args, list(feature_layers)
        size = args.hidden_size
        self.fc = nn.Linear(len(self.feature_layers) * size, size, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(size, draft_vocab_size, bias=False)

    def __call__(self, features, next_embeddings, cache=None, mask=None):
        """(B, L, 3d) target features at t, or (B, L, d) own predictions, and embeddings of
        x_{t+1} -> (B, L, d) predicted hidden state (before ``norm``; fed back as it is)."""
        hidden = self.fc(features) if features.shape[-1] != self.args.hidden_size else features
        layer_cache = cache[0] if cache else None
        mask = create_attention_mask(hidden, layer_cache) if mask is None else mask
        return self.midlayer(next_embeddings, hidden, mask, layer_cache)

    def logits(self, predicted: mx.array) -> mx.array:
        """Scores over the draft vocabulary (``vocab_ids`` from ``load_head`` maps them)."""
        return self.lm_head(self.norm(predicted))

    def make_cache(self) -> list:
        return [KVCache()]
