"""``orcapod generate``: run prompts through the engine in this process.

Every prompt becomes one request; all of them share each forward pass
(selective batching), prompts prefilled in chunks beside the decodes. With
one prompt the answer streams to the terminal as it is generated.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from gateway.tokenizer import ChatTokenizer, IncrementalDetokenizer
from gpu_worker.attention import BACKEND_NAMES
from gpu_worker.engine import Engine
from gpu_worker.kv_cache import KVCacheBudget
from gpu_worker.local_blocks import step_alone
from gpu_worker.model_config import ModelLoadError
from gpu_worker.model_loading import load_model
from gpu_worker.quantized_linear import weight_format_of
from shared.log import configure_logging
from shared.messages import PrefillChunk, RequestSpec, SamplingParams, StepPlan
from shared.settings import WEIGHT_FORMATS, WorkerSettings, model_location

PREFILL_CHUNK_TOKENS = 256


@dataclass
class _Conversation:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer
    num_prefilled: int = 0
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_generated: int = 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orcapod generate", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="one or more user messages (or raw prompts)")
    parser.add_argument("--raw", action="store_true", help="send prompts as is, no chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=None, help="HF-format model dir (default: embedded)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: automatic)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: automatic)")
    parser.add_argument("--backend", default=None, choices=BACKEND_NAMES)
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=WorkerSettings.weight_format,
        help="the weight format, as the worker's --weights (default: the worker's, auto)",
    )
    parser.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="decode through the worker's compiled graphs (tens of seconds to compile the "
        "first time; default: eager)",
    )
    return parser


def _shortened(prompt: str, limit: int = 60) -> str:
    return prompt if len(prompt) <= limit else prompt[: limit - 1] + "…"


def _sampling(args: argparse.Namespace) -> SamplingParams:
    # Written so that NaN fails each bound, as the gateway's validation does.
    if not (
        args.max_tokens >= 1 and 0 <= args.temperature <= 100 and 0 < args.top_p <= 1
        and args.top_k >= 0
    ):  # fmt: skip
        raise ValueError(
            "need max_tokens >= 1, 0 <= temperature <= 100, 0 < top_p <= 1, top_k >= 0"
        )
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )


def _next_plan(step_index: int, pending: list[_Conversation], sampling: SamplingParams) -> StepPlan:
    new_requests, chunks, decodes = [], [], []
    for conversation in pending:
        start = conversation.num_prefilled
        if start == 0:
            new_requests.append(
                RequestSpec(conversation.request_id, len(conversation.prompt_ids), sampling)
            )
        if start < len(conversation.prompt_ids):
            end = min(len(conversation.prompt_ids), start + PREFILL_CHUNK_TOKENS)
            chunk_ids = conversation.prompt_ids[start:end]
            chunks.append(PrefillChunk(conversation.request_id, chunk_ids, start))
            conversation.num_prefilled = end
        else:
            decodes.append(conversation.request_id)
    return StepPlan(
        worker_id="local",
        epoch=0,
        step_index=step_index,
        new_requests=new_requests,
        prefill_chunks=chunks,
        decode_request_ids=decodes,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``orcapod generate``."""
    args = _parser().parse_args(argv)
    # Stdout is the answers': warnings only (a format not packed, a path dropped), on stderr.
    configure_logging("generate", level="warning")
    try:
        sampling = _sampling(args)
        model_dir = model_location(model_dir=args.model).model_dir
        tokenizer = ChatTokenizer.from_model_dir(model_dir)
        model = load_model(
            model_dir, device=args.device, dtype=args.dtype, weight_format=args.weights
        )
    except (ValueError, ModelLoadError) as error:
        print(f"orcapod generate: {error}", file=sys.stderr)
        return 2
    engine = Engine(
        model, KVCacheBudget(num_bytes=512 << 20), args.backend,
        compile_decode=args.compile_decode,
    )  # fmt: skip
    conversations = []
    context = model.config.max_position_embeddings
    for index, prompt in enumerate(args.prompts):
        text = (
            prompt
            if args.raw
            else tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=args.raw)
        if not 0 < len(prompt_ids) < context:
            print(
                f"orcapod generate: prompt {index + 1} is {len(prompt_ids)} tokens; "
                f"it needs 1 to {context - 1} (the model's context is {context})",
                file=sys.stderr,
            )
            return 2
        conversations.append(
            _Conversation(
                f"prompt{index}", prompt, prompt_ids, IncrementalDetokenizer(tokenizer, prompt_ids)
            )
        )
    by_id = {c.request_id: c for c in conversations}
    stream = len(conversations) == 1
    started = time.perf_counter()
    step_index = 0
    while pending := [c for c in conversations if c.finish_reason is None]:
        # No scheduler here: the plan's K/V blocks are granted as it would.
        output = step_alone(engine, _next_plan(step_index, pending, sampling))
        step_index += 1
        for token in output.tokens:
            conversation = by_id[token.request_id]
            conversation.num_generated += 1
            delta = conversation.detokenizer.add(token.token_id)
            if token.finish_reason is not None:
                conversation.finish_reason = token.finish_reason
                delta += conversation.detokenizer.finish()
            conversation.text.append(delta)
            if stream:
                print(delta, end="", flush=True)
        for failure in output.failed:
            conversation = by_id[failure.request_id]
            conversation.finish_reason = "error"
            conversation.text.append(f"[error: {failure.message}]\n")
            if stream:
                print(conversation.text[-1], end="", flush=True)
    elapsed_s = time.perf_counter() - started
    for conversation in conversations:
        if not stream:
            print(f"--- {_shortened(conversation.prompt)!r}")
            print("".join(conversation.text))
        elif conversation.text and not conversation.text[-1].endswith("\n"):
            print()
    num_generated = sum(c.num_generated for c in conversations)
    print(
        f"[{len(conversations)} request(s), {engine.stats.num_steps} steps, {num_generated} tokens "
        f"in {elapsed_s:.2f} s: {num_generated / elapsed_s:.1f} tok/s; {model.device}, "
        f"{weight_format_of(model.weights)} weights, {engine.backend.name} attention, "
        f"paths {', '.join(engine.paths.planned())}; "
        f"finish: {', '.join(c.finish_reason or '?' for c in conversations)}]",
        file=sys.stderr,
    )
    return 0
