"""Serving under load: concurrent streaming clients against `cullama serve --max-batch B`, the way `vllm bench
serve` reports it: time to first token, time between tokens (p50 / p99) and aggregate tokens/s per concurrency.

    python benchmarks/serve_load.py [--model DIR | --synthetic PRESET [--tokenizer PATH]] [--device auto]
                                    [--concurrency 1,2,4,8,16] [--tokens 128] [--rounds 2] [--max-batch 8]
                                    [--compare [--replicas 1] | --url URL [--url URL ...]] [--repeats 1]
                                    [--json FILE]

The server runs as its own process (127.0.0.1, a free port) on a checkpoint directory (default stories260K in
../shared) or random weights of a preset (--synthetic llama-2-7b, with --tokenizer's pieces). For each
concurrency C, after one untimed request: C client threads each stream `rounds` requests one after another
(/v1/completions, prompt BOS, greedy, EOS ignored, --tokens tokens), all starting together. Per level: TTFT
(send to first chunk) p50 / p99, inter-token gap (chunk to chunk) p50 / p99, tokens/s of all the clients together
(tokens over the level's wall time) and per client. The issue 17 targets on an H200 (benchmarks/PREDICTIONS.md):
at C = 8, the inter-token p99 at most 1.3x that at C = 1 and the aggregate tokens/s at least 6x. On the CPU (the
kernels' NumPy twins) it is a smoke run; CI runs it so (tests/benchmarks/test_benchmark_scripts.py).

Side by side (issue 28: what Ray Serve's layer costs): --compare starts `cullama serve` and `cullama serve --replicas
R` (the ray extra; a local Ray cluster) with the same model and options; --url measures servers already running
instead (each URL one, the first the reference). Their requests are interleaved, one round of a level on each in
turn (at C = 1 request by request), so that both see the same load of the machine; each path's line, then each
other path against the first: TTFT p50 / p99 added (ms), gap p50 / p99 as a multiple, and `bunched`, the share of
its gaps shorter than a quarter of the reference's median gap (chunks held back and sent together: bursts).
--repeats N runs it all N times and ends with the medians of the runs' comparisons.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

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
    return summarize({"concurrency": concurrency, "ttft_ms": ttft, "gap_ms": gaps, "tokens": counts, "wall_s": wall})


def summarize(row: dict) -> dict:
    """The row with its summary (of its samples)."""
    ttft, gaps, total, wall = row["ttft_ms"], row["gap_ms"], sum(row["tokens"]), row["wall_s"]
    return {**row, "summary": {
        "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p99": percentile(ttft, 0.99),
        "gap_ms_p50": statistics.median(gaps) if gaps else None,
        "gap_ms_p99": percentile(gaps, 0.99) if gaps else None,
        "gap_ms_max": max(gaps) if gaps else None,  # the worst gap: a join's prefill chunk, say
        "tokens_per_s": total / wall, "tokens_per_s_per_client": total / wall / row["concurrency"]}}


def interleaved(servers: dict[str, Server], concurrency: int, tokens: int, rounds: int) -> dict[str, dict]:
    """One level on every server, a round on each in turn: {name: its row, the rounds' samples together}."""
    parts: dict[str, list[dict]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name, server in servers.items():
            parts[name].append(level(server, concurrency, tokens, 1))
    return {name: summarize({"concurrency": concurrency,
                             **{key: [v for row in rows for v in row[key]] for key in ("ttft_ms", "gap_ms", "tokens")},
                             "wall_s": sum(row["wall_s"] for row in rows)})
            for name, rows in parts.items()}


def against(row: dict, reference: dict) -> dict:
    """A path's row against the reference path's at the same level."""
    s, r = row["summary"], reference["summary"]
    quarter = r["gap_ms_p50"] / 4
    return {"ttft_p50_added_ms": s["ttft_ms_p50"] - r["ttft_ms_p50"],
            "ttft_p99_added_ms": s["ttft_ms_p99"] - r["ttft_ms_p99"],
            "gap_p50_ratio": s["gap_ms_p50"] / r["gap_ms_p50"], "gap_p99_ratio": s["gap_ms_p99"] / r["gap_ms_p99"],
            "bunched": sum(g < quarter for g in row["gap_ms"]) / len(row["gap_ms"]),
            "reference_bunched": sum(g < quarter for g in reference["gap_ms"]) / len(reference["gap_ms"])}


def against_line(name: str, reference: str, c: dict) -> str:
    return (f"    {name} against {reference}: TTFT p50 {c['ttft_p50_added_ms']:+.2f} ms, p99 "
            f"{c['ttft_p99_added_ms']:+.2f} ms; gap p50 x{c['gap_p50_ratio']:.3f}, p99 x{c['gap_p99_ratio']:.3f}; "
            f"bunched {c['bunched']:.3f} ({reference} {c['reference_bunched']:.3f})")


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
    parser.add_argument("--compare", action="store_true", help="`cullama serve` against `cullama serve --replicas "
                                                               "R` (Ray Serve), interleaved")
    parser.add_argument("--replicas", type=positive_int, default=1, help="R of --compare")
    parser.add_argument("--url", action="append", default=[], help="a server already running (repeatable; the "
                                                                   "first is the reference; a path: before /v1)")
    parser.add_argument("--repeats", type=positive_int, default=1, help="run everything this many times")
    parser.add_argument("--json", metavar="FILE", help="write every sample and the summary here")
    parser.add_argument("--serve-synthetic", help=argparse.SUPPRESS)  # the server process of --synthetic
    args = parser.parse_args(argv)
    if args.serve_synthetic:
        return serve_synthetic(args.serve_synthetic, args.tokenizer, args.device, args.max_batch)
    if args.model and args.synthetic:
        parser.error("give --model or --synthetic, not both")
    if args.url and (args.compare or args.model or args.synthetic):
        parser.error("--url measures servers already running: give no --model, --synthetic or --compare with it")
    if args.compare and args.synthetic:
        parser.error("--compare serves a checkpoint directory (--model), not --synthetic")
    model = args.model or str(SHARED / "models" / "stories260K")
    serve = [sys.executable, "-c", CLI, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
             "--device", args.device, "--max-batch", str(args.max_batch), "--max-queue", "64"]
    if args.url:
        commands = {(urlsplit(u).netloc + urlsplit(u).path).rstrip("/"): u for u in args.url}
    elif args.synthetic:
        commands = {"direct": [sys.executable, __file__, "--serve-synthetic", args.synthetic, "--tokenizer",
                               args.tokenizer, "--device", args.device, "--max-batch", str(args.max_batch)]}
    else:
        commands = {"direct": serve}
        if args.compare:
            commands[f"ray-{args.replicas}"] = serve + ["--replicas", str(args.replicas)]
    name = args.synthetic or Path(model).name
    record = {"model": name, "device": args.device, "max_batch": args.max_batch, "rows": [], "paths": list(commands),
              "runs": []}
    several = len(commands) > 1
    with tempfile.TemporaryDirectory() as log_dir:
        servers: dict[str, Server] = {}
        try:
            for path, command in commands.items():
                logs = os.path.join(log_dir, path) if several else log_dir
                os.makedirs(logs, exist_ok=True)
                servers[path] = Remote(command) if isinstance(command, str) else Server(command, logs)
            print(f"serve_load: {name}, --max-batch {args.max_batch}, {args.tokens} tokens per request, "
                  f"{args.rounds} per client (prompt BOS, greedy, EOS ignored); ms"
                  + (f"; paths {', '.join(servers)}, interleaved" if several else ""))
            for server in servers.values():
                server.stream(min(args.tokens, 4))  # warm-up: kernels, plans, connections
            for run in range(args.repeats):
                if args.repeats > 1:
                    print(f"run {run + 1} of {args.repeats} (load average {os.getloadavg()[0]:.1f} on "
                          f"{os.cpu_count()} cores)")
                print((f"{'path':>12} " if several else "") + HEADER)
                runs = {path: [] for path in servers}
                for concurrency in args.concurrency:
                    rows = interleaved(servers, concurrency, args.tokens, args.rounds)
                    for path, row in rows.items():
                        runs[path].append(row)
                        print((f"{path:>12} " if several else "") + table_line(row), flush=True)
                    reference = next(iter(servers))
                    for path in list(servers)[1:]:
                        rows[path]["against"] = against(rows[path], rows[reference])
                        print(against_line(path, reference, rows[path]["against"]), flush=True)
                record["runs"].append(runs)
                record["rows"] = next(iter(runs.values()))
                if args.json:
                    save_json(args.json, record, args, complete=False)
        finally:
            for server in servers.values():
                server.stop()
    if several and args.repeats > 1:
        print(f"medians of {args.repeats} runs:")
        reference = next(iter(commands))
        for path in list(commands)[1:]:
            for i, concurrency in enumerate(args.concurrency):
                c = {key: statistics.median(run[path][i]["against"][key] for run in record["runs"])
                     for key in record["runs"][0][path][i]["against"]}
                print(f"  C={concurrency}" + against_line(path, reference, c)[3:])
    rows = {r["concurrency"]: r["summary"] for r in record["rows"]}
    if not several and 1 in rows and 8 in rows and rows[1]["gap_ms_p99"] and rows[8]["gap_ms_p99"]:
        print(f"C=8 against C=1: inter-token p99 {rows[8]['gap_ms_p99'] / rows[1]['gap_ms_p99']:.2f}x (target on an "
              f"H200 <= 1.3x), tokens/s {rows[8]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x (target >= 6x)")
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0


class Remote(Server):
    """A server already running at a URL (--url): measured, never started or stopped here."""

    def __init__(self, url: str):  # noqa: super().__init__ would start a process
        parts = urlsplit(url)
        self.host, self.port, self.prefix = parts.hostname, parts.port or 80, parts.path.rstrip("/")

    def stop(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
