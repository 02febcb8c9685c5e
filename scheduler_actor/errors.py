"""Typed errors of the scheduler core: each becomes a clear message to the sender."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base of every error the scheduler core raises on bad input."""


class ConfigError(SchedulerError, ValueError):
    """A scheduler or simulator setting is out of range."""


class InvalidRequestError(SchedulerError, ValueError):
    """A submitted request is malformed (empty prompt, max_tokens below 1)."""


class DuplicateRequestError(SchedulerError):
    """A request id was submitted while a request with that id is still live."""


class RequestTooLargeError(SchedulerError):
    """Prompt plus max_tokens does not fit the whole K/V cache of any worker."""


class QueueFullError(SchedulerError):
    """``max_waiting`` requests wait already, or the tenant has its
    ``max_queued`` waiting; retry later."""


class UnknownWorkerError(SchedulerError, KeyError):
    """An event names a worker that has not joined (or was lost)."""


class DuplicateWorkerError(SchedulerError):
    """A worker joined twice without being lost in between."""
