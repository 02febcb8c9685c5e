"""`orcapod generate` as a user runs it: a process of its own on the packaged model
(one prompt streamed, several batched, each batched answer the one it gives
alone) and on a tiny random model; bad input gets a clear error and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_worker.tiny_models import write_tiny_model
from tests.up_process import REPO


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orcapod", "generate", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _answers(stdout: str) -> list[str]:
    """The answers of a batched run, in prompt order (each after its ``---`` line)."""
    return [part.split("\n", 1)[1].strip() for part in stdout.split("--- ")[1:]]


def test_one_prompt_streams_its_answer(prepared_model_dir: Path) -> None:
    completed = _generate(
        "--model", str(prepared_model_dir), "--max-tokens", "8", "--temperature", "0",
        "What is the capital of France?",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "Paris" in completed.stdout
    summary = completed.stderr.strip().splitlines()[-1]
    assert summary.startswith("[1 request(s), ") and "finish: " in summary, summary


def test_batched_prompts_answer_as_each_alone(prepared_model_dir: Path) -> None:
    prompts = ["Why is the sky blue?", "Count to five.", "Name a fruit."]
    model = ("--model", str(prepared_model_dir), "--max-tokens", "24", "--temperature", "0")
    batched = _generate(*model, *prompts)
    assert batched.returncode == 0, batched.stderr
    answers = _answers(batched.stdout)
    assert len(answers) == len(prompts) and all(answers), batched.stdout
    assert "[3 request(s), " in batched.stderr
    for prompt, answer in zip(prompts[:2], answers, strict=False):
        alone = _generate(*model, prompt)
        assert alone.returncode == 0, alone.stderr
        assert alone.stdout.strip() == answer


def test_a_tiny_random_model_generates_for_two_prompts(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    completed = _generate(
        "--model", str(model_dir), "--raw", "--max-tokens", "5", "hello world", "a b c"
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.count("--- ") == 2
    assert "[2 request(s), " in completed.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--raw", ""], "prompt 1 is 0 tokens"),
        (["--max-tokens", "0", "hi"], "max_tokens >= 1"),
        (["--temperature", "nan", "hi"], "temperature"),
        (["--temperature", "1e308", "hi"], "temperature"),
        (["--top-p", "0", "hi"], "top_p"),
        (["--raw", "word " * 600], "it needs 1 to"),
    ],
    ids=["empty prompt", "no tokens", "NaN temperature", "huge temperature", "top_p 0",
         "past the context"],
)  # fmt: skip
def test_bad_input_is_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    """On a tiny model (512 positions): refused before any step runs, exit status 2."""
    model_dir = write_tiny_model(tmp_path / "tiny", "llama")
    completed = _generate("--model", str(model_dir), *args)
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stderr
    assert message in completed.stderr.strip().splitlines()[-1]
