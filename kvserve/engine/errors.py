"""Typed errors raised by the engine; the server maps each to an HTTP status in one place."""
from __future__ import annotations


class KVServeError(Exception):
    """Base class. `code` is the OpenAI-style error code string; `retry_after` (seconds) goes out as
    Retry-After (503s without one say 1)."""

    code = "internal_error"
    http_status = 500
    error_type = "server_error"
    retry_after: float | None = None
    headers: dict | None = None  # more response headers (a rate limit's x-ratelimit-*)
    param: str | None = None  # the request field at fault, if one is

    def error_body(self) -> dict:
        """OpenAI's error object for this error: what an HTTP response, or a batch line's result, carries."""
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(KVServeError):
    """Bad input the schema could not catch (a prompt that encodes to nothing, token ids outside the
    vocabulary, a chat template that refuses the messages): 400. `param` names the field."""

    code = "invalid_value"
    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class InvalidStructuredOutput(InvalidRequest):
    """A structured-output constraint that cannot be served (malformed, unsupported, over a limit, or past its
    compile budget): a 400 naming the request field it came from."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message, param=param, code="invalid_structured_output")


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


class InsufficientQuota(KVServeError):
    """The tenant's budget cannot cover the request's worst-case price (checked before any engine work)."""

    code = "insufficient_quota"
    http_status = 429
    error_type = "insufficient_quota"


class RateLimitExceeded(KVServeError):
    """The tenant's requests or tokens per minute are used up for this window: 429 with Retry-After."""

    code = "rate_limit_exceeded"
    http_status = 429
    error_type = "requests"

    def __init__(self, message: str, retry_after: float, headers: dict | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers


class QueueTimeout(KVServeError):
    """A request waited past its tier's queue deadline without being scheduled."""

    code = "queue_timeout"
    http_status = 503
    error_type = "capacity_exhausted"


class ModelWarming(KVServeError):
    code = "model_warming"
    http_status = 503
    error_type = "model_warming"


class ModelFailed(KVServeError):
    """The model's engine failed to load or stopped working."""

    code = "model_failed"
    http_status = 503
    error_type = "model_unavailable"
    retry_after = 30.0


class ModelNotFound(KVServeError):
    code = "model_not_found"
    http_status = 404
    error_type = "invalid_request_error"
    param = "model"


class LoRANotFound(ModelNotFound):
    """A request or an admin named an adapter the model does not have: 404."""


class LoRAAdapterError(InvalidRequest):
    """An adapter that cannot be loaded (a bad file, a rank past max_lora_rank, a module the model lacks): 400."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path", code="invalid_lora_adapter")


class LoRAAdaptersBusy(KVServeError):
    """Every resident adapter is pinned or serving requests (max_cpu_loras): 503, retry when one ends."""

    code = "lora_adapters_busy"
    http_status = 503
    error_type = "server_error"
    retry_after = 1.0


class ServerDraining(KVServeError):
    code = "server_draining"
    http_status = 503
    error_type = "server_draining"


def to_wire(exc: KVServeError) -> dict:
    """A typed error as plain data, to cross a process boundary (a fleet replica refusing a request)."""
    return {"class": type(exc).__name__, "message": str(exc),
            "attrs": {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, type(None)))}}


def from_wire(data: dict) -> KVServeError:
    """The typed error `to_wire` described (a KVServeError when the class is not one of ours)."""
    cls = globals().get(data.get("class", ""))
    if not (isinstance(cls, type) and issubclass(cls, KVServeError)):
        cls = KVServeError
    exc = cls.__new__(cls)
    Exception.__init__(exc, data.get("message", ""))
    for k, v in data.get("attrs", {}).items():
        setattr(exc, k, v)
    return exc
