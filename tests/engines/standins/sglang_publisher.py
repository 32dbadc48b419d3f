"""A stand-in for SGLang's ZmqEventPublisher, speaking its exact wire (SGLang cannot run on
these machines). Imports nothing of kvfold.

    python sglang_publisher.py --connect tcp://127.0.0.1:PORT --frames FILE [--count N]
                               [--skip SEQ ...] [--metrics PAGE]

FILE holds the live messages [topic, seq, payload] as a msgpack stream (the first N of
them are sent, all by default; a --skip SEQ is kept for replays but never sent live, as if
lost in transit). Like SGLang's publisher it binds a ROUTER for replays and connects its PUB
to the given endpoint (a "tcp://host:port" without "*" is connected to). Then:

  1. prints "REPLAY <endpoint>" on stdout, and with --metrics, serves the text file PAGE at
     GET /metrics on 127.0.0.1 (as SGLang's --enable-metrics does) and prints
     "METRICS <url>";
  2. until a "go" line arrives on stdin, sends [b"standin-hello", b"", b""] every 20 ms (so
     the subscriber can tell when the PUB/SUB link is up: nothing published before that
     is lost to ZMQ's slow joiner);
  3. publishes every message of FILE, in order, keeping each (seq, payload) for replay;
  4. answers replays until stdin closes or says "stop": a request [identity, b"",
     start_seq] gets [identity, b"", seq, payload] for every kept seq >= start_seq, then
     [identity, b"", ff * 8, b""], as SGLang's _service_replay does.

Every wait is bounded (--deadline-s); the process exits on its own when it runs out.
"""

from __future__ import annotations

import argparse
import selectors
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connect", required=True)
    parser.add_argument("--frames", required=True)
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--skip", type=int, action="append", default=[])
    parser.add_argument("--metrics", default=None)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline_s

    unpacker = msgpack.Unpacker(raw=False)
    with open(args.frames, "rb") as f:
        unpacker.feed(f.read())
    messages = [list(m) for m in unpacker][: args.count]

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 1000)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 1000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pub.connect(args.connect)
    print(f"REPLAY tcp://127.0.0.1:{port}", flush=True)
    if args.metrics:
        url = serve_metrics(Path(args.metrics).read_bytes())
        print(f"METRICS {url}", flush=True)

    stdin = selectors.DefaultSelector()
    stdin.register(sys.stdin, selectors.EVENT_READ)

    def stdin_line(timeout_s: float) -> str | None:
        """A line from stdin, "" at EOF, None if none came within timeout_s."""
        if not stdin.select(timeout=timeout_s):
            return None
        return sys.stdin.readline()

    while time.monotonic() < deadline:  # 2: hello until "go"
        pub.send_multipart([b"standin-hello", b"", b""])
        line = stdin_line(0.02)
        if line is not None:
            if line.strip() != "go":
                return 0
            break
    else:
        return 1

    kept: list[tuple[bytes, bytes]] = []
    for topic, seq, payload in messages:  # 3: publish
        if int.from_bytes(seq, "big") not in args.skip:
            pub.send_multipart([topic, seq, payload])
        kept.append((seq, payload))

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while time.monotonic() < deadline:  # 4: replays
        if dict(poller.poll(timeout=20)).get(router):
            frame = router.recv_multipart()
            if len(frame) == 3:
                identity, _, start = frame
                start_seq = int.from_bytes(start, "big")
                for seq, payload in kept:
                    if int.from_bytes(seq, "big") >= start_seq:
                        router.send_multipart([identity, b"", seq, payload])
                router.send_multipart([identity, b"", END_SEQ, b""])
        line = stdin_line(0)
        if line is not None and line.strip() in ("", "stop"):
            break
    pub.close()
    router.close()
    ctx.term()
    return 0


def serve_metrics(page: bytes) -> str:
    """GET /metrics answers `page` (Prometheus text), on a daemon thread; returns its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()  # fmt: skip
    return f"http://127.0.0.1:{server.server_address[1]}/metrics"


if __name__ == "__main__":
    sys.exit(main())
