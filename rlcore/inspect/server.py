"""``--serve``: the page of a live run on 127.0.0.1, rebuilt from the folder at each load, behind a token.

``/``: the page; ``/data.json``: what the page shows, as JSON (``load_run``: metrics, the trajectory
sample, the consistency check's verdicts), for scripts and notebooks watching a run.

Why a token although it binds loopback: any local user or web page the browser opens could
otherwise reach the port; the page shows prompts and model outputs. The token is random per start,
is part of the URL printed, and every request without it gets 403.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from rlcore.inspect.page import render_page
from rlcore.inspect.run_data import RunFolderError, load_run

HOST = "127.0.0.1"
DATA_PATH = "/data.json"
REQUEST_TIMEOUT_S = 30.0  # a client that stops sending mid-request frees its thread after this


class InspectorServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path, port: int = 0, token: str | None = None, last: int | None = None) -> None:
        self.folder, self.last = Path(folder), last
        self.token = token or secrets.token_urlsafe(24)
        load_run(self.folder, last)  # a bad folder fails now, not at the first page load
        super().__init__((HOST, port), Handler)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/?token={self.token}"

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (tests, notebooks); ``shutdown()`` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="rlcore-inspect", daemon=True)
        thread.start()
        return thread


class Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT_S
    server: InspectorServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        given = parse_qs(parts.query).get("token", [""])[0]
        if not hmac.compare_digest(given.encode(), self.server.token.encode()):
            return self.reply(403, "text/plain", "403: this page needs the token printed by python -m rlcore.inspect "
                                                 "(?token=...)\n")
        if parts.path not in ("/", DATA_PATH):
            return self.reply(404, "text/plain", f"404: no {parts.path}; the page is /, its data {DATA_PATH}\n")
        try:
            data = load_run(self.server.folder, self.server.last)
        except RunFolderError as exc:
            return self.reply(500, "text/plain", f"500: {exc}\n")
        if parts.path == DATA_PATH:
            return self.reply(200, "application/json", json.dumps(data, ensure_ascii=False, allow_nan=False))
        self.reply(200, "text/html; charset=utf-8", render_page(data))

    def reply(self, status: int, kind: str, text: str) -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Referrer-Policy", "no-referrer")  # the token is in the URL
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass  # the token would otherwise be printed with every request line
