"""A lone request's decode through one compiled graph on the CPU (gpu_worker/compiled_decode.py).

One real compile of a tiny model (module fixture: its attention, lone and
batch graphs, about a minute on two cores with an empty inductor cache) checks
the graphs against the eager engine token for token, through shuffled blocks
and beside prompt chunks; the attention it traces is checked against the CPU
backend without a compile; the ways it is refused fall back to the eager forward.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import msgspec
import pytest
import torch
from structlog.testing import capture_logs
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

from gpu_worker import compiled_decode, quantized_linear
from gpu_worker.__main__ import parse_settings
from gpu_worker.attention import SequenceLayout
from gpu_worker.attention_cpu import CpuAttention
from gpu_worker.compile_cache_warmer import WarmerSpec, warm_compile_cache
from gpu_worker.compiled_decode import MIN_BLOCKS, CompiledDecode, GraphDecodeAttention
from gpu_worker.decode_attention import CompiledDecodeAttention
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget, PagedKVCache
from gpu_worker.llama import LlamaModel
from gpu_worker.model_config import load_model_config
from gpu_worker.model_loading import load_model
from gpu_worker.path_compiler import held_back_blocks
from gpu_worker.quantized_linear import (
    INT4_MAX_ROWS,
    Float16Linear,
    Int4Linear,
    pack_weights,
    weight_format_of,
)
from gpu_worker.unguarded_compile import max_relative_error
from gpu_worker.weights import load_weights
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from tests.gpu_worker.attention_calls import count_attention_calls
from tests.gpu_worker.tiny_models import (
    TINY_VOCAB_SIZE,
    on_a_q4_1_grid,
    on_a_q8_0_grid,
    write_tiny_model,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu", dtype="float32")


def _engine(model, compile_decode: bool) -> Engine:
    """NUM_BLOCKS to grant either way (the compiled engine holds more back for its checks)."""
    held_back = held_back_blocks(model, BLOCK_SIZE) if compile_decode else 0
    budget = KVCacheBudget(
        num_bytes=(NUM_BLOCKS + held_back) * _block_bytes(model), block_size=BLOCK_SIZE
    )
    return Engine(model, budget, "cpu", compile_decode=compile_decode)


def _block_bytes(model) -> int:
    config = model.config
    return 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4


@pytest.fixture(scope="module")
def compiled_engine(model):
    engine = _engine(model, compile_decode=True)
    assert engine.compiles_decode
    return engine


def _counting_runs(monkeypatch, engine: Engine) -> list[int]:
    """Batch sizes of the steps the compiled runner takes."""
    runner = engine.paths.decode_runner
    assert isinstance(runner, CompiledDecode)
    calls: list[int] = []
    real_run = runner.run

    def run(token_ids, positions, slots, layout):
        calls.append(len(layout))
        return real_run(token_ids, positions, slots, layout)

    monkeypatch.setattr(runner, "run", run)
    return calls


def _start(engine: Engine, request_id: str, prompt: list[int], blocks: list[int]) -> int:
    output = engine.step(
        StepPlan(
            "g", 0, 0,
            new_requests=[RequestSpec(request_id, len(prompt), GREEDY)],
            prefill_chunks=[PrefillChunk(request_id, prompt, 0)],
            block_grants={request_id: blocks},
        )
    )  # fmt: skip
    (token,) = output.tokens
    return token.token_id


def _decode(engine: Engine, request_ids: list[str]) -> dict[str, int]:
    output = engine.step(StepPlan("g", 0, 0, decode_request_ids=request_ids))
    return {token.request_id: token.token_id for token in output.tokens}


def _release(engine: Engine, request_ids: list[str]) -> None:
    engine.step(StepPlan("g", 0, 0, released_request_ids=request_ids))


def test_a_lone_decode_through_shuffled_blocks_matches_the_eager_engine(
    model, compiled_engine, monkeypatch
):
    """40 tokens over 12 blocks in no order (the graph's one dynamic size grows from
    its minimum), the same tokens as the eager forward's, every step through the graph."""
    eager_engine = _engine(model, compile_decode=False)
    calls = _counting_runs(monkeypatch, compiled_engine)
    blocks = random.Random(3).sample(range(NUM_BLOCKS), 12)
    prompt = [5, 17, 33]
    outputs = []
    for engine in (compiled_engine, eager_engine):
        tokens = [_start(engine, "lone", prompt, blocks)]
        for _ in range(40):
            tokens.append(_decode(engine, ["lone"])["lone"])
        _release(engine, ["lone"])
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert calls == [1] * 40


