"""`lynx-sglang bench-ttft --url`: measuring an already running cluster, end to end through the CLI.

The cluster is a stub: a small `http.server` on a real socket, in a thread, speaking the subset of
SGLang's native API the tool uses: `/generate` (plain JSON and streamed server-sent events, one
HTTP chunk per event, cumulative `output_ids` as SGLang streams them by default), `/flush_cache`,
and a Prometheus `/metrics` page with Lynx's stream-byte counters. It stands in for SGLang because
a real server (and its router) takes minutes to start on a small CPU box, too slow for the fast
suite; tests/sglang runs the tool's client against real servers. `--no-bench-serving` keeps
`sglang.bench_serving` out for the same reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lynx_tools.cli import main
from lynx_tools.ttft.bench import LAUNCH_DEFAULTS, add_arguments, check_arguments
from lynx_tools.ttft.clients import stream_byte_counters
from lynx_tools.ttft.results import LYNX_CLIENT

ANCHOR_BYTES, RESIDUAL_BYTES = 1000, 3000  # per streamed request, as the stub counts them


@dataclass
class StubState:
    """What the stub serves and what it was asked, for the test to check."""

    metrics: bool = True
    generate_bodies: list[dict] = field(default_factory=list)
    flushes: int = 0
    streamed: int = 0
    # Set by a test: the first streamed requests wait here for each other, so they must have been
    # sent at once (a request sent after another's end breaks the barrier).
    together: threading.Barrier | None = None


class StubSGLang(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streaming, as SGLang's uvicorn sends it

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes, last: bool = False) -> None:
        # The end of the body goes with the last event: the client hangs up once it has [DONE].
        end = b"0\r\n\r\n" if last else b""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" + end)
        self.wfile.flush()

    def do_POST(self) -> None:
        state = self.server.state
        body = self.rfile.read(int(self.headers["content-length"] or 0))
        if self.path.startswith("/flush_cache"):
            state.flushes += 1
            self._send(200, b"Cache flushed.\n", "text/plain")
            return
        if self.path != "/generate":
            self._send(404, b"{}")
            return
        req = json.loads(body)
        state.generate_bodies.append(req)
        n = req["sampling_params"]["max_new_tokens"]
        ids = [7 + i for i in range(n)]
        meta = {"id": req.get("rid", "x"), "prompt_tokens": len(req["input_ids"]),
                "cached_tokens": 0}
        if not req.get("stream"):
            done = meta | {"completion_tokens": n, "finish_reason": {"type": "length"}}
            self._send(200, json.dumps({"text": "w" * n, "output_ids": ids,
                                        "meta_info": done}).encode())
            return
        state.streamed += 1
        if state.together is not None and state.streamed <= state.together.parties:
            try:
                state.together.wait()
            except threading.BrokenBarrierError:
                self._send(500, b'{"error": "requests of one round not sent at once"}')
                return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for k in range(1, n + 1):
            time.sleep(0.002)  # tokens arrive one after the other
            event = {"text": "t" * k, "output_ids": ids[:k],
                     "meta_info": meta | {"completion_tokens": k, "finish_reason":
                                          {"type": "length"} if k == n else None}}
            self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n", last=True)

    def do_GET(self) -> None:
        state = self.server.state
        if self.path != "/metrics" or not state.metrics:
            self._send(404, b'{"detail": "Not Found"}')
            return
        labels = 'model_name="stub",role="decode",tp_rank="0"'
        page = ["# HELP lynx_stream_bytes_total KV bytes received per Lynx stream (decode)",
                "# TYPE lynx_stream_bytes_total counter",
                *(f'lynx_stream_bytes_total{{{labels},stream="{s}"}} {b * state.streamed:.1f}'
                  for s, b in (("anchor", ANCHOR_BYTES), ("residual", RESIDUAL_BYTES)))]
        self._send(200, ("\n".join(page) + "\n").encode(), "text/plain; version=0.0.4")


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubSGLang)
    server.state = StubState()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer folder: --model with --url reads only the tokenizer."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "Item", "the", "value", "of", "key", "is", "Question", "what", "Answer",
             ":", "?", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_bench_ttft_url_measures_a_running_cluster(stub_url, tokenizer_dir, tmp_path):
    url, stub = stub_url
    requests_n, new_tokens = 2, 6
    proc = subprocess.run(
        [sys.executable, "-m", "lynx_tools.cli", "bench-ttft", "--url", url,
         "--label", "stub", "--model", str(tokenizer_dir), "--no-bench-serving",
         "--prompt-tokens", "64", "--max-new-tokens", str(new_tokens),
         "--requests", str(requests_n), "--token-marks", "2,6", "--out", str(tmp_path),
         "--request-timeout-s", "30"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Progress on stderr, results on stdout.
    assert f"variant 1/1 stub: measuring the running cluster at {url}" in proc.stderr
    assert f"request {requests_n}/{requests_n}" in proc.stderr
    assert "unavailable for an already running cluster" in proc.stdout

    doc = json.loads((tmp_path / "bench_ttft.json").read_text())
    cfg = doc["config"]
    assert cfg["url"] == url and cfg["use_bench_serving"] is False and cfg["complete"] is True
    assert cfg["variants"] == ["stub"] and cfg["link"] is None and cfg["kv_dtype"] is None
    assert cfg["variant_specs"][0]["transfer_backend"] == "unknown"
    result = doc["variants"]["stub"]
    client = result["requests"][LYNX_CLIENT]
    assert len(client) == requests_n and result["requests"]["bench_serving"] == []
    for r in client:
        assert r["prompt_tokens"] == 64 and r["output_tokens"] == new_tokens
        assert 0 < r["ttft_s"] <= r["token_s"]["2"] <= r["token_s"]["6"]
        # Trace-record fields stay empty instead of being made up.
        assert r["prefill_done_s"] is None and r["network_ttft_s"] is None
        assert r["stages"] is None and r["lynx_events_s"] == {}
    # No prefill line, so no token times from prefill done; the time per token needs none.
    assert set(result["medians"]) == {f"{LYNX_CLIENT}.{k}"
                                      for k in ("ttft_s", "t2_s", "t6_s", "tpot_s")}
    assert result["stream_bytes"] == {"anchor": ANCHOR_BYTES, "residual": RESIDUAL_BYTES}
    assert result["bytes_measured"] is True
    assert result["same_text_both_clients"] is None and result["server_config"] is None
    assert any("net TTFT" in why for why in result["unavailable"])
    assert not any("bytes per stream" in why for why in result["unavailable"])
    assert doc["ratios"] == {}
    assert (tmp_path / "bench_ttft.png").is_file()

    # The stub saw the warm-up and the streamed prompts, each after a flush of the caches.
    warmup, *streamed = stub.generate_bodies
    assert not warmup.get("stream") and len(streamed) == requests_n
    assert all(b["stream"] and b["sampling_params"]["ignore_eos"] and b["rid"] for b in streamed)
    assert stub.flushes >= requests_n


def test_bench_ttft_concurrency_sends_rounds_at_once(stub_url, tokenizer_dir, tmp_path):
    """--concurrency 2 with 3 requests: a round of two sent at once (both in flight together, or
    the stub's barrier fails them), then a round of one; the cache flushed before each round."""
    url, stub = stub_url
    stub.together = threading.Barrier(2, timeout=10)
    proc = subprocess.run(
        [sys.executable, "-m", "lynx_tools.cli", "bench-ttft", "--url", url,
         "--label", "stub", "--model", str(tokenizer_dir), "--no-bench-serving",
         "--prompt-tokens", "64", "--max-new-tokens", "4", "--requests", "3",
         "--concurrency", "2", "--token-marks", "2,4", "--out", str(tmp_path),
         "--request-timeout-s", "30"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in rounds of 2 sent at once" in proc.stdout
    doc = json.loads((tmp_path / "bench_ttft.json").read_text())
    assert doc["config"]["concurrency"] == 2
    client = doc["variants"]["stub"]["requests"][LYNX_CLIENT]
    assert [r["index"] for r in client] == [0, 1, 2]
    assert all(r["output_tokens"] == 4 for r in client)
    assert len(stub.generate_bodies) == 1 + 3 and stub.flushes == 2  # the warm-up, then 3


def test_stream_byte_counters_of_a_metrics_page(stub_url):
    url, stub = stub_url
    stub.streamed = 2
    assert stream_byte_counters(url) == {"anchor": 2 * ANCHOR_BYTES,
                                         "residual": 2 * RESIDUAL_BYTES}
    stub.metrics = False  # a router, or a server without --enable-metrics
    assert stream_byte_counters(url) is None
    assert stream_byte_counters("http://127.0.0.1:9") is None  # nothing listens there


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://x", "--link", "1gbit", "--variants", "lynx"],
     "--variants, --link: only for the clusters bench-ttft starts itself"),
    (["--url", "http://x", "--kv-dtype", "float32"], "--kv-dtype: only for the clusters"),
    (["--label", "a", "--metrics-url", "http://y"], "--label, --metrics-url: only with --url"),
    (["--url", "http://x", "--interleave"], "--interleave: only for the clusters"),
    (["--url", "http://x", "--disable-overlap-schedule"],
     "--disable-overlap-schedule: only for the clusters"),
    (["--interleave", "--variants", "mooncake,lynx"], "--interleave needs --no-bench-serving"),
    (["--interleave", "--no-bench-serving", "--variants", "lynx", "--baseline", "lynx"],
     "--interleave needs two variants or more"),
])
def test_url_excludes_the_launch_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench-ttft", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_launch_defaults_without_url():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--link", "10mbit"])
    check_arguments(parser, args)
    assert args.link == "10mbit" and args.url is None and args.label is None
    assert {k: getattr(args, k) for k in LAUNCH_DEFAULTS if k != "link"} == {
        k: v for k, v in LAUNCH_DEFAULTS.items() if k != "link"}


