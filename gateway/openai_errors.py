"""OpenAI's error object: :class:`OpenAIError` (an HTTP status and
``{"error": {"message", "type", "param", "code"}}``), the errors the OpenAI
API answers with, and the HTTP face of the core's refusals. Pure.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec

from gateway.refusal import RefusalReason
from shared.protocol import Error, ErrorCode


class OpenAIError(Exception):
    """A request answered with OpenAI's error object and an HTTP status."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return _encoder.encode(
            _ErrorBody(_ErrorDetail(self.message, self.type, self.param, self.code))
        )

    @property
    def metric_code(self) -> str:
        """The ``code`` it is counted under in ``orcapod_request_errors_total``:
        OpenAI's code when it has one; a 400 without one is ``invalid_request``,
        as the core's refusal of a bad field is; else the status
        (``forbidden``, ``not_found``, ``method_not_allowed``)."""
        if self.code is not None:
            return self.code
        if self.status == HTTPStatus.BAD_REQUEST:
            return "invalid_request"
        return HTTPStatus(self.status).phrase.lower().replace(" ", "_")


class _ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct, frozen=True):
    error: _ErrorDetail


_encoder = msgspec.json.Encoder()


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400 for a request that can never succeed as sent."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param)


def unauthorized(message: str) -> OpenAIError:
    """A 401: no key, or not a valid one."""
    return OpenAIError(
        HTTPStatus.UNAUTHORIZED, message, type="authentication_error", code="invalid_api_key"
    )


def model_not_found(requested: str, served_model: str, param: str | None) -> OpenAIError:
    """A 404 for a model this server does not serve (``param``: the body's
    ``model``; None for the one in ``GET /v1/models/{model}``'s path)."""
    return OpenAIError(
        HTTPStatus.NOT_FOUND,
        f"the model {requested!r} does not exist; this server serves {served_model!r}",
        param=param,
        code="model_not_found",
    )


def shutting_down() -> OpenAIError:
    """The gateway is draining: a new request is refused, one still running ends."""
    return OpenAIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "the gateway is shutting down; try another one",
        type="server_error",
        code="service_unavailable",
    )


def error_of_code(code: ErrorCode, message: str, param: str | None = None) -> OpenAIError:
    """The HTTP face of one of orcapod's protocol error codes (``param``: the
    field at fault, when one is)."""
    if code == "invalid_request":
        return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param)
    if code == "prompt_too_long":
        return OpenAIError(
            HTTPStatus.BAD_REQUEST, message, param=param, code="context_length_exceeded"
        )
    if code == "unauthorized":
        return unauthorized(message)
    if code == "queue_full":
        return OpenAIError(
            HTTPStatus.TOO_MANY_REQUESTS,
            message,
            type="rate_limit_error",
            param=param,
            code="rate_limit_exceeded",
        )
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", param=param)


def error_of_frame(
    error: Error, param: str | None = None, reason: RefusalReason | None = None
) -> OpenAIError:
    """The core's ``error`` frame as OpenAI's error, with the data its refusal
    came with (``SendFrame``): the field at fault, and why (a draining
    gateway's refusal is a 503)."""
    if reason == "shutting_down":
        return shutting_down()
    return error_of_code(error.code, error.message, param)
