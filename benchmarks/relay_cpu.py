"""The CPU a relay spends per streamed chunk: `cullama serve --replicas N`'s relay (or any front) at --url, its
process at --pid, streamed through by C clients; the CPU time of each of the process's threads over the run (from
/proc/PID/task/*/stat), the busiest one (the relay's event loop; the others are Ray's driver, polling) divided by the
chunks that went through it.

    python benchmarks/relay_cpu.py --url http://127.0.0.1:8962 --pid PID [--url URL --pid PID ...]
                                   [--requests 40] [--tokens 100] [--concurrency 1] [--repeats 3]

With several --url/--pid pairs the paths are measured in turn, repeat by repeat (interleaved: the same load of the
machine for each), and the medians printed. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from urllib.parse import urlsplit

from gemv_sweep import positive_int  # benchmarks/ on sys.path
from serve_load import Remote

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """{thread id: its CPU seconds (user + system)} of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def measure(url: str, pid: int, requests: int, tokens: int, concurrency: int) -> dict:
    server = Remote(url)
    chunks = []
    lock = threading.Lock()

    def client(n: int):
        for _ in range(n):
            _, arrivals, _ = server.stream(tokens)
            with lock:
                chunks.append(len(arrivals) + 2)  # the text chunks, the usage chunk, [DONE]

    before = thread_cpu(pid)
    threads = [threading.Thread(target=client, args=(requests // concurrency,)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = thread_cpu(pid)
    deltas = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    busiest = max(deltas, key=deltas.get)
    n = sum(chunks)
    return {"chunks": n, "busiest_us_per_chunk": deltas[busiest] / n * 1e6,
            "process_us_per_chunk": sum(deltas.values()) / n * 1e6}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="a relay (repeatable, with a --pid each)")
    parser.add_argument("--pid", action="append", type=int, required=True, help="the process serving --url")
    parser.add_argument("--requests", type=positive_int, default=40, help="requests per path per repeat")
    parser.add_argument("--tokens", type=positive_int, default=100, help="tokens per request")
    parser.add_argument("--concurrency", type=positive_int, default=1, help="clients at once")
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    if len(args.url) != len(args.pid):
        parser.error("give one --pid for each --url")
    for url in args.url:
        Remote(url).stream(4)  # warm-up
    results = {url: [] for url in args.url}
    for run in range(args.repeats):
        for url, pid in zip(args.url, args.pid):
            r = measure(url, pid, args.requests, args.tokens, args.concurrency)
            results[url].append(r)
            print(f"run {run + 1} {urlsplit(url).netloc}: {r['chunks']} chunks, relay thread "
                  f"{r['busiest_us_per_chunk']:.1f} us/chunk, whole process {r['process_us_per_chunk']:.1f} us/chunk",
                  flush=True)
    for url, rows in results.items():
        print(f"median {urlsplit(url).netloc}: relay thread "
              f"{statistics.median(r['busiest_us_per_chunk'] for r in rows):.1f} us/chunk, whole process "
              f"{statistics.median(r['process_us_per_chunk'] for r in rows):.1f} us/chunk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