def test_a_batch_through_its_graph_and_its_survivor_through_the_lone_one(
    model, compiled_engine, monkeypatch
):
    """Two requests decoding together go through the batch graph; once one leaves,
    the other's steps go through the lone graph, its K/V intact; the same tokens as
    the eager forward's."""
    eager_engine = _engine(model, compile_decode=False)
    calls = _counting_runs(monkeypatch, compiled_engine)
    outputs = []
    for engine in (compiled_engine, eager_engine):
        tokens = {
            "a": [_start(engine, "a", [7, 8, 9, 10, 11], [3, 40, 12, 22])],
            "b": [_start(engine, "b", [20, 21], [50, 1, 9])],
        }
        for _ in range(5):
            for request_id, token in _decode(engine, ["a", "b"]).items():
                tokens[request_id].append(token)
        _release(engine, ["b"])
        for _ in range(3):
            tokens["a"].append(_decode(engine, ["a"])["a"])
        _release(engine, ["a"])
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert calls == [2] * 5 + [1] * 3


def test_an_engine_serves_eagerly_while_its_paths_compile_then_on_them(
    model, tiny_model_dir, compiled_engine, monkeypatch
):
    """With compile_in_background the engine serves at once on the eager forward while
    a child process makes the first compile and a thread then compiles from its cache,
    probes (on blocks held back from the grants) and installs the paged attention and
    the graphs between two steps. Requests join and leave all the while: every token
    is the eager engine's, the served K/V untouched by the compiler's steps, and each
    change of paths is told, in order."""
    # The suite's cache folder (the module's compiled engine filled it: the child
    # loads from it), without the marker, so the child runs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    spec = WarmerSpec(tiny_model_dir, "float32", "float32", "cpu")
    held_back = held_back_blocks(model, BLOCK_SIZE)
    marker = spec.marker(NUM_BLOCKS + held_back, BLOCK_SIZE)
    assert marker is not None
    marker.unlink(missing_ok=True)
    warmed: list[tuple[int, int]] = []

    def warm(num_blocks: int, block_size: int) -> None:
        warm_compile_cache(spec, num_blocks, block_size)
        warmed.append((num_blocks, block_size))

    told: list[tuple[list[str], bool]] = []
    budget = KVCacheBudget(
        num_bytes=(NUM_BLOCKS + held_back) * _block_bytes(model), block_size=BLOCK_SIZE
    )
    engine = Engine(
        model, budget, "cpu", compile_decode=True, compile_in_background=True,
        on_paths_changed=lambda paths, compiling: told.append((list(paths), compiling)),
        warm_compile_cache=warm,
    )  # fmt: skip
    assert engine.path_compiler is not None and engine.num_blocks == NUM_BLOCKS
    eager_engine = _engine(model, compile_decode=False)
    rng = random.Random(7)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    running: dict[str, list[int]] = {}  # request id -> its blocks
    tokens: dict[str, list[list[int]]] = {}  # request id -> each engine's tokens
    paths: list[str] = []
    deadline = time.monotonic() + 600
    rounds_after_settling = 0
    for index in itertools.count():
        if engine.path_compiler.join(0):
            rounds_after_settling += 1
        if rounds_after_settling > 96 or time.monotonic() > deadline:
            break
        plan = StepPlan("g", 0, 0, decode_request_ids=list(running))
        # Joins up to 3 requests, then none until one is left alone, and again.
        most = 3 if (index // 24) % 2 == 0 else 1
        if index % 4 == 0 and len(running) < most:  # a join: a prompt beside the decodes
            request_id, prompt = f"r{index}", [rng.randrange(TINY_VOCAB_SIZE) for _ in range(3)]
            running[request_id], free = free[:5], free[5:]  # room for 3 + 12 tokens
            tokens[request_id] = [[], []]
            plan = msgspec.structs.replace(
                plan,
                new_requests=[RequestSpec(request_id, len(prompt), GREEDY)],
                prefill_chunks=[PrefillChunk(request_id, prompt, 0)],
                block_grants={request_id: running[request_id]},
            )
        for side, served in enumerate((engine, eager_engine)):
            output = served.step(plan)
            for token in output.tokens:
                tokens[token.request_id][side].append(token.token_id)
            if served is engine:
                paths.append(output.path)
        # A service's engine waits for plans between steps: so does this one, a little
        # (back to back, its steps would leave the child at nice 10 a tenth of a core).
        time.sleep(0.005)
        for request_id in [r for r in running if len(tokens[r][0]) == 12]:  # a leave
            for served in (engine, eager_engine):
                _release(served, [request_id])
            free += running.pop(request_id)
    assert engine.path_compiler.join(0), "the paths did not compile in 10 minutes"
    assert all(ours == eager for ours, eager in tokens.values())
    assert paths[0] == "eager" and "graph[1]" in paths and "graph[2-4096]" in paths
    assert told[0] == (["eager"], True)
    assert told[-1] == (engine.stats.live_paths, False) and "graph[1]" in told[-1][0]
    assert engine.stats.compiling_paths is False
    # The child compiled for the engine's whole pool, and marked it done.
    assert warmed == [(NUM_BLOCKS + held_back, BLOCK_SIZE)] and marker.exists()


def test_a_compile_cache_warmer_that_fails_only_says_so(tmp_path, monkeypatch):
    """A child that cannot load the model (or compile) costs its time and one line;
    nothing is marked, and the engine's thread goes on to compile itself."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    spec = WarmerSpec(tmp_path / "no-model", "float32", "float32", "cpu")
    with capture_logs() as logs:
        warm_compile_cache(spec, 64, BLOCK_SIZE)
    (line,) = [entry for entry in logs if entry["event"] == "compile_cache_not_warmed"]
    assert line["exit_status"] != 0 and "no-model" in line["output"]
    marker = spec.marker(64, BLOCK_SIZE)
    assert marker is not None and not marker.exists()
    # Another pool shape, format or model is another marker.
    assert spec.marker(64, BLOCK_SIZE) != spec.marker(65, BLOCK_SIZE)
    other = WarmerSpec(tmp_path / "no-model", "float32", "float16", "cpu")
    assert other.marker(64, BLOCK_SIZE) != marker


def test_the_traced_attention_matches_the_cpu_backend():
    """GraphDecodeAttention (what the graphs run) against CpuAttention, without a
    compile: random pools, block tables in any order, one block (padded to MIN_BLOCKS)
    to many, every offset within the last block."""
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 8, 32
    keys = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(keys.shape, generator=generator)
    lone, cpu = GraphDecodeAttention(BLOCK_SIZE), CpuAttention()
    device = torch.device("cpu")
    for num_cached in [0, 1, 3, 4, 5, 7, 8, 30, 63]:
        table = rng.sample(range(num_blocks), num_cached // BLOCK_SIZE + 1)
        layout = [SequenceLayout(0, 1, num_cached, table)]
        query = torch.randn(1, num_heads, head_dim, generator=generator)
        plan = lone.prepare(layout, BLOCK_SIZE, device)
        assert plan.block_ids.shape[1] >= MIN_BLOCKS
        expected = cpu.attend(query, keys, values, cpu.prepare(layout, BLOCK_SIZE, device))
        actual = lone.attend(query, keys, values, plan)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_the_kv_writer_writes_only_the_new_slot():
    keys = torch.zeros(8, 2, 4)
    values = torch.zeros(8, 2, 4)
    key, value = torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)
    GraphDecodeAttention(BLOCK_SIZE).write_kv(keys, values, torch.tensor([5]), key, value)
    assert keys[5].eq(1).all() and values[5].eq(2).all()
    assert keys.sum() == 8 and values.sum() == 16


def _decodes_like_the_eager_engine(model, engine: Engine) -> None:
    eager = _engine(model, compile_decode=False)
    outputs = []
    for each in (engine, eager):
        tokens = [_start(each, "r", [4, 5, 6], [9, 2, 30])]
        tokens += [_decode(each, ["r"])["r"] for _ in range(6)]
        _release(each, ["r"])
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def _refused_engine(model, monkeypatch, fake_compile) -> tuple[Engine, str]:
    """An engine asked to compile with ``fake_compile`` as torch.compile: it must not
    use the runner; returns it and the reason its one log line gives."""
    monkeypatch.setattr(compiled_decode.torch, "compile", fake_compile)
    with capture_logs() as logs:
        engine = _engine(model, compile_decode=True)
    assert not engine.compiles_decode
    (line,) = [entry for entry in logs if entry["event"] == "decode_not_compiled"]
    return engine, line["reason"]


def test_a_compile_that_fails_keeps_the_eager_forward(model, monkeypatch):
    """No C++ compiler, an op inductor cannot take: one log line, the engine runs eagerly."""

    def no_compiler(fn, **options):
        def fail(*args):
            raise RuntimeError("no working C++ compiler found")

        return fail

    engine, reason = _refused_engine(model, monkeypatch, no_compiler)
    assert "no working C++ compiler" in reason
    _decodes_like_the_eager_engine(model, engine)


def test_a_graph_whose_logits_stray_is_not_used(model, monkeypatch):
    def straying(fn, **options):
        return lambda *args: fn(*args) * 1.01

    engine, reason = _refused_engine(model, monkeypatch, straying)
    assert "stray" in reason
    _decodes_like_the_eager_engine(model, engine)


def test_the_traced_forward_uncompiled_is_the_eager_engine(model, monkeypatch):
    """The runner's own inputs, plan and K/V writes, with torch.compile a no-op."""
    monkeypatch.setattr(compiled_decode.torch, "compile", lambda fn, **options: fn)
    engine = _engine(model, compile_decode=True)
    assert engine.compiles_decode
    _decodes_like_the_eager_engine(model, engine)


def test_layers_that_are_only_fbgemm_objects_are_not_compiled(model):
    """A layer matrix the tracer cannot enter (fbgemm's fp16 object without its plain
    copy) would break the graph at every matmul."""
    first, *others = model.weights.layers
    untraceable = Float16Linear.pack(first.qkv_proj, traceable=False)
    packed = dataclasses.replace(first, qkv_proj=untraceable)
    weights = dataclasses.replace(model.weights, layers=[packed, *others])
    fbgemm_model = LlamaModel(model.config, weights, model.device, model.dtype)
    with capture_logs() as logs:
        engine = _engine(fbgemm_model, compile_decode=True)
    assert not engine.compiles_decode
    (line,) = [entry for entry in logs if entry["event"] == "decode_not_compiled"]
    assert line["reason"].startswith("its 1 layer matrices are only fbgemm's packed objects")


def test_float16_layers_compile_and_decode_as_their_eager_kernel(
    compiled_engine, tmp_path, monkeypatch
):
    """The CPU default where bf16 is emulated (AVX2): fbgemm's fp16 matrices eagerly,
    their plain fp16 copies in the graph, and a head on a Q8_0 grid as its int8 form
    in the graph; the same tokens either way. Compiled while the float32 model's
    graph exists (``compiled_engine``): each runner has its own."""
    here = torch.backends.cpu.get_cpu_capability()  # its int8 head form, on AVX2 too
    monkeypatch.setattr(quantized_linear, "INT8_GROUP_CPU_CAPABILITIES", (here,))
    model_dir = write_tiny_model(tmp_path / "tiny", "llama", num_hidden_layers=1)
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, torch.device("cpu"), torch.float32)
    head = on_a_q8_0_grid(weights.lm_head)  # as the packaged model's tied embedding
    weights = dataclasses.replace(weights, embed_tokens=head, lm_head=head)
    weights = pack_weights(weights, "float16", torch.device("cpu"), torch.float32)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    assert weight_format_of(model.weights) == "float16"
    with capture_logs() as logs:
        compiled = _engine(model, compile_decode=True)
    assert compiled.compiles_decode
    # Batches stay eager: the traced fp16 form would read every weight once a request.
    assert compiled.paths.decode_runner.graph_names() == ["graph[1]"]
    (line,) = [entry for entry in logs if entry["event"] == "batch_decode_not_compiled"]
    assert "float16" in line["reason"]
    assert compiled.paths.decode_runner.head_in_graph  # its int8 form, one loop in the graph
    calls = _counting_runs(monkeypatch, compiled)
    blocks = random.Random(5).sample(range(NUM_BLOCKS), 9)
    outputs = []
    for engine in (compiled, _engine(model, compile_decode=False)):
        tokens = [_start(engine, "lone", [9, 2, 30, 4], blocks)]
        tokens += [_decode(engine, ["lone"])["lone"] for _ in range(30)]
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert calls == [1] * 30


