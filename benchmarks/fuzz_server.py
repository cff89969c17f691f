"""A tracking server answering garbage, for benchmarks/fuzz.py: whatever MLflow's client asks, it answers random
bytes, an HTML page, JSON of the wrong shape, 200 with an empty body, or closes the connection unanswered.

    with Garbage("HTML", seed) as server:   # server.url: http://127.0.0.1:<port>
        ...
"""

from __future__ import annotations

import json
import random
import socket
import threading

ANSWERS = ("random bytes", "HTML", "wrong JSON", "200, empty body", "closed connection")
WRONG_JSON = ([], 5, "x", None, {"experiments": 5}, {"experiment": {}}, {"user": []}, {"run": {"info": 1}},
              {"experiment_id": None}, {"runs": [1, 2]}, {"error_code": 7}, {"registered_model": "x"})


def _http(status: str, body: bytes, kind: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            .encode() + body)


class Garbage:
    """A loopback server answering every request with ``answer`` (one of ``ANSWERS``)."""

    def __init__(self, answer: str, seed: int):
        self.answer, self.rng, self.lock = answer, random.Random(seed), threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0

    def __enter__(self) -> Garbage:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _reply(self) -> bytes:
        with self.lock:
            self.requests += 1
            rng = self.rng
            if self.answer == "random bytes":
                return rng.randbytes(rng.randint(1, 4096))
            if self.answer == "HTML":
                status = rng.choice(["200 OK", "502 Bad Gateway", "404 Not Found", "503 Service Unavailable"])
                return _http(status, b"<html><head><title>Bad Gateway</title></head><body><h1>nginx</h1></body>"
                                     b"</html>", "text/html")
            if self.answer == "wrong JSON":
                return _http("200 OK", json.dumps(rng.choice(WRONG_JSON)).encode(), "application/json")
            if self.answer == "200, empty body":
                return _http("200 OK", b"", rng.choice(["application/json", "text/plain"]))
            return b""  # closed connection

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 1 << 20:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = len(head.split(b"\r\n\r\n", 1)[-1])
                while body < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += len(chunk)
                reply = self._reply()
                if reply:
                    conn.sendall(reply)
            except (OSError, ValueError):
                pass  # a client that went away: nothing to answer
