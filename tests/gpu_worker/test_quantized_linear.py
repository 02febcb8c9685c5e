"""Packed weights (``--weights float16`` / ``int4``): each packed
linear's error against fp32, the engine generating with them, ``auto``'s
order of formats, and the fall back to the next format or the exact path,
with one log line each, wherever one cannot be used."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from gpu_worker import quantized_linear
from gpu_worker.__main__ import parse_settings
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.llama import LlamaModel
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_config import load_model_config
from gpu_worker.model_loading import load_model
from gpu_worker.q4_1_kernel import Q80Matrix
from gpu_worker.quantized_linear import (
    AUTO_CPU_FORMATS,
    INT4_GROUP_SIZE,
    INT4_MAX_ROWS,
    Float16Linear,
    Int4Kernel,
    Int4Linear,
    Int8GroupLinear,
    PackError,
    Q41I16Linear,
    Q41Linear,
    WithTracedForm,
    candidate_formats,
    linear,
    pack_weights,
    resolve_weight_format,
    traceable,
    unsupported_reason,
    weight_format_of,
)
from gpu_worker.weights import load_weights
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.tiny_models import on_a_q4_1_grid, on_a_q8_0_grid, write_tiny_model

CPU = torch.device("cpu")
PROMPTS = {
    "a": [5, 17, 33, 60, 9, 12, 80],
    "b": [40, 41, 42],
    "c": [90, 3, 3, 71, 26, 55, 14, 8, 62, 30, 77],
}
PACK_EVENTS = ("weights_packed", "weights_not_packed")
# The tiny random model's greedy continuation repeats the prompt's last token;
# seeded sampling at temperature 1 depends on the whole distribution instead.
SAMPLED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=7)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def fp32_model(tiny_dir: Path) -> LlamaModel:
    return load_model(tiny_dir, "cpu", "float32")


@pytest.fixture(scope="module")
def grid_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every projection on Q4_1's grid (the packaged model's
    layers); the tied embedding stays off it (the packaged one is Q8_0)."""
    return _snapped_copy(tiny_dir, tmp_path_factory.mktemp("grid") / "model")


@pytest.fixture(scope="module")
def q8_0_dir(grid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``grid_dir`` with the tied embedding on Q8_0's grid: as the packaged model is."""
    directory = tmp_path_factory.mktemp("q8_0-head") / "model"
    shutil.copytree(grid_dir, directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"] = on_a_q8_0_grid(tensors["model.embed_tokens.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture
def bf16_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Say the CPU has avx512_bf16, so int4 runs here too (slower where it has not)."""
    monkeypatch.setattr(quantized_linear, "cpu_has_native_bf16", lambda: True)


def _snapped_copy(model_dir: Path, target: Path) -> Path:
    """A copy of ``model_dir`` with every projection whose columns come in groups of
    32 put on Q4_1's grid."""
    shutil.copytree(model_dir, target)
    path = target / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith("proj.weight") and tensor.shape[1] % INT4_GROUP_SIZE == 0:
            tensors[name] = on_a_q4_1_grid(tensor)
    save_file(tensors, path, metadata={"format": "pt"})
    return target


def _generate(model: LlamaModel, sampling: SamplingParams) -> dict[str, list[int]]:
    """Continuations of PROMPTS, run together."""
    engine = Engine(model, KVCacheBudget(num_bytes=4 << 20, block_size=4), "cpu")
    max_tokens = sampling.max_tokens
    output = step_alone(engine,
        StepPlan(
            worker_id="t", epoch=0, step_index=0,
            new_requests=[RequestSpec(rid, len(ids), sampling) for rid, ids in PROMPTS.items()],
            prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in PROMPTS.items()],
        )
    )  # fmt: skip
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for step_index in range(1, max_tokens + 1):
        assert not output.failed
        for token in output.tokens:
            tokens[token.request_id].append(token.token_id)
        if step_index == max_tokens:
            return tokens
        output = step_alone(engine, StepPlan("t", 0, step_index, decode_request_ids=list(PROMPTS)))
    raise AssertionError("unreachable")


def _pack_logs(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if entry["event"] in PACK_EVENTS]


def _with_weight(model_dir: Path, target: Path, name: str, value: float) -> Path:
    """A copy of ``model_dir`` with one entry of tensor ``name`` set to ``value``."""
    shutil.copytree(model_dir, target)
    path = target / "model.safetensors"
    tensors = load_file(path)
    tensors[name][0, 0] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return target


# --- one packed matrix against fp32 ----------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_an_int8_group_head_is_the_q8_0_matrix_exactly(rows):
    """The compiled decode's form of a Q8_0 head: fp32 sums of exact int8 levels and
    scales, so it differs from F.linear on the dequantized matrix only by rounding;
    zero groups and levels of either sign's extreme included."""
    generator = torch.Generator().manual_seed(3)
    weight = on_a_q8_0_grid(torch.randn(48, 96, generator=generator))
    weight[5, :32] = 0.0  # a zero group
    weight[7, 40] = -weight[7, 32:64].abs().max()  # -127 where +127 was the largest
    x = torch.randn(rows, 96, generator=generator)
    packed = Int8GroupLinear.pack(weight)
    assert packed.num_bytes == 48 * 96 + 48 * 3 * 4
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        (torch.randn(16, 64), "not on an 8-bit grid"),
        (on_a_q8_0_grid(torch.randn(16, 96))[:, :80], "not a multiple of 32"),
        (on_a_q8_0_grid(torch.randn(24, 64)), "not a multiple of 16"),
        (torch.full((16, 64), float("nan")), "not on an 8-bit grid"),
    ],
    ids=["off the grid", "odd columns", "odd rows", "nan"],
)
def test_an_int8_group_head_refuses_what_it_cannot_hold(weight, reason):
    with pytest.raises(PackError, match=reason):
        Int8GroupLinear.pack(weight)


