"""Prefill timing: time to first token of LLaMA-2-7B prompts with each choice of prefill kernels.

    python benchmarks/prefill_step.py [--lengths 10,100,256,500] [--chunks 256,512] [--trials 5] [--json FILE]
                                      [--model PRESET] [--peak-tflops T]

Random weights of the preset are made on the GPU (Llama.synthetic). For each (GEMM, attention) pair of
cullama.runtime.prefill_kernels that this GPU runs (mma or wgmma, scalar or mma; wgmma on sm_90 only), each
prefill chunk in --chunks (prompt rows per pass: a runner of its own on the same weights), with the
kernels launched plainly and, on sm_90, overlapped (programmatic dependent launch, CULLAMA_OVERLAP=1),
and each prompt length L: one untimed prefill (kernels loaded, plans resolved), then --trials timed
`runner.start(prompt)` on the host clock, as `cullama bench` times TTFT (the prefill chunks, the first
token's gemv_logits + sample, and reading it back). Each run's last-row logits are checked against the
default pair's at the first chunk size, launched plainly: within FP16 tolerance, and the same first
token. The floor of a length is max(weights read once per chunk / read bandwidth, its matmul FLOPs at
--peak-tflops): what a prefill could not beat. Every trial is a whole prefill (the prefix cache off). Then
the prefix cache, with the default pair at the first chunk: each prompt again with the cache on, which
holds its whole chunks from the untimed run, so only its last chunk runs: that TTFT, and its first token
and last-row logits against the whole prefill's, bit for bit (a difference fails the run). Run it on a
GPU; without one it says so in one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from cullama.common.errors import CullamaError
from cullama.runtime.prefill_kernels import ATTENTIONS, GEMMS, PrefillKernels
from gemv_sweep import positive_int, positive_ints, read_bandwidth, require_gpu, save_json

DEFAULT = PrefillKernels()


def choices(arch: str) -> list[PrefillKernels]:
    """Every pair this GPU runs, the default first."""
    pairs = [PrefillKernels(gemm=gemm, attention=attention) for gemm in GEMMS for attention in ATTENTIONS]
    return [DEFAULT] + [k for k in pairs if k != DEFAULT and k.runs_on(arch)]


def floor_ms(cfg, length: int, chunk: int, bps: float, peak_tflops: float) -> float:
    """max(weight reads, matmul FLOPs): every chunk streams all linear weights once; each row costs 2 FLOPs a
    layer weight, and the lm_head runs on the last row only."""
    chunks = -(-length // chunk)
    weight_bytes = cfg.decode_weight_bytes()
    head_params = cfg.vocab_size * cfg.hidden_size
    flops = 2 * (weight_bytes / 2 - head_params) * length + 2 * head_params
    return max(chunks * weight_bytes / bps, flops / (peak_tflops * 1e12)) * 1e3


def measure(runner, prompt: list[int], trials: int, cached: bool = False) -> tuple[list[float], int, np.ndarray]:
    """(TTFT ms of each trial, the first token, the last row's logits). Each trial a whole prefill, or with
    `cached` the prefix cache on: the untimed run leaves the prompt's whole chunks in it."""
    from cullama.bench.latency import GREEDY as greedy

    runner.prefix_cache = cached
    runner.start(prompt, greedy)  # untimed: kernels loaded, the plans resolved
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        token = runner.start(prompt, greedy)
        times.append((time.perf_counter() - t0) * 1e3)
    return times, token, runner.backend.read("logits")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_ints, default=[10, 100, 256, 500], help="prompt lengths")
    parser.add_argument("--chunks", type=positive_ints, default=[256, 512], help="prompt rows per prefill pass")
    parser.add_argument("--trials", type=positive_int, default=5, help="timed prefills per length and pair")
    parser.add_argument("--model", default="llama-2-7b", help="preset to synthesize")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="matrix rate for the floor (the H200's measured dense bf16 matmul: ~790)")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    require_gpu("prefill_step")

    from cullama import Llama
    from cullama.bench.latency import prompt_ids
    from cullama.runtime.device import environment
    from cullama.runtime.engine import PlanRunner

    try:
        bps, bandwidth = read_bandwidth()
        max_seq = max(args.lengths) + 1
        llm = Llama.synthetic(args.model, device="cuda", max_seq_len=max_seq)
        backend, cfg = llm.runner.backend, llm.config
        pairs = choices(backend.arch)
        print(f"{args.model} on {backend.arch}: read bandwidth {bps / 1e9:.0f} GB/s; pairs "
              + ", ".join(f"{k.gemm}+{k.attention}" for k in pairs)
              + "; chunks " + ", ".join(map(str, args.chunks)), flush=True)
        rows, reference = [], {}
        record = {"model": args.model, "default": {"gemm": DEFAULT.gemm, "attention": DEFAULT.attention,
                                                   "chunk": args.chunks[0], "overlap": False},
                  "read_bandwidth_bytes_per_s": bps, "bandwidth": bandwidth, "environment": environment(),
                  "rows": rows, "prefix_cache": []}
        backend.set_overlap(True)
        modes = [False, True] if backend.overlap else [False]  # no programmatic dependent launch before sm_90
        for chunk in args.chunks:
            runner = PlanRunner(cfg, backend, max_seq, prefill_chunk=chunk)  # its own prefill buffers, same weights
            for overlap in modes:
                backend.set_overlap(overlap)
                for kernels in pairs:
                    runner.set_prefill_kernels(kernels)
                    for length in args.lengths:
                        prompt = prompt_ids(length, cfg.vocab_size, seed=length)
                        times, token, logits = measure(runner, prompt, args.trials)
                        ref_token, ref_logits = reference.setdefault(length, (token, logits))
                        diff = float(np.max(np.abs(logits - ref_logits)))
                        ok = token == ref_token and diff <= 2e-2 * max(1.0, float(np.max(np.abs(ref_logits))))
                        rows.append({"gemm": kernels.gemm, "attention": kernels.attention, "chunk": chunk,
                                     "overlap": overlap, "length": length, "ttft_ms": statistics.median(times),
                                     "ttft_min_ms": min(times), "trials": times,
                                     "floor_ms": floor_ms(cfg, length, chunk, bps, args.peak_tflops),
                                     "first_token": token, "logits_max_diff": diff, "check_ok": ok})
                        print(f"  chunk {chunk} {kernels.gemm}+{kernels.attention}{' overlap' if overlap else ''} "
                              f"L={length}: {rows[-1]['ttft_ms']:.2f} ms", flush=True)
                    if args.json:
                        save_json(args.json, record, args, complete=False)
        backend.set_overlap(False)
        runner = PlanRunner(cfg, backend, max_seq, prefill_chunk=args.chunks[0])
        for length in args.lengths:
            prompt = prompt_ids(length, cfg.vocab_size, seed=length)
            times, token, logits = measure(runner, prompt, args.trials, cached=True)
            ref_token, ref_logits = reference[length]
            fresh = next(r["ttft_ms"] for r in rows if r["length"] == length)  # the default pair, first chunk
            exact = token == ref_token and logits.tobytes() == ref_logits.tobytes()
            record["prefix_cache"].append({"length": length, "reused": runner.reused, "bit_exact": exact,
                                           "ttft_ms": statistics.median(times), "fresh_ttft_ms": fresh})
            print(f"  prefix cache L={length}: {runner.reused} rows reused, {statistics.median(times):.2f} ms "
                  f"(whole prefill {fresh:.2f} ms), bit-exact: {exact}", flush=True)
    except CullamaError as exc:
        sys.exit(f"prefill_step: {exc}")
    print(f"\n{'chunk':>5} {'gemm':<6} {'attention':<9} {'overlap':<7} {'L':>5} {'TTFT ms':>8} {'min ms':>7} "
          f"{'floor ms':>8} {'floor/TTFT':>10} {'vs default':>10}  check")
    for r in rows:
        base = rows[[b["length"] for b in rows].index(r["length"])]["ttft_ms"]  # the default pair, first chunk
        r["speedup_vs_default"] = base / r["ttft_ms"]
        check = "ok" if r["check_ok"] else f"WRONG (token {r['first_token']}, max diff {r['logits_max_diff']:.2e})"
        print(f"{r['chunk']:>5} {r['gemm']:<6} {r['attention']:<9} {'on' if r['overlap'] else 'off':<7} "
              f"{r['length']:>5} {r['ttft_ms']:>8.2f} "
              f"{r['ttft_min_ms']:>7.2f} {r['floor_ms']:>8.2f} {100 * r['floor_ms'] / r['ttft_ms']:>9.1f}% "
              f"{r['speedup_vs_default']:>9.2f}x  "
              f"{check}")
    print(f"TTFT: median of {args.trials} runner.start() on the host clock; floor: max(weights read once per "
          f"chunk / read bandwidth, 2 x layer params x L FLOPs / {args.peak_tflops:.0f} TFLOP/s); vs default: "
          f"against {DEFAULT.gemm}+{DEFAULT.attention} at chunk {args.chunks[0]}, plain launches")
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0 if all(r["check_ok"] for r in rows) and all(c["bit_exact"] for c in record["prefix_cache"]) else 1


if __name__ == "__main__":
    sys.exit(main())
