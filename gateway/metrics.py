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
from shared.metric_buckets import INTER_TOKEN_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S, TTFT_BUCKETS_S
from shared.metrics_labels import labelled_registry
from shared.protocol import Done, Error, Token


class GatewayMetrics:
    """Every metric of one gateway, labelled ``gateway`` and ``model_name``."""

    def __init__(self, gateway_id: str, model_name: str = "") -> None:
        own = CollectorRegistry()
        self.registry = labelled_registry(own, {"model_name": model_name})
        labels = ["gateway"]
        self._ttft = Histogram(
            "orcapod_time_to_first_token_seconds",
            "Time from accepting a request to its first token.",
            labels,
            buckets=TTFT_BUCKETS_S,
            registry=own,
        ).labels(gateway_id)
        self._inter_token = Histogram(
            "orcapod_inter_token_latency_seconds",
            "Time between two tokens of one request, as sent to its client.",
            labels,
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=own,
        ).labels(gateway_id)
        self._e2e = Histogram(
            "orcapod_e2e_request_latency_seconds",
            "Time from accepting a request to its end.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=own,
        ).labels(gateway_id)
        self._success = Counter(
            "orcapod_request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=own,
        )
        self._errors = Counter(
            "orcapod_request_errors",
            "Errors sent to clients, by code (an error frame's, or an HTTP refusal's).",
            [*labels, "code"],
            registry=own,
        )
        self._prompt_tokens = Counter(
            "orcapod_prompt_tokens",
            "Prompt tokens of the requests that ended.",
            labels,
            registry=own,
        ).labels(gateway_id)
        self._generation_tokens = Counter(
            "orcapod_generation_tokens",
            "Tokens generated for the requests that ended.",
            labels,
            registry=own,
        ).labels(gateway_id)
        self._open_sockets = Gauge(
            "orcapod_open_sockets",
            "Open websockets.",
            labels,
            registry=own,
        ).labels(gateway_id)
        self._http_in_flight = Gauge(
            "orcapod_http_requests_in_flight",
            "OpenAI API requests being answered.",
            labels,
            registry=own,
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
            self.count_error(frame.code)

    def count_error(self, code: str) -> None:
        """One error sent to a client: an ``error`` frame's protocol code, or the
        code of an OpenAI API refusal that no frame carried (``gateway/openai_endpoint.py``)."""
        self._errors.labels(self._gateway_id, code).inc()

    def socket_opened(self) -> None:
        self._open_sockets.inc()

    def socket_closed(self) -> None:
        self._open_sockets.dec()

    def http_request_started(self) -> None:
        self._http_in_flight.inc()

    def http_request_ended(self, aborted: bool) -> None:
        """An OpenAI request's handler is done; ``aborted``: its client went away
        before the end (the request was cancelled, and no frame says so)."""
        self._http_in_flight.dec()
        if aborted:
            self._success.labels(self._gateway_id, "abort").inc()

    def connection_closed(self, socket_id: int) -> None:
        """Forget what was kept for the requests of a closed connection (a
        websocket, or an OpenAI request's virtual socket)."""
        self._last_token_s.pop(socket_id, None)

    def _ended(self, socket_id: int, client_id: str) -> None:
        last = self._last_token_s.get(socket_id)
        if last is not None:
            last.pop(client_id, None)
