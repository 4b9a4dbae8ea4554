"""Log-probabilities on a decode step: what the logprobs kernel adds to the captured decode graph for each number
of alternatives, and what a generated token's log-probabilities cost on the host clock.

    python benchmarks/logprobs_step.py [--context 500] [--steps 100] [--trials 3] [--tops 0,1,5,20]
                                       [--model PRESET] [--max-seq-len N] [--json FILE]

Random weights (Llama.synthetic). Per trial, from the same fresh prefill each time: the plain decode graph and the
decode graph with the logprobs kernel for each N of --tops (N alternatives), each replayed --steps times (CUDA
events: ms per step; the difference is the kernel's); then the host-observed next(ahead=True), token arrival to
token arrival, plain and with logprobs=N (the records' copy beside the token and their finishing in float64, taken
each token as generation takes them). Medians over --trials; predictions in PREDICTIONS.md. Run it on a GPU;
without one it says so in one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from cullama.common.errors import CullamaError
from gemv_sweep import events_ms, positive_int, require_gpu, save_json  # benchmarks/ on sys.path


def graph_ms(llm, cp, prompt: list[int], steps: int, plan) -> float:
    """ms per replay of `plan` (a decode step), captured untimed first, timed from a fresh prefill."""
    from cullama.bench.latency import GREEDY as greedy

    runner, backend = llm.runner, llm.runner.backend
    runner.start(prompt, greedy)
    backend.replay(plan)
    runner.start(prompt, greedy)
    return events_ms(cp, backend.stream, lambda: backend.replay(plan), steps)


def host_ms(llm, prompt: list[int], steps: int, top: int | None) -> float:
    """The median host-observed ms from one next(ahead=True) token to the next, log-probabilities `top` (None:
    off), each token's record taken as it comes."""
    from cullama.bench.latency import GREEDY as greedy

    runner = llm.runner
    runner.start(prompt, greedy, logprobs=top)
    times, last = [], time.perf_counter()
    for _ in range(steps):
        runner.next(ahead=True)
        runner.take_logprobs()
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    runner.drain()
    return statistics.median(times)


def measure(llm, cp, prompt: list[int], steps: int, tops: list[int]) -> dict:
    runner = llm.runner
    trial = {"graph_ms": graph_ms(llm, cp, prompt, steps, runner.decode), "host_ms": host_ms(llm, prompt, steps, None),
             "tops": []}
    for top in tops:
        plan = runner.decode_plan(top)  # the plan (and so the graph) next() replays with logprobs=top
        trial["tops"].append({"top": top, "graph_ms": graph_ms(llm, cp, prompt, steps, plan),
                              "host_ms": host_ms(llm, prompt, steps, top)})
    return trial


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=positive_int, default=500, help="the prompt length each run starts at")
    parser.add_argument("--steps", type=positive_int, default=100, help="decode steps timed per run")
    parser.add_argument("--trials", type=positive_int, default=3, help="runs of everything (median)")
    parser.add_argument("--tops", type=lambda s: [int(t) for t in s.split(",")], default=[0, 1, 5, 20],
                        help="alternatives per token (0 to 20) of the graphs with the logprobs kernel")
    parser.add_argument("--max-seq-len", type=positive_int, default=1024, help="KV-cache length")
    parser.add_argument("--model", default="llama-2-7b", help="preset to synthesize")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    if args.context + args.steps + 2 > args.max_seq_len:
        parser.error(f"--context {args.context} + {args.steps} steps does not fit in --max-seq-len "
                     f"{args.max_seq_len}")
    if not all(0 <= t <= 20 for t in args.tops):
        parser.error(f"--tops: each from 0 to 20, got {args.tops}")
    require_gpu("logprobs_step")
    import cupy as cp

    from cullama import Llama
    from cullama.bench.latency import prompt_ids
    from cullama.runtime.device import environment

    try:
        llm = Llama.synthetic(args.model, device="cuda", max_seq_len=args.max_seq_len)
        prompt = prompt_ids(args.context, llm.config.vocab_size, seed=args.context)
        measure(llm, cp, prompt[:10], 4, args.tops)  # warm-up: kernels loaded, graphs captured
        trials = []
        record = {"model": args.model, "context": args.context, "steps": args.steps, "environment": environment(),
                  "trials": trials}
        for _ in range(args.trials):
            trials.append(measure(llm, cp, prompt, args.steps, args.tops))
            if args.json:
                save_json(args.json, record, args, complete=False)
    except CullamaError as exc:
        sys.exit(f"logprobs_step: {exc}")
    record["graph_ms"] = statistics.median(t["graph_ms"] for t in trials)
    record["host_ms"] = statistics.median(t["host_ms"] for t in trials)
    record["rows"] = [{"top": top,
                       "graph_ms": statistics.median(t["tops"][i]["graph_ms"] for t in trials),
                       "host_ms": statistics.median(t["tops"][i]["host_ms"] for t in trials)}
                      for i, top in enumerate(args.tops)]
    print(f"{args.model}, context {args.context}, {args.steps} steps, median of {args.trials} trials: decode graph "
          f"{record['graph_ms']:.3f} ms/step, next(ahead) {record['host_ms']:.3f} ms/token without log-probabilities")
    print(f"{'top':>4} {'graph ms':>9} {'+kernel us':>10} {'next ms':>8} {'+host us':>9}")
    for row in record["rows"]:
        row["kernel_us"] = (row["graph_ms"] - record["graph_ms"]) * 1e3
        row["host_us"] = (row["host_ms"] - record["host_ms"]) * 1e3
        print(f"{row['top']:>4} {row['graph_ms']:>9.3f} {row['kernel_us']:>10.1f} {row['host_ms']:>8.3f} "
              f"{row['host_us']:>9.1f}")
    if args.json:
        save_json(args.json, record, args, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
