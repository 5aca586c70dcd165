"""Opening a gRPC channel to autobyted: address and token defaults, TLS, auth metadata."""

from __future__ import annotations

import os

import grpc

DEFAULT_DAEMON = "127.0.0.1:7077"
# Trailing metadata of a RESOURCE_EXHAUSTED answer: milliseconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after-ms"


def daemon_address(explicit: str | None = None) -> str:
    return explicit or os.environ.get("AUTOBYTE_DAEMON") or DEFAULT_DAEMON


def split_host_port(address: str, what: str, *, lowest_port: int = 1) -> tuple[str, int]:
    """(host, port) of `what`'s address HOST:PORT ([::1]:PORT for IPv6); the host keeps no brackets.
    ValueError says what is wrong with it (no port, a port that is not a number or is out of range)
    and how it should look. `lowest_port=0` admits port 0 (a listener's "any free port")."""
    host, sep, port_text = address.rpartition(":")
    shape = f"{what} address {address!r} must look like HOST:PORT, e.g. 127.0.0.1:7077"
    if not sep or not host.strip("[]") or not port_text:
        raise ValueError(f"{shape} (it has no {'host' if sep and port_text else 'port'})")
    if not port_text.isdigit():
        raise ValueError(f"{shape} (its port {port_text!r} is not a number)")
    port = int(port_text)
    if not lowest_port <= port <= 65535:
        raise ValueError(
            f"{what} address {address!r}: port {port} is out of range "
            f"(a port is {lowest_port} to 65535)"
        )
    return host.strip("[]"), port


def daemon_addresses(explicit: str | None = None) -> tuple[str, ...]:
    """The daemons to use, in order: a comma-separated list (--daemon / AUTOBYTE_DAEMON), each
    HOST:PORT. Several daemons share one database, so any of them serves any job. ValueError names
    an entry that is not HOST:PORT and what is wrong with it."""
    text = daemon_address(explicit)
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    for address in addresses:
        split_host_port(address, "daemon")
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
