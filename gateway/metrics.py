"""The gateway's Prometheus metrics, shaped like vLLM's (``docs/metrics.md``).

Fed by the frames the core sends to clients, whichever protocol carries them
(a websocket, or an HTTP request's virtual socket): a ``done`` gives the
request's time to first token, end-to-end time, finish reason and tokens, an
``error`` its code, the gap between two ``token`` frames of one request an
inter-token latency. One registry per gateway; served at ``/metrics`` on the
gateway's own port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.actions import ServerFrame
from shared.protocol import Done, Error, Token

# vLLM's buckets for the same histograms (seconds).
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
INTER_TOKEN_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class GatewayMetrics:
    """Every metric of one gateway, labelled ``gateway``."""

    def __init__(self, gateway_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["gateway"]
        self._ttft = Histogram(
            "orcapod_time_to_first_token_seconds",
            "Time from accepting a request to its first token.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        ).labels(gateway_id)
        self._inter_token = Histogram(
            "orcapod_inter_token_latency_seconds",
            "Time between two tokens of one request, as sent to its client.",
            labels,
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=self.registry,
        ).labels(gateway_id)
        self._e2e = Histogram(
            "orcapod_e2e_request_latency_seconds",
            "Time from accepting a request to its end.",
            labels,
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        ).labels(gateway_id)
        self._success = Counter(
            "orcapod_request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._errors = Counter(
            "orcapod_request_errors",
            "Error frames sent to clients, by protocol error code.",
            [*labels, "code"],
            registry=self.registry,
        )
        self._prompt_tokens = Counter(
            "orcapod_prompt_tokens",
            "Prompt tokens of the requests that ended.",
            labels,
            registry=self.registry,
        ).labels(gateway_id)
        self._generation_tokens = Counter(
            "orcapod_generation_tokens",
            "Tokens generated for the requests that ended.",
            labels,
            registry=self.registry,
        ).labels(gateway_id)
        self._open_sockets = Gauge(
            "orcapod_open_sockets",
            "Open websockets.",
            labels,
            registry=self.registry,
        ).labels(gateway_id)
        self._http_in_flight = Gauge(
            "orcapod_http_requests_in_flight",
            "OpenAI API requests being answered.",
            labels,
            registry=self.registry,
        ).labels(gateway_id)
        self._gateway_id = gateway_id
        # Per connection, per client id: when its last token was sent.
        self._last_token_s: dict[int, dict[str, float]] = {}

    def on_frame(self, socket_id: int, frame: ServerFrame, now_s: float) -> None:
        """A frame the core sent to ``socket_id`` at ``now_s``."""
        if isinstance(frame, Token):
            last = self._last_token_s.setdefault(socket_id, {})
            previous_s = last.get(frame.id)
            if previous_s is not None:
                self._inter_token.observe(max(0.0, now_s - previous_s))
            last[frame.id] = now_s
        elif isinstance(frame, Done):
            self._ended(socket_id, frame.id)
            if frame.timings.ttft_ms is not None:
                self._ttft.observe(frame.timings.ttft_ms / 1000)
            self._e2e.observe(frame.timings.total_ms / 1000)
            reason = "abort" if frame.finish_reason == "cancelled" else frame.finish_reason
            self._success.labels(self._gateway_id, reason).inc()
            self._prompt_tokens.inc(frame.usage.prompt_tokens)
            self._generation_tokens.inc(frame.usage.completion_tokens)
        elif isinstance(frame, Error):
            if frame.id is not None:
                self._ended(socket_id, frame.id)
            self._errors.labels(self._gateway_id, frame.code).inc()

    def socket_opened(self) -> None:
        self._open_sockets.inc()

    def socket_closed(self, socket_id: int) -> None:
        self._open_sockets.dec()
        self.connection_closed(socket_id)

    def http_request_started(self) -> None:
        self._http_in_flight.inc()

    def http_request_ended(self, socket_id: int | None, aborted: bool) -> None:
        """An OpenAI request's handler is done; ``aborted``: its client went away
        before the end (the request was cancelled, and no frame says so)."""
        self._http_in_flight.dec()
        if aborted:
            self._success.labels(self._gateway_id, "abort").inc()
        if socket_id is not None:
            self.connection_closed(socket_id)

    def connection_closed(self, socket_id: int) -> None:
        """Forget what was kept for the requests of a closed connection."""
        self._last_token_s.pop(socket_id, None)

    def _ended(self, socket_id: int, client_id: str) -> None:
        last = self._last_token_s.get(socket_id)
        if last is not None:
            last.pop(client_id, None)