def test_a_q8_0_head_gets_its_int8_form_for_graphs_and_fbgemm_eagerly(tiny_dir, monkeypatch):
    """float16: the head on a Q8_0 grid (the packaged model's embedding) is fbgemm's
    fp16 eagerly (no plain copy: no graph reads it) and the int8 form inside graphs
    (said to be AVX-512 code here); the layers keep their traceable copies; off the
    grid, or where the vector code is AVX2, the head is fbgemm's alone."""
    here = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(quantized_linear, "INT8_GROUP_CPU_CAPABILITIES", (here,))
    weights = load_weights(tiny_dir, load_model_config(tiny_dir), CPU, torch.float32)
    head = on_a_q8_0_grid(weights.lm_head)
    snapped = dataclasses.replace(weights, embed_tokens=head, lm_head=head)
    packed = pack_weights(snapped, "float16", CPU, torch.float32)
    assert isinstance(packed.lm_head, WithTracedForm)
    assert isinstance(packed.lm_head.eager, Float16Linear)
    assert packed.lm_head.eager.weight is None
    assert traceable(packed.lm_head) and traceable(packed.layers[0].qkv_proj)
    x = torch.randn(2, head.shape[1])
    torch.testing.assert_close(linear(x, packed.lm_head), F.linear(x, head), rtol=1e-3, atol=1e-3)
    off_grid = pack_weights(weights, "float16", CPU, torch.float32).lm_head
    assert isinstance(off_grid, Float16Linear) and not traceable(off_grid)
    monkeypatch.setattr(quantized_linear, "INT8_GROUP_CPU_CAPABILITIES", ())  # AVX2: 3.5x slower
    avx2 = pack_weights(snapped, "float16", CPU, torch.float32).lm_head
    assert isinstance(avx2, Float16Linear) and not traceable(avx2)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (96, 64), (160, 64), (576, 1536), (3072, 576)])
