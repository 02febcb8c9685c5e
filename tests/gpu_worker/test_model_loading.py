"""Loading: clear errors for what is not a model, device and dtype choice (the K/V
pool's size: test_kv_cache.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker.device import choose_device, choose_dtype, cpu_has_native_bf16
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.model_config import ModelLoadError, load_model_config
from gpu_worker.model_loading import load_model
from shared.messages import SamplingParams
from tests.gpu_worker.plans import Job, run_jobs
from tests.gpu_worker.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    return target


def test_a_missing_directory_says_how_to_get_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist.*orcapod model prepare"):
        load_model_config(tmp_path / "nowhere")


def test_missing_files_are_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path)
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json, \*\.safetensors"):
        load_model_config(model_dir)


def test_a_model_that_is_not_llama_family_is_refused(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not a Llama-family decoder"):
        load_model_config(model_dir)


def test_unsupported_rope_scaling_is_named(tiny_dir, tmp_path):
    model_dir = _copy(tiny_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        load_model_config(model_dir)


def test_a_missing_weight_is_named(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _copy(tiny_dir, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(model_dir, device="cpu", dtype="float32")


def test_stop_tokens_come_from_config_and_the_vocabulary(tiny_dir):
    assert 2 in load_model_config(tiny_dir).eos_token_ids


def test_device_and_dtype_are_automatic_and_overridable(tmp_path):
    assert choose_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert choose_device().type == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            choose_device("cuda")
    assert choose_dtype(torch.device("cpu"), "bfloat16") is torch.bfloat16
    assert choose_dtype(torch.device("cuda"), None) is torch.bfloat16
    assert choose_dtype(torch.device("cpu"), None) is torch.float32  # bf16 units or not
    flags = tmp_path / "cpuinfo"
    flags.write_text("flags\t\t: fpu avx2 avx512_bf16\n")
    assert cpu_has_native_bf16(flags, "AVX512")
    # Held to AVX2 (ATEN_CPU_CAPABILITY=avx2), torch's kernels use no bf16 units.
    assert not cpu_has_native_bf16(flags, "AVX2")
    flags.write_text("flags\t\t: fpu avx2\n")
    assert not cpu_has_native_bf16(flags, "AVX512")
    with pytest.raises(ValueError, match="float64"):
        choose_dtype(torch.device("cpu"), "float64")


def test_bf16_on_the_cpu_runs_and_backends_agree(tiny_dir):
    model = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert model.weights.embed_tokens.dtype is torch.bfloat16
    outputs = []
    for backend in ("reference", "cpu"):
        jobs = [
            Job(
                f"r{i}",
                list(range(3, 3 + 7 * (i + 1))),
                SamplingParams(max_tokens=5, ignore_eos=True),
                join_step=i,
            )
            for i in range(3)
        ]
        run_jobs(Engine(model, KVCacheBudget(num_bytes=1 << 20, block_size=4), backend), jobs)
        outputs.append([job.generated_ids for job in jobs])
    assert outputs[0] == outputs[1]
