"""`orcapod up` for real: embedded redis-server, scheduler, worker and two gateways
as processes; a websocket client on each gateway; `orcapod chat` in a pipe;
SIGTERM stops everything with no process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from gpu_worker.q4_1_kernel import kernel_unavailable_reason
from gpu_worker.quantized_linear import AUTO_CPU_FORMATS, resolve_weight_format
from shared.protocol import Done, Generate, Token, decode_server_message, encode_json
from tests.conftest import descendants, free_port_run
from tests.prometheus_server import PROMETHEUS, prometheus_scraping
from tests.test_up_metrics import METRICS_LINE, scrape_families
from tests.up_process import REPO, UpProcess


@pytest.fixture(scope="module")
def service(prepared_model_dir):
    """One `orcapod up` for the module; its last test stops it."""
    port = free_port_run(2)
    # What a user runs: no REDIS_URL, the default weights and the compiled decode
    # (not the suite's pins).
    pins = ("REDIS_URL", "ORCAPOD_WEIGHTS", "ORCAPOD_COMPILE_DECODE")
    env = {k: v for k, v in os.environ.items() if k not in pins}
    up = UpProcess(
        [
            *("--port", str(port), "--gateways", "2", "--model", str(prepared_model_dir)),
            "--worker-arg=--kv-cache-bytes=134217728",
        ],
        env,
    )
    up.wait_ready(timeout_s=120)  # it serves eagerly while compiling its paths
    # The tests below take the compiled paths a user's chats take once they are live.
    up.wait_for("step_paths_settled", "compile its step paths", timeout_s=900)
    yield up.process, port, up
    up.stop()


async def _generate(url: str, question: str, max_tokens: int = 12) -> tuple[str, Done]:
    async with connect(url) as socket:
        await socket.send(
            encode_json(
                Generate(
                    id="q",
                    messages=[{"role": "user", "content": question}],  # type: ignore[list-item]
                    max_tokens=max_tokens,
                    temperature=0.0,
                )
            )
        )
        text = []
        seqs = []
        while True:
            message = decode_server_message(await asyncio.wait_for(socket.recv(), 60))
            if isinstance(message, Token):
                text.append(message.text)
                seqs.append(message.seq)
            elif isinstance(message, Done):
                assert seqs == list(range(len(seqs)))
                return "".join(text), message


OVERLAP_QUESTIONS = [
    "Write a poem about the sea.",
    "Why is the sky blue?",
    "Count to ten.",
    "A compiler is",
    "What is the capital of France?",
    "Name three fruits.",
]


def test_overlapping_greedy_chats_answer_as_each_alone(service):
    """The default a user gets (packed weights, compiled decode paths): six greedy
    chats sent 0.15 s apart over both gateways give the answers each gives alone.
    (Once, the compiled attention of batches read a strided view of the queries
    and garbled every overlapping answer but the first.)"""
    _, port, _ = service
    urls = [f"ws://127.0.0.1:{port + index % 2}/ws" for index in range(len(OVERLAP_QUESTIONS))]

    async def alone() -> list[str]:
        return [
            (await _generate(url, q, 40))[0] for url, q in zip(urls, OVERLAP_QUESTIONS, strict=True)
        ]

    async def overlapping() -> list[str]:
        async def after(delay_s: float, url: str, question: str) -> str:
            await asyncio.sleep(delay_s)
            return (await _generate(url, question, 40))[0]

        return list(
            await asyncio.gather(
                *(
                    after(0.15 * i, url, q)
                    for i, (url, q) in enumerate(zip(urls, OVERLAP_QUESTIONS, strict=True))
                )
            )
        )

    lone_answers = asyncio.run(alone())
    assert asyncio.run(overlapping()) == lone_answers


def test_chat_client_streams_keeps_the_conversation_and_ctrl_c_stops_only_the_answer(service):
    _, port, _ = service
    chat = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orcapod",
            "chat",
            "--url",
            f"ws://127.0.0.1:{port}/ws",
            "--temperature",
            "0",
            "--max-tokens",
            # More than the fastest decode here streams in the 6 s below: an answer
            # that ended before Ctrl-C would make it leave the client instead.
            "1500",
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert chat.stdin is not None and chat.stdout is not None
    chat.stdin.write("Write a very long story about a dragon.\n")
    chat.stdin.flush()
    time.sleep(6)  # the answer is streaming now
    chat.send_signal(signal.SIGINT)
    time.sleep(1)
    chat.stdin.write("What is the capital of France? Answer in one word.\n")
    chat.stdin.flush()
    time.sleep(5)
    chat.stdin.write("/quit\n")
    chat.stdin.flush()
    output, _ = chat.communicate(timeout=60)
    assert chat.returncode == 0, output
    assert "[cancelled]" in output  # Ctrl-C ended the first answer, not the client
    assert "Paris" in output.split("[cancelled]", 1)[1]


def test_up_serves_the_cpu_default_weights_packed(service):
    _, _, up = service
    # Logged by the worker before it joined, so before "ready": the packaged
    # model's layers as its file holds them (q4_1, on every CPU) where the
    # project's kernel runs, else float16 (int4 and q4_1_i16 are choices:
    # gpu_worker/quantized_linear.py says why).
    expected = resolve_weight_format("auto", torch.device("cpu"), torch.float32)
    assert expected == ("float16" if kernel_unavailable_reason() else AUTO_CPU_FORMATS[0])
    packed = [line for line in up.output if "weights_packed" in line]
    assert packed and f'"weight_format": "{expected}"' in packed[0], packed


def _metrics_urls(up: UpProcess) -> dict[str, str]:
    """Actor name -> the /metrics URL `orcapod up` printed for it."""
    output = up.drain()
    ready_at = next(i for i, line in enumerate(output) if "orcapod is ready" in line)
    return {
        match["name"]: match["url"]
        for line in output[ready_at:]
        if (match := METRICS_LINE.match(line.rstrip("\n")))
    }


def test_up_prints_and_serves_the_actors_metrics(service):
    _, port, up = service
    output = up.drain()
    ready_at = next(i for i, line in enumerate(output) if "orcapod is ready" in line)
    # The lines it printed before still come first.
    assert output[ready_at + 1].strip().startswith(f"ws://127.0.0.1:{port}/ws")
    urls = _metrics_urls(up)
    assert set(urls) == {"scheduler", "worker-0", "gateway-0", "gateway-1"}
    assert urls["gateway-1"] == f"http://127.0.0.1:{port + 1}/metrics"
    assert urls["scheduler"] != urls["worker-0"]
    deadline_s = time.monotonic() + 30
    assert "orcapod_kv_pool_blocks" in scrape_families(urls["scheduler"], deadline_s)
    assert "orcapod_step_time_seconds" in scrape_families(urls["worker-0"], deadline_s)
    # The overlapping chats above took the compiled paths a user's chats take.
    with urllib.request.urlopen(urls["worker-0"], timeout=5) as response:
        families = text_string_to_metric_families(response.read().decode())
    step_paths = {
        sample.labels["path"]
        for family in families
        if family.name == "orcapod_step_time_seconds"
        for sample in family.samples
    }
    assert {"graph[1]", "eager+paged_attention"} <= step_paths, step_paths
    # ...which the worker says are live, none compiling any more.
    with urllib.request.urlopen(urls["worker-0"], timeout=5) as response:
        samples = [
            sample
            for family in text_string_to_metric_families(response.read().decode())
            for sample in family.samples
        ]
    live = {s.labels["path"]: s.value for s in samples if s.name == "orcapod_step_path_live"}
    assert live == {"graph[1]": 1, "eager": 1, "eager+paged_attention": 1}, live
    assert [s.value for s in samples if s.name == "orcapod_step_paths_compiling"] == [0]
    assert "orcapod_time_to_first_token_seconds" in scrape_families(urls["gateway-0"], deadline_s)


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed")
def test_a_real_prometheus_stores_the_documented_names(service, tmp_path):
    """Debian's Prometheus 2.42 (which asks for OpenMetrics first) scrapes every
    actor; a histogram quantile and the idle totals answer by the names
    docs/metrics.md gives, with the served model's name on them."""
    _, _, up = service
    with prometheus_scraping(list(_metrics_urls(up).values()), tmp_path) as prometheus:
        [ttft] = prometheus.wait_for(
            "histogram_quantile(0.5, sum by (le, model_name) "
            "(orcapod_time_to_first_token_seconds_bucket))"
        )
        assert ttft["metric"] == {"model_name": "SmolLM2-135M-Instruct"}
        assert 0 < float(ttft["value"][1]) < 60
        [prefill] = prometheus.wait_for(
            "histogram_quantile(0.9, sum by (le) (orcapod_request_prefill_time_seconds_bucket))"
        )
        assert 0 < float(prefill["value"][1]) < 60
        [running] = prometheus.wait_for("orcapod_num_requests_running")
        assert running["metric"]["job"] == "orcapod" and running["value"][1] == "0"
        # Nothing stored under another name (a colon, or the escaped form).
        names = {series["metric"]["__name__"] for series in prometheus.query('{job="orcapod"}')}
        own = {name for name in names if name != "up" and not name.startswith("scrape_")}
        assert own and all(name.startswith("orcapod_") for name in own), own


