"""Real listeners on free localhost ports that are not autobyted, for the CLI's "not autobyted" errors:
a gRPC server serving no autobyte service, an HTTP/2 server that answers every request 404, and an
HTTP/1.1 server."""

from __future__ import annotations

import contextlib
import http.server
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc

# HTTP/2 (RFC 9113 section 4.1): a frame is a 9-byte header (length, type, flags, stream id) and its payload
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _SETTINGS, _PING = 0x1, 0x4, 0x6
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_STATUS_404 = b"\x8d"  # HPACK (RFC 7541 appendix A): static table entry 13 is ":status: 404"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


def _serve_http2_404(conn: socket.socket) -> None:
    """One connection: the server's SETTINGS, then `:status 404` (no body, no gRPC status) for every
    request, as a web server that knows no such path answers."""
    with conn:
        try:
            if _read_exactly(conn, len(_PREFACE)) != _PREFACE:
                return
            conn.sendall(_frame(_SETTINGS, 0, 0))
            while True:
                header = _read_exactly(conn, 9)
                length = int.from_bytes(header[:3], "big")
                kind, flags = header[3], header[4]
                stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                payload = _read_exactly(conn, length)
                if kind == _SETTINGS and not flags & _ACK:
                    conn.sendall(_frame(_SETTINGS, _ACK, 0))
                elif kind == _PING and not flags & _ACK:
                    conn.sendall(_frame(_PING, _ACK, 0, payload))
                elif kind == _HEADERS:
                    conn.sendall(_frame(_HEADERS, _END_STREAM | _END_HEADERS, stream, _STATUS_404))
        except OSError:
            return


@contextlib.contextmanager
def http2_404_server() -> Iterator[str]:
    """An HTTP/2 (cleartext, prior knowledge) server on a free localhost port that answers every
    request 404; yields its HOST:PORT. Written here because no HTTP/2 server library is installed."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve_http2_404, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        # wakes the accept() (closing a listening socket alone does not, on Linux: the join waited
        # its whole 5 s)
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


@contextlib.contextmanager
def foreign_grpc_server() -> Iterator[str]:
    """A real gRPC server on a free localhost port serving only the standard health service (no
    autobyte service); yields its HOST:PORT."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass


@contextlib.contextmanager
def http1_server() -> Iterator[str]:
    """Python's own HTTP/1.1 server on a free localhost port; yields its HOST:PORT."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