def test_a_pool_too_small_for_the_graph_is_refused(model):
    cache = PagedKVCache(model.config, MIN_BLOCKS - 1, BLOCK_SIZE, torch.device("cpu"), model.dtype)
    with pytest.raises(compiled_decode.DecodeCompileError, match="fewer than"):
        CompiledDecode(model, cache)


def test_the_worker_flag_and_its_environment(monkeypatch):
    monkeypatch.setenv("ORCAPOD_COMPILE_DECODE", "1")
    assert parse_settings([]).compile_decode
    assert not parse_settings(["--no-compile-decode"]).compile_decode
    monkeypatch.setenv("ORCAPOD_COMPILE_DECODE", "0")
    assert not parse_settings([]).compile_decode
    assert parse_settings(["--compile-decode"]).compile_decode
    # A worker serves while it compiles unless told to wait.
    monkeypatch.delenv("ORCAPOD_SERVE_WHILE_COMPILING", raising=False)
    assert parse_settings([]).serve_while_compiling
    assert not parse_settings(["--no-serve-while-compiling"]).serve_while_compiling
    monkeypatch.setenv("ORCAPOD_SERVE_WHILE_COMPILING", "0")
    assert not parse_settings([]).serve_while_compiling
    assert parse_settings(["--serve-while-compiling"]).serve_while_compiling


