"""A worker group's logits equal one engine's: pipeline stages run exactly one
engine's ops (bit for bit), tensor-parallel ranks add their partial sums in
another order (fp32 rounding only), on a mixed step of prompts and a decode
(``group_logits.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu_worker.group_logits import engine_logits, group_logits, relative_error
from tests.gpu_worker.tiny_models import write_tiny_model

# fp32 rounding of sums in another order, over the largest logit (measured on the
# tiny model: about 1e-7; SmolLM2 with T = 3 in docs/performance.md).
FP32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of 4 layers, 4 heads and 2 K/V heads (splits in 2 and 2)."""
    directory = tmp_path_factory.mktemp("tiny") / "llama"
    return write_tiny_model(directory, "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def exact(tiny_dir: Path) -> torch.Tensor:
    return engine_logits(tiny_dir)


def test_pipeline_stages_give_one_engines_logits_bit_for_bit(
    tiny_dir: Path, exact: torch.Tensor
) -> None:
    assert torch.equal(group_logits(tiny_dir, 2, 1), exact)


def test_tensor_ranks_give_one_engines_logits_to_fp32_rounding(
    tiny_dir: Path, exact: torch.Tensor
) -> None:
    # Two stages of two tensor ranks: the hidden states a stage's leader receives
    # shared with its other rank, the partial sums of each stage's own group.
    logits = group_logits(tiny_dir, 2, 2)
    assert relative_error(logits, exact) <= FP32_TOLERANCE
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
