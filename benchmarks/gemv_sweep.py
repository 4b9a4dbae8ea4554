"""GEMV sweep: every gemv_mma.cu variant on every LLaMA-2-7B matrix shape, in GB/s and % of read bandwidth.

    python benchmarks/gemv_sweep.py [--json FILE] [--bits 16|4,8] [--rows 1,2,5,9,16] [--trials N] [--launches N]
                                    [--l2-multiple K] [--model PRESET]

Each shape is timed with the kernel the decode step uses for it (qkv: gemv_qkv_rope, o_proj and
down: gemv_residual, gate_up: gemv_gate_up_silu, lm_head: gemv_logits), one token row, in every variant of
SWEEP below (the plan's, then the candidates). --model sweeps another preset's shapes instead, as the decode
step runs them (cullama.model.layout.device_config; the tests run `tiny` on a fake CuPy). Launches are
captured in a CUDA graph (as in the decode step) that rotates over copies of the weight matrix
totalling several times the L2, so no launch finds its weights in the cache; CUDA events time the
replays. On sm_90 and newer the same launches are timed again linked by programmatic dependent launch
(the decode graph's overlap mode, CULLAMA_OVERLAP=1: each launch streams its weights during the
previous one's tail). GB/s counts the FP16 weight bytes only (the vectors are < 0.2 % of the
traffic); % is of the read bandwidth as `cullama bench` measures it (cullama.bench.latency.measure_bandwidth).
Before timing, each variant's output is checked against the kernel's NumPy twin. Run it on a GPU;
without one it says so in one line.
--bits 4,8 sweeps gemv_mma.cu on quantized weights instead (W4A16 and W8A16: SWEEP's variants for those bits, the
four weight matrices: no quantized lm_head), with
weights as on-load quantization makes them (Weights below: INT4 in groups of 128 along K, INT8 one group per row); GB/s
is then the effective weight bandwidth, the bytes of codes and (scale, zero) pairs that a decode step reads
(quant.QuantFormat.nbytes), and a shape the format cannot hold (K not a multiple of the 16-byte vector) is skipped with
a line saying so.
--rows T1,T2,... (issue 26) sweeps the token rows instead: per bits and shape, for each count the launch a batched
step of that many rows makes (a verify step's kernel; the decode step's for 1), read off the plans with its own
arguments, bound to random buffers as the backends bind them (cullama/bench/gemvs.py: gemv.cu / gemv_quant.cu's TOKENS
variants today, gemv_mma.cu once the plans launch it, whatever its parameters), checked against its twin, in
effective TB/s and as its time against the same shape's 1-row time (the targets: 16 rows <= 1.15x one row;
benchmarks/PREDICTIONS.md predicts both). A count no plan launches (over 9 today) is skipped with a line. The shapes
are the plans' (quantized: intermediate_size padded to 32, as on-load quantization runs them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys

import numpy as np

from cullama.runtime import plan as plans
from cullama.model import quant
from cullama.model.config import preset
from cullama.common.errors import CullamaError
from cullama.runtime import ops
from cullama.runtime.ops import gemv_mma as twins
from cullama.runtime.registry import KernelLoader, KernelSpec


def require_gpu(prog: str) -> None:
    """Exit with one line when there is no usable GPU."""
    from cullama.runtime.device import cuda_status

    ok, why = cuda_status()
    if not ok:
        sys.exit(f"{prog}: needs an NVIDIA GPU: {why}")


def positive_int(text: str) -> int:
    """argparse type of a count: 0 would divide by zero, or take the median of nothing."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type of a comma-separated list of counts (lengths, rows, splits): at least one, all >= 1."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def events_ms(cp, stream, fn, reps: int) -> float:
    """Milliseconds per call of fn, by CUDA events on `stream` around `reps` back-to-back calls."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps


def save_json(path: str, record: dict, args: argparse.Namespace, complete: bool) -> None:
    """Write a script's record with the date, the commit, its options and whether it ran to the end. The
    scripts call it after each unit of work, so that a step cut short by its timeout still leaves what it
    measured; written to a temporary file first, so a reader never sees half a file."""
    from cullama.bench.latency import git_commit

    options = {k: v for k, v in vars(args).items() if k != "json"}
    full = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "options": options, "complete": complete, **record}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(full, f, indent=1)
    os.replace(tmp, path)


def read_bandwidth() -> tuple[float, dict]:
    """(bytes/s, record): this GPU's read bandwidth as `cullama bench` measures it, for every % here."""
    from cullama.bench.latency import measure_bandwidth

    record = measure_bandwidth()
    return record["bytes_per_s"], record


