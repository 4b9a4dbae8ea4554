"""The scheduler: a decode step and a prefill chunk as *data*, an ordered list of kernel launches over
named buffers. Both backends run the same plan: `cuda` with CuPy (the decode step captured once as a
CUDA graph), `numpy` with each kernel's NumPy twin.

A decode step processes the token in state[TOKEN] at position state[POS] (its embedding already in
x), and ends with the sample kernel, which writes the next token, its embedding and pos + 1. The
position lives in device memory, so one captured graph serves every position.

    per layer: gemv_qkv_rope -> attention_decode -> gemv_residual (o) -> gemv_gate_up_silu -> gemv_residual (down)
    then:      gemv_logits -> sample

A prefill chunk runs n prompt tokens at positions start..start+n-1 with GEMMs, then the same
gemv_logits + sample on its last row (or a logits GEMM over every row, for `Llama.logits`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .config import LlamaConfig
from .errors import KernelError
from .reference import rope_tables
from .registry import KernelSpec

GEMV_ROWS, GEMV_UNROLL, GEMV_THREADS = 4, 4, 128
ATTENTION_THREADS = 128
SAMPLE_THREADS = 1024
PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the prefill buffers, any prompt length works
GEMM_TILE_M, GEMM_TILE_N, GEMM_THREADS = 64, 128, 256
GEMM_TILE_K = 32  # K per pipeline stage of gemm.cu: a split-K range is a multiple of it
GEMM_SMS = 132  # streaming multiprocessors of the target GPU (H100 / H200 SXM), for gemm_splits
GEMM_MAX_SPLIT = 4  # most K splits of one prefill GEMM (partials per tile in gemm_workspace)
GEMM_SPLIT_K = True  # False: every prefill GEMM runs with S = 1 (no split-K), to compare; read at plan time
ROW_THREADS = 256  # the row-wise prefill kernels: one block per token row
# Kernels that may start before the kernel ahead of them has finished (programmatic dependent launch,
# the CUDA backend's `overlap` mode): before pdl_wait() they read only weights, which no kernel writes,
# and write nothing. tests/test_contracts.py checks this in their sources.
OVERLAP_SAFE = frozenset({"gemv_qkv_rope", "attention_decode", "gemv_residual", "gemv_gate_up_silu",
                          "gemv_logits", "sample"})


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    kind: str  # "weight" | "cache" | "state" | "constant" | "activation"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Ref:
    """A buffer argument; `index` selects one slice along the first axis (a layer, a row)."""

    name: str
    index: int | None = None


@dataclasses.dataclass(frozen=True)
class Launch:
    spec: KernelSpec
    grid: tuple[int, int, int]
    block: int
    args: tuple  # Ref, np.int32, np.uint32 or np.float32, in the kernel's parameter order


@dataclasses.dataclass
class Plan:
    name: str
    launches: list[Launch]

    def kernels(self) -> set[KernelSpec]:
        return {launch.spec for launch in self.launches}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_supported(cfg: LlamaConfig) -> None:
    """Shapes the kernels handle; anything else is a clear error, never wrong numbers."""
    hd = cfg.head_dim
    if hd < 8 or hd > 128 or hd & (hd - 1):
        raise KernelError(f"{cfg.name}: head_dim {hd} is not supported on the GPU (a power of two from 8 to 128)")
    for field in ("hidden_size", "intermediate_size"):
        if getattr(cfg, field) % 8:
            raise KernelError(f"{cfg.name}: {field} {getattr(cfg, field)} is not a multiple of 8")
    if cfg.group_size > 8:
        raise KernelError(f"{cfg.name}: {cfg.group_size} query heads per key/value head (at most 8 supported)")


def attention_splits(cfg: LlamaConfig) -> int:
    """Blocks per key/value head in decode attention: enough blocks to fill the GPU at any length."""
    return max(1, min(32, 256 // cfg.num_kv_heads))


ATTENTION_PREFILL_QUERIES = 4  # (row, head) queries a prefill attention block holds: <= 128 registers/thread


def attention_rows_q(cfg: LlamaConfig) -> int:
    """Query rows per prefill attention block (ROWS_Q): each K/V row it loads serves ROWS_Q x GROUP
    queries, so the keys are read from L2 ROWS_Q times less often. Each thread keeps q, acc, m and l of
    every query in registers: 4 queries fit in 128 registers (4 blocks per SM), 8 need ~215 (2 blocks),
    so ROWS_Q = 4 / GROUP rows (1 for GROUP 4 and 8, which already share each key 4 or 8 ways)."""
    return max(1, ATTENTION_PREFILL_QUERIES // cfg.group_size)


def _split_rule(m: int, n: int, k: int) -> int:
    tiles = cdiv(n, GEMM_TILE_N) * cdiv(m, GEMM_TILE_M)
    if tiles >= GEMM_SMS // 2:
        return 1
    return max(1, min(GEMM_MAX_SPLIT, GEMM_SMS // tiles, k // 256))


def gemm_splits(m: int, n: int, k: int) -> int:
    """K splits S of a prefill GEMM (its grid's z; see gemm.cu for the deterministic split-K).

    tiles = ceil(n / 128) * ceil(m / 64) blocks fill the GPU when tiles >= GEMM_SMS // 2 (two blocks
    fit on an SM): then S = 1. Below that, S = min(GEMM_MAX_SPLIT, GEMM_SMS // tiles, k // 256), at
    least 1: at most one wave of S * tiles blocks, at most 4 partials to sum, and at least 256 of K (8
    pipeline tiles) per block. It does not depend on accumulate (the last block adds C either way).
    On LLaMA-2-7B it splits o_proj and down_proj (n = 4096: 32 tiles) 4 ways for prompts of up to 64
    rows and 2 ways for 65..128 rows. A first guess, not a measurement: benchmarks/gemm_sweep.py
    times S = 1, 2, 4 and this rule, and decides. GEMM_SPLIT_K = False makes it 1 everywhere.
    """
    return _split_rule(m, n, k) if GEMM_SPLIT_K else 1


def gemm_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(n, k) of every prefill GEMM: qkv, o_proj, gate_up, down, lm_head."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return [(cfg.qkv_dim, d), (d, cfg.q_dim), (2 * ff, d), (d, ff), (cfg.vocab_size, d)]


def gemm_split_tiles(cfg: LlamaConfig, chunk: int = PREFILL_CHUNK) -> int:
    """Most tiles (blocks per split) of any split-K GEMM a prefill plan of up to `chunk` rows can make
    (whatever GEMM_SPLIT_K says), at least 1: gemm_workspace holds GEMM_MAX_SPLIT partials of that many
    tiles, gemm_tile_count one counter each. A launch of S splits and t tiles uses the first S * t slots."""
    tiles = [cdiv(n, GEMM_TILE_N) * row_tiles for n, k in gemm_shapes(cfg)
             for row_tiles in range(1, cdiv(chunk, GEMM_TILE_M) + 1)
             if _split_rule(row_tiles * GEMM_TILE_M, n, k) > 1]
    return max(tiles, default=1)


# -- buffers --------------------------------------------------------------------------------------
def weight_buffers(cfg: LlamaConfig) -> list[Buffer]:
    d, ff, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out = [Buffer("embed", (V, d), "float16", "weight"),  # [vocab, d]
           Buffer("final_norm", (d,), "float16", "weight"),  # [d]
           Buffer("lm_head", (V, d), "float16", "weight")]  # [vocab, d]
    for i in range(cfg.num_layers):
        out += [Buffer(f"layers.{i}.attn_norm", (d,), "float16", "weight"),  # [d]
                Buffer(f"layers.{i}.wqkv", (cfg.qkv_dim, d), "float16", "weight"),  # [q_dim + 2 kv_dim, d]
                Buffer(f"layers.{i}.wo", (d, cfg.q_dim), "float16", "weight"),  # [d, q_dim]
                Buffer(f"layers.{i}.ffn_norm", (d,), "float16", "weight"),  # [d]
                Buffer(f"layers.{i}.w_gate_up", (2 * ff, d), "float16", "weight"),  # [2 ff, d]
                Buffer(f"layers.{i}.w_down", (d, ff), "float16", "weight")]  # [d, ff]
    return out


def runtime_buffers(cfg: LlamaConfig, max_seq: int, chunk: int = PREFILL_CHUNK) -> list[Buffer]:
    """Everything but the weights: KV cache, state, and the decode and prefill activations."""
    d, ff, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    kv = (cfg.num_layers, cfg.num_kv_heads, max_seq, hd)
    return [
        Buffer("k_cache", kv, "float16", "cache"),  # [layers, kv_heads, max_seq, hd]
        Buffer("v_cache", kv, "float16", "cache"),  # [layers, kv_heads, max_seq, hd]
        Buffer("rope", (max_seq, hd // 2, 2), "float32", "constant"),  # [max_seq, hd/2, (cos, sin)]
        Buffer("state", (8,), "int32", "state"),  # see STATE_* in kernels_cu/common.cuh
        Buffer("fparams", (4,), "float32", "state"),  # temperature, top_p, repetition penalty
        Buffer("seen", (V,), "uint8", "state"),  # 1 where a token is in the prompt or was generated
        # decode step
        Buffer("x", (d,), "float32", "activation"),  # [d] the residual stream
        Buffer("q", (cfg.q_dim,), "float32", "activation"),  # [heads * hd] after RoPE
        Buffer("attn_part", (cfg.num_heads, attention_splits(cfg), hd + 2), "float32", "activation"),
        Buffer("attn_count", (cfg.num_kv_heads,), "uint32", "activation"),  # arrivals per kv head (zeroed)
        Buffer("attn_out", (cfg.q_dim,), "float32", "activation"),  # [heads * hd]
        Buffer("h", (ff,), "float32", "activation"),  # [ff] silu(gate) * up
        Buffer("logits", (V,), "float32", "activation"),  # [vocab]
        # prefill chunk of up to `chunk` rows
        Buffer("prefill_ids", (chunk,), "int32", "activation"),  # [n] the chunk's token ids
        Buffer("x_rows", (chunk, d), "float32", "activation"),  # [n, d] residual stream
        Buffer("xn_rows", (chunk, d), "float16", "activation"),  # [n, d] rmsnorm(x), GEMM input
        Buffer("qkv_rows", (chunk, cfg.qkv_dim), "float32", "activation"),  # [n, q_dim + 2 kv_dim]
        Buffer("q_rows", (chunk, cfg.q_dim), "float16", "activation"),  # [n, heads * hd] after RoPE
        Buffer("attn_rows", (chunk, cfg.q_dim), "float16", "activation"),  # [n, heads * hd]
        Buffer("gu_rows", (chunk, 2 * ff), "float32", "activation"),  # [n, 2 ff] gate | up
        Buffer("h_rows", (chunk, ff), "float16", "activation"),  # [n, ff]
        Buffer("logits_rows", (chunk, V), "float32", "activation"),  # [n, vocab] (Llama.logits only)
        # split-K prefill GEMMs (gemm_splits): partial tiles, and arrivals per tile (zero; reset by the kernel)
        Buffer("gemm_workspace", (GEMM_MAX_SPLIT, gemm_split_tiles(cfg, chunk), GEMM_TILE_M * GEMM_TILE_N), "float32",
               "activation"),  # [max split, max tiles of a split-K launch, 64 * 128]
        Buffer("gemm_tile_count", (gemm_split_tiles(cfg, chunk),), "uint32", "activation"),  # [those tiles]
    ]


def rope_table(cfg: LlamaConfig, max_seq: int) -> np.ndarray:
    """[max_seq, hd/2, 2] float32 (cos, sin): the reference's own values, so both paths rotate alike."""
    cos, sin = rope_tables(cfg.head_dim, np.arange(max_seq), cfg.rope_theta)
    return np.stack([cos, sin], axis=-1).astype(np.float32)


# -- kernels --------------------------------------------------------------------------------------
def gemv(name: str) -> KernelSpec:
    return KernelSpec("gemv.cu", name, (("ROWS", GEMV_ROWS), ("UNROLL", GEMV_UNROLL)))


def attention(name: str, cfg: LlamaConfig) -> KernelSpec:
    return KernelSpec("attention.cu", name, (("HEAD_DIM", cfg.head_dim), ("GROUP", cfg.group_size)))


def attention_prefill_spec(cfg: LlamaConfig) -> KernelSpec:
    """attention_prefill with ROWS_Q = attention_rows_q(cfg); the decode spec has no ROWS_Q."""
    return KernelSpec("attention.cu", "attention_prefill",
                      attention("attention_prefill", cfg).defines + (("ROWS_Q", attention_rows_q(cfg)),))


SAMPLE = KernelSpec("sampling.cu", "sample")
GEMM = KernelSpec("gemm.cu", "gemm")


def prefill(name: str) -> KernelSpec:
    return KernelSpec("prefill.cu", name)


i32, f32 = np.int32, np.float32


def _layer(i: int, name: str) -> Ref:
    return Ref(f"layers.{i}.{name}")


def decode_plan(cfg: LlamaConfig, max_seq: int) -> Plan:
    check_supported(cfg)
    d, ff = cfg.hidden_size, cfg.intermediate_size
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, f32(cfg.rms_norm_eps)
    pairs_per_block = GEMV_ROWS // 2
    launches = []
    for i in range(cfg.num_layers):
        launches += [
            Launch(gemv("gemv_qkv_rope"), (cdiv(cfg.qkv_dim // 2, pairs_per_block), 1, 1), GEMV_THREADS,
                   (Ref("x"), _layer(i, "attn_norm"), _layer(i, "wqkv"), Ref("q"), Ref("k_cache", i),
                    Ref("v_cache", i), Ref("rope"), Ref("state"), i32(d), i32(nh), i32(nkv), i32(hd),
                    i32(max_seq), eps)),
            Launch(attention("attention_decode", cfg), (nkv, attention_splits(cfg), 1), ATTENTION_THREADS,
                   (Ref("q"), Ref("k_cache", i), Ref("v_cache", i), Ref("attn_part"), Ref("attn_count"),
                    Ref("attn_out"), Ref("state"), i32(max_seq), f32(1.0 / np.sqrt(hd)))),
            Launch(gemv("gemv_residual"), (cdiv(d, GEMV_ROWS), 1, 1), GEMV_THREADS,
                   (Ref("attn_out"), _layer(i, "wo"), Ref("x"), i32(d), i32(cfg.q_dim))),
            Launch(gemv("gemv_gate_up_silu"), (cdiv(ff, pairs_per_block), 1, 1), GEMV_THREADS,
                   (Ref("x"), _layer(i, "ffn_norm"), _layer(i, "w_gate_up"), Ref("h"), i32(ff), i32(d), eps)),
            Launch(gemv("gemv_residual"), (cdiv(d, GEMV_ROWS), 1, 1), GEMV_THREADS,
                   (Ref("h"), _layer(i, "w_down"), Ref("x"), i32(d), i32(ff))),
        ]
    return Plan("decode", launches + _logits_and_sample(cfg, Ref("x")))


def _logits_and_sample(cfg: LlamaConfig, x: Ref) -> list[Launch]:
    d, V = cfg.hidden_size, cfg.vocab_size
    return [
        Launch(gemv("gemv_logits"), (cdiv(V, GEMV_ROWS), 1, 1), GEMV_THREADS,
               (x, Ref("final_norm"), Ref("lm_head"), Ref("logits"), i32(V), i32(d), f32(cfg.rms_norm_eps))),
        Launch(SAMPLE, (1, 1, 1), SAMPLE_THREADS,
               (Ref("logits"), Ref("seen"), Ref("state"), Ref("fparams"), Ref("embed"), Ref("x"), i32(V), i32(d))),
    ]


def _gemm(a: str, w: Ref, c: str, m: int, n: int, k: int, accumulate: bool) -> Launch:
    return Launch(GEMM, (cdiv(n, GEMM_TILE_N), cdiv(m, GEMM_TILE_M), gemm_splits(m, n, k)), GEMM_THREADS,
                  (Ref(a), w, Ref(c), Ref("gemm_workspace"), Ref("gemm_tile_count"), i32(m), i32(n), i32(k),
                   i32(accumulate)))


PREFILL_OUTPUTS = ("sample", "logits", "none")


def prefill_plan(cfg: LlamaConfig, max_seq: int, start: int, n: int, output: str = "sample") -> Plan:
    """Prompt tokens prefill_ids[:n] at positions start..start+n-1 (n <= PREFILL_CHUNK).

    output "sample": the last row's logits go through the decode step's gemv_logits + sample (which
    sets pos = start + n, so the host sets state[POS] = start + n - 1 first); "logits":
    logits_rows[:n] gets every row's logits; "none": only the KV cache is filled (an early chunk).
    """
    check_supported(cfg)
    if output not in PREFILL_OUTPUTS:
        raise KernelError(f"prefill output {output!r} is not one of {PREFILL_OUTPUTS}")
    if not 0 < n <= PREFILL_CHUNK or start + n > max_seq:
        raise KernelError(f"prefill chunk of {n} tokens at {start} does not fit (chunk {PREFILL_CHUNK}, "
                          f"context {max_seq})")
    d, ff, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, f32(cfg.rms_norm_eps)
    rows = lambda name, *args: Launch(prefill(name), (n, 1, 1), ROW_THREADS, args)  # noqa: E731
    launches = [rows("embed_rows", Ref("prefill_ids"), Ref("embed"), Ref("x_rows"), i32(d))]
    for i in range(cfg.num_layers):
        launches += [
            rows("rmsnorm_rows", Ref("x_rows"), _layer(i, "attn_norm"), Ref("xn_rows"), i32(d), eps),
            _gemm("xn_rows", _layer(i, "wqkv"), "qkv_rows", n, cfg.qkv_dim, d, False),
            rows("rope_kv_rows", Ref("qkv_rows"), Ref("rope"), Ref("q_rows"), Ref("k_cache", i),
                 Ref("v_cache", i), i32(start), i32(nh), i32(nkv), i32(hd), i32(max_seq)),
            Launch(attention_prefill_spec(cfg), (nkv, cdiv(n, attention_rows_q(cfg)), 1), ATTENTION_THREADS,
                   (Ref("q_rows"), Ref("k_cache", i), Ref("v_cache", i), Ref("attn_rows"), i32(start), i32(n),
                    i32(max_seq), f32(1.0 / np.sqrt(hd)))),
            _gemm("attn_rows", _layer(i, "wo"), "x_rows", n, d, cfg.q_dim, True),
            rows("rmsnorm_rows", Ref("x_rows"), _layer(i, "ffn_norm"), Ref("xn_rows"), i32(d), eps),
            _gemm("xn_rows", _layer(i, "w_gate_up"), "gu_rows", n, 2 * ff, d, False),
            rows("silu_mul_rows", Ref("gu_rows"), Ref("h_rows"), i32(ff)),
            _gemm("h_rows", _layer(i, "w_down"), "x_rows", n, d, ff, True),
        ]
    if output == "logits":
        launches += [rows("rmsnorm_rows", Ref("x_rows"), Ref("final_norm"), Ref("xn_rows"), i32(d), eps),
                     _gemm("xn_rows", Ref("lm_head"), "logits_rows", n, V, d, False)]
    elif output == "sample":
        launches += _logits_and_sample(cfg, Ref("x_rows", n - 1))
    return Plan(f"prefill[{start}:{start + n}]", launches)