def test_a_float16_linear_stays_within_a_thousandth_of_fp32(shape):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(out_features * 10_007 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(5, in_features, generator=generator)  # [T, in]
    bias = torch.randn(out_features, generator=generator) * 0.1
    exact = F.linear(x, weight, bias)
    packed = linear(x, Float16Linear.pack(weight), bias)
    assert packed.shape == exact.shape and packed.dtype == torch.float32
    assert float((packed - exact).norm() / exact.norm()) <= 1e-3


def test_float16_holds_the_matrix_rounded_to_fp16():
    weight = torch.randn(64, 32)
    fp16_weight, _ = Float16Linear.pack(weight).packed.unpack()
    # fbgemm hands an fp16 matrix back widened; its values are fp16's.
    assert torch.equal(fp16_weight, weight.half().float())


# --- the engine with packed weights ----------------------------------------------------


@pytest.mark.parametrize("weight_format", ["float16", "auto"])
def test_float16_weights_sample_the_same_tokens_as_fp32(tiny_dir, fp32_model, weight_format):
    with capture_logs() as logs:
        model = load_model(tiny_dir, "cpu", "float32", weight_format)
    *skipped, entry = _pack_logs(logs)
    if weight_format == "auto":
        # auto tries q4_1 first: these random weights are off its grid, which
        # one line says, naming the format used instead.
        [q4_1] = skipped
        assert q4_1["event"] == "weights_not_packed" and q4_1["weight_format"] == "q4_1"
        assert "grid" in q4_1["reason"] and q4_1["using"] == "float16", q4_1
    else:
        assert skipped == []
    assert entry["event"] == "weights_packed" and entry["weight_format"] == "float16"
    assert entry["probe_logit_error"] < 1e-3
    assert weight_format_of(model.weights) == "float16"
    expected = _generate(fp32_model, SAMPLED)
    assert len({t for ids in expected.values() for t in ids}) > 10  # not one repeated token
    assert _generate(model, SAMPLED) == expected


def test_packed_weights_whose_probe_logits_stray_fall_back_to_the_exact_path(tiny_dir):
    weights = load_weights(tiny_dir, load_model_config(tiny_dir), CPU, torch.float32)

    def straying_probe(candidate):  # packed logits 2 % from the loaded weights'
        return torch.full((3, 8), 1.0 if candidate is weights else 1.02)

    with capture_logs() as logs:
        kept = pack_weights(weights, "float16", CPU, torch.float32, probe=straying_probe)
    assert kept is weights
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and entry["weight_format"] == "float16"
    assert "probe prompt" in entry["reason"] and "exact path" in entry["using"]


# --- where packed weights cannot run ---------------------------------------------------


@pytest.mark.parametrize("weight_format", ["float16", "int4"])
def test_packing_for_cuda_keeps_the_weights_and_says_why(tiny_dir, weight_format):
    # Needs no GPU: the device is refused before any tensor moves.
    weights = load_weights(tiny_dir, load_model_config(tiny_dir), CPU, torch.float32)
    with capture_logs() as logs:
        kept = pack_weights(weights, weight_format, torch.device("cuda"), torch.float32)
    assert kept is weights
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and "cuda" in entry["reason"]


def test_packed_weights_on_a_bfloat16_model_fall_back_to_bfloat16(tiny_dir):
    with capture_logs() as logs:
        model = load_model(tiny_dir, "cpu", "bfloat16", "float16")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and "bfloat16" in entry["reason"]
    assert weight_format_of(model.weights) == "bfloat16"
    assert all(len(ids) == GREEDY.max_tokens for ids in _generate(model, GREEDY).values())


def test_a_torch_without_fbgemm_cannot_pack():
    assert unsupported_reason(CPU, torch.float32, engines=["qnnpack"]) is not None
    assert unsupported_reason(CPU, torch.float32, engines=["qnnpack", "fbgemm"]) is None


@pytest.mark.parametrize(
    ("weight_format", "value", "matrix"),
    [("float16", 1e5, "layers.1.gate_up_proj"), ("float16", float("nan"), "layers.1.gate_up_proj")],
)
def test_a_matrix_the_format_cannot_hold_keeps_the_model_exact(
    tiny_dir, tmp_path, weight_format, value, matrix
):
    odd_dir = _with_weight(tiny_dir, tmp_path / "odd", "model.layers.1.mlp.up_proj.weight", value)
    with capture_logs() as logs:
        model = load_model(odd_dir, "cpu", "float32", weight_format)
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and entry["reason"].startswith(matrix)
    assert weight_format_of(model.weights) == "float32"


def test_an_unknown_weight_format_is_refused(tiny_dir):
    weights = load_weights(tiny_dir, load_model_config(tiny_dir), CPU, torch.float32)
    with pytest.raises(ValueError, match="int3"):
        pack_weights(weights, "int3", CPU, torch.float32)


def test_auto_is_the_kernels_formats_then_float16_on_the_cpu_and_the_loaded_tensors_elsewhere(
    monkeypatch,
):
    monkeypatch.setattr(quantized_linear, "cpu_has_native_bf16", lambda: False)
    # Every CPU alike, AVX2-only or AVX-512: exact q4_1 first, never q4_1_i16 (its
    # rounding lets an answer change with its batch: a choice, not a default).
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert resolve_weight_format("auto", CPU, torch.float32) == "q4_1"
        assert candidate_formats("auto", CPU, torch.float32) == ("q4_1", "float16")
    assert resolve_weight_format("auto", torch.device("cuda"), torch.float32) == "float32"
    assert resolve_weight_format("auto", CPU, torch.bfloat16) == "float32"
    # q4_1 where its kernel is built; where not (no AVX2/FMA/F16C, no compiler), said
    # why, and auto starts at float16.
    assert unsupported_reason(CPU, torch.float32, weight_format="q4_1") is None
    monkeypatch.setattr(quantized_linear, "kernel_unavailable_reason", lambda: "no AVX2")
    assert unsupported_reason(CPU, torch.float32, weight_format="q4_1") == "no AVX2"
    assert candidate_formats("auto", CPU, torch.float32) == ("float16",)
    assert resolve_weight_format("auto", CPU, torch.float32) == "float16"
    for chosen in ("float32", "float16", "int4", "q4_1", "q4_1_i16"):
        assert resolve_weight_format(chosen, CPU, torch.float32) == chosen
    with pytest.raises(ValueError, match="'int8' is not one of"):  # a dropped format
        resolve_weight_format("int8", CPU, torch.float32)
    with pytest.raises(ValueError, match="'Auto' is not one of"):
        resolve_weight_format("Auto", CPU, torch.float32)


def test_the_worker_flag_sets_the_weight_format(monkeypatch, capsys):
    monkeypatch.delenv("ORCAPOD_WEIGHTS", raising=False)
    assert parse_settings([]).weight_format == "auto"
    assert parse_settings(["--weights=float16"]).weight_format == "float16"
    assert parse_settings(["--weights=int4"]).weight_format == "int4"
    assert parse_settings(["--weights=q4_1"]).weight_format == "q4_1"
    assert parse_settings(["--weights=q4_1_i16"]).weight_format == "q4_1_i16"
    # $ORCAPOD_WEIGHTS stands in for the flag, which wins; a bad value is a usage error.
    monkeypatch.setenv("ORCAPOD_WEIGHTS", "float32")
    assert parse_settings([]).weight_format == "float32"
    assert parse_settings(["--weights=auto"]).weight_format == "auto"
    monkeypatch.setenv("ORCAPOD_WEIGHTS", "")
    assert parse_settings([]).weight_format == "auto"
    for bad in ("int4 ", "FLOAT16", " float16", "nan", "Q4_1", "q4_0", "int8"):
        monkeypatch.setenv("ORCAPOD_WEIGHTS", bad)
        with pytest.raises(SystemExit) as exit_info:
            parse_settings([])
        assert exit_info.value.code == 2
        assert "$ORCAPOD_WEIGHTS" in capsys.readouterr().err


def test_the_dropped_int8_format_is_an_unknown_choice(monkeypatch, capsys):
    """The int8 format (fbgemm's dynamic int8) is gone: argparse refuses it as it
    does any unknown choice."""
    monkeypatch.delenv("ORCAPOD_WEIGHTS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--weights", "int8"])
    assert exit_info.value.code == 2
    assert "argument --weights: invalid choice: 'int8'" in capsys.readouterr().err


