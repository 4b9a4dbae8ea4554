"""Issue 17's CPU target: N concurrent requests on the numpy backend against the same N requests one after another.

    python benchmarks/cpu_batch.py [--model DIR] [--requests 8] [--max-new-tokens 128] [--trials 3]
                                   [--temperature 0.8] [--profile FILE] [--json FILE]

One model (device="cpu", max_batch = --requests) runs N prompts (the first N of PROMPTS) two ways, same options:
batched, one Llama.generate(list) call, and in a row, N solo Llama.generate calls. Every request ignores EOS, so
each draws exactly --max-new-tokens tokens either way and the two do the same work. Each trial times both (host
clock, whole calls: prefill, decode, sampling, detokenizing); the best trial of each is reported, with their ratio
(the target: well under 1). The batched requests' tokens are checked against their solo ones (the promise: the
same bits), and a mismatch exits 1. `--profile FILE`: cProfile one more batched run and write its top functions
(by own time) to FILE. No GPU needed: this is the CPU figure; `cullama bench --batch` is the per-step one.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import cullama
from cullama.common.errors import CullamaError

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"  # ../shared from the repo
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird",
           "There was a big red ball", "Sam had a toy car", "The sun was hot", "Mom said"]


def timed(fn):
    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a model directory (default: stories260K)")
    ap.add_argument("--requests", type=int, default=8, help=f"concurrent requests, 1 to {len(PROMPTS)}")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy; else seeded sampling (seed 1)")
    ap.add_argument("--profile", help="cProfile one more batched run; its top functions go to this file")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.requests <= len(PROMPTS) or args.trials < 1 or args.max_new_tokens < 1:
        ap.error(f"--requests must be 1 to {len(PROMPTS)}, --trials and --max-new-tokens >= 1")
    prompts = PROMPTS[:args.requests]
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1, ignore_eos=True)
    try:
        llm = cullama.Llama.from_pretrained(args.model, device="cpu", max_batch=args.requests)
    except CullamaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    llm.generate(prompts, max_new_tokens=2)  # first calls import and build what later ones reuse (batch plans too)
    llm.generate(prompts[0], max_new_tokens=2)

    batched_s, row_s = [], []
    for trial in range(args.trials):
        together, seconds = timed(lambda: llm.generate(prompts, **options))
        batched_s.append(seconds)
        alone, seconds = timed(lambda: [llm.generate(p, **options) for p in prompts])
        row_s.append(seconds)
        print(f"trial {trial + 1}: batched {batched_s[-1]:.2f} s, in a row {row_s[-1]:.2f} s", flush=True)
        differ = [i for i, (a, b) in enumerate(zip(together, alone)) if a.token_ids != b.token_ids]
        if differ:
            print(f"error: request {differ[0]}'s batched tokens differ from its solo tokens (the promise broken)",
                  file=sys.stderr)
            return 1
    best_batched, best_row = min(batched_s), min(row_s)
    tokens = args.requests * args.max_new_tokens
    print(f"{args.requests} requests x {args.max_new_tokens} tokens on {os.cpu_count()} CPUs: batched "
          f"{best_batched:.2f} s ({tokens / best_batched:.0f} tok/s), in a row {best_row:.2f} s "
          f"({tokens / best_row:.0f} tok/s), ratio {best_batched / best_row:.2f}")

    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(llm.generate, prompts, **options)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        Path(args.profile).write_text(text.getvalue())
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(args.model), "requests": args.requests, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "cpus": os.cpu_count(), "batched_s": batched_s, "in_a_row_s": row_s,
            "ratio": best_batched / best_row}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
