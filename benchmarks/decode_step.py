"""Decode-step timing: the captured CUDA graph of one LLaMA-2-7B decode step against the bandwidth floor.

    python benchmarks/decode_step.py [--contexts 10,100,500,1000] [--steps 100] [--trials N] [--json FILE]
                                     [--model PRESET] [--max-seq-len N] [--breakdown-context L]
                                     [--verify-drafts 1,2,4,8] [--verify-context L]

Random LLaMA-2-7B weights are made on the GPU (Llama.synthetic). For each context L, a fresh
prefill of an L-token prompt, then CUDA events around --steps back-to-back replays of the
captured decode graph (each replay advances the position: the steps run at L .. L+steps-1), once
captured plainly and once with its kernels overlapped (programmatic dependent launch, sm_90+);
then the same from a fresh prefill with eager launches of the same plan (backend.run), and the
host-observed time from one runner.next() token to the next (replay + reading the token id back),
plain and with next(ahead=True) (the next step queued before the token is read: what generation does).
Then the speculative verify step at context 500 (--verify-context), for each k of --verify-drafts: its
captured graph (k + 1 token rows: the last token and k drafts) replayed --steps times, against the plain
decode graph replayed from the same prompt in the same trial, and the host-observed verify() call (ids in,
verdict out). Last, a per-kernel breakdown at context 500 (--breakdown-context): the same launches captured
with an event-record node between each pair, so each kernel's share of the step (and its GB/s) can be
read off. --model synthesizes another preset (the tests run `tiny` on a fake CuPy).
The floor is the bytes a step must read (decode_weight_bytes) over the measured read bandwidth.
Medians over --trials. Run it on a GPU; without one it says so in one line.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

from cullama.common.errors import CullamaError, DeviceError
from gemv_sweep import events_ms, positive_int, positive_ints, read_bandwidth, require_gpu, save_json  # benchmarks/ on sys.path

WARMUP_CONTEXT, WARMUP_STEPS = 10, 8  # the untimed first measure(): kernels loaded, graphs captured


def measure(llm, cp, prompt: list[int], steps: int) -> dict:
    """One trial at one context, ms per step: graph replays, plain and overlapped (programmatic dependent
    launch; None where the GPU has none), eager launches, and the host-observed next() from one token's
    arrival to the next, plain and ahead (both in the backend's default overlap mode)."""
    from cullama.bench.latency import GREEDY as greedy

    runner = llm.runner
    backend, plan = runner.backend, runner.decode
    default = backend.overlap
    timed = {}
    for overlap in (False, True):
        backend.set_overlap(overlap)  # drops the captured graph when the mode changes
        if backend.overlap != overlap:  # before sm_90: no programmatic dependent launch
            timed[overlap] = None
            continue
        runner.start(prompt, greedy)
        backend.replay(plan)  # captured here, untimed
        runner.start(prompt, greedy)
        timed[overlap] = events_ms(cp, backend.stream, lambda: backend.replay(plan), steps)
    backend.set_overlap(default)
    runner.start(prompt, greedy)
    eager = events_ms(cp, backend.stream, lambda: backend.run(plan), steps)
    runner.start(prompt, greedy)
    host = {}
    for ahead in (False, True):  # each token read back before the next replay; or the next step queued first
        runner.start(prompt, greedy)
        times, last = [], time.perf_counter()
        for _ in range(steps):
            runner.next(ahead=ahead)
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
        runner.drain()
        host[ahead] = statistics.median(times)
    return {"graph_ms": timed[False], "overlap_ms": timed[True], "eager_ms": eager,
            "next_ms": host[False], "ahead_ms": host[True]}


def verify_times(llm, cp, prompt: list[int], steps: int, ks: list[int]) -> dict:
    """One trial of the verify step per k, ms: its graph replayed `steps` times (each replay moves the position
    by the tokens it accepts: fixed drafts on random weights accept next to none, so about one) and the
    host-observed verify() call, against the plain decode graph replayed from the same prompt."""
    from cullama.bench.latency import GREEDY as greedy

    runner = llm.runner
    backend = runner.backend
    runner.start(prompt, greedy)
    backend.replay(runner.decode)  # captured here if it was not yet, untimed
    runner.start(prompt, greedy)
    plain = events_ms(cp, backend.stream, lambda: backend.replay(runner.decode), steps)
    rows = []
    for k in ks:
        plan, drafts = runner.verify_plan(k), [(7 * i + 3) % llm.config.vocab_size for i in range(k)]
        runner.start(prompt, greedy)
        runner.verify(drafts)  # captured on first use, untimed; the drafts are on the device now
        replay = events_ms(cp, backend.stream, lambda: backend.replay(plan), steps)
        runner.start(prompt, greedy)
        times, last = [], time.perf_counter()
        for _ in range(steps):
            runner.verify(drafts)
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
        rows.append({"k": k, "replay_ms": replay, "verify_ms": statistics.median(times), "x_plain": replay / plain})
    return {"plain_ms": plain, "rows": rows}


VERIFY_TARGETS = {4: 1.10, 8: 1.25}  # issue 9: the verify step at 500 tokens of context, x the plain step


LAYER_LABELS = ("qkv_rope", "attention", "o_proj", "gate_up_silu", "down")
CU_EVENT_RECORD_EXTERNAL = 1  # cuda.h: in a capturing stream, record the event as a graph node


def load_driver():
    """The CUDA driver library (ctypes), for the one call CuPy does not wrap; tests substitute a fake."""
    from cullama.runtime.backends import driver

    return driver.load("event nodes (the per-kernel breakdown)")


def node_recorder(driver):
    """record(event, stream): an event-record node in the capturing stream's graph, recorded at each replay.
    A plain Event.record inside a capture only marks a dependency: CUDA then refuses to time the event
    (cudaErrorCapturedEvent); a node needs cuEventRecordWithFlags(..., CU_EVENT_RECORD_EXTERNAL)."""
    fn = driver.cuEventRecordWithFlags
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int

    def record(event, stream) -> None:
        status = fn(event.ptr, stream.ptr, CU_EVENT_RECORD_EXTERNAL)
        if status != 0:
            raise DeviceError(f"cuEventRecordWithFlags (an event node in the graph) failed: CUresult {status}")

    return record


def launch_bytes(cfg, label: str, context: int) -> int:
    """Bytes one launch must read: its weight matrix, or the K and V of one layer (attention: of the positions it
    attends, all of the context or a sliding window's)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    attended = min(context, cfg.sliding_window or context)
    return 2 * {"qkv_rope": cfg.qkv_dim * d, "o_proj": d * cfg.q_dim, "gate_up_silu": 2 * ff * d,
                "down": d * ff, "lm_head": cfg.vocab_size * d, "attention": 2 * cfg.kv_dim * attended,
                "sample": 2 * cfg.vocab_size}[label]


def breakdown(llm, cp, prompt: list[int], steps: int) -> list[dict]:
    """Per-kernel time inside the decode graph: a second graph of the same launches with an event
    recorded between each pair (event-record nodes), replayed `steps` times; median us per launch,
    grouped by role (qkv_rope, attention, o_proj, gate_up_silu, down per layer; lm_head; sample)."""
    from cullama.bench.latency import GREEDY as greedy

    runner = llm.runner
    backend, plan = runner.backend, runner.decode
    launches = backend.prepared(plan)
    labels = [LAYER_LABELS[i % 5] for i in range(len(launches) - 2)] + ["lm_head", "sample"]
    events = [cp.cuda.Event() for _ in range(len(launches) + 1)]
    record = node_recorder(load_driver())
    stream = backend.stream
    runner.start(prompt, greedy)
    stream.synchronize()
    with stream:
        stream.begin_capture()
        try:
            for event, (fn, grid, block, args, smem) in zip(events, launches):
                record(event, stream)
                fn(grid, block, args, shared_mem=smem)
            record(events[-1], stream)
        finally:
            graph = stream.end_capture()
    per_launch = [[] for _ in launches]
    for _ in range(steps):
        graph.launch(stream=stream)
        stream.synchronize()
        for i in range(len(launches)):
            per_launch[i].append(cp.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3)
    rows = {}
    for label, times in zip(labels, per_launch):
        row = rows.setdefault(label, {"kernel": label, "count": 0, "us_each": []})
        row["count"] += 1
        row["us_each"].append(statistics.median(times))
    context = len(prompt) + steps // 2
    for row in rows.values():
        row["us_each"] = statistics.median(row["us_each"])
        row["us_per_step"] = row["us_each"] * row["count"]
        row["bytes"] = launch_bytes(llm.config, row["kernel"], context)  # one launch's
        row["gb_s"] = row["bytes"] / row["us_each"] / 1e3
    return list(rows.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=positive_ints, default=[10, 100, 500, 1000],
                        help="prompt lengths: the context each timed run starts at")
    parser.add_argument("--steps", type=positive_int, default=100, help="decode steps timed per trial")
    parser.add_argument("--trials", type=positive_int, default=3, help="fresh prefill + timing per context (median)")
    parser.add_argument("--max-seq-len", type=positive_int, default=2048, help="KV-cache length")
    parser.add_argument("--model", default="llama-2-7b", help="preset to synthesize")
    parser.add_argument("--breakdown-context", type=positive_int, default=500,
                        help="the context the per-kernel breakdown starts at")
    parser.add_argument("--verify-drafts", type=positive_ints, default=[1, 2, 4, 8],
                        help="the k of the verify steps timed (drafts per step, at most 8)")
    parser.add_argument("--verify-context", type=positive_int, default=500,
                        help="the context the verify steps start at")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    longest = max(args.contexts + [args.breakdown_context])
    if max(longest + args.steps, WARMUP_CONTEXT + WARMUP_STEPS) + 1 > args.max_seq_len:  # replays are unchecked
        parser.error(f"context {longest} + {args.steps} steps (or the warm-up's {WARMUP_CONTEXT} + {WARMUP_STEPS}) "
                     f"does not fit in --max-seq-len {args.max_seq_len}")
    if max(args.verify_drafts) > 8:
        parser.error(f"--verify-drafts: a verify step checks at most 8 drafts, not {max(args.verify_drafts)}")
    verify_reach = args.verify_context + (max(args.verify_drafts) + 1) * (args.steps + 1)  # all accepted, at worst
    if verify_reach + 1 > args.max_seq_len:
        parser.error(f"--verify-context {args.verify_context} + {args.steps + 1} verify steps of up to "
                     f"{max(args.verify_drafts) + 1} tokens does not fit in --max-seq-len {args.max_seq_len}")
    require_gpu("decode_step")
    import cupy as cp

    from cullama import Llama
    from cullama.runtime.device import environment

    from cullama.bench.latency import prompt_ids, step_bytes

    try:
        bps, bandwidth = read_bandwidth()  # before the weights arrive: the buffer is a few GiB
        t0 = time.perf_counter()
        llm = Llama.synthetic(args.model, device="cuda", max_seq_len=args.max_seq_len)
        cp.cuda.Device().synchronize()
        cfg = llm.config
        weight_bytes = cfg.decode_weight_bytes()
        floor_ms = weight_bytes / bps * 1e3
        print(f"{args.model}: random weights on the GPU in {time.perf_counter() - t0:.1f} s; "
              f"{len(llm.runner.decode.launches)} launches per decode step; read bandwidth {bps / 1e9:.0f} GB/s "
              f"(cullama.bench.latency.measure_bandwidth); {weight_bytes / 1e9:.2f} GB of weights per step: floor "
              f"{floor_ms:.3f} ms")
        measure(llm, cp, prompt_ids(WARMUP_CONTEXT, cfg.vocab_size), WARMUP_STEPS)
        rows, parts = [], []
        verify = {"context": args.verify_context, "steps": args.steps, "trials": []}
        record = {"model": args.model, "read_bandwidth_bytes_per_s": bps, "bandwidth": bandwidth,
                  "weight_bytes": weight_bytes, "floor_ms": floor_ms, "environment": environment(), "rows": rows,
                  "verify": verify, "kernels": parts}
        for L in args.contexts:
            prompt = prompt_ids(L, cfg.vocab_size, seed=L)
            trials = [measure(llm, cp, prompt, args.steps) for _ in range(args.trials)]
            row = {"context": L, "steps": args.steps, "trials": trials}
            for key in ("graph_ms", "overlap_ms", "eager_ms", "next_ms", "ahead_ms"):
                row[key] = None if trials[0][key] is None else statistics.median(t[key] for t in trials)
            row["graph_spread_ms"] = [min(t["graph_ms"] for t in trials), max(t["graph_ms"] for t in trials)]
            row["graph_gb_s"] = weight_bytes / row["graph_ms"] / 1e6
            row["pct_of_floor"] = 100 * floor_ms / row["graph_ms"]
            # with the K and V the steps read too, at their mean context (as cullama bench counts GB/s)
            row["floor_kv_ms"] = step_bytes(cfg, L + (args.steps - 1) / 2) / bps * 1e3
            rows.append(row)
            overlapped = "n/a" if row["overlap_ms"] is None else f"{row['overlap_ms']:.3f}"
            print(f"  context {L}: graph {row['graph_ms']:.3f} ms/step, overlapped {overlapped}", flush=True)
            if args.json:
                save_json(args.json, record, args, complete=False)
        prompt = prompt_ids(args.verify_context, cfg.vocab_size, seed=args.verify_context)
        verify["trials"] = [verify_times(llm, cp, prompt, args.steps, args.verify_drafts) for _ in range(args.trials)]
        verify["plain_ms"] = statistics.median(t["plain_ms"] for t in verify["trials"])
        verify["rows"] = [{key: statistics.median(t["rows"][i][key] for t in verify["trials"]) if key != "k" else k
                           for key in ("k", "replay_ms", "verify_ms", "x_plain")}
                          for i, k in enumerate(args.verify_drafts)]
        if args.json:
            save_json(args.json, record, args, complete=False)
        L = args.breakdown_context
        parts += breakdown(llm, cp, prompt_ids(L, cfg.vocab_size, seed=L), args.steps)
    except CullamaError as exc:
        sys.exit(f"decode_step: {exc}")
    print(f"\n{'context':>8} {'graph ms':>9} {'min-max':>13} {'GB/s':>6} {'% bw':>6} {'floor ms':>9} "
          f"{'floor/graph':>11} {'+KV floor':>9} {'overlap ms':>10} {'eager ms':>9} {'next() ms':>10} {'ahead ms':>9}")
    for r in rows:
        lo, hi = r["graph_spread_ms"]
        print(f"{r['context']:>8} {r['graph_ms']:>9.3f} {f'{lo:.3f}-{hi:.3f}':>13} {r['graph_gb_s']:>6.0f} "
              f"{100 * r['graph_gb_s'] * 1e9 / bps:>5.1f}% {floor_ms:>9.3f} {r['pct_of_floor']:>10.1f}% "
              f"{r['floor_kv_ms']:>9.3f} {'n/a' if r['overlap_ms'] is None else format(r['overlap_ms'], '.3f'):>10} "
              f"{r['eager_ms']:>9.3f} {r['next_ms']:>10.3f} {r['ahead_ms']:>9.3f}")
    print(f"each row: {args.steps} steps at positions L..L+{args.steps - 1}, median of {args.trials} trials. "
          f"GB/s counts the weights only; floor = weights / read bandwidth; +KV floor adds the K and V read; "
          f"overlap = the same graph with programmatic dependent launch between its kernels (CULLAMA_OVERLAP=1); "
          f"eager = backend.run of the same plan; next() = replay + token id read back, arrival to arrival on "
          f"the host clock; ahead = the same with next(ahead=True), the next step queued first (as generation)")
    print(f"\nverify step (k drafts: k + 1 token rows in one pass) at context {args.verify_context}, {args.steps} "
          f"replays, median of {args.trials} trials; plain decode graph {verify['plain_ms']:.3f} ms/step:")
    print(f"{'k':>3} {'replay ms':>10} {'x plain':>8} {'target':>7} {'verify() ms':>12}")
    for r in verify["rows"]:
        target = f"<= {VERIFY_TARGETS[r['k']]:.2f}" if r["k"] in VERIFY_TARGETS else ""
        print(f"{r['k']:>3} {r['replay_ms']:>10.3f} {r['x_plain']:>8.3f} {target:>7} {r['verify_ms']:>12.3f}")
    print("replay: the verify graph alone (each replay accepts about one token here: fixed drafts on random "
          "weights); x plain: over the plain decode graph timed from the same prompt in the same trial; "
          "verify() ms: the host-observed call, ids in and verdict out")
    total = sum(p["us_per_step"] for p in parts)
    print(f"\nper kernel, inside the graph (events between launches), context {args.breakdown_context}, "
          f"{args.steps} steps:")
    print(f"{'kernel':<14} {'per step':>8} {'us each':>8} {'us/step':>8} {'share':>6} {'GB/s':>6}")
    for p in parts:
        print(f"{p['kernel']:<14} {p['count']:>8} {p['us_each']:>8.2f} {p['us_per_step']:>8.1f} "
              f"{100 * p['us_per_step'] / total:>5.1f}% {p['gb_s']:>6.0f}")
    print(f"{'sum':<14} {'':>8} {'':>8} {total:>8.1f}  (event nodes add their own small gaps)")
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