# --- int4: weights on a 4-bit grid -------------------------------------------------------


def test_auto_leaves_int4_out_where_the_cpu_computes_bf16(bf16_native):
    # int4 runs here, but its bf16 rounding lets a greedy answer change with the
    # batch it runs in (tests/gpu_worker/test_step_paths.py): a choice, not the default.
    assert resolve_weight_format("auto", CPU, torch.float32) == AUTO_CPU_FORMATS[0]
    assert "int4" not in candidate_formats("auto", CPU, torch.float32)
    assert resolve_weight_format("int4", CPU, torch.float32) == "int4"
    assert resolve_weight_format("auto", torch.device("cuda"), torch.float32) == "float32"
    assert unsupported_reason(CPU, torch.float32, weight_format="int4", bf16_native=True) is None
    reason = unsupported_reason(CPU, torch.float32, weight_format="int4", bf16_native=False)
    assert reason is not None and "avx512_bf16" in reason


@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("shape", [(32, 32), (96, 64), (576, 1536), (3072, 576)])
def test_an_int4_linear_on_the_grid_is_within_bf16s_error_of_fp32(shape, rows):
    # Both kernels: the 4-bit one for few rows, the bf16 copy for more.
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(out_features * 31 + in_features)
    weight = on_a_q4_1_grid(torch.randn(out_features, in_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator)
    exact = F.linear(x, weight)
    packed = linear(x, Int4Linear.pack(weight))
    assert packed.shape == exact.shape and packed.dtype == torch.float32
    assert float((packed - exact).norm() / exact.norm()) <= 0.01  # measured 0.2-0.4 %


def test_int4_holds_the_grids_levels_exactly():
    # With fp32 activations the 4-bit kernel gives back (level - 8) * scale + zero
    # with the very levels of the matrix: only the scale and the zero are rounded
    # (to bf16).
    generator = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (64, 3, INT4_GROUP_SIZE), generator=generator).float()
    levels[..., 0], levels[..., 1] = 0, 15  # each group spans the grid
    scale = (torch.rand(64, 3, 1, generator=generator) * 0.1 + 0.01).half().float()
    minimum = torch.randn(64, 3, 1, generator=generator).half().float()
    weight = (levels * scale + minimum).reshape(64, 96)
    kernel = Int4Kernel.pack(weight)
    unpacked = torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.eye(96), kernel.packed, INT4_GROUP_SIZE, kernel.scales_and_zeros.float()
    ).T.reshape(64, 3, INT4_GROUP_SIZE)
    rounded_scale = scale.bfloat16().float()
    rounded_zero = (minimum + 8 * scale).bfloat16().float()
    assert torch.allclose(unpacked, (levels - 8) * rounded_scale + rounded_zero, atol=1e-6)