# -- the shapes and their kernels ----------------------------------------------------------------
def shapes(cfg):
    """(label, kernel, M, K) for each decode-step matrix of the model."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return [(f"qkv {cfg.qkv_dim}x{d}", "gemv_qkv_rope", cfg.qkv_dim, d),
            (f"o_proj {d}x{cfg.q_dim}", "gemv_residual", d, cfg.q_dim),
            (f"gate_up {2 * ff}x{d}", "gemv_gate_up_silu", 2 * ff, d),
            (f"down {d}x{ff}", "gemv_residual", d, ff),
            (f"lm_head {cfg.vocab_size}x{d}", "gemv_logits", cfg.vocab_size, d)]


def case(kernel: str, cfg, M: int, K: int, rng, max_seq: int = 64):
    """(named args in the kernel's order with W as None, names of the outputs); host NumPy arrays."""
    i32, f32 = np.int32, np.float32
    vec = lambda n: rng.standard_normal(n).astype(np.float32)  # noqa: E731
    poison = lambda n: np.full(n, np.nan, np.float32)  # noqa: E731
    norm_w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float16)
    eps = f32(cfg.rms_norm_eps)
    # the RMSNorm kernels' input as gemv_residual prepares it (the plans' form): xn and Σ x² in parts
    xn, ssp = twins.prepare(vec(K)[None], norm_w, K)
    prepared = [("xn", xn[0]), ("ssp", ssp[0])]
    if kernel == "gemv_qkv_rope":
        state = np.zeros(8, np.int32)
        state[0] = max_seq - 1  # the position written in the KV cache
        cache = lambda: np.zeros((cfg.num_kv_heads, max_seq, cfg.head_dim), np.float16)  # noqa: E731
        return (prepared + [("W", None), ("bias", np.zeros(M, np.float16)),
                 ("q", poison(cfg.q_dim)), ("k", cache()), ("v", cache()), ("rope", plans.rope_table(cfg, max_seq)),
                 ("state", state), ("rows", np.zeros((1, 2), np.int32)), ("d", i32(K)),
                 ("heads", i32(cfg.num_heads)), ("kv_heads", i32(cfg.num_kv_heads)), ("hd", i32(cfg.head_dim)),
                 ("max_seq", i32(max_seq)), ("eps", eps)], ["q", "k", "v"])
    if kernel == "gemv_residual":  # the input: FP16 (attention's output, gate_up's h)
        inp = vec(K).astype(np.float16)
        next_norm = (1 + 0.1 * rng.standard_normal(M)).astype(np.float16)
        return ([("in", inp), ("W", None), ("x", vec(M)), ("norm_w", next_norm), ("xn", np.zeros(M, np.float16)),
                 ("ssp", np.zeros(plans.ss_parts(M), np.float32)), ("M", i32(M)), ("K", i32(K))], ["x"])
    if kernel == "gemv_gate_up_silu":
        return (prepared + [("W", None), ("h", poison(M // 2).astype(np.float16)), ("ff", i32(M // 2)), ("d", i32(K)),
                            ("eps", eps)],
                ["h"])
    return prepared + [("W", None), ("logits", poison(M)), ("V", i32(M)), ("d", i32(K)), ("eps", eps)], ["logits"]


def random_fp16(cp, loader, shape, seed: int, std: float = 0.02):
    """Random FP16 weights made on the GPU by kernels_cu/fill.cu (never zeros: they can time faster)."""
    from cullama.runtime.load import FILL

    out = cp.empty(shape, dtype=cp.float16)
    loader.function(FILL)((1024,), (256,), (out, np.uint64(out.size), np.uint64(seed), np.float32(0), np.float32(std)))
    return out


# -- the weights a sweep streams: FP16 (gemv_mma.cu, gemm.cu) or quantized (gemv_mma.cu, gemm_quant.cu) -----------
@dataclasses.dataclass(frozen=True)
class Weights:
    """How the swept matrices are stored: bits 16 is FP16; 4 and 8 are cullama/model/quant.py's format as on-load
    quantization makes it (INT4 in groups of 128 along K, or the largest multiple of 32 below that divides K;
    INT8 one group per row). Gemv_sweep and gemm_sweep share it."""

    bits: int = 16

    @property
    def names(self) -> tuple[str, ...]:
        """The kernels' weight parameters, in order, where FP16 kernels take W."""
        return ("W",) if self.bits == 16 else ("qweight", "qparams")

    def group(self, K: int) -> int | None:
        """The group size along K (None: the format cannot hold a row of K)."""
        if self.bits == 8:
            return K if K % quant.VECTOR[8] == 0 else None
        return next((g for g in range(quant.INT4_GROUP, 0, -quant.VECTOR[4]) if K % g == 0), None)

    def holds(self, K: int) -> bool:
        return self.bits == 16 or self.group(K) is not None

    def nbytes(self, M: int, K: int) -> int:
        """Bytes a launch reads for the matrix: FP16 W, or codes and (scale, zero) pairs."""
        return 2 * M * K if self.bits == 16 else quant.QuantFormat(self.bits, self.group(K)).nbytes(M, K)

    def make(self, cp, loader, M: int, K: int, seed: int) -> dict:
        """One random device copy of an [M, K] matrix: {parameter name: array}. Codes are random FP16 bits (any
        word is a valid word of codes); scales of both signs, zeros anywhere in 0 .. 2**bits."""
        if self.bits == 16:
            return {"W": random_fp16(cp, loader, (M, K), seed)}
        rng = np.random.default_rng(seed)
        groups = K // self.group(K)
        scale = (0.02 * 2 / (1 << self.bits) * rng.standard_normal((M, groups))).astype(np.float16)
        zero = rng.integers(0, (1 << self.bits) + 1, (M, groups))
        codes = random_fp16(cp, loader, (M, K * self.bits // 16), seed).view(cp.uint32)  # [M, K bits / 32]
        return {"qweight": codes, "qparams": cp.asarray(quant.params(scale, zero))}

    def scalars(self, K: int) -> list:
        """The kernels' arguments after their FP16 twins' last one: the group size."""
        return [] if self.bits == 16 else [("group", np.int32(self.group(K)))]

    def args(self, named: list, K: int) -> list:
        """A kernel's (name, value) arguments with ("W", None) replaced by this storage's (name, None) and its
        scalars appended."""
        out = []
        for name, value in named:
            out += [(n, None) for n in self.names] if name == "W" else [(name, value)]
        return out + self.scalars(K)

    def label(self) -> str:
        return "FP16" if self.bits == 16 else f"W{self.bits}"


def overlap_launcher(loader):
    """backends.pdl's launcher where the GPU has programmatic dependent launch (sm_90 and newer), else None."""
    from cullama.runtime.backends import pdl

    return pdl.PdlLauncher() if pdl.supported(loader.arch) else None


def graph_us(cp, stream, launches: int, launch, trials: int) -> list[float]:
    """Microseconds per launch of `trials` replays of one graph of launch(0) .. launch(launches - 1)."""
    with stream:
        stream.begin_capture()
        try:
            for i in range(launches):
                launch(i)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)  # warm-up
        return [events_ms(cp, stream, lambda: graph.launch(stream), 1) / launches * 1e3 for _ in range(trials)]


def sweep_variants(bits: int, group: int = 0) -> list[tuple]:
    """The variants timed for `bits` on weights in groups of `group` (quantized), one token row (a decode step): the
    plan's first (its KBLOCK_SCALE form where the groups hold whole k-blocks), then NTILES 2 (16 rows a block, twice
    the blocks: the candidate for the 7B o_proj / down's 128 blocks on 132 SMs)."""
    plan = twins.defines(bits, 1, group)
    return [plan, plan + (("NTILES", 2),)]


SWEEP = {bits: sweep_variants(bits) for bits in twins.FORMATS}  # without groups (FP16's are the plan's)


def gemv_kernels(weights: Weights, K: int):
    """(source, twins module, decode variants) of the GEMV kernels for this storage and K."""
    return twins.SOURCE, twins, sweep_variants(weights.bits, 0 if weights.bits == 16 else weights.group(K))


def gemv_args(weights: Weights, kernel: str, named: list, K: int) -> list:
    """The kernel's (name, value) arguments: one gemv_mma signature for every BITS, (W, qparams) and `group` last;
    an FP16 kernel is passed W twice and group 0 (unread), as the plans do; gemv_logits (FP16 only) has neither."""
    if weights.bits != 16 or kernel == "gemv_logits":
        return weights.args(named, K)
    out = []
    for name, value in named:
        out += [("W", None), ("W", None)] if name == "W" else [(name, value)]
    return out + [("group", np.int32(0))]


def sweep_shape(cp, loader, cfg, label, kernel, M, K, args, pdl=None, weights=Weights()) -> list[dict]:
    rng = np.random.default_rng(0)
    named, outputs = case(kernel, cfg, M, K, rng)
    named = gemv_args(weights, kernel, named, K)
    source, module, variants = gemv_kernels(weights, K)
    nbytes = weights.nbytes(M, K)
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    n_copies = max(3, math.ceil(args.l2_multiple * l2 / nbytes))
    copies = [weights.make(cp, loader, M, K, seed=1 + i) for i in range(n_copies)]
    # The specification: the twin on the host, on the inputs as they are before any launch.
    host = {n: (a.copy() if isinstance(a, np.ndarray) else a) for n, a in named if a is not None}
    host.update({n: a.get() for n, a in copies[0].items()})
    getattr(module, kernel)(*(host[n] for n, _ in named))
    expected = np.concatenate([host[n].astype(np.float32).ravel() for n in outputs])
    dev = {n: cp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in named if a is not None}
    cp.cuda.Device().synchronize()  # made on the default stream; used on `stream`
    launches = n_copies * math.ceil(args.launches / n_copies)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for defines in variants:
        variant = " ".join(f"{k}={v}" for k, v in defines)
        fn = loader.function(KernelSpec(source, kernel, tuple(defines)))
        grid = (plans.cdiv(M, twins.rows_per_block(defines)), 1, 1)  # ROWS rows (or ROWS/2 pairs) per block
        argv = lambda copy: tuple(copy[n] if n in copy else dev[n] for n, _ in named)  # noqa: E731
        with stream:
            for n in outputs:  # poisoned (or the residual's starting x) before the checked launch
                dev[n].set(dict(named)[n], stream=stream)
            fn(grid, (plans.GEMV_THREADS,), argv(copies[0]))
        stream.synchronize()
        got = np.concatenate([dev[n].get().astype(np.float32).ravel() for n in outputs])
        err = float(np.max(np.abs(got - expected)) / max(float(np.max(np.abs(expected))), 1e-30))
        ok = bool(np.isfinite(got).all() and err < 2e-3)
        block = (plans.GEMV_THREADS,)
        per_launch = graph_us(cp, stream, launches, lambda i: fn(grid, block, argv(copies[i % n_copies])), args.trials)
        us = statistics.median(per_launch)
        row = {"shape": label, "kernel": kernel, "bits": weights.bits, "M": M, "K": K, "variant": variant,
               "defines": dict(defines), "us": us, "us_min": min(per_launch), "us_max": max(per_launch),
               "gb_s": nbytes / us / 1e3, "weight_bytes": nbytes, "copies": n_copies, "launches_per_graph": launches,
               "check_rel_err": err, "check_ok": ok, "us_overlap": None, "gb_s_overlap": None}
        if pdl is not None:  # the first launch waits for what came before the graph, as in the decode step
            overlapped = graph_us(cp, stream, launches, lambda i: fn(grid, block, argv(copies[0])) if i == 0 else
                                  pdl(fn, grid, (block[0], 1, 1), argv(copies[i % n_copies]), stream.ptr), args.trials)
            row["us_overlap"] = statistics.median(overlapped)
            row["gb_s_overlap"] = nbytes / row["us_overlap"] / 1e3
        rows.append(row)
    copies.clear()  # the weight copies go back to the pool (a closure above still names the list)
    cp.get_default_memory_pool().free_all_blocks()
    return rows


FORMAT_OF_BITS = {16: "float16", 8: "int8", 4: "int4"}


def sweep_rows_shape(cp, loader, layout, shape: str, tokens: list[int], args, pdl, weights: Weights,
                     skipped: list[str]) -> list[dict]:
    """--rows, one shape: for each token count the launch a batched step of that many rows makes (the verify step's
    kernel; the decode step's for 1), bound to its buffers as the backends bind them (cullama/bench/gemvs.py: random
    content, the plans' own parameters whatever they are), checked against its twin, timed over weight copies
    beyond the L2. A count no plan launches is added to `skipped`."""
    from cullama.bench import gemvs
    from cullama.runtime.plan import Ref

    launches = {t: gemvs.batch_launches(layout, t).get(shape) if t <= plans.VERIFY_ROWS else None for t in tokens}
    first = next((launch for launch in launches.values() if launch is not None), None)
    if first is None:
        return []
    names = gemvs.matrix_names(first, layout)
    M, K = layout.shape(gemvs.FIELDS[shape]) if shape in gemvs.FIELDS else (layout.device.vocab_size,
                                                                               layout.device.hidden_size)
    label = f"{shape} {M}x{K}"
    nbytes = weights.nbytes(M, K)
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    n_copies = max(3, math.ceil(args.l2_multiple * l2 / nbytes))
    made = [weights.make(cp, loader, M, K, seed=1 + i) for i in range(n_copies)]
    copies = [dict(zip(names, (m[n] for n in weights.names))) for m in made]  # buffer name -> device array
    n_launches = n_copies * math.ceil(args.launches / n_copies)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for t, launch in launches.items():
        if launch is None:
            skipped.append(f"{weights.label()} {label}: no plan launches a GEMV for {t} token rows "
                           f"(at most {plans.VERIFY_ROWS})")
            print(f"skipped {skipped[-1]}")
            continue
        host = gemvs.launch_buffers(launch, layout, np.random.default_rng(t), matrices=False)
        twin_bufs = {n: a.copy() for n, a in host.items()} | {n: a.get() for n, a in copies[0].items()}
        bind = lambda bufs: tuple(a.of(bufs[a.name]) if isinstance(a, Ref) else a for a in launch.args)  # noqa: E731
        ops.twin(launch.spec.source, launch.spec.name)(*bind(twin_bufs))
        dev = {n: cp.asarray(a) for n, a in host.items()}
        cp.cuda.Device().synchronize()  # made on the default stream; used on `stream`
        fn, grid, block = loader.function(launch.spec), launch.grid, (launch.block,)
        with stream:
            fn(grid, block, bind(dev | copies[0]))
        stream.synchronize()
        got = np.concatenate([dev[n].get().astype(np.float32).ravel() for n in host])
        expected = np.concatenate([twin_bufs[n].astype(np.float32).ravel() for n in host])
        err = float(np.max(np.abs(got - expected)) / max(float(np.max(np.abs(expected))), 1e-30))
        ok = bool(np.isfinite(got).all() and err < 2e-3)
        per_launch = graph_us(cp, stream, n_launches, lambda i: fn(grid, block, bind(dev | copies[i % n_copies])),
                              args.trials)
        us = statistics.median(per_launch)
        row = {"shape": label, "kernel": launch.spec.name, "bits": weights.bits, "M": M, "K": K,
               "variant": f"{launch.spec.source} " + " ".join(f"{k}={v}" for k, v in launch.spec.defines),
               "source": launch.spec.source, "defines": dict(launch.spec.defines), "tokens": t, "grid": list(grid),
               "us": us, "us_min": min(per_launch), "us_max": max(per_launch), "gb_s": nbytes / us / 1e3,
               "weight_bytes": nbytes, "copies": n_copies, "launches_per_graph": n_launches, "check_rel_err": err,
               "check_ok": ok, "us_overlap": None, "gb_s_overlap": None}
        if pdl is not None:  # the first launch waits for what came before the graph, as in the decode step
            overlapped = graph_us(cp, stream, n_launches, lambda i: fn(grid, block, bind(dev | copies[0])) if i == 0
                                  else pdl(fn, grid, (block[0], 1, 1), bind(dev | copies[i % n_copies]), stream.ptr),
                                  args.trials)
            row["us_overlap"] = statistics.median(overlapped)
            row["gb_s_overlap"] = nbytes / row["us_overlap"] / 1e3
        rows.append(row)
    made.clear()
    copies.clear()  # the weight copies go back to the pool (a closure above still names the list)
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def bits_list(text: str) -> list[int]:
    """argparse type of --bits: 16 (FP16) or any of 4 and 8 (W4A16 / W8A16), comma-separated."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or not (values == [16] or set(values) <= set(quant.BITS)):
        raise argparse.ArgumentTypeError(f"{text!r}: give 16 (FP16) or any of {', '.join(map(str, quant.BITS))}")
    return values


def token_rows(text: str) -> list[int]:
    """argparse type of --rows: token counts from 1 to 16, comma-separated."""
    values = positive_ints(text)
    if max(values) > 16:
        raise argparse.ArgumentTypeError(f"{text!r}: token rows are 1 to 16")
    return values


def plan_variant(bits: list[int]) -> str:
    """The variant(s) the plan launches for a decode step, as the table's footnote and the record say."""
    return ", ".join(" ".join(f"{k}={v}" for k, v in twins.defines(b)) for b in bits)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every row and the environment here")
    parser.add_argument("--trials", type=positive_int, default=20, help="timed graph replays per variant (median)")
    parser.add_argument("--launches", type=positive_int, default=64, help="launches per captured graph (at least)")
    parser.add_argument("--l2-multiple", type=float, default=6.0,
                        help="weight copies totalling at least this many times the L2")
    parser.add_argument("--model", default="llama-2-7b", help="preset whose decode-step shapes are swept")
    parser.add_argument("--bits", type=bits_list, default=[16],
                        help="16: FP16 weights; 4,8: the quantized ones (gemv_mma.cu BITS) [16]")
    parser.add_argument("--rows", type=token_rows, default=None,
                        help="token rows, e.g. 1,2,5,9,16: time the kernel the plans launch for each count (decode, "
                             "verify, batch) per shape, in TB/s and against the 1-row time, instead of the decode "
                             "variants at one row")
    args = parser.parse_args(argv)
    require_gpu("gemv_sweep")
    import cupy as cp

    from cullama.runtime.device import environment
    from cullama.model.layout import device_config

    try:
        cfg, loader = device_config(preset(args.model)), KernelLoader()
        pdl = overlap_launcher(loader)
        bps, bandwidth = read_bandwidth()
        print(f"read bandwidth: {bps / 1e9:.0f} GB/s (cullama.bench.latency.measure_bandwidth, "
              f"{bandwidth['statistic']}); overlapped launches: {'timed too' if pdl else 'not on ' + loader.arch}")
        rows, skipped = [], []
        record = {"model": args.model, "plan_variant": plan_variant(args.bits),
                  "read_bandwidth_bytes_per_s": bps, "bandwidth": bandwidth, "environment": environment(),
                  "bits": args.bits, "rows": rows, "skipped": skipped}
        if args.rows:
            record["plan_variant"], record["token_rows"] = "read off the plans per row count", args.rows
            sweep_rows(cp, loader, args, pdl, bps, record)
        for bits in args.bits if not args.rows else []:
            weights = Weights(bits)
            for label, kernel, M, K in shapes(cfg):
                if kernel == "gemv_logits" and bits != 16:
                    continue  # the lm_head stays FP16
                if not weights.holds(K):
                    skipped.append(f"{weights.label()} {label}: K = {K} is not a multiple of {quant.VECTOR[bits]}")
                    print(f"skipped {skipped[-1]}")
                    continue
                for r in sweep_shape(cp, loader, cfg, label, kernel, M, K, args, pdl, weights):
                    r["pct_read_bw"] = 100 * r["gb_s"] * 1e9 / bps
                    rows.append(r)
                if args.json:
                    save_json(args.json, record, args, complete=False)
    except CullamaError as exc:
        sys.exit(f"gemv_sweep: {exc}")
    if args.rows:
        print_rows(rows, bps)
    else:
        print_variants(rows, args, bps)
    if args.json:
        save_json(args.json, record, args, complete=True)
        print(f"wrote {args.json}")
    return 0 if all(r["check_ok"] for r in rows) else 1


def sweep_rows(cp, loader, args, pdl, bps: float, record: dict) -> None:
    """--rows: per bits and shape, the plans' kernel for each token count, into record["rows"] (with the time against
    the same shape's 1-row time, where 1 is among the counts) and record["skipped"]."""
    from cullama.bench import gemvs

    for bits in args.bits:
        weights = Weights(bits)
        layout = gemvs.layout_for(preset(args.model), FORMAT_OF_BITS[bits])  # the plans' shapes (padded when quantized)
        for shape in gemvs.SHAPE_ORDER:
            if shape == "lm_head" and bits != 16:
                continue  # the lm_head stays FP16
            measured = sweep_rows_shape(cp, loader, layout, shape, args.rows, args, pdl, weights, record["skipped"])
            one = next((r["us"] for r in measured if r["tokens"] == 1), None)
            for r in measured:
                r["pct_read_bw"] = 100 * r["gb_s"] * 1e9 / bps
                r["vs_1row"] = r["us"] / one if one else None
                record["rows"].append(r)
            if args.json:
                save_json(args.json, record, args, complete=False)


def print_rows(rows: list[dict], bps: float) -> None:
    width = max([24, *(len(r["variant"]) for r in rows)])
    print(f"{'bits':>4} {'shape':<22} {'kernel':<18} {'rows':>4} {'variant':<{width}} {'us':>8} {'min-max us':>15} "
          f"{'TB/s':>6} {'% bw':>6} {'x 1-row':>7} {'ov TB/s':>7}  check")
    for r in rows:
        spread = f"{r['us_min']:.1f}-{r['us_max']:.1f}"
        check = "ok" if r["check_ok"] else f"WRONG (rel err {r['check_rel_err']:.1e})"
        ratio = "-" if r["vs_1row"] is None else f"{r['vs_1row']:.3f}"
        overlap = "-" if r["gb_s_overlap"] is None else f"{r['gb_s_overlap'] / 1e3:.2f}"
        print(f"{r['bits']:>4} {r['shape']:<22} {r['kernel']:<18} {r['tokens']:>4} {r['variant']:<{width}} "
              f"{r['us']:>8.1f} {spread:>15} {r['gb_s'] / 1e3:>6.2f} {r['pct_read_bw']:>5.1f}% {ratio:>7} "
              f"{overlap:>7}  {check}")
    print("TB/s: effective (the weight bytes a launch reads: FP16 W, or codes and (scale, zero) pairs, over its time); "
          "x 1-row: time against the same shape's 1-row time (targets, issue 26: <= 1.15 at 16 rows); "
          "ov: linked by programmatic dependent launch (CULLAMA_OVERLAP=1)")


def print_variants(rows: list[dict], args, bps: float) -> None:
    best = {}
    for r in rows:
        key = (r["bits"], r["shape"])
        if r["check_ok"] and r["gb_s"] > best.get(key, {"gb_s": 0})["gb_s"]:
            best[key] = r
    quantized = args.bits != [16]
    width = max([24 if quantized else 16, *(len(r["variant"]) for r in rows)])  # "ROWS=8 UNROLL=2 MIN_BLOCKS=4"
    print(f"{'shape':<22} {'kernel':<18} {'variant':<{width}} {'us':>8} {'min-max us':>15} "
          f"{'GB/s':>7} {'% bw':>6} {'ov GB/s':>7} {'ov % bw':>7}  check")
    for r in rows:
        mark = "*" if best.get((r["bits"], r["shape"])) is r else " "
        spread = f"{r['us_min']:.1f}-{r['us_max']:.1f}"
        check = "ok" if r["check_ok"] else f"WRONG (rel err {r['check_rel_err']:.1e})"
        overlap = ("-", "-") if r["gb_s_overlap"] is None else \
            (f"{r['gb_s_overlap']:.0f}", f"{100 * r['gb_s_overlap'] * 1e9 / bps:.1f}%")
        print(f"{r['shape']:<22} {r['kernel']:<18} {r['variant']:<{width}} {r['us']:>8.1f} "
              f"{spread:>15} {r['gb_s']:>7.0f} {r['pct_read_bw']:>5.1f}%{mark} {overlap[0]:>7} {overlap[1]:>7} {check}")
    print(f"* fastest correct variant per shape{' and bits' if quantized else ''}; the plan uses "
          f"{plan_variant(args.bits)}; {'GB/s: effective (codes and (scale, zero) pairs); ' if quantized else ''}"
          f"ov: the same launches linked by programmatic dependent launch (CULLAMA_OVERLAP=1)")


if __name__ == "__main__":
    sys.exit(main())