# Last: it stops the module's service.
def _status(port: int, head: str, body: bytes = b"") -> int:
    """The status of one raw HTTP/1.1 request (any Host, as a rebound page sends)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        return int(connection.makefile("rb").readline().split()[1])


def test_a_rebound_name_cannot_drive_the_keyless_service(service):
    """DNS rebinding: a page on attacker.example whose name now resolves to
    127.0.0.1. Its browser sends ``Host`` and ``Origin`` of its own name, which
    the Origin check alone took for the gateway's own pages."""
    _, port, _ = service
    rebound = f"Host: attacker.example:{port}\nOrigin: http://attacker.example:{port}\n"
    upgrade = (
        "Upgrade: websocket\nConnection: Upgrade\nSec-WebSocket-Version: 13\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\n"
    )
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    post = f"POST /v1/chat/completions HTTP/1.1\nContent-Length: {len(body)}\n"
    assert _status(port, "GET /v1/models HTTP/1.1\n" + rebound) == 403
    assert _status(port, "GET /ws HTTP/1.1\n" + upgrade + rebound) == 403
    assert _status(port, "GET /dashboard/ws HTTP/1.1\n" + upgrade + rebound) == 403
    assert _status(port, post + "Content-Type: text/plain\n" + rebound, body) == 403
    assert _status(port, post + "Content-Type: application/json\n" + rebound, body) == 403
    # Its own names still work, and a text/plain body is refused there too.
    local = f"Host: localhost:{port}\n"
    assert _status(port, "GET /v1/models HTTP/1.1\n" + local) == 200
    assert _status(port, post + "Content-Type: text/plain\n" + local, body) == 415


def test_up_serves_on_every_gateway_and_stops_cleanly(service):
    process, port, up = service
    # Each actor is its own process, named by its command line.
    commands = [cmd for _, cmd in descendants(process.pid)]
    restarts = [line for line in up.drain() if any(w in line for w in ("exit", "restart", "Error"))]
    for role in ("redis-server", "-m scheduler_actor", "-m gpu_worker", "-m gateway"):
        assert any(role in cmd for cmd in commands), (role, commands, restarts)
    assert sum("-m gateway" in cmd for cmd in commands) == 2, (commands, restarts)
    # The embedded Redis password never shows on a command line.
    assert not any("requirepass" in cmd or "@127.0.0.1" in cmd for cmd in commands)

    for gateway_port in (port, port + 1):
        text, done = asyncio.run(
            _generate(f"ws://127.0.0.1:{gateway_port}/ws", "What is the capital of France?")
        )
        assert "Paris" in text
        assert done.finish_reason in ("stop", "length")
        assert done.usage.completion_tokens >= 1

    pids = [pid for pid, _ in descendants(process.pid)]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    time.sleep(0.2)
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        )
