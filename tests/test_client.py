"""lynx_tools.client against a small `http.server` stub on a real socket (a real SGLang
server is too slow to start for the fast suite; tests/sglang use the client against real ones):
incremental streams, and every failure surfacing as GenerateError with a message that says what
went wrong — HTTP errors, an error or abort event, an empty stream, a read past the timeout, and a
refused connection."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lynx_tools.client import GenerateError, generate, generate_stream

# The events the stub streams for POST /<mode>/generate.
EVENTS = {
    "incremental": [{"output_ids": [5, 6], "text": "ab",
                     "meta_info": {"completion_tokens": 3, "prompt_tokens": 4}},
                    {"output_ids": [7], "text": "c",
                     "meta_info": {"completion_tokens": 3, "prompt_tokens": 4,
                                   "cached_tokens": 2}}],
    "error": [{"error": {"message": "boom"}}],
    "abort": [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort",
                                                                 "message": "no KV"}}}],
    "empty": [],
}


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        mode = self.path.strip("/").split("/")[0]
        if mode == "http500":
            body = b'{"detail": "server fell over"}'
            self.send_response(500)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if mode == "slow":  # the client gives up first: nothing to answer
            time.sleep(1.0)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in EVENTS.get(mode, []):
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.fixture(scope="module")
def base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_incremental_stream(base):
    got = generate_stream(f"{base}/incremental", input_ids=[1, 2, 3, 4], timeout_s=10)
    assert got.output_ids == [5, 6, 7] and got.text == "abc"
    assert got.prompt_tokens == 4 and got.cached_tokens == 2
    assert len(got.t_tokens) == 3 and got.t_send <= got.t_first_token <= got.t_last_token


@pytest.mark.parametrize("mode, message", [
    ("http500", "HTTP 500: b'{\"detail\": \"server fell over\"}'"),
    ("error", "server error: {'message': 'boom'}"),
    ("abort", "request aborted: no KV"),
    ("empty", "the stream carried no output token"),
])
def test_stream_failures(base, mode, message):
    with pytest.raises(GenerateError) as exc:
        generate_stream(f"{base}/{mode}", input_ids=[1], timeout_s=10)
    assert str(exc.value) == message


def test_generate_http_error(base):
    with pytest.raises(GenerateError, match=r"HTTP 500: .*server fell over"):
        generate(f"{base}/http500", text="hi", timeout_s=10)


def test_timeout_and_refused_connection(base):
    t0 = time.monotonic()
    with pytest.raises(GenerateError, match=r"request to .* failed: .*timed out"):
        generate_stream(f"{base}/slow", input_ids=[1], timeout_s=0.2)
    assert time.monotonic() - t0 < 0.9  # the read timeout ended the wait, not the answer
    with pytest.raises(GenerateError, match=re.escape("request to http://127.0.0.1:9 failed")):
        generate("http://127.0.0.1:9", text="hi", timeout_s=5)
