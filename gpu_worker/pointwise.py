"""The per-token ops between the matmuls of a layer: norms, RoPE with the K/V store, SwiGLU.

On a GPU a decode step's time at small batches is mostly the launch and tail
of many tiny kernels, not bytes: the torch ops below are about 30 launches
per layer (an fp32 RMSNorm alone is six). ``pointwise_triton.py`` does the
same arithmetic in three kernels per layer (residual add + norm, RoPE + K/V
store, SwiGLU), rounding where torch rounds. ``TorchPointwise`` is what runs
on the CPU.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F

from gpu_worker.attention import KVWriter
from gpu_worker.rotary import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class PointwiseOps(Protocol):
    """The ops of ``LlamaModel.forward`` that are neither matmuls nor attention."""

    name: str

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden + delta`` (the residual stream; ``hidden`` when no delta) and its
        RMSNorm. ``hidden`` may be updated in place: the caller uses only what is returned."""
        ...

    def rotary_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> object:
        """Whatever ``rope_and_store_kv`` needs of the positions, once per forward."""
        ...

    def rope_and_store_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rotary_inputs: object,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        write_kv: KVWriter,
    ) -> torch.Tensor:
        """Split the fused ``qkv`` [T, (heads + 2 kv_heads) * head_dim], rotate queries and
        keys, store keys and values at ``slot_mapping`` in one layer's pool (``write_kv``
        is how, where the ops do not store themselves); return the queries [T, heads,
        head_dim]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` of ``gate_up`` [T, 2 * intermediate]."""
        ...


class TorchPointwise:
    """Plain torch ops: any device."""

    name = "torch"

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, eps)

    def rotary_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.tables(positions)

    def rope_and_store_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rotary_inputs: object,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        write_kv: KVWriter,
    ) -> torch.Tensor:
        cos, sin = cast(tuple[torch.Tensor, torch.Tensor], rotary_inputs)
        head_dim = keys.shape[-1]
        query_key, value = qkv.split(
            [(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1
        )
        # Queries and keys rotate as one tensor: the same arithmetic, half the ops.
        rotated = apply_rotary(query_key.view(-1, num_heads + num_kv_heads, head_dim), cos, sin)
        query, key = rotated.split([num_heads, num_kv_heads], dim=1)
        write_kv(keys, values, slot_mapping, key, value.view(-1, num_kv_heads, head_dim))
        return query

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def make_pointwise(name: str) -> PointwiseOps:
    """``torch`` or ``triton`` (CUDA; on the CPU only under ``TRITON_INTERPRET=1``)."""
    if name == "torch":
        return TorchPointwise()
    if name == "triton":
        from gpu_worker.pointwise_triton import TritonPointwise

        return TritonPointwise()
    raise ValueError(f"pointwise ops {name!r} are not one of torch, triton")


def default_pointwise_name(device: torch.device) -> str:
    """``triton`` on CUDA when it imports, else ``torch``."""
    from gpu_worker.attention import triton_available

    return "triton" if device.type == "cuda" and triton_available() else "torch"