@pytest.mark.parametrize(
    ("weight", "reason"),
    [
        (torch.randn(64, 64), "4-bit grid"),  # fp32 values: no 16 levels per group
        (on_a_q4_1_grid(torch.randn(16, 64))[:, :48], "not a multiple of 32"),
        (on_a_q4_1_grid(torch.randn(24, 64)), "24 rows, not a multiple of 16"),
        # Constant groups at fp32's largest value: on the grid, but bf16 rounds it to inf.
        (torch.full((16, 32), torch.finfo(torch.float32).max), "bf16's range"),
        (torch.tensor([[-3e38] * 16 + [3e38] * 16] * 16), "4-bit grid"),  # the span overflows
    ],
)
def test_a_matrix_off_the_grid_is_refused_by_int4(weight, reason):
    with pytest.raises(PackError, match=reason):
        Int4Kernel.pack(weight)
    with pytest.raises(PackError, match=reason):
        Int4Linear.pack(weight)


def test_a_constant_group_is_on_the_grid():
    weight = torch.zeros(16, 64)
    weight[1] = -0.5
    x = torch.randn(2, 64)
    assert torch.allclose(linear(x, Int4Linear.pack(weight)), F.linear(x, weight), rtol=0.01)


def test_a_tied_head_off_the_grid_keeps_float16_for_few_rows(grid_dir, bf16_native):
    with capture_logs() as logs:
        model = load_model(grid_dir, "cpu", "float32", "int4")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_packed" and entry["weight_format"] == "int4"
    assert weight_format_of(model.weights) == "int4"
    layer = model.weights.layers[0]
    assert isinstance(layer.qkv_proj, Int4Linear)
    assert isinstance(layer.qkv_proj.few_rows, Int4Kernel)
    head = model.weights.lm_head
    assert isinstance(head, Int4Linear) and isinstance(head.few_rows, Float16Linear)


