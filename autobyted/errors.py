"""Domain errors of the daemon and the one function that maps them to gRPC status codes."""

from __future__ import annotations

import grpc


class AutobytedError(Exception):
    """Base of every error the daemon reports to a person."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(AutobytedError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(AutobytedError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(AutobytedError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(AutobytedError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(AutobytedError):
    code = grpc.StatusCode.UNAUTHENTICATED


class StorageError(AutobytedError):
    """The database failed (malformed, locked, unreachable). INTERNAL, not UNAVAILABLE: a client must
    be able to tell "the daemon answered: its database failed" from "the daemon cannot be reached"."""

    code = grpc.StatusCode.INTERNAL


class Overloaded(AutobytedError):
    """The daemon cannot take more work now; the client should retry after `retry_after_ms`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(f"{message}; retry in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class DatabaseInUse(AutobytedError):
    """Another autobyted holds this SQLite database; raised before anything is touched."""


class ForeignDatabase(AutobytedError):
    """The database holds tables that autobyted did not create; it is never touched."""


class ConfigError(AutobytedError):
    """The daemon's own settings are invalid; raised before anything starts."""


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an error raised while serving a request."""
    if isinstance(error, AutobytedError):
        return error.code, str(error)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error in autobyted ({type(error).__name__}); see the daemon log",
    )
