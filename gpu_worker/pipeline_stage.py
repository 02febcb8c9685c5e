"""One pipeline stage's share of the model: its layers and their K/V pool.

A stage's model holds only its layers (and the embeddings in the first stage,
the final norm and LM head in the last: ``weight_share.py``).
``PipelineStage.forward`` runs a step's tokens through those layers with
exactly the ops of one whole forward (``LlamaModel``'s ``embed``,
``run_layers`` and ``final_rows``), so a pipeline's logits equal one rank's.
The K/V slots are the first stage's (its block tables): every stage's pool
has the group's number of blocks.
"""

from __future__ import annotations

import torch

from gpu_worker.attention import make_backend
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.step_path import StepInputs


class PipelineStage:
    """A stage's model, K/V pool and attention backend (the eager forward's)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        backend_name: str,
        first: bool,
        last: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = make_backend(backend_name, model.dtype)
        self.first = first
        self.last = last

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, carried: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers over one step: from the token ids (first stage) or the
        residual stream ``carried`` ``[2, T, hidden]`` the stage before sent; the
        stream for the next stage, or the last stage's logits (fp32, the sampled rows)."""
        model, device = self.model, self.model.device
        positions = torch.tensor(inputs.positions, dtype=torch.int64, device=device)
        slots = torch.tensor(inputs.slots, dtype=torch.int64, device=device)
        delta: torch.Tensor | None
        if self.first:
            token_ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=device)
            hidden, delta = model.embed(token_ids), None
        else:
            assert carried is not None
            hidden, delta = carried[0].to(device), carried[1].to(device)
        plan = self.backend.prepare(inputs.layout, self.kv_cache.block_size, device)
        hidden, delta = model.run_layers(
            hidden, delta, positions, slots, self.kv_cache, self.backend, plan
        )
        if not self.last:
            assert delta is not None  # every stage has a layer
            return torch.stack([hidden, delta])
        rows = torch.tensor(inputs.logits_rows, dtype=torch.int64, device=device)
        return model.logits(model.final_rows(hidden, delta, rows))