def test_int4_weights_generate_what_fp32_does_with_the_same_weights(grid_dir, bf16_native):
    fp32 = load_model(grid_dir, "cpu", "float32")
    with capture_logs() as logs:
        model = load_model(grid_dir, "cpu", "float32", "int4")
    [entry] = _pack_logs(logs)
    assert entry["probe_logit_error"] < 0.01
    # Three requests in one batch: prefill takes the bf16 copy, decode the 4-bit kernel.
    assert _generate(model, GREEDY) == _generate(fp32, GREEDY)


@pytest.mark.parametrize("weight_format", ["int4", "q4_1", "q4_1_i16"])
def test_a_grid_format_where_a_layer_is_off_the_grid_keeps_the_model_exact(
    grid_dir, tmp_path, bf16_native, weight_format
):
    odd_dir = _with_weight(grid_dir, tmp_path / "odd", "model.layers.1.mlp.down_proj.weight", 0.123)
    with capture_logs() as logs:
        model = load_model(odd_dir, "cpu", "float32", weight_format)
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and entry["weight_format"] == weight_format
    assert entry["reason"].startswith("layers.1.down_proj") and "exact path" in entry["using"]
    assert weight_format_of(model.weights) == "float32"


def test_int4_asked_for_where_it_cannot_run_keeps_the_model_exact(grid_dir, monkeypatch):
    monkeypatch.setattr(quantized_linear, "cpu_has_native_bf16", lambda: False)
    with capture_logs() as logs:
        model = load_model(grid_dir, "cpu", "float32", "int4")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and "avx512_bf16" in entry["reason"]
    assert "exact path" in entry["using"] and weight_format_of(model.weights) == "float32"


def test_int4_on_odd_shapes_keeps_the_model_exact(tmp_path, bf16_native):
    # An MLP of 100: gate/up have 200 rows (not a multiple of the kernel's 16),
    # down 100 columns (not a multiple of 32): those stay off the grid.
    odd = write_tiny_model(tmp_path / "odd", "llama", intermediate_size=100)
    odd_dir = _snapped_copy(odd, tmp_path / "odd-grid")
    with capture_logs() as logs:
        model = load_model(odd_dir, "cpu", "float32", "int4")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and "exact path" in entry["using"]
    assert entry["reason"] == "layers.0.gate_up_proj has 200 rows, not a multiple of 16"
    assert weight_format_of(model.weights) == "float32"


# --- q4_1: the project's kernel on the Q4_1 grid ------------------------------------------


def test_q4_1_holds_the_layers_and_keeps_an_off_grid_head_in_float16(grid_dir):
    with capture_logs() as logs:
        model = load_model(grid_dir, "cpu", "float32", "q4_1")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_packed" and entry["weight_format"] == "q4_1"
    assert entry["probe_logit_error"] < 1e-3  # the layers exact; the head rounded to fp16
    assert weight_format_of(model.weights) == "q4_1"
    assert isinstance(model.weights.layers[0].qkv_proj, Q41Linear)
    head = model.weights.lm_head
    eager_head = head.eager if isinstance(head, WithTracedForm) else head
    assert isinstance(eager_head, Float16Linear)


def test_q4_1_weights_generate_what_fp32_does_with_the_same_weights(grid_dir):
    """Greedy and sampled, three requests in one batch (prefill and decode through the
    kernel): the same tokens as the exact path on the same weights."""
    fp32 = load_model(grid_dir, "cpu", "float32")
    model = load_model(grid_dir, "cpu", "float32", "q4_1")
    assert _generate(model, GREEDY) == _generate(fp32, GREEDY)
    assert _generate(model, SAMPLED) == _generate(fp32, SAMPLED)


