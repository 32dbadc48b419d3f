"""A stand-in for trtllm-serve's /kv_cache_events and /metrics, speaking their exact wire
(TensorRT-LLM cannot run on these machines). Standard library only; imports nothing of
kvfold.

    python trtllm_server.py --events FILE.jsonl --metrics FILE.json [--drop-page N ...]
                            [--port P] [--drain-metrics]

Each line of FILE.jsonl is one /kv_cache_events answer, as trtllm-serve renders it. Like
the real endpoint (POST; it drains the engine's event queue), each POST answers the next
page, then "[]" once all are out. --drop-page N throws page N away unanswered, as the
engine does when a reader falls more than event_buffer_max_size events behind. GET
/metrics answers FILE.json (the iteration stats); with --drain-metrics only the first
time, then "[]", as trtllm-serve does (each answer drains the engine's stats queue: an
idle engine has no new iteration to give). Listens on 127.0.0.1, on port P (0: any free
one), prints "PORT <n>" on stdout once it does, and exits when stdin closes or after
--deadline-s.
"""

from __future__ import annotations

import argparse
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", required=True)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--drop-page", type=int, action="append", default=[])
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--drain-metrics", action="store_true")
    args = parser.parse_args()
    lines = Path(args.events).read_text().splitlines()
    pages = [p.encode() for n, p in enumerate(lines) if n not in set(args.drop_page)]
    metrics = [Path(args.metrics).read_bytes().strip()]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/kv_cache_events":
                self.send_error(404)
                return
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            with lock:
                body = pages.pop(0) if pages else b"[]"
            self._answer(body)

        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            with lock:
                body = metrics[0]
                if args.drain_metrics:
                    metrics[0] = b"[]"
            self._answer(body)

        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait(timeout=args.deadline_s)
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
