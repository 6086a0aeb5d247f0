"""`python -m tests.fleet.stub_replica NAME`: a stand-in for a `leanlm serve` replica, as its own process (so a
test can SIGSTOP it: alive, silent). It prints its port, answers /health, and answers completions with its NAME as
the text: whole, or streamed as two events. A prompt holding "hold:NAME" gets nothing for a minute (streamed: after
its status and first event), as from a replica deep in a long generation."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    name = "?"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path == "/metrics":
            page = b'# TYPE leanlm_stub_requests counter\nleanlm_stub_requests_total{model_name="m"} 1.0\n'
            self._send(200, "text/plain; version=0.0.4", page)
        else:
            self._send(200, "application/json", b'{"status": "ok"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        hold = f"hold:{self.name}" in json.dumps(body.get("prompt", body.get("messages", "")))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(f'data: {{"choices": [{{"index": 0, "text": "{self.name}"}}]}}\n\n'.encode())
            if hold:
                time.sleep(60)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
            return
        if hold:
            time.sleep(60)
        answer = {"object": "text_completion", "choices": [{"index": 0, "text": self.name, "finish_reason": "stop"}]}
        self._send(200, "application/json", json.dumps(answer).encode())

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def main() -> None:
    _Handler.name = sys.argv[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
