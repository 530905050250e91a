"""A fake admin API on loopback (stdlib http.server in a thread): canned answers per route, and a
record of what was asked, for the Python client's unit tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Route = Callable[[dict[str, Any] | None, str], tuple[int, Any]]


class FakeApi:
    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.seen: list[tuple[str, str, Any, str]] = []

    def on(self, method: str, path: str, answer: Route | Any, status: int = 200) -> None:
        self.routes[(method, path)] = answer if callable(answer) else (lambda body, query: (status, answer))


@contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[FakeApi, Path]]:
    """A running fake API and a data directory whose admin.addr / admin.token point at it."""
    api = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            path, _, query = self.path.partition("?")
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            api.seen.append((self.command, path, body, query))
            if self.headers.get("Authorization") != "Bearer sekret":
                status, doc = 401, {"error": "unauthorized", "code": "unauthorized"}
            elif (self.command, path) in api.routes:
                status, doc = api.routes[(self.command, path)](body, query)
            else:
                status, doc = 404, {"error": f"this node does not serve {path}", "code": "not_served"}
            raw = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(doc, str) else "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    data_dir = tmp_path / "node"
    data_dir.mkdir()
    (data_dir / "admin.addr").write_text(f"http://127.0.0.1:{server.server_address[1]}\n")
    (data_dir / "admin.token").write_text("sekret\n")
    try:
        yield api, data_dir
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
