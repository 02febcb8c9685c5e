"""Loading a model for the engine: the weights on a device and dtype, packed into
the chosen format (``quantized_linear.py``), and the probe prompt whose logits a
packed format must reproduce."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.attention import SequenceLayout, default_backend_name, make_backend
from gpu_worker.block_tables import blocks_for
from gpu_worker.device import choose_device, choose_dtype
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.model_config import load_model_config
from gpu_worker.quantized_linear import linear, pack_weights
from gpu_worker.weight_share import WeightShare
from gpu_worker.weights import NOT_HELD, ModelWeights, load_weights

# Tokens of the prompt whose logits packed weights must reproduce at load.
PROBE_PROMPT_TOKENS = 32


def load_model(
    model_dir: Path,
    device: str | None = None,
    dtype: str | None = None,
    weight_format: str = "float32",
    share: WeightShare | None = None,
) -> LlamaModel:
    """Load a Hugging Face-format Llama directory on the chosen device and dtype:
    the whole model, or a worker group rank's ``share`` of it (only that is read).

    ``weight_format`` 'q4_1', 'float16' or 'int4' packs the matrices for the CPU's
    kernels (``quantized_linear``; 'auto' picks float16 where they
    run, the loaded tensors elsewhere); where they cannot run, or their
    logits of a probe prompt stray from the loaded weights', the loaded
    tensors are kept (the exact path) and one log line says why. A share,
    which cannot compute logits alone, is probed by its matrices' products
    (``matrix_probe``).
    """
    torch_device = choose_device(device)
    torch_dtype = choose_dtype(torch_device, dtype)
    config = load_model_config(model_dir)
    share = share or WeightShare.whole(config)
    weights = load_weights(model_dir, config, torch_device, torch_dtype, share)

    def probe(candidate: ModelWeights) -> torch.Tensor:
        if not share.is_whole(config):
            return matrix_probe(candidate, torch_device, torch_dtype)
        return probe_logits(LlamaModel(config, candidate, torch_device, torch_dtype))

    weights = pack_weights(
        weights, weight_format, torch_device, torch_dtype, probe, include_lm_head=share.head
    )
    return LlamaModel(share.config(config), weights, torch_device, torch_dtype)


def matrix_probe(
    weights: ModelWeights, device: torch.device, dtype: torch.dtype, num_rows: int = 4
) -> torch.Tensor:
    """Every projection's product (and the LM head's, where held) over ``num_rows``
    fixed pseudo-random rows, flattened into one vector: the probe of a share of a
    model, whose packed matrices must reproduce the loaded ones' products."""
    generator = torch.Generator().manual_seed(0)
    matrices = [
        matrix
        for layer in weights.layers
        for matrix in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    if weights.lm_head is not NOT_HELD:
        matrices.append(weights.lm_head)
    products = []
    for matrix in matrices:
        width = matrix.shape[1] if isinstance(matrix, torch.Tensor) else matrix.in_features
        rows = torch.randn(num_rows, width, generator=generator).to(device=device, dtype=dtype)
        products.append(linear(rows, matrix).float().flatten())
    return torch.cat(products)


def probe_logits(model: LlamaModel, num_tokens: int = PROBE_PROMPT_TOKENS) -> torch.Tensor:
    """Logits ``[num_tokens, vocab]`` of every position of a fixed pseudo-random
    prompt, prefilled in one pass into a throwaway K/V cache."""
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(model.config.vocab_size, (num_tokens,), generator=generator)
    return prompt_logits(model, token_ids.tolist())


def prompt_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` of every position of ``token_ids``,
    prefilled in one pass into a throwaway K/V cache."""
    device, num_tokens = model.device, len(token_ids)
    block_size = 16
    cache = PagedKVCache(
        model.config, blocks_for(num_tokens, block_size), block_size, device, model.dtype
    )
    cache.tables.extend("probe", range(cache.num_blocks))
    backend = make_backend(default_backend_name(device), model.dtype)
    layout = [SequenceLayout(0, num_tokens, 0, cache.tables.table("probe"))]
    return model.forward(
        token_ids=torch.tensor(token_ids, device=device),
        positions=torch.arange(num_tokens, device=device),
        slot_mapping=torch.tensor(cache.slot_ids("probe", 0, num_tokens), device=device),
        kv_cache=cache,
        backend=backend,
        attention_plan=backend.prepare(layout, block_size, device),
        logits_rows=torch.arange(num_tokens, device=device),
    )