def test_prompt_tokens_outside_the_vocabulary_still_fail_alone(compiled_engine):
    """Bad input before the graph: the engine's checks, unchanged."""
    output = compiled_engine.step(
        StepPlan(
            "g", 0, 0,
            new_requests=[RequestSpec("bad", 2, GREEDY)],
            prefill_chunks=[PrefillChunk("bad", [1, TINY_VOCAB_SIZE], 0)],
            block_grants={"bad": [0]},
        )
    )  # fmt: skip
    assert [failure.request_id for failure in output.failed] == ["bad"]


def test_batches_of_every_size_decode_through_one_graph_as_eagerly(
    model, compiled_engine, monkeypatch
):
    """Batches of 2 to 13 requests of different lengths in shuffled blocks, joining
    and leaving between steps: every step through the batch graph (float32 layers:
    one graph for every size), the same tokens as the eager forward's."""
    runner = compiled_engine.paths.decode_runner
    assert [(g.min_requests, g.max_requests) for g in runner.graphs] == [
        (1, 1), (2, compiled_decode.BATCH_MAX_REQUESTS)
    ]  # fmt: skip
    calls = _counting_runs(monkeypatch, compiled_engine)
    eager_engine = _engine(model, compile_decode=False)
    blocks = random.Random(11).sample(range(NUM_BLOCKS), 13 * 4)
    prompts = {f"r{i}": [(7 * i + j) % 90 + 3 for j in range(2 + i)] for i in range(13)}
    outputs = []
    for engine in (compiled_engine, eager_engine):
        tokens = {}
        for index, (request_id, prompt) in enumerate(prompts.items()):
            tokens[request_id] = [_start(engine, request_id, prompt, blocks[4 * index :][:4])]
        for size in (13, 2, 5, 9, 3):
            running = list(prompts)[:size]
            for request_id, token in _decode(engine, running).items():
                tokens[request_id].append(token)
        _release(engine, list(prompts))
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert calls == [13, 2, 5, 9, 3]


