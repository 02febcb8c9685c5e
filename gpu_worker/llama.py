"""The Llama-family decoder as a pure function of flattened tokens.

``forward(token_ids, positions, ...)`` runs every non-attention op once over
all new tokens of all requests (``[T, hidden]``, no padding); only attention
is split per request, inside the attention backend. No sampling, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.attention import AttentionBackend, kv_writer
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model_config import ModelConfig
from gpu_worker.pointwise import PointwiseOps, default_pointwise_name, make_pointwise
from gpu_worker.quantized_linear import linear
from gpu_worker.rotary import RotaryEmbedding
from gpu_worker.weights import ModelWeights


class LlamaModel:
    """Weights plus the forward pass; K/V lives in a ``PagedKVCache`` passed in."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        device: torch.device,
        dtype: torch.dtype,
        pointwise: PointwiseOps | None = None,
    ) -> None:
        """``pointwise``: the norms, RoPE and SwiGLU (default: Triton kernels on CUDA)."""
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.rotary = RotaryEmbedding(config, device, dtype)
        self.pointwise = pointwise or make_pointwise(default_pointwise_name(device))
        # A tensor-parallel rank's partial sums of the row-parallel products (the
        # output and down projections) added up across its ranks, in place
        # (``tensor_shard.py``); None: the whole model is here.
        self.reduce_partial: Callable[[torch.Tensor], None] | None = None

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
        last = self.final_hidden(
            token_ids, positions, slot_mapping, kv_cache, backend, attention_plan, logits_rows
        )
        return self.logits(last)

    @torch.inference_mode()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """The LM head over ``final_hidden``'s rows: fp32 ``[rows, vocab]``."""
        return linear(last, self.weights.lm_head).float()

    @torch.inference_mode()
    def final_hidden(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        attention_plan: object,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The selected rows' final hidden states, normed: ``[len(logits_rows), hidden]``
        (everything of ``forward`` but the LM head)."""
        hidden = self.embed(token_ids)
        hidden, delta = self.run_layers(
            hidden, None, positions, slot_mapping, kv_cache, backend, attention_plan
        )
        return self.final_rows(hidden, delta, logits_rows)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings: ``[T, hidden]`` (the first pipeline stage's start)."""
        return self.weights.embed_tokens[token_ids]

    def run_layers(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        attention_plan: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer of ``self.weights`` over the residual stream ``hidden + delta``
        (``delta`` None: nothing to add yet), which comes out the same way: each add
        is fused into the next norm, so a pipeline stage hands on both halves and the
        next one goes on with exactly the ops of one whole forward. Undecorated, as
        ``embed`` and ``final_rows``: a compiled graph traces them under no_grad
        (``compiled_decode.py``); callers outside ``final_hidden`` hold inference mode."""
        config, ops, eps = self.config, self.pointwise, self.config.rms_norm_eps
        rotary_inputs = ops.rotary_inputs(self.rotary, positions)
        write_kv = kv_writer(backend)
        for index, layer in enumerate(self.weights.layers):
            hidden, x = ops.add_rms_norm(hidden, delta, layer.input_norm, eps)
            qkv = linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, q_size + 2 * kv_size]
            layer_keys, layer_values = kv_cache.keys[index], kv_cache.values[index]
            query = ops.rope_and_store_kv(
                qkv, config.num_heads, config.num_kv_heads, rotary_inputs,
                slot_mapping, layer_keys, layer_values, write_kv,
            )  # fmt: skip
            attended = backend.attend(query, layer_keys, layer_values, attention_plan)
            delta = linear(attended.reshape(len(query), -1), layer.o_proj)
            if self.reduce_partial is not None:
                self.reduce_partial(delta)
            hidden, x = ops.add_rms_norm(hidden, delta, layer.post_attention_norm, eps)
            delta = linear(ops.silu_mul(linear(x, layer.gate_up_proj)), layer.down_proj)
            if self.reduce_partial is not None:
                self.reduce_partial(delta)
        return hidden, delta

    def final_rows(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """The selected rows of the residual stream, added up and normed by the final norm."""
        rows_delta = None if delta is None else delta[logits_rows]
        eps = self.config.rms_norm_eps
        _, last = self.pointwise.add_rms_norm(
            hidden[logits_rows], rows_delta, self.weights.final_norm, eps
        )
        return last
