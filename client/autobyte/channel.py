"""Opening a gRPC channel to autobyted: address and token defaults, TLS, auth metadata."""

from __future__ import annotations

import os

import grpc

DEFAULT_DAEMON = "127.0.0.1:7077"
# Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after-ms"


def daemon_address(explicit: str | None = None) -> str:
    return explicit or os.environ.get("AUTOBYTE_DAEMON") or DEFAULT_DAEMON


def daemon_addresses(explicit: str | None = None) -> tuple[str, ...]:
    """The daemons to use, in order: a comma-separated list (--daemon / AUTOBYTE_DAEMON), each
    HOST:PORT. Several daemons share one database, so any of them serves any job. ValueError names
    an entry that is not HOST:PORT."""
    text = daemon_address(explicit)
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"daemon address {address!r} must look like HOST:PORT, e.g. 127.0.0.1:7077 "
                "(several: a comma-separated list)"
            )
    if not addresses:
        raise ValueError(
            f"no daemon address in {text!r}: give HOST:PORT, or several separated by commas"
        )
    return addresses


def daemon_token(explicit: str | None = None) -> str | None:
    return explicit or os.environ.get("AUTOBYTE_TOKEN") or None


def open_channel(address: str, tls_ca: str | None = None) -> grpc.Channel:
    # Short reconnect backoff: after a daemon restart the client should be back within seconds
    # (gRPC's default grows to 120 s); the client's own loops add jitter on top.
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5000),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
    ]
    if tls_ca:
        with open(tls_ca, "rb") as handle:
            credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
        return grpc.secure_channel(address, credentials, options=options)
    return grpc.insecure_channel(address, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