def test_bench_serving_record_reads_the_last_record_or_names_the_log(tmp_path):
    """The one runner of `sglang.bench_serving` for bench-ttft and bench-load: the last JSONL
    record of a run that wrote one (an earlier file is not appended to), a BenchError naming what
    ran and its log otherwise."""
    from lynx_tools.ttft.clients import bench_serving_record
    from lynx_tools.ttft.results import BenchError

    out, log = tmp_path / "out.jsonl", tmp_path / "run.log"
    out.write_text('{"stale": 1}\n')
    write = ("import json, sys; f = open(sys.argv[1], 'a'); "
             "[f.write(json.dumps({'n': i}) + '\\n') for i in range(2)]; print('ran')")
    assert bench_serving_record([sys.executable, "-c", write, str(out)], out, log, 60,
                                "x") == {"n": 1}
    assert log.read_text().strip() == "ran"
    with pytest.raises(BenchError, match=r"lynx at 0\.1 req/s: bench_serving exited with 3; log"):
        bench_serving_record([sys.executable, "-c", "raise SystemExit(3)"], out, log, 60,
                             "lynx at 0.1 req/s")
    with pytest.raises(BenchError, match="exited with 0"):  # a run that wrote no record
        bench_serving_record([sys.executable, "-c", "pass"], out, log, 60, "x")


