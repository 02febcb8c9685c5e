"""What one rank of a worker group holds of a model (pure).

A rank of stage s and tensor rank t reads only its stage's layers, each cut to
its tensor rank's share as it is read (``tensor_shard.shard_layer``), the
embeddings only where its stage is the first, and the final norm and LM head
only where it samples (the last stage's leader): no rank ever holds the whole
model, so a model bigger than one device's memory (or one host's) fits a group
whose shares do. One engine's share is the whole model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.model_config import ModelConfig
from gpu_worker.tensor_shard import shard_config, shard_layer

if TYPE_CHECKING:
    from gpu_worker.weights import LayerWeights


@dataclass(frozen=True)
class WeightShare:
    """The layers a rank runs, whether it embeds and whether it samples, and its
    tensor-parallel cut (rank ``tensor_rank`` of ``tensor_parallel``)."""

    layers: range
    embeddings: bool
    head: bool  # the final norm and the LM head
    tensor_parallel: int = 1
    tensor_rank: int = 0

    @classmethod
    def whole(cls, config: ModelConfig) -> WeightShare:
        """One engine's share: everything."""
        return cls(range(config.num_layers), embeddings=True, head=True)

    def is_whole(self, config: ModelConfig) -> bool:
        """Whether this share is the whole model (the logits probe can run on it)."""
        return self == WeightShare.whole(config)

    def config(self, config: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its layers, heads, K/V heads and
        intermediate units."""
        shape = dataclasses.replace(config, num_layers=len(self.layers))
        if self.tensor_parallel == 1:
            return shape
        return shard_config(shape, self.tensor_parallel)

    def cut(self, layer: LayerWeights, config: ModelConfig) -> LayerWeights:
        """A whole layer's loaded (unpacked) weights cut to this rank's share."""
        if self.tensor_parallel == 1:
            return layer
        return shard_layer(layer, config, self.tensor_parallel, self.tensor_rank)