def _mixed_steps(engine: Engine) -> dict[str, list[int]]:
    """Six requests prefilled, then 12 steps of their decodes beside two-token chunks
    of a seventh prompt (shuffled blocks): mixed steps, which the eager forward runs;
    all seven are released at the end."""
    rng = random.Random(7)
    free_blocks = rng.sample(range(NUM_BLOCKS), 7 * 9)
    prompts = {f"m{i}": [rng.randrange(3, 90) for _ in range(5 + 3 * i)] for i in range(6)}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    grants = {rid: [free_blocks.pop() for _ in range(9)] for rid in [*prompts, "long"]}
    output = engine.step(
        StepPlan(
            "g", 0, 0,
            new_requests=[RequestSpec(rid, len(ids), GREEDY) for rid, ids in prompts.items()],
            prefill_chunks=[PrefillChunk(rid, ids, 0) for rid, ids in prompts.items()],
            block_grants={rid: grants[rid] for rid in prompts},
        )
    )  # fmt: skip
    long_prompt = [rng.randrange(3, 90) for _ in range(26)]
    for step in range(12):
        for token in output.tokens:
            tokens[token.request_id].append(token.token_id)
        chunk = PrefillChunk("long", long_prompt[2 * step : 2 * step + 2], 2 * step)
        output = engine.step(
            StepPlan(
                "g", 0, 0,
                new_requests=[RequestSpec("long", len(long_prompt), GREEDY)] if step == 0 else [],
                prefill_chunks=[chunk],
                decode_request_ids=list(prompts),
                block_grants={"long": grants["long"]} if step == 0 else {},
            )
        )  # fmt: skip
    _release(engine, [*prompts, "long"])
    return tokens


