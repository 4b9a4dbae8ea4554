"""GEMM sweep: the prefill GEMMs (gemm.cu, gemm_wgmma.cu, gemm_quant.cu) with and without split-K on the LLaMA-2-7B
shapes.

    python benchmarks/gemm_sweep.py [--json FILE] [--kernels mma,wgmma,mma-w4,mma-w8] [--rows 1,10,64,256]
                                    [--splits 2,4] [--trials N] [--launches N] [--l2-multiple K] [--model PRESET]

For each prefill matrix of LLaMA-2-7B (qkv 12288x4096, o_proj 4096x4096, gate_up 22016x4096,
down 4096x11008; o_proj and down accumulate into the residual, as in the plan), or of --model's
preset as the plan runs it (cullama.model.layout.device_config; the tests run `tiny` on a fake CuPy),
each GEMM kernel in --kernels (cullama.runtime.prefill_kernels: `mma` is gemm.cu, `wgmma` gemm_wgmma.cu as the
plan launches it, `wgmma-n128` / `wgmma-n256` / `wgmma-m64` / `wgmma-noswizzle` its other compiled
variants; `mma-w4` / `mma-w8` gemm_quant.cu, the same tiles and split rule on INT4 / INT8 weights as on-load
quantization makes them (gemv_sweep.Weights); default: mma, and wgmma on an sm_90 GPU) and each prompt length M in
--rows, times the kernel at S = 1 (no split), at the S that its split rule picks (marked "plan"), and at each S in
--splits. Launches are captured in a CUDA graph that rotates over copies of the weight matrix totalling several
times the L2, so no launch finds its weights in the cache; CUDA events time the replays. GB/s counts the weight
bytes once per launch (FP16, or codes and (scale, zero) pairs; what a short prompt's GEMM is bound by); TFLOP/s
is 2 M N K per launch; % is of the read bandwidth as `cullama bench` measures it. Before timing, each S is
checked: S = 1 against the NumPy twin (M <= 64; the GPU tests cover the rest), every S against S = 1 (float32
rounding), and S > 1 against itself on a rerun (bitwise: the split-K is deterministic). Run it on a GPU; without
one it says so in one line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import numpy as np

import dataclasses

from cullama.runtime import prefill_kernels
from cullama.model.config import preset
from cullama.common.errors import CullamaError
from cullama.runtime.ops import gemm as twin
from cullama.runtime.ops import gemm_quant as quant_twin
from cullama.runtime.ops import gemm_wgmma as wgmma_ops
from cullama.runtime.prefill_kernels import MMA_GEMM, WGMMA_GEMM, GemmKernel, PrefillKernels, cdiv
from cullama.runtime.registry import KernelSpec
from gemv_sweep import (Weights, events_ms, positive_int, positive_ints, random_fp16, read_bandwidth, require_gpu,
                        save_json)


def wgmma_variant(defines: tuple) -> GemmKernel:
    """The plan's wgmma GEMM with another compiled variant's defines and geometry (same split rule)."""
    g = wgmma_ops.geometry(defines)
    return dataclasses.replace(WGMMA_GEMM, spec=dataclasses.replace(WGMMA_GEMM.spec, defines=defines),
                               tile_m=g.tile_m, tile_n=g.tile_n, threads=g.threads, smem=g.smem_bytes)


def quant_variant(bits: int) -> GemmKernel:
    """gemm_quant.cu for `bits`-bit weights: gemm.cu's geometry and split rule (prefill_kernels.MMA_GEMM)."""
    return dataclasses.replace(MMA_GEMM, name=f"mma-w{bits}",
                               spec=KernelSpec(quant_twin.SOURCE, "gemm_quant", quant_twin.defines(bits)))


