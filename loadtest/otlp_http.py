"""A minimal OTLP/HTTP receiver on 127.0.0.1, for benchmarks and tests that check what tierserve exports.

``POST <path>`` with a protobuf body (gzip or not) is decoded as ``request_type`` and handed to
``on_request`` (on the server's thread); the answer is the empty ``Export*ServiceResponse``. Anything
else is a 404. :class:`loadtest.tracing_bench.OtlpCollector` receives spans with it, and
tests/e2e/test_otlp_metrics.py metrics.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Generic, TypeVar

from google.protobuf.message import Message

HOST = "127.0.0.1"

M = TypeVar("M", bound=Message)


class OtlpHttpReceiver(Generic[M]):
    def __init__(
        self, path: str, request_type: type[M], response: Message, on_request: Callable[[M], None]
    ) -> None:
        self.path = path
        answer = response.SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != path:
                    self.send_error(404)
                    return
                request = request_type()
                request.ParseFromString(body)
                on_request(request)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self._server.serve_forever, name=f"otlp-http{path}", daemon=True).start()

    @property
    def base_url(self) -> str:
        """What ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes (the SDK appends ``/v1/traces`` or ``/v1/metrics``)."""
        return f"http://{HOST}:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
