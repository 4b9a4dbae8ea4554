"""Serving under load: concurrent streaming clients against `cullama serve --max-batch B`, the way `vllm bench
serve` reports it: time to first token, time between tokens (p50 / p99) and aggregate tokens/s per concurrency.

    python benchmarks/serve_load.py [--model DIR | --synthetic PRESET [--tokenizer PATH]] [--device auto]
                                    [--concurrency 1,2,4,8,16] [--tokens 128] [--rounds 2] [--max-batch 8]
                                    [--json FILE]

The server runs as its own process (127.0.0.1, a free port) on a checkpoint directory (default stories260K in
../shared) or random weights of a preset (--synthetic llama-2-7b, with --tokenizer's pieces). For each
concurrency C, after one untimed request: C client threads each stream `rounds` requests one after another
(/v1/completions, prompt BOS, greedy, EOS ignored, --tokens tokens), all starting together. Per level: TTFT
(send to first chunk) p50 / p99, inter-token gap (chunk to chunk) p50 / p99, tokens/s of all the clients together
(tokens over the level's wall time) and per client. The issue 17 targets on an H200 (benchmarks/PREDICTIONS.md):
at C = 8, the inter-token p99 at most 1.3x that at C = 1 and the aggregate tokens/s at least 6x. On the CPU (the
kernels' NumPy twins) it is a smoke run; CI runs it so (tests/benchmarks/test_benchmark_scripts.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from gemv_sweep import positive_int, positive_ints, save_json  # benchmarks/ on sys.path
from serve_latency import CLI, SHARED, Server, percentile


def serve_synthetic(name: str, tokenizer: str, device: str, max_batch: int) -> int:
    """The server process of --synthetic: `cullama serve`'s own code on random weights, max_batch slots."""
    from cullama import Llama
    from cullama.model.config import preset
    from cullama.common.errors import CullamaError
    from cullama.server.app import Settings
    from cullama.server.launch import run
    from cullama.text.tokenizer import Tokenizer

    def load():  # as serve_latency.synthetic_llm, with max_batch sequence slots
        base = Llama.synthetic(name, device=device, max_batch=max_batch)
        tok = Tokenizer(tokenizer)
        if tok.vocab_size != base.config.vocab_size:
            raise CullamaError(f"{tokenizer} has {tok.vocab_size} pieces, the {name} preset {base.config.vocab_size}")
        return Llama(base.config, base.runner, tok, base.device)

    settings = Settings(model_name=name, context=preset(name).max_seq_len)
    return run(load, settings, "127.0.0.1", 0, max_queue=64, max_batch=max_batch)


def level(server: Server, concurrency: int, tokens: int, rounds: int) -> dict:
    """One concurrency level: every request's TTFT, every gap between chunks, the tokens, the wall time."""
    ttft, gaps, counts, errors = [], [], [], []
    lock = threading.Lock()
    start = threading.Barrier(concurrency)

    def client():
        start.wait()
        for _ in range(rounds):
            try:
                first, arrivals, n = server.stream(tokens)
            except BaseException as exc:  # noqa: BLE001 - reported with the level, not lost in a thread
                with lock:
                    errors.append(repr(exc))
                return
            with lock:
                ttft.append(first * 1e3)
                gaps.extend((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]))
                counts.append(n)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if errors:
        sys.exit(f"serve_load: a client failed at concurrency {concurrency}: {errors[0]}")
    total = sum(counts)
    return {"concurrency": concurrency, "ttft_ms": ttft, "gap_ms": gaps, "tokens": counts, "wall_s": wall,
            "summary": {"ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
                        "gap_ms_p50": statistics.median(gaps) if gaps else None,
                        "gap_ms_p99": percentile(gaps, 0.99) if gaps else None,
                        "gap_ms_max": max(gaps) if gaps else None,  # the worst gap: a join's prefill chunk, say
                        "tokens_per_s": total / wall, "tokens_per_s_per_client": total / wall / concurrency}}


HEADER = (f"{'C':>3} {'requests':>8} | {'TTFT p50':>9} {'p99':>9} | {'gap p50':>8} {'p99':>8} | "
          f"{'tok/s':>8} {'/client':>8}")


def table_line(row: dict) -> str:
    s = row["summary"]
    gap = (f"{s['gap_ms_p50']:>8.2f} {s['gap_ms_p99']:>8.2f}" if s["gap_ms_p50"] is not None else f"{'-':>8} {'-':>8}")
    return (f"{row['concurrency']:>3} {len(row['tokens']):>8} | {s['ttft_ms_p50']:>9.2f} {s['ttft_ms_p99']:>9.2f} | "
            f"{gap} | {s['tokens_per_s']:>8.1f} {s['tokens_per_s_per_client']:>8.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory with its tokenizer [default: stories260K in ../shared]")
    parser.add_argument("--synthetic", metavar="PRESET", help="random weights of a preset instead of --model")
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "llama2" / "tokenizer.model"),
                        help="the tokenizer of --synthetic")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 2, 4, 8, 16], help="clients at once")
    parser.add_argument("--tokens", type=positive_int, default=128, help="tokens generated per request")
    parser.add_argument("--rounds", type=positive_int, default=2, help="requests per client per level")
    parser.add_argument("--max-batch", type=positive_int, default=8, help="the server's --max-batch")
    parser.add_argument("--json", metavar="FILE", help="write every sample and the summary here")
    parser.add_argument("--serve-synthetic", help=argparse.SUPPRESS)  # the server process of --synthetic
    args = parser.parse_args(argv)
    if args.serve_synthetic:
        return serve_synthetic(args.serve_synthetic, args.tokenizer, args.device, args.max_batch)
    if args.model and args.synthetic:
        parser.error("give --model or --synthetic, not both")
    model = args.model or str(SHARED / "models" / "stories260K")
    if args.synthetic:
        command = [sys.executable, __file__, "--serve-synthetic", args.synthetic, "--tokenizer", args.tokenizer,
                   "--device", args.device, "--max-batch", str(args.max_batch)]
    else:
        command = [sys.executable, "-c", CLI, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                   "--device", args.device, "--max-batch", str(args.max_batch), "--max-queue", "64"]
    name = args.synthetic or Path(model).name
    record = {"model": name, "device": args.device, "max_batch": args.max_batch, "rows": []}
    with tempfile.TemporaryDirectory() as log_dir:
        server = Server(command, log_dir)
        try:
            print(f"serve_load: {name}, --max-batch {args.max_batch}, {args.tokens} tokens per request, "
                  f"{args.rounds} per client (prompt BOS, greedy, EOS ignored); ms")
            server.stream(min(args.tokens, 4))  # warm-up: kernels, plans, connections
            print(HEADER)
            for concurrency in args.concurrency:
                record["rows"].append(level(server, concurrency, args.tokens, args.rounds))
                print(table_line(record["rows"][-1]), flush=True)
                if args.json:
                    save_json(args.json, record, args, complete=False)
        finally:
            server.stop()
    rows = {r["concurrency"]: r["summary"] for r in record["rows"]}
    if 1 in rows and 8 in rows and rows[1]["gap_ms_p99"] and rows[8]["gap_ms_p99"]:
        print(f"C=8 against C=1: inter-token p99 {rows[8]['gap_ms_p99'] / rows[1]['gap_ms_p99']:.2f}x (target on an "
              f"H200 <= 1.3x), tokens/s {rows[8]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x (target >= 6x)")
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
