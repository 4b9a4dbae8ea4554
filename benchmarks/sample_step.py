"""The sample kernel's cost per decode step at each vocabulary size (LLaMA-2's 32,000, LLaMA-3's 128,256, Qwen2.5's
152,064), greedy and with each of its cuts: on the GPU the kernel itself, on the CPU its NumPy twin (what the numpy
backend spends on the step's last launch).

    python benchmarks/sample_step.py [--vocabs 32000,128256,152064] [--reps 200] [--cpu-reps 10] [--cpu-only]
                                     [--json FILE]

Random logits (3 x a standard normal, as the kernel tests draw them), a tenth of the ids seen, one token row. GPU:
CUDA events around --reps back-to-back launches (us per launch; the state advances, so each draw is new). CPU: the
median wall time of --cpu-reps twin calls. Past 32,768 ids the kernel keeps 32 ids a thread on chip and re-reads
the rest at every pass (sampling.cu's header): 66 passes with top-k and top-p, 3 without, 1 greedy. Predictions
for the GPU are in PREDICTIONS.md; without a GPU the CPU rows are measured and the GPU's are left out (one line
says so), unlike the other scripts, which need one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from cullama.runtime.ops import sampling as twin
from gemv_sweep import events_ms, positive_int, positive_ints, save_json  # benchmarks/ on sys.path

D = 4096  # LLaMA-2-7B's width: the kernel writes the next token's embedding row and its prepared RMSNorm input
# (label, temperature, top_k, top_p, repetition penalty)
OPTIONS = [("greedy", 0.0, 0, 1.0, 1.0), ("greedy + penalty 1.1", 0.0, 0, 1.0, 1.1),
           ("T 0.8, no cut", 0.8, 0, 1.0, 1.0), ("T 0.8, top-k 40", 0.8, 40, 1.0, 1.0),
           ("T 0.8, top-p 0.9", 0.8, 0, 0.9, 1.0), ("T 0.8, top-k 40, top-p 0.9, penalty 1.1", 0.8, 40, 0.9, 1.1)]


def inputs(V: int, seed: int = 0):
    """logits [V] f32, seen [V] uint8, embed [V, D] f16."""
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal(V)).astype(np.float32)
    seen = (rng.random(V) < 0.1).astype(np.uint8)
    return logits, seen, rng.standard_normal((V, D)).astype(np.float16)


def state_and_params(option) -> tuple[np.ndarray, np.ndarray]:
    _, temperature, top_k, top_p, penalty = option
    state = np.zeros(8, np.int32)
    state[twin.STATE_TOP_K], state[twin.STATE_SEED_LO] = top_k, 12345
    return state, np.array([temperature, top_p, penalty, 0.0], np.float32)


def one_row(xp):
    """A decode step's rows table, verify arguments and masks (rows, ids, picks, out, arrivals, masks): one token row
    of slot 0, no drafts, no mask (state[MASKED] is 0)."""
    return (xp.zeros((1, 2), np.int32), xp.zeros(1, np.int32), xp.zeros(1, np.int32), xp.zeros(2, np.int32),
            xp.zeros(1, np.uint32), xp.zeros(1, np.uint32))


def next_input(xp) -> tuple:
    """The sample kernel's next-input arguments (norm_w, x, xn, ssp) for one row of width D."""
    return (xp.asarray(np.ones(D, np.float16)), xp.zeros(D, np.float32), xp.zeros(D, np.float16),
            xp.zeros(-(-D // 32), np.float32))


def sizes(V: int) -> tuple:
    """The sample kernel's last arguments for one slot's seen [V]: V, d, seen_stride, mask_words, verify (1: a decode
    step)."""
    return np.int32(V), np.int32(D), np.int32(V), np.int32(-(-V // 32)), np.int32(1)


def cpu_ms(V: int, option, reps: int) -> float:
    """Median ms of the twin's call, the state advancing between calls."""
    logits, seen, embed = inputs(V)
    state, fparams = state_and_params(option)
    nxt, rows = next_input(np), one_row(np)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        twin.sample(logits, seen, state, fparams, embed, *nxt, *rows, *sizes(V), grid=(1, 1, 1))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gpu_us(cp, fn, V: int, option, reps: int) -> float:
    """us per launch of the sample kernel, by events around `reps` launches (after one untimed)."""
    logits, seen, embed = (cp.asarray(a) for a in inputs(V))
    state, fparams = (cp.asarray(a) for a in state_and_params(option))
    args = (logits, seen, state, fparams, embed, *next_input(cp), *one_row(cp), *sizes(V))
    stream = cp.cuda.get_current_stream()
    launch = lambda: fn((1,), (1024,), args)  # noqa: E731
    launch()
    return events_ms(cp, stream, launch, reps) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", type=positive_ints, default=[32000, 128256, 152064], help="vocabulary sizes")
    parser.add_argument("--reps", type=positive_int, default=200, help="GPU launches timed per row")
    parser.add_argument("--cpu-reps", type=positive_int, default=10, help="twin calls per row (median)")
    parser.add_argument("--cpu-only", action="store_true", help="the twin's rows only, even where there is a GPU")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    from cullama.runtime.device import cuda_status, environment

    ok, why = (False, "--cpu-only") if args.cpu_only else cuda_status()
    fn = cp = None
    if ok:
        import cupy as cp

        from cullama.runtime.plan import SAMPLE
        from cullama.runtime.registry import KernelLoader

        fn = KernelLoader().function(SAMPLE)
    else:
        print(f"sample_step: the GPU's rows are left out ({why}); the CPU twin's follow", file=sys.stderr)
    rows = []
    record = {"environment": environment() if ok else None, "rows": rows}
    print(f"{'V':>7}  {'options':<40} {'GPU us':>8} {'CPU ms':>8}")
    for V in args.vocabs:
        for option in OPTIONS:
            row = {"V": V, "options": option[0], "gpu_us": gpu_us(cp, fn, V, option, args.reps) if ok else None,
                   "cpu_ms": cpu_ms(V, option, args.cpu_reps)}
            rows.append(row)
            gpu = f"{row['gpu_us']:>8.1f}" if ok else f"{'-':>8}"
            print(f"{V:>7}  {option[0]:<40} {gpu} {row['cpu_ms']:>8.2f}", flush=True)
            if args.json:
                save_json(args.json, record, args, complete=False)
    if args.json:
        save_json(args.json, record, args, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
