"""A local HTTP server in a thread that records every request (method, path, query, headers) and
answers with a fixed status, echoing what it was sent, as real servers and proxies do in their
error bodies (so a test sees whether an echoed credential is redacted)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]


@dataclass
class Recording:
    url: str  # http://127.0.0.1:<port>
    requests: list[Seen] = field(default_factory=list)
    status: int = 200
    body: dict | None = None  # the 200 answer (JSON); default: an empty model list


def _handler(recording: Recording) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length:
                self.rfile.read(length)
            parts = urlsplit(self.path)
            seen = Seen(self.command, parts.path, parts.query, dict(self.headers.items()))
            recording.requests.append(seen)
            if recording.status == 200:
                body = recording.body if recording.body is not None else {"data": []}
            else:  # echo the request, credentials included
                body = {"error": f"denied {self.command} {self.path}", "headers": seen.headers}
            data = json.dumps(body).encode()
            self.send_response(recording.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: object) -> None:
            pass  # no stderr noise

    return Handler


@contextmanager
def recording_server(status: int = 200) -> Iterator[Recording]:
    """A server on a free local port for the ``with`` block."""
    recording = Recording(url="", status=status)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(recording))
    recording.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield recording
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
