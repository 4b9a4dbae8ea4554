"""Server overhead: the time between streamed chunks at an HTTP client against Llama.stream's own per-token times.

    python benchmarks/serve_latency.py [--model DIR | --synthetic PRESET [--tokenizer PATH]] [--device auto]
                                       [--lengths 64,256] [--requests 5] [--json FILE]

`cullama serve` runs as a process of its own (127.0.0.1, a free port) on the model: a checkpoint
directory (default: ../shared/models/stories260K), or random weights of a preset made on the device
(`--synthetic llama-2-7b`, no download; the text side is --tokenizer, default the LLaMA-2 one in
../shared). For each length L, --requests times, untimed warm-up first:
- stream: `Llama.stream` in this process on the same weights (the server idle): each token's time
  after the first (Generation.timings.token_s), and the prefill;
- engine: the same generation inside the server: its own per-token times, from /metrics (the sum and
  count of cullama_time_between_tokens_seconds before and after the request);
- client: a raw HTTP client streams /v1/completions (BOS, greedy, EOS ignored, L tokens) and notes when
  each SSE chunk arrives.
`added` is the client's time per token (first to last chunk, over the tokens between) minus stream's
mean: what serving adds to each token. Issue 10's target, on a GPU: no more than 0.2 ms. On the CPU
(the kernels' NumPy twins) the script runs the same way, which CI uses as a smoke test; its figures
say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gemv_sweep import positive_int, positive_ints, save_json  # benchmarks/ on sys.path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CULLAMA_SHARED") or REPO.parent / "shared")
CLI = "from cullama.cli.main import main; main()"  # the `cullama` command, this Python's
TOKEN_TIME = "cullama_time_between_tokens_seconds"


def synthetic_llm(name: str, tokenizer: str, device: str):
    """Random weights of preset `name` (seed 0: the server and this process make the same ones) with a
    real tokenizer, so that the server has text to send."""
    from cullama import Llama
    from cullama.common.errors import CullamaError
    from cullama.text.tokenizer import Tokenizer

    base = Llama.synthetic(name, device=device)
    tok = Tokenizer(tokenizer)
    if tok.vocab_size != base.config.vocab_size:
        raise CullamaError(f"{tokenizer} has {tok.vocab_size} pieces, the {name} preset {base.config.vocab_size}")
    return Llama(base.config, base.runner, tok, base.device)


def serve_synthetic(name: str, tokenizer: str, device: str) -> int:
    """The server process of --synthetic: `cullama serve`'s own code, loading random weights."""
    from cullama.model.config import preset
    from cullama.server.app import Settings
    from cullama.server.launch import run

    settings = Settings(model_name=name, context=preset(name).max_seq_len)
    return run(lambda: synthetic_llm(name, tokenizer, device), settings, "127.0.0.1", 0, max_queue=4)