def test_q4_1_takes_a_head_on_the_q8_0_grid_in_the_kernels_q8_0_form(q8_0_dir):
    """As the packaged model is: layers on Q4_1's grid, the tied embedding on Q8_0's.
    The head is then the kernel's Q8_0 form, exact (not fp16), eagerly; the probe's
    logits match the loaded weights' to fp32 rounding and the tokens are fp32's."""
    with capture_logs() as logs:
        model = load_model(q8_0_dir, "cpu", "float32", "q4_1")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_packed" and entry["probe_logit_error"] < 1e-5
    head = model.weights.lm_head
    eager_head = head.eager if isinstance(head, WithTracedForm) else head
    assert isinstance(eager_head, Q41Linear) and isinstance(eager_head.matrix, Q80Matrix)
    fp32 = load_model(q8_0_dir, "cpu", "float32")
    assert _generate(model, GREEDY) == _generate(fp32, GREEDY)
    assert _generate(model, SAMPLED) == _generate(fp32, SAMPLED)


def test_q4_1_i16_rounds_the_layers_activations_and_answers_as_fp32_does(q8_0_dir):
    """The activations of the layers and of the Q8_0 head rounded to int16 per 32
    values: the probe's logits within 1e-4 of the loaded weights', and three
    requests in one batch (prefill and decode) get fp32's greedy tokens."""
    with capture_logs() as logs:
        model = load_model(q8_0_dir, "cpu", "float32", "q4_1_i16")
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_packed" and entry["weight_format"] == "q4_1_i16"
    assert entry["probe_logit_error"] < 1e-4
    assert isinstance(model.weights.layers[0].qkv_proj, Q41I16Linear)
    head = model.weights.lm_head
    eager_head = head.eager if isinstance(head, WithTracedForm) else head
    assert isinstance(eager_head, Q41I16Linear) and isinstance(eager_head.matrix, Q80Matrix)
    for layer in (model.weights.layers[0].o_proj, eager_head):
        x = torch.randn(3, layer.in_features)
        exact = layer.matrix(x)
        assert not torch.equal(layer(x), exact)  # rounded, not the exact kernel's product
        assert bool(torch.allclose(layer(x), exact, rtol=1e-3, atol=1e-4))
    fp32 = load_model(q8_0_dir, "cpu", "float32")
    assert _generate(model, GREEDY) == _generate(fp32, GREEDY)


def test_q4_1_i16_keeps_one_head_form_where_q4_1_adds_the_int8_one(q8_0_dir, monkeypatch):
    """Where the vector code is AVX-512 an exact Q8_0 head also gets the int8 form the
    compiled lone decode reads; q4_1_i16's head rounds x as its layers do, so a graph
    reading the exact form would give a chat other logits alone than batched: it keeps
    the one op everywhere."""
    here = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(quantized_linear, "INT8_GROUP_CPU_CAPABILITIES", (here,))
    exact = load_model(q8_0_dir, "cpu", "float32", "q4_1")
    assert isinstance(exact.weights.lm_head, WithTracedForm)
    rounded = load_model(q8_0_dir, "cpu", "float32", "q4_1_i16")
    assert isinstance(rounded.weights.lm_head, Q41I16Linear)


@pytest.mark.parametrize("weight_format", ["q4_1", "q4_1_i16"])
def test_q4_1_where_the_kernel_cannot_run_keeps_the_model_exact_and_says_why(
    grid_dir, monkeypatch, weight_format
):
    reason = "the Q4_1 kernel needs avx2, which this CPU lacks"
    monkeypatch.setattr(quantized_linear, "kernel_unavailable_reason", lambda: reason)
    with capture_logs() as logs:
        model = load_model(grid_dir, "cpu", "float32", weight_format)
    [entry] = _pack_logs(logs)
    assert entry["event"] == "weights_not_packed" and entry["reason"] == reason
    assert "exact path" in entry["using"] and weight_format_of(model.weights) == "float32"