# --kernels names: the plan's two GEMMs, then gemm_wgmma's other compiled variants (ops/gemm_wgmma.VARIANTS), then
# the quantized GEMM per bits
KERNELS = {"mma": MMA_GEMM, "wgmma": WGMMA_GEMM,
           "wgmma-n256": wgmma_variant((("GW_TILE_N", 256), ("GW_STAGES", 4))),
           "wgmma-n128": wgmma_variant((("GW_TILE_N", 128), ("GW_STAGES", 6))),
           "wgmma-m64": wgmma_variant((("GW_WARPGROUPS", 1), ("GW_TILE_N", 256), ("GW_STAGES", 5))),
           "wgmma-noswizzle": wgmma_variant((("GW_SWIZZLE", 0),)),
           "mma-w4": quant_variant(4), "mma-w8": quant_variant(8)}
assert all(k.spec.defines in wgmma_ops.VARIANTS for k in KERNELS.values() if k.spec.arch_specific)


def weights_of(kernel: GemmKernel) -> Weights:
    """How the kernel's weights are stored (FP16, or gemm_quant's BITS)."""
    return Weights(dict(kernel.spec.defines)["BITS"]) if kernel.spec.source == quant_twin.SOURCE else Weights()


def shapes(cfg):
    """(label, N, K, accumulate) of each prefill GEMM of a layer, as prefill_plan launches them."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return [(f"qkv {cfg.qkv_dim}x{d}", cfg.qkv_dim, d, 0),
            (f"o_proj {d}x{cfg.q_dim}", d, cfg.q_dim, 1),
            (f"gate_up {2 * ff}x{d}", 2 * ff, d, 0),
            (f"down {d}x{ff}", d, ff, 1)]


def launcher(kernel: GemmKernel, fn, A, C, workspace, count, M, N, K, accumulate, splits):
    """run(copy): one launch on a weight copy ({parameter name: device array}, gemv_sweep.Weights.make)."""
    grid = (cdiv(N, kernel.tile_n), cdiv(M, kernel.tile_m), splits)
    weights = weights_of(kernel)
    scalars = (np.int32(M), np.int32(N), np.int32(K), np.int32(accumulate)) + tuple(v for _, v in weights.scalars(K))
    return lambda copy: fn(grid, (kernel.threads,), (A, *(copy[n] for n in weights.names), C, workspace, count)
                           + scalars, shared_mem=kernel.smem)


def load(loader, kernel: GemmKernel):
    """The loaded kernel, allowed its dynamic shared memory (wgmma: ~200 KB, beyond the default 48 KB)."""
    from cullama.runtime.backends.func_attr import allow_dynamic_shared

    fn = loader.function(kernel.spec)
    if kernel.smem > 48 * 1024:
        allow_dynamic_shared(fn, kernel.smem)
    return fn


def sweep_shape(cp, loader, name, label, N, K, accumulate, args) -> list[dict]:
    kernel = KERNELS[name]
    weights = weights_of(kernel)
    fn = load(loader, kernel)
    nbytes = weights.nbytes(N, K)
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    n_copies = max(3, math.ceil(args.l2_multiple * l2 / nbytes))
    copies = [weights.make(cp, loader, N, K, seed=1 + i) for i in range(n_copies)]
    W_host = None  # copies[0] on the host, fetched once for the twin
    launches = n_copies * math.ceil(args.launches / n_copies)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    rows = []
    for M in args.rows:
        plan_s = kernel.splits(M, N, K)
        candidates = sorted({1, plan_s, *args.splits})
        tiles = kernel.tiles(M, N)
        A = random_fp16(cp, loader, (M, K), seed=1000 + M, std=1.0)
        C0 = rng.standard_normal((M, N)).astype(np.float32)
        C = cp.asarray(C0)
        workspace = cp.zeros(max(candidates) * tiles * kernel.tile_m * kernel.tile_n, dtype=cp.float32)
        count = cp.zeros(tiles, dtype=cp.uint32)
        cp.cuda.Device().synchronize()  # made on the default stream; used on `stream`
        results = {}
        for splits in candidates:
            run = launcher(kernel, fn, A, C, workspace, count, M, N, K, accumulate, splits)
            outs = []
            with stream:
                for _ in range(2 if splits > 1 else 1):  # S > 1 twice: bitwise the same
                    C.set(C0, stream=stream)
                    run(copies[0])
                    outs.append(C.get(stream=stream))
            stream.synchronize()
            results[splits] = outs[0]
            ok, notes = bool(np.isfinite(outs[0]).all() and not count.get().any()), []
            if splits == 1 and M <= 64:
                if W_host is None:
                    W_host = [copies[0][n].get() for n in weights.names]
                ref = C0.copy()
                if weights.bits == 16:
                    twin.gemm(A.get(), *W_host, ref, None, None, M, N, K, accumulate)
                else:
                    quant_twin.gemm_quant(A.get(), *W_host, ref, None, None, M, N, K, accumulate, weights.group(K))
                err = float(np.linalg.norm(outs[0] - ref) / np.linalg.norm(ref - (C0 if accumulate else 0)))
                ok &= err <= 1e-3
                notes.append(f"twin rel err {err:.1e}")
            if splits > 1:
                diff = float(np.max(np.abs(outs[0] - results[1])) / max(float(np.max(np.abs(results[1]))), 1e-30))
                ok &= diff <= 1e-5
                notes.append(f"vs S=1 {diff:.1e}")
                same = bool(np.array_equal(outs[0], outs[1]))
                ok &= same
                if not same:
                    notes.append("NOT DETERMINISTIC")
            with stream:
                stream.begin_capture()
                try:
                    for i in range(launches):
                        run(copies[i % n_copies])
                finally:
                    graph = stream.end_capture()
                graph.launch(stream)  # warm-up
                per_launch = [events_ms(cp, stream, lambda: graph.launch(stream), 1) / launches
                              for _ in range(args.trials)]
            us = statistics.median(per_launch) * 1e3
            rows.append({"kernel": name, "bits": weights.bits, "shape": label, "M": M, "N": N, "K": K,
                         "accumulate": accumulate,
                         "splits": splits, "plan_splits": plan_s, "tiles": tiles, "blocks": tiles * splits, "us": us,
                         "us_min": min(per_launch) * 1e3, "us_max": max(per_launch) * 1e3,
                         "gb_s": nbytes / us / 1e3, "tflop_s": 2 * M * N * K / us / 1e6, "weight_bytes": nbytes,
                         "copies": n_copies, "launches_per_graph": launches, "check_ok": ok,
                         "check": "; ".join(notes)})
        base = next(r["us"] for r in rows if r["shape"] == label and r["M"] == M and r["splits"] == 1)
        for r in rows:
            if r["shape"] == label and r["M"] == M:
                r["speedup_vs_s1"] = base / r["us"]
        del A, C, workspace, count
    del copies
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def kernel_names(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    unknown = [n for n in names if n not in KERNELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(KERNELS)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every row and the environment here")
    parser.add_argument("--kernels", type=kernel_names, help=f"GEMM kernels among {', '.join(KERNELS)} "
                        "[default: mma, and wgmma on an sm_90 GPU]")
    parser.add_argument("--rows", type=positive_ints, default=[1, 10, 64, 256], help="prompt rows M (comma-separated)")
    parser.add_argument("--splits", type=positive_ints, default=[2, 4], help="split counts timed besides 1 and the plan's")
    parser.add_argument("--trials", type=positive_int, default=10, help="timed graph replays per case (median)")
    parser.add_argument("--launches", type=positive_int, default=24, help="launches per captured graph (at least)")
    parser.add_argument("--l2-multiple", type=float, default=4.0,
                        help="weight copies totalling at least this many times the L2")
    parser.add_argument("--model", default="llama-2-7b", help="preset whose prefill GEMM shapes are swept")
    args = parser.parse_args(argv)
    require_gpu("gemm_sweep")
    import cupy as cp

    from cullama.runtime.device import environment
    from cullama.model.layout import device_config
    from cullama.runtime.registry import KernelLoader

    try:
        cfg, loader = device_config(preset(args.model)), KernelLoader()
        wgmma = PrefillKernels(gemm="wgmma")
        names = args.kernels or (["mma", "wgmma"] if wgmma.runs_on(loader.arch) else ["mma"])
        if any(KERNELS[n].spec.arch_specific for n in names):
            wgmma.check_arch(loader.arch)  # a one-line error on anything but sm_90
        bps, bandwidth = read_bandwidth()
        print(f"read bandwidth: {bps / 1e9:.0f} GB/s (cullama.bench.latency.measure_bandwidth, "
              f"{bandwidth['statistic']}); SPLIT_K={prefill_kernels.SPLIT_K}; kernels {', '.join(names)}")
        rows = []
        record = {"model": args.model, "read_bandwidth_bytes_per_s": bps, "bandwidth": bandwidth,
                  "environment": environment(), "split_k": prefill_kernels.SPLIT_K, "kernels": names, "rows": rows}
        for name in names:
            for label, N, K, accumulate in shapes(cfg):
                if not weights_of(KERNELS[name]).holds(K):
                    print(f"skipped {name} {label}: K = {K} is not a multiple of the 16-byte vector of codes")
                    continue
                for r in sweep_shape(cp, loader, name, label, N, K, accumulate, args):
                    r["pct_read_bw"] = 100 * r["gb_s"] * 1e9 / bps
                    rows.append(r)
                if args.json:
                    save_json(args.json, record, args, complete=False)
    except CullamaError as exc:
        sys.exit(f"gemm_sweep: {exc}")
    best, fastest = {}, {}
    for r in rows:
        key = (r["kernel"], r["shape"], r["M"])
        if r["check_ok"] and r["us"] < best.get(key, {"us": math.inf})["us"]:
            best[key] = r
        if r["check_ok"] and r["us"] < fastest.get(key[1:], {"us": math.inf})["us"]:
            fastest[key[1:]] = r
    print(f"{'kernel':<15} {'shape':<20} {'M':>4} {'S':>2} {'blocks':>6} {'us':>8} {'min-max us':>15} {'GB/s':>6} "
          f"{'% bw':>6} {'TFLOP/s':>7} {'x S=1':>6}  check")
    for r in rows:
        mark = ("*" if best.get((r["kernel"], r["shape"], r["M"])) is r else " ")
        mark += "p" if r["splits"] == r["plan_splits"] else " "
        mark += "!" if fastest.get((r["shape"], r["M"])) is r else " "
        spread = f"{r['us_min']:.1f}-{r['us_max']:.1f}"
        check = ("ok" if r["check_ok"] else "WRONG") + (f" ({r['check']})" if r["check"] else "")
        print(f"{r['kernel']:<15} {r['shape']:<20} {r['M']:>4} {r['splits']:>2} {r['blocks']:>6} {r['us']:>8.1f} "
              f"{spread:>15} {r['gb_s']:>6.0f} {r['pct_read_bw']:>5.1f}% {r['tflop_s']:>7.1f} "
              f"{r['speedup_vs_s1']:>5.2f}x{mark} {check}")
    print("* fastest correct S per kernel, shape and M; p: the S that the kernel's split rule picks "
          "(cullama.runtime.prefill_kernels); !: the fastest of all kernels for that shape and M")
    agree = sum(best[k]["splits"] == best[k]["plan_splits"] for k in best)
    print(f"the plan's S is the fastest in {agree} of {len(best)} cases")
    for name in names:
        wins = sum(r["kernel"] == name for r in fastest.values())
        print(f"{name}: fastest in {wins} of {len(fastest)} (shape, M) cases")
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0 if all(r["check_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