class Server:
    """The server process: started, its URL read from its log, ready once /health says 200."""

    prefix = ""  # before the API's paths (serve_load.py's --url with a path: a Ray Serve application's route prefix)

    def __init__(self, command: list[str], log_dir: str, timeout: float = 600):
        self.log_path = Path(log_dir) / "server.log"
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"listening on http://([\d.]+):(\d+)", self.text())):
            self._alive(deadline)
        self.host, self.port = found.group(1), int(found.group(2))
        while self.get("/health")[0] != 200:
            self._alive(deadline)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _alive(self, deadline: float) -> None:
        if self.process.poll() is not None:
            sys.exit(f"serve_latency: the server exited with {self.process.returncode}:\n{self.text()}")
        if time.monotonic() > deadline:
            sys.exit(f"serve_latency: the server was not ready in time:\n{self.text()}")
        time.sleep(0.05)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def token_times(self) -> tuple[float, int]:
        """The engine's (sum of seconds, count) of time between tokens so far."""
        text = self.get("/metrics")[1].decode()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(TOKEN_TIME + "_"))
        return float(values[TOKEN_TIME + "_sum"]), int(values[TOKEN_TIME + "_count"])

    def stream(self, length: int) -> tuple[float, list[float], int]:
        """(seconds from sending to the first chunk, arrival time of each chunk with text, tokens generated)."""
        body = {"prompt": [1], "max_tokens": length, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            sent = time.perf_counter()
            conn.request("POST", self.prefix + "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                sys.exit(f"serve_latency: the server answered {response.status}: {response.read()[:300]!r}")
            arrivals, tokens = [], 0
            while line := response.readline():
                now = time.perf_counter()
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(now)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            return arrivals[0] - sent, arrivals, tokens
        finally:
            conn.close()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


def ms(seconds: list[float]) -> list[float]:
    return [s * 1e3 for s in seconds]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(server: Server, llm, length: int, requests: int) -> dict:
    """One length: `requests` runs of Llama.stream here and of the same request through the server."""
    row = {"length": length, "stream_token_ms": [], "stream_ttft_ms": [], "engine_token_ms_mean": [],
           "client_gap_ms": [], "client_token_ms_mean": [], "client_ttft_ms": [], "chunks": [], "tokens": []}
    for _ in range(requests):
        stream = llm.stream([1], max_new_tokens=length, ignore_eos=True)
        for _ in stream:
            pass
        row["stream_token_ms"] += ms(stream.result.timings.token_s)
        row["stream_ttft_ms"].append(stream.result.timings.prefill_s * 1e3)
        (sum_before, count_before) = server.token_times()
        ttft, arrivals, tokens = server.stream(length)
        (sum_after, count_after) = server.token_times()
        row["engine_token_ms_mean"].append((sum_after - sum_before) / max(count_after - count_before, 1) * 1e3)
        row["client_gap_ms"] += ms([b - a for a, b in zip(arrivals, arrivals[1:])])
        row["client_token_ms_mean"].append((arrivals[-1] - arrivals[0]) / max(tokens - 1, 1) * 1e3)
        row["client_ttft_ms"].append(ttft * 1e3)
        row["chunks"].append(len(arrivals))
        row["tokens"].append(tokens)
    stream_mean = statistics.fmean(row["stream_token_ms"])
    client_mean = statistics.fmean(row["client_token_ms_mean"])
    row["summary"] = {
        "stream_token_ms_p50": statistics.median(row["stream_token_ms"]), "stream_token_ms_mean": stream_mean,
        "engine_token_ms_mean": statistics.fmean(row["engine_token_ms_mean"]),
        "client_gap_ms_p50": statistics.median(row["client_gap_ms"]),
        "client_gap_ms_p99": percentile(row["client_gap_ms"], 0.99), "client_token_ms_mean": client_mean,
        "added_ms_per_token": client_mean - stream_mean,
        "stream_ttft_ms_p50": statistics.median(row["stream_ttft_ms"]),
        "client_ttft_ms_p50": statistics.median(row["client_ttft_ms"]),
    }
    return row


HEADER = (f"{'L':>5} {'tokens':>6} {'chunks':>6} | {'stream p50':>10} {'mean':>7} | {'engine mean':>11} | "
          f"{'client p50':>10} {'p99':>7} {'mean':>7} | {'added':>7} | {'TTFT stream':>11} {'client':>7}")


def table_line(row: dict) -> str:
    s = row["summary"]
    return (f"{row['length']:>5} {statistics.median(row['tokens']):>6.0f} {statistics.median(row['chunks']):>6.0f} | "
            f"{s['stream_token_ms_p50']:>10.3f} {s['stream_token_ms_mean']:>7.3f} | "
            f"{s['engine_token_ms_mean']:>11.3f} | "
            f"{s['client_gap_ms_p50']:>10.3f} {s['client_gap_ms_p99']:>7.3f} {s['client_token_ms_mean']:>7.3f} | "
            f"{s['added_ms_per_token']:>7.3f} | {s['stream_ttft_ms_p50']:>11.3f} {s['client_ttft_ms_p50']:>7.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory with its tokenizer.model [default: stories260K in "
                                        "../shared]")
    parser.add_argument("--synthetic", metavar="PRESET", help="random weights of a preset instead of --model")
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "llama2" / "tokenizer.model"),
                        help="the tokenizer of --synthetic")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--lengths", type=positive_ints, default=[64, 256], help="tokens generated per request")
    parser.add_argument("--requests", type=positive_int, default=5, help="timed requests per length")
    parser.add_argument("--json", metavar="FILE", help="write every sample and the summary here")
    parser.add_argument("--serve-synthetic", help=argparse.SUPPRESS)  # the server process of --synthetic
    args = parser.parse_args(argv)
    if args.serve_synthetic:
        return serve_synthetic(args.serve_synthetic, args.tokenizer, args.device)
    if args.model and args.synthetic:
        parser.error("give --model or --synthetic, not both")

    from cullama import Llama
    from cullama.common.errors import CullamaError

    model = args.model or str(SHARED / "models" / "stories260K")
    try:
        llm = (synthetic_llm(args.synthetic, args.tokenizer, args.device) if args.synthetic else
               Llama.from_pretrained(model, device=args.device))
    except CullamaError as exc:
        sys.exit(f"serve_latency: {exc}")
    if max(args.lengths) >= llm.runner.max_seq_len:
        parser.error(f"--lengths must stay under the context ({llm.runner.max_seq_len})")
    if args.synthetic:
        command = [sys.executable, __file__, "--serve-synthetic", args.synthetic, "--tokenizer", args.tokenizer,
                   "--device", llm.device]
    else:
        command = [sys.executable, "-c", CLI, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                   "--device", llm.device]
    name = args.synthetic or Path(model).name
    with tempfile.TemporaryDirectory() as log_dir:
        server = Server(command, log_dir)
        try:
            print(f"serve_latency: {name} on {llm.device}, {args.requests} requests per length (prompt BOS, greedy, "
                  "EOS ignored); ms")
            if llm.device == "cpu":
                print("(the CPU runs the kernels' NumPy twins: a smoke run; the 0.2 ms target is for a GPU)")
            measure(server, llm, min(args.lengths), 1)  # warm-up: kernels, plans, connections
            print(HEADER)
            rows = []
            for length in args.lengths:
                rows.append(measure(server, llm, length, args.requests))
                print(table_line(rows[-1]), flush=True)
                if args.json:
                    save_json(args.json, {"model": name, "device": llm.device, "rows": rows}, args, complete=False)
        finally:
            server.stop()
    print("added = client ms per token - stream mean ms per token (target on a GPU: <= 0.2)")
    if args.json:
        save_json(args.json, {"model": name, "device": llm.device, "rows": rows}, args, complete=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
