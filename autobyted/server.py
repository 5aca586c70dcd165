"""Builds the daemon's gRPC server; starts nothing (app.py does)."""

from __future__ import annotations

import errno
import hmac
import socket

import grpc
from autobyte.protocol import autobyte_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from autobyted.servicer import Services
from autobyted.settings import Settings, split_host_port

# The standard health service answers without a token: load balancers and orchestrators probe it
# without credentials, and it tells nothing but SERVING / NOT_SERVING.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC must carry `authorization: Bearer <token>` when the daemon has a token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = metadata.get("authorization", "")
        if isinstance(supplied, str):
            supplied = supplied.encode()
        if hmac.compare_digest(supplied, self._expected):
            return await continuation(handler_call_details)
        message = (
            "missing token: pass --token or set AUTOBYTE_TOKEN"
            if not supplied
            else "wrong token: check --token / AUTOBYTE_TOKEN against the daemon's"
        )
        handler = await continuation(handler_call_details)
        return _deny(handler, message)


def _deny(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


def check_address(address: str, what: str) -> None:
    """OSError with one clear line if nothing can listen on HOST:PORT (in use, not local), so that
    the daemon fails before it creates or migrates anything. Port 0 (any free port) always works."""
    host, port = split_host_port(address, what)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise OSError(f"cannot listen on {address}: {error.strerror}") from None
    failures = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(sockaddr)
            except OSError as error:
                failures.append(error)
    # "localhost" may name ::1 on a host without IPv6: one family that binds is enough, a port
    # in use on any of them is not.
    in_use = [error for error in failures if error.errno == errno.EADDRINUSE]
    if in_use or (failures and len(failures) == len(infos)):
        error = (in_use or failures)[0]
        raise OSError(f"cannot listen on {address}: {(error.strerror or str(error)).lower()}")


def make_server(
    services: Services, health: health_pb2_grpc.HealthServicer, settings: Settings
) -> tuple[grpc.aio.Server, int]:
    """An unstarted server bound to settings.listen; returns it with the bound port (0 → a free one)."""
    interceptors = [TokenInterceptor(settings.token)] if settings.token else []
    server = grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
            # Clients ping every 10 s to notice a dead daemon quickly; accept that.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    pb_grpc.add_TelemetryServicer_to_server(services.telemetry, server)
    pb_grpc.add_ControlServicer_to_server(services.control, server)
    pb_grpc.add_QueryServicer_to_server(services.query, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if settings.tls_cert:
        with open(settings.tls_key, "rb") as key, open(settings.tls_cert, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        add_port = lambda: server.add_secure_port(settings.listen, credentials)
    else:
        add_port = lambda: server.add_insecure_port(settings.listen)
    try:
        port = add_port()
    except RuntimeError as error:  # grpcio raises instead of returning 0 on a failed bind
        raise OSError(f"cannot listen on {settings.listen}: {error}") from None
    if port == 0:
        raise OSError(f"cannot listen on {settings.listen} (address in use or not local?)")
    return server, port