def test_mixed_steps_take_the_compiled_attention_for_their_decodes(
    model, compiled_engine, monkeypatch
):
    """In steps that also prefill (the eager forward), the decodes go through the
    engine's compiled attention (one call per layer, every request's blocks in
    place), with the same greedy tokens as the engine without it."""
    kernel = compiled_engine.paths.paged_attention
    assert isinstance(kernel, CompiledDecodeAttention)
    calls = count_attention_calls(monkeypatch, kernel)
    eager_engine = _engine(model, compile_decode=False)
    assert eager_engine.paths.paged_attention is None
    assert _mixed_steps(compiled_engine) == _mixed_steps(eager_engine)
    assert calls == [(6, 9)] * (12 * model.config.num_layers)


def test_batch_ranges_split_where_int4_changes_kernel() -> None:
    """int4's matrices take their 4-bit kernel up to INT4_MAX_ROWS rows, their bf16
    copy above: a graph each; plain matrices take one kernel for every size."""
    plain = torch.zeros(16, 32)
    int4 = Int4Linear.pack(on_a_q4_1_grid(torch.randn(16, 32)))
    last = compiled_decode.BATCH_MAX_REQUESTS
    assert compiled_decode.batch_ranges([plain, plain]) == [(2, last)]
    assert compiled_decode.batch_ranges([plain, int4]) == [
        (2, INT4_MAX_ROWS), (INT4_MAX_ROWS + 1, last)
    ]  # fmt: skip


def test_int4_batches_take_the_graph_of_their_range(tmp_path, monkeypatch) -> None:
    """A one-layer model (a fifth less to compile; the float32 tests have two layers)
    on Q4_1's grid packed as int4: a lone graph and two batch graphs, each
    within its bound of the eager forward at a size of its range (the 4-bit kernel up
    to INT4_MAX_ROWS requests, the bf16 copy above, in the graph as eagerly)."""
    monkeypatch.setattr(quantized_linear, "cpu_has_native_bf16", lambda: True)
    model_dir = write_tiny_model(tmp_path / "tiny", "llama", num_hidden_layers=1)
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, torch.device("cpu"), torch.float32)
    layers = [
        dataclasses.replace(
            layer, **{name: on_a_q4_1_grid(getattr(layer, name)) for name in _MATRICES}
        )
        for layer in weights.layers
    ]
    weights = dataclasses.replace(weights, layers=layers)
    weights = pack_weights(weights, "int4", torch.device("cpu"), torch.float32)
    model = LlamaModel(config, weights, torch.device("cpu"), torch.float32)
    assert weight_format_of(model.weights) == "int4"
    engine = _engine(model, compile_decode=True)
    runner = engine.paths.decode_runner
    ranges = [(graph.min_requests, graph.max_requests) for graph in runner.graphs]
    assert ranges == [(1, 1), *compiled_decode.batch_ranges(compiled_decode.layer_matrices(model))]
    for size, bound in ((3, compiled_decode.MAX_LOGIT_ERROR),
                        (INT4_MAX_ROWS + 2, quantized_linear.BF16_LOGIT_ERROR)):  # fmt: skip
        layout = [SequenceLayout(i, 1, 2 + i, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(size)]
        token_ids, positions = [5 + i for i in range(size)], [2 + i for i in range(size)]
        slots = [3 * i * BLOCK_SIZE + 2 + i for i in range(size)]
        assert runner.graph_for(layout) is not None
        compiled = runner.run(token_ids, positions, slots, layout)
        backend = CpuAttention()
        eager = model.forward(
            torch.tensor(token_ids), torch.tensor(positions), torch.tensor(slots),
            engine.kv_cache, backend, backend.prepare(layout, BLOCK_SIZE, torch.device("cpu")),
            torch.arange(size),
        )  # fmt: skip
        assert max_relative_error(compiled, eager) <= bound


_MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
