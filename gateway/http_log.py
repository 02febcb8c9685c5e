"""aiohttp's server log, told apart: a request the client malformed (a
repeated ``Host``, smuggling attempts, a bad chunk) is one line, not a
traceback; anything else aiohttp logs stays as it is.

aiohttp answers a malformed request with a 400 itself and logs it as an
exception, ~30 lines each: anyone who can reach the port could fill the log.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = logging.getLogger("aiohttp.server")


class _OneLineClientErrors(logging.Filter):
    """Rewrites a record whose exception is the client's fault to one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg = "malformed HTTP request refused (%s %s): %s"
            record.args = (error.code, type(error).__name__, error.message.strip())
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_malformed_requests() -> None:
    """Log a malformed request in one line from now on (idempotent)."""
    if not any(isinstance(f, _OneLineClientErrors) for f in SERVER_LOGGER.filters):
        SERVER_LOGGER.addFilter(_OneLineClientErrors())
