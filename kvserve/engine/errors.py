"""Typed errors raised by the engine; the server maps each to an HTTP status in one place."""
from __future__ import annotations


class KVServeError(Exception):
    """Base class. `code` is the OpenAI-style error code string."""

    code = "internal_error"
    http_status = 500
    error_type = "server_error"


class ContextLengthExceeded(KVServeError):
    code = "context_length_exceeded"
    http_status = 400
    error_type = "invalid_request_error"


class CapacityExhausted(KVServeError):
    """Admission refused: a tier's queue bound is reached. retry_after is an estimate in seconds."""

    code = "capacity_exhausted"
    http_status = 429
    error_type = "capacity_exhausted"

    def __init__(self, message: str, retry_after: float = 1.0, reason: str = "queue_full"):
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class QueueTimeout(KVServeError):
    """A request waited past its tier's queue deadline without being scheduled."""

    code = "queue_timeout"
    http_status = 503
    error_type = "capacity_exhausted"


class ModelWarming(KVServeError):
    code = "model_warming"
    http_status = 503
    error_type = "model_warming"


class ModelNotFound(KVServeError):
    code = "model_not_found"
    http_status = 404
    error_type = "invalid_request_error"


class ServerDraining(KVServeError):
    code = "server_draining"
    http_status = 503
    error_type = "server_draining"


class BudgetExceeded(KVServeError):
    code = "budget_exceeded"
    http_status = 429
    error_type = "budget_exceeded"