def test_a_shared_prefix_workload_replaces_the_random_prompts(tmp_path):
    """bench-load --workload rag: bench_serving's generated-shared-prefix dataset with the
    documents' and questions' sizes, one request per question, instead of random-id prompts."""
    from lynx_tools.ttft.clients import SharedPrefixWorkload, bench_serving_command

    rag = SharedPrefixWorkload(docs=3, questions_per_doc=5, doc_tokens=1500, question_tokens=32)
    cmd = bench_serving_command("http://x", tmp_path, 999, 16, 2, 7, tmp_path / "o.jsonl",
                                request_rate=0.1, shared_prefix=rag)

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--dataset-name") == "generated-shared-prefix"
    assert (value("--gsp-num-groups"), value("--gsp-prompts-per-group"),
            value("--gsp-system-prompt-len"), value("--gsp-question-len"),
            value("--gsp-output-len"), value("--num-prompts")) == ("3", "5", "1500", "32", "16",
                                                                   "15")
    assert "--random-input-len" not in cmd and "--tokenize-prompt" in cmd
    plain = bench_serving_command("http://x", tmp_path, 999, 16, 2, 7, tmp_path / "o.jsonl")
    assert plain[plain.index("--dataset-name") + 1] == "random-ids"
    assert plain[plain.index("--random-input-len") + 1] == "999"
