"""SuduError: a failure the user can act on. The CLI prints its message on one line and exits non-zero;
the server maps it to an OpenAI-style error body."""


class SuduError(Exception):
    pass


class ModelNotFoundError(SuduError):
    pass


class RequestTooLongError(SuduError):
    """A request that can never fit (prompt + max_tokens beyond max_model_len or the whole KV pool)."""


class EngineFailedError(SuduError):
    """The engine hit a fault it could not pin on one request and cannot continue: every request in
    flight fails with it, and the server reports 503 and exits non-zero so a supervisor restarts it."""
