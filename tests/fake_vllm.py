"""A stand-in for a vLLM server's HTTP surface, on the standard library's HTTP server: the routes
asyncrl's server engine uses (`/health`, `/server_info`, `/v1/models`, `/abort_requests`,
`/is_paused`, `/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`, `/weight_info`,
`/v1/load_lora_adapter`, streamed `/v1/completions`), with vLLM's answers, and a record of
what it was asked. It samples nothing: each sample is token 3 then the request's stop token,
log-prob -0.5 each. A restart (`stop`, then a new one on the same port) starts it over, as a
supervisor's restart starts vLLM on its initial weights (`weight_version` "default").

In a test: `FakeVLLM(secret=...).start()`. As a launched server's command (`python
tests/fake_vllm.py --port P`), it requires `ASYNCRL_SERVER_SECRET` where set, and with
`--child` starts one more process in its group (vLLM's engine core) and writes its pid to the
log, for tests of what ends a launch's process groups."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeVLLM:
    def __init__(self, port: int = 0, secret: str = "", model: str = "/nowhere/model") -> None:
        self.secret = secret
        self.model = model
        self.weight_version = "default"
        self.paused = False
        self.calls: list[tuple[str, str]] = []  # (method, path) of every authorized request
        self.refused: list[str] = []  # paths answered 401
        self.reloads = 0
        self.aborts = 0
        self.completions = 0
        self.restart_in_stream = False
        """Set: the next completion's stream ends at once, the server restarted under it (its
        string "default" again, its initial weights), answering `/health` as before."""
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread: threading.Thread | None = None

    def start(self) -> FakeVLLM:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, method: str, path: str, query: dict[str, Any], body: Any) -> Any:
        """The JSON answer to one authorized request (None: 404)."""
        with self.lock:
            self.calls.append((method, path))
            if path == "/health":
                return {}
            if path == "/server_info":
                return {"vllm_config": {"model_config": {
                    "model": self.model, "dtype": "torch.float32",
                    "logprobs_mode": "processed_logprobs"}}, "vllm_env": {}}  # fmt: skip
            if path == "/v1/models":
                return {"data": [{"id": "served"}]}
            if path == "/abort_requests":
                self.aborts += 1
                return {"aborted": 0}
            if path == "/is_paused":
                return {"is_paused": self.paused}
            if path in ("/pause", "/resume"):
                self.paused = path == "/pause"
                return {"status": path[1:]}
            if path == "/collective_rpc":
                self.reloads += body.get("method") == "reload_weights"
                return {"results": [None]}
            if path == "/update_weight_version":
                self.weight_version = str(body["new_version"])
                return {"success": True, "new_version": self.weight_version}
            if path == "/weight_info":
                return {"weight_version": self.weight_version}
            if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                return {}
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a body ends with its connection

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                if fake.secret and self.headers.get("Authorization") != f"Bearer {fake.secret}":
                    with fake.lock:
                        fake.refused.append(parts.path)
                    return self._send(401, {"error": "Unauthorized"})
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"null") if size else None
                if parts.path == "/v1/completions":
                    with fake.lock:
                        fake.calls.append((method, parts.path))
                        fake.completions += 1
                    return self._stream(body)
                answer = fake.answer(method, parts.path, parse_qs(parts.query), body)
                self._send(404 if answer is None else 200, answer or {})

            def _send(self, status: int, answer: Any) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                with fake.lock:
                    restart, fake.restart_in_stream = fake.restart_in_stream, False
                    if restart:
                        fake.weight_version = "default"
                        fake.calls.append(("RESTART", ""))
                if restart:
                    return  # the connection closes: the stream broke
                stop = int(body["stop_token_ids"][0])
                ids = [3, stop][: int(body["max_tokens"])]
                reason = "stop" if ids[-1] == stop else "length"
                for index in range(int(body["n"])):
                    choice = {"index": index, "token_ids": ids, "finish_reason": reason,
                              "logprobs": {"token_logprobs": [-0.5] * len(ids)}}  # fmt: skip
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--child", action="store_true")
    args, _ = parser.parse_known_args()
    if args.child:  # vLLM's engine core: one more process of the server's group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        print(f"fake_vllm child {child.pid}", flush=True)
    fake = FakeVLLM(args.port, secret=os.environ.get("ASYNCRL_SERVER_SECRET", ""))
    fake.httpd.serve_forever()


if __name__ == "__main__":
    main()
