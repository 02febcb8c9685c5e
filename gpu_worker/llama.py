"""The Llama-family decoder as a pure function of flattened tokens.

``forward(token_ids, positions, ...)`` runs every non-attention op once over
all new tokens of all requests (``[T, hidden]``, no padding); only attention
is split per request, inside the attention backend. No sampling, no I/O.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionBackend, kv_writer
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model_config import ModelConfig
from gpu_worker.rotary import RotaryEmbedding, apply_rotary
from gpu_worker.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    """Weights plus the forward pass; K/V lives in a ``PagedKVCache`` passed in."""

    def __init__(
        self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.rotary = RotaryEmbedding(config, device, dtype)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        attention_plan: object,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (fp32) ``[len(logits_rows), vocab]`` of the selected token rows.

        token_ids, positions, slot_mapping: ``[T]``; each token's K/V is written
        to its slot before attention reads the pool.
        """
        config = self.config
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        cos, sin = self.rotary.tables(positions)  # [T, 1, head_dim]
        hidden = self.weights.embed_tokens[token_ids]  # [T, hidden]
        write_kv = kv_writer(backend)
        for index, layer in enumerate(self.weights.layers):
            x = rms_norm(hidden, layer.input_norm, config.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, q_size + 2 * kv_size]
            query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
            query = apply_rotary(query.view(-1, num_heads, head_dim), cos, sin)
            key = apply_rotary(key.view(-1, num_kv_heads, head_dim), cos, sin)
            layer_keys, layer_values = kv_cache.keys[index], kv_cache.values[index]
            value = value.view(-1, num_kv_heads, head_dim)
            write_kv(layer_keys, layer_values, slot_mapping, key, value)
            attended = backend.attend(query, layer_keys, layer_values, attention_plan)
            hidden = hidden + F.linear(attended.reshape(-1, q_size), layer.o_proj)
            x = rms_norm(hidden, layer.post_attention_norm, config.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up_proj).chunk(2, dim=-1)  # [T, intermediate] each
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_proj)
        last = rms_norm(hidden[logits_rows], self.weights.final_norm, config.rms_norm_eps)
        return F.linear(last, self.weights.lm_head).float()  # [rows, vocab]
