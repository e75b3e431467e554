"""The published EAGLE draft heads in PyTorch, as oracles for draft_head/eagle.py.

A port of SafeAILab/EAGLE's ``eagle/model/cnets.py`` (EAGLE-3) and ``cnets1.py`` (EAGLE-1/2)
forward passes, built from transformers' Llama pieces (RMSNorm, rotary embedding, MLP). The
parameter names are the published ones, so ``state_dict()`` is a head file. Tree drafting,
training and the embedding download are left out.
"""

import math

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)


def eagle3_layer_inputs(layer_inputs: list) -> torch.Tensor:
    """The reference's choice of target features: the inputs of layers 2, L//2 and L-3
    (``modeling_llama_kv.py``), concatenated in layer order."""
    count = len(layer_inputs)
    chosen = [
        h for idx, h in enumerate(layer_inputs) if idx == count - 3 or idx == count // 2 or idx == 2
    ]
    return torch.cat(chosen, dim=-1)


class Attention(nn.Module):
    """Llama attention whose projections read ``in_width`` features; keys and values are cached
    as a (keys, values) pair, and position p attends to cached positions < p and itself."""

    def __init__(self, config: LlamaConfig, in_width: int):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, x, past=None):
        batch, length, _ = x.shape
        start = 0 if past is None else past[0].shape[2]
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(start, start + length)[None]
        cos, sin = self.rotary_emb(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        present = (k, v)
        groups = self.heads // self.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        allowed = torch.arange(k.shape[2])[None, :] <= positions[0][:, None]
        # softmax(q k^T / sqrt(head_dim)) v, by PyTorch's kernel (as transformers' default "sdpa";
        # a batched matmul here crashes when the tests have loaded OpenBLAS into the process).
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=1 / math.sqrt(self.head_dim)
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), present


class Eagle3MidLayer(nn.Module):
    """cnets.py ``LlamaDecoderLayeremb``: attention over [input_layernorm(emb); hidden_norm(h)]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        size = config.hidden_size
        self.self_attn = Attention(config, 2 * size)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(size, eps=config.rms_norm_eps)

    def forward(self, input_emb, hidden_states, past=None):
        residual = hidden_states
        mixed = torch.cat(
            (self.input_layernorm(input_emb), self.hidden_norm(hidden_states)), dim=-1
        )
        attended, present = self.self_attn(mixed, past)
        hidden_states = residual + attended
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class Eagle3Reference(nn.Module):
    """cnets.py ``Model``: fc over three target layers, one midlayer, norm and a draft-vocabulary
    head."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, size)
        self.fc = nn.Linear(3 * size, size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = LlamaRMSNorm(size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def forward(self, hidden_states, input_ids, past=None):
        """Target features (3d) or the head's own output (d) at t, and x_{t+1}; returns the
        head's hidden states and its cache."""
        inputs_embeds = self.embed_tokens(input_ids)
        if hidden_states.shape[-1] != inputs_embeds.shape[-1]:
            hidden_states = self.fc(hidden_states)
        return self.midlayer(inputs_embeds, hidden_states, past)

    def logits(self, hidden_states):
        return self.lm_head(self.norm(hidden_states))

    def target_tokens(self, draft_indices):
        return draft_indices + self.d2t[draft_indices]


class Eagle1DecoderLayer(nn.Module):
    """cnets1.py ``LlamaDecoderLayer``: the first layer has no input norm."""

    def __init__(self, config: LlamaConfig, index: int):
        super().__init__()
        self.index = index
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = LlamaMLP(config)
        if index != 0:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, past=None):
        residual = hidden_states
        if self.index != 0:
            hidden_states = self.input_layernorm(hidden_states)
        attended, present = self.self_attn(hidden_states, past)
        hidden_states = residual + attended
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class Eagle1Reference(nn.Module):
    """cnets1.py ``Model``: fc over [embedding; hidden] and decoder layers; the target's LM head
    scores."""

    def __init__(self, config: LlamaConfig, bias: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Eagle1DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bias)

    def forward(self, hidden_states, input_ids, past=None):
        hidden_states = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        presents = []
        for index, layer in enumerate(self.layers):
            hidden_states, present = layer(hidden_states, None if past is None else past[index])
            presents.append(present)
        return hidden_states, presents
