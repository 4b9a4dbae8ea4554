"""The scheduler: a decode step and a prefill chunk as *data*, an ordered list of kernel launches over
named buffers. Both backends run the same plan: `cuda` with CuPy (the decode step captured once as a
CUDA graph), `numpy` with each kernel's NumPy twin.

A decode step processes the token in state[TOKEN] at position state[POS] (its embedding already in
x), and ends with the sample kernel, which writes the next token, its embedding and pos + 1. The
position lives in device memory, so one captured graph serves every position.

    per layer: gemv_qkv_rope -> attention_decode -> gemv_residual (o) -> gemv_gate_up_silu -> gemv_residual (down)
    then:      gemv_logits -> sample

A verify step (speculative decoding) is the same launches over k + 1 token rows at positions pos..pos + k:
verify_ids = [the last sampled token, k drafts] (written by the host), embed_rows, then every kernel above
with k + 1 rows (each weight read once for all of them; every row computed exactly as a decode step at its
position), and the sample kernel accepts on the device: verify_out = [n, the n accepted tokens], and
state, seen and x end as n decode steps would leave them.

A prefill chunk runs n prompt tokens at positions start..start+n-1 with GEMMs, then the same
gemv_logits + sample on its last row (or a logits GEMM over every row, for `Llama.logits`).

The weights are read in the device layout (cullama/model/layout.py), which every plan function takes (a config stands
for its FP16 layout): every decode, verify and batch GEMV is gemv_mma.cu's (FP16, or on a quantized linear its
BITS 8 / 4 variant on its qweight and qparams, with its group as the last argument; the prefill runs gemm_quant.cu's
GEMM); under act-order a gather kernel first puts the linear's input in its weight's input order (ops/gather.py), into a buffer of its own.

`sample_vocab` (default: the whole vocabulary) limits gemv_logits + sample to the ids 0 .. sample_vocab - 1,
through the V both kernels take (their rows, and the row stride of a verify step's logits): a model whose
vocabulary is padded past its tokenizer's pieces never samples an id that has no text.

Constrained decoding (a grammar's allowed-token mask, sampling.cu): the sample kernel of every plan reads the mask rows
of a slot whose state[MASKED] is set, masks[slot][offset], and no mask at all otherwise, so an unconstrained step is
the same launches as ever. The host computes a constrained slot's next mask while the step's forward runs:
`split_at_sample` cuts a plan into its launches before the sample kernel and those from it on, and the host copies the
mask between the two (engine.py).

Log-probabilities (cullama/runtime/logprobs.py) are launches added to these plans by the end of this module, never in
them: `token_logprobs` after a step's sample (a decode step's row, a verify step's rows, a prefill's last row) into
logprob_step, `prompt_logprobs` over a chunk's "logits" output into logprob_rows, each with N alternatives (0..20)
over the sample_vocab ids; `with_logprobs` and `scored_prefill_plan` compose the plans that carry them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model.config import LlamaConfig
from ..common.errors import KernelError
from ..model.layout import GATHERED, LINEARS, NO_BIAS, NORM_OF, Buffer, Layout, as_layout, buffer_name, decode_floor_ms
from .ops import attention_mma as attention_mma_ops
from .ops import gemv_mma as gemv_mma_ops
from .prefill_kernels import GemmKernel, PrefillKernels, cdiv, quant_gemm, tile_counters, workspace_floats
from ..model.reference import rope_tables
from .registry import KernelSpec
from .ops import sampling as sampling_ops  # the logprobs kernel's
from .ops.rows import FPARAMS_LEN, STATE_LEN, logits_stride

# The decode, verify and batch GEMVs: gemv_mma.cu, one kernel for 1..16 token rows (the MMA's M), FP16 / INT8 / INT4.
GEMV_ROWS, GEMV_THREADS = gemv_mma_ops.ROWS, gemv_mma_ops.THREADS  # output rows per block, threads per block
MAX_DRAFT = gemv_mma_ops.MAX_TOKENS - 1  # drafts one verify step checks at most (15)
VERIFY_ROWS = MAX_DRAFT + 1  # its token rows at most: the last sampled token and the drafts (a batch group's rows)
ATTENTION_THREADS = 128
SAMPLE_THREADS = 1024
PREFILL_CHUNK = 256  # default prompt tokens per prefill pass: bounds the prefill buffers, any prompt length works
MAX_PREFILL_CHUNK = 4096  # the most rows a prefill pass may be given (prefill_chunk, --prefill-chunk)
# A model loaded for batched decoding (slots > 1) prefills in smaller chunks (batch_prefill_chunk), which run between
# two batched steps: on the H200's roofline, one chunk costs the running streams about one decode step.
PREFILL_GEMM_FLOPS = 300e12  # gemm.cu (mma.sync) on an H200: predicted 250-400 TFLOP/s (PREDICTIONS.md), unmeasured
CHUNK_UNIT = 16  # a batch prefill chunk is a multiple of the MMA's row fragment (m16)
ROW_THREADS = 256  # the row-wise prefill kernels: one block per token row
# Kernels that may start before the kernel ahead of them has finished (programmatic dependent launch,
# the CUDA backend's `overlap` mode): before pdl_wait() they read only weights, which no kernel writes,
# and write nothing. tests/runtime/test_contracts.py checks this in their sources. Every kernel of the decode
# step and of a prefill chunk is one.
OVERLAP_SAFE = frozenset({"gemv_qkv_rope", "attention_decode", "gemv_residual", "gemv_gate_up_silu",
                          "gemv_logits", "gemv_logits_x", "sample", "embed_rows", "embed_rows_prepared",
                          "rmsnorm_rows", "rope_kv_rows", "silu_mul_rows", "gemm", "gemm_wgmma",
                          "attention_prefill", "attention_prefill_mma", "gemm_quant", "gather_f16"})


@dataclasses.dataclass(frozen=True)
class Ref:
    """A buffer argument; `index` selects one slice along the first axis (a layer, a row), or along the first
    axes (a tuple: a layer's slot of the KV cache), `rows` the first `rows` slices (a verify step's token rows:
    the kernels get their address, the twins that shape)."""

    name: str
    index: int | tuple[int, ...] | None = None
    rows: int | None = None

    def of(self, array):
        """This argument's view of the buffer `array` (NumPy or CuPy)."""
        if self.index is not None:
            return array[self.index]
        return array if self.rows is None else array[:self.rows]


@dataclasses.dataclass(frozen=True)
class Launch:
    spec: KernelSpec
    grid: tuple[int, int, int]
    block: int
    args: tuple  # Ref, np.int32, np.uint32 or np.float32, in the kernel's parameter order
    smem: int = 0  # dynamic shared memory per block, bytes


@dataclasses.dataclass
class Plan:
    name: str
    launches: list[Launch]

    def kernels(self) -> set[KernelSpec]:
        return {launch.spec for launch in self.launches}


def check_supported(cfg: LlamaConfig) -> None:
    """Shapes the kernels handle; anything else is a clear error, never wrong numbers. The CPU runs the same
    plans (the kernels' twins), so the limits hold on every device. Cheap: call it as soon as a config is read,
    before any weight loads (of the device layout: layout.device_config pads intermediate_size)."""
    hd = cfg.head_dim
    if hd < 8 or hd > 128 or hd & (hd - 1):
        raise KernelError(f"{cfg.name}: head_dim {hd} is not supported by cullama's kernels "
                          "(a power of two from 8 to 128)")
    for field in ("hidden_size", "intermediate_size"):
        if getattr(cfg, field) % 8:
            raise KernelError(f"{cfg.name}: {field} {getattr(cfg, field)} is not supported by cullama's kernels "
                              "(a multiple of 8)")
    if cfg.group_size > 8:
        raise KernelError(f"{cfg.name}: {cfg.group_size} query heads per key/value head are not supported by "
                          "cullama's kernels (at most 8)")
    if ss_parts(cfg.hidden_size) > MAX_SS_PARTS:
        raise KernelError(f"{cfg.name}: hidden_size {cfg.hidden_size} is not supported by cullama's kernels "
                          f"(at most {MAX_SS_PARTS * gemv_mma_ops.SS_SPAN})")


def attention_splits(cfg: LlamaConfig) -> int:
    """Blocks per key/value head in decode attention: enough blocks to fill the GPU at any length."""
    return max(1, min(32, 256 // cfg.num_kv_heads))


def attention_window(cfg: LlamaConfig, max_seq: int) -> int:
    """The attention kernels' `window`: the keys a query sees, counting back from its own position (Mistral's
    sliding_window; max_seq, every key, for a model without one). The KV cache keeps every position either way:
    the window bounds what a step reads, not what it stores (a rolling cache would save memory only, and would
    make a verify step's rows overwrite keys that its earlier rows still read)."""
    return min(cfg.sliding_window or max_seq, max_seq)


ATTENTION_PREFILL_QUERIES = 4  # (row, head) queries a prefill attention block holds: <= 128 registers/thread


def attention_rows_q(cfg: LlamaConfig) -> int:
    """Query rows per prefill attention block (ROWS_Q): each K/V row it loads serves ROWS_Q x GROUP
    queries, so the keys are read from L2 ROWS_Q times less often. Each thread keeps q, acc, m and l of
    every query in registers: 4 queries fit in 128 registers (4 blocks per SM), 8 need ~215 (2 blocks),
    so ROWS_Q = 4 / GROUP rows (1 for GROUP 4 and 8, which already share each key 4 or 8 ways)."""
    return max(1, ATTENTION_PREFILL_QUERIES // cfg.group_size)


# -- buffers --------------------------------------------------------------------------------------
def weight_buffers(model: LlamaConfig | Layout) -> list[Buffer]:
    """The weight buffers of a layout (layout.Layout.buffers)."""
    return as_layout(model).buffers()


def runtime_buffers(model: LlamaConfig | Layout, max_seq: int, chunk: int | None = None,
                    slots: int = 1) -> list[Buffer]:
    """Everything but the weights: KV cache, state, and the decode and prefill activations (prefill chunks
    of up to `chunk` rows, default prefill_chunk_for(model, slots)), and under act-order the gathered inputs, for
    `slots` sequences (each its own KV cache and state)."""
    layout = as_layout(model)
    chunk = chunk or prefill_chunk_for(layout, slots)
    cfg = layout.device
    d, ff, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    kv = (cfg.num_layers, slots, cfg.num_kv_heads, max_seq, hd)
    return [
        Buffer("k_cache", kv, "float16", "cache"),  # [layers, slots, kv_heads, max_seq, hd]
        Buffer("v_cache", kv, "float16", "cache"),  # [layers, slots, kv_heads, max_seq, hd]
        Buffer("rope", (max_seq, hd // 2, 2), "float32", "constant"),  # [max_seq, hd/2, (cos, sin)]
        Buffer(NO_BIAS, (cfg.qkv_dim,), "float16", "constant"),  # [q_dim + 2 kv_dim] zeros: layout.bias_name
        Buffer("state", (slots, STATE_LEN), "int32", "state"),  # [slots, 8] see STATE_* in kernels_cu/common.cuh
        Buffer("fparams", (slots, FPARAMS_LEN), "float32", "state"),  # [slots, 4] temperature, top_p, penalty
        Buffer("seen", (slots, seen_stride(V)), "uint8", "state"),  # [slots, V rounded up to 4] 1: in the text
        # [slots, VERIFY_ROWS, ceil(V / 32)] constrained decoding: slot s's allowed ids for its token row at offset o,
        # one bit each (sampling.cu); read only for a slot whose state[MASKED] is set
        Buffer("masks", (slots, VERIFY_ROWS, mask_words(V)), "uint32", "state"),
        # [slots, VERIFY_ROWS, (slot, offset)]: slot s's rows table for a decode or verify step (slot_rows_table)
        Buffer("slot_rows", (slots, VERIFY_ROWS, 2), "int32", "constant"),
        # batched decode (batch_plan): group g of up to VERIFY_ROWS rows, its rows table and each row's token (the
        # host writes both when the batch changes; sample writes the tokens step after step)
        Buffer("batch_rows", (batch_groups(slots), VERIFY_ROWS, 2), "int32", "state"),  # [groups, rows, 2]
        Buffer("batch_ids", (batch_groups(slots), VERIFY_ROWS), "int32", "state"),  # [groups, rows] their tokens
        # decode step
        Buffer("x", (d,), "float32", "activation"),  # [d] the residual stream
        # the next RMSNorm GEMV's input as gemv_residual prepares it: fp16(x * norm_w) and Σ x² in parts
        Buffer("xn", (d,), "float16", "activation"),  # [d]
        Buffer("x_ss", (ss_parts(d),), "float32", "activation"),  # [ceil(d / SS_SPAN)]
        Buffer("q", (cfg.q_dim,), "float32", "activation"),  # [heads * hd] after RoPE
        Buffer("attn_part", (cfg.num_heads, attention_splits(cfg), hd + 2), "float32", "activation"),
        Buffer("attn_count", (cfg.num_kv_heads,), "uint32", "activation"),  # arrivals per kv head (zeroed)
        Buffer("attn_out", (cfg.q_dim,), "float16", "activation"),  # [heads * hd], as o_proj multiplies it
        Buffer("h", (ff,), "float16", "activation"),  # [ff] silu(gate) * up, as down multiplies it
        Buffer("logits", (V,), "float32", "activation"),  # [vocab]
        # verify step: the decode step's activations for up to VERIFY_ROWS token rows, and the acceptance
        Buffer("verify_ids", (VERIFY_ROWS,), "int32", "state"),  # [rows] row inputs: last sampled, drafts (host)
        Buffer("verify_picks", (VERIFY_ROWS,), "int32", "activation"),  # [rows] each row's sampled token
        Buffer("verify_out", (VERIFY_ROWS + 1,), "int32", "activation"),  # [1 + rows] n accepted, those n ids
        Buffer("verify_arrivals", (1,), "uint32", "activation"),  # sample blocks done (zero between launches)
        Buffer("verify_x", (VERIFY_ROWS, d), "float32", "activation"),  # [rows, d] residual streams
        Buffer("verify_xn", (VERIFY_ROWS, d), "float16", "activation"),  # [rows, d] as xn
        Buffer("verify_x_ss", (VERIFY_ROWS, ss_parts(d)), "float32", "activation"),  # [rows, ceil(d / SS_SPAN)]
        Buffer("verify_q", (VERIFY_ROWS, cfg.q_dim), "float32", "activation"),  # [rows, heads * hd]
        Buffer("verify_attn_part", (VERIFY_ROWS, cfg.num_heads, attention_splits(cfg), hd + 2), "float32",
               "activation"),  # [rows, heads, splits, hd + 2]
        Buffer("verify_attn_count", (VERIFY_ROWS, cfg.num_kv_heads), "uint32", "activation"),  # [rows, kv heads]
        Buffer("verify_attn_out", (VERIFY_ROWS, cfg.q_dim), "float16", "activation"),  # [rows, heads * hd]
        Buffer("verify_h", (VERIFY_ROWS, ff), "float16", "activation"),  # [rows, ff]
        # [rows, vocab] at a row stride of vocab rounded up to 4 (16-byte aligned rows for the sample kernel)
        Buffer("verify_logits", (VERIFY_ROWS, logits_stride(V)), "float32", "activation"),
        # a step's log-probabilities (the logprobs kernel's rows): a decode step's or a prefill's token in row 0,
        # a verify step's in rows 0..k
        Buffer("logprob_step", (VERIFY_ROWS, sampling_ops.LP_WIDTH), "float32", "activation"),  # [rows, LP_WIDTH]
        # prefill chunk of up to `chunk` rows
        Buffer("prefill_ids", (chunk,), "int32", "activation"),  # [n] the chunk's token ids
        Buffer("x_rows", (chunk, d), "float32", "activation"),  # [n, d] residual stream
        Buffer("xn_rows", (chunk, d), "float16", "activation"),  # [n, d] rmsnorm(x), GEMM input
        Buffer("qkv_rows", (chunk, cfg.qkv_dim), "float32", "activation"),  # [n, q_dim + 2 kv_dim]
        Buffer("q_rows", (chunk, cfg.q_dim), "float16", "activation"),  # [n, heads * hd] after RoPE
        Buffer("attn_rows", (chunk, cfg.q_dim), "float16", "activation"),  # [n, heads * hd]
        Buffer("gu_rows", (chunk, 2 * ff), "float32", "activation"),  # [n, 2 ff] gate | up
        Buffer("h_rows", (chunk, ff), "float16", "activation"),  # [n, ff]
        Buffer("logits_rows", (chunk, V), "float32", "activation"),  # [n, vocab] (Llama.logits, prompt logprobs)
        Buffer("prefill_targets", (chunk,), "int32", "activation"),  # [n] each row's next prompt id (-1: none)
        Buffer("logprob_rows", (chunk, sampling_ops.LP_WIDTH), "float32", "activation"),  # [n, LP_WIDTH]
        # split-K prefill GEMMs (prefill_kernels): partial tiles, and arrivals per tile (zero; reset by the
        # kernel), sized for every GEMM kernel so that the choice can change at run time
        Buffer("gemm_workspace", (workspace_floats(cfg, chunk),), "float32",
               "activation"),  # [max split x max tiles of a split-K launch x tile_m x tile_n]
        Buffer("gemm_tile_count", (tile_counters(cfg, chunk),), "uint32", "activation"),  # [those tiles]
    ] + (_gathered_buffers(cfg, chunk) if _gathers(layout) else [])


def prefill_chunk_for(model: LlamaConfig | Layout, slots: int) -> int:
    """The prefill chunk of a runner with `slots` sequence slots: PREFILL_CHUNK for one (the lowest time to the
    first token), batch_prefill_chunk for more. The chunk is a property of the loaded model: a prompt's K and V,
    and so its answer, depend on it (a GPU prefill GEMM splits K by the chunk's rows: prefill_kernels.split_rule),
    so the solo and the batched paths of one model both use it."""
    return PREFILL_CHUNK if slots == 1 else batch_prefill_chunk(model)


def batch_prefill_chunk(model: LlamaConfig | Layout) -> int:
    """The largest multiple of CHUNK_UNIT up to PREFILL_CHUNK whose predicted prefill time is at most a decode
    step's (predicted_prefill_ms; CHUNK_UNIT when none is): a joining prompt's chunk, run between two batched
    steps, then keeps a running stream's gap between tokens within about two decode steps. From the model's shape
    and fixed H200 figures only, never from a timing: every load of a model must cut prompts the same way."""
    layout = as_layout(model)
    step = decode_floor_ms(layout.decode_bytes())
    fits = [c for c in range(CHUNK_UNIT, PREFILL_CHUNK + 1, CHUNK_UNIT) if predicted_prefill_ms(layout, c) <= step]
    return max(fits, default=CHUNK_UNIT)


def predicted_prefill_ms(model: LlamaConfig | Layout, rows: int) -> float:
    """A prefill chunk of `rows` on the H200's roofline: its GEMMs read the weights a decode step reads (at the
    measured bandwidth: layout.decode_floor_ms, the decode step's own prediction) and do 2 x rows x the linears'
    weights in FLOPs (at PREFILL_GEMM_FLOPS), whichever takes longer. The attention (growing with the position),
    the row kernels and the launches are left out, as the decode step's floor leaves out its own."""
    layout = as_layout(model)
    cfg = layout.device
    weights = cfg.num_layers * sum(M * K for M, K in (layout.shape(field) for field in LINEARS))  # per row
    return max(decode_floor_ms(layout.decode_bytes()), 2 * rows * weights / PREFILL_GEMM_FLOPS * 1e3)


def _gathers(layout: Layout) -> bool:
    return any(layout.perm_name(i, field) for i in range(layout.config.num_layers) for field in GATHERED)


def _gathered_buffers(cfg: LlamaConfig, chunk: int) -> list[Buffer]:
    """An act-order linear's input in its weight's input order (ops/gather.py): the decode, verify and prefill
    forms of the RMSNorm input xn (before wqkv and w_gate_up) and of attn_out (before wo)."""
    d, q = cfg.hidden_size, cfg.q_dim
    return [Buffer("xn_perm", (d,), "float16", "activation"),  # [d] xn in the input order
            Buffer("attn_out_perm", (q,), "float16", "activation"),  # [heads * hd]
            Buffer("verify_xn_perm", (VERIFY_ROWS, d), "float16", "activation"),  # [rows, d]
            Buffer("verify_attn_out_perm", (VERIFY_ROWS, q), "float16", "activation"),  # [rows, heads * hd]
            Buffer("xn_rows_perm", (chunk, d), "float16", "activation"),  # [n, d] rmsnorm(x) in the input order
            Buffer("attn_rows_perm", (chunk, q), "float16", "activation")]  # [n, heads * hd]


def mask_words(V: int) -> int:
    """The uint32 words of one mask row over a vocabulary of V ids (a bit each): ceil(V / 32)."""
    return -(-V // 32)


def split_at_sample(plan: Plan) -> tuple[Plan, Plan]:
    """(the launches before the plan's sample kernel, those from it on): a step whose sample needs a mask the host
    computes while the first part runs. Named after the plan (the CUDA backend captures a graph per name)."""
    at = next((i for i, launch in enumerate(plan.launches) if launch.spec == SAMPLE), None)
    if at is None:
        raise KernelError(f"{plan.name} has no sample kernel to split at")
    return Plan(f"{plan.name}/forward", plan.launches[:at]), Plan(f"{plan.name}/sample", plan.launches[at:])


def seen_stride(V: int) -> int:
    """The row stride of `seen` [slots, V]: V rounded up to 4, so that every slot's row is 4-byte aligned (the sample
    kernel reads a word of 4 flags at once)."""
    return logits_stride(V)


MAX_SLOTS = 64  # sequences a runner holds at most (--max-batch)


def embed_x_plan(cfg: LlamaConfig) -> Plan:
    """x = embed[verify_ids[0]] as float32 and its prepared RMSNorm input (xn, x_ss): a sequence's next input for a
    decode step, written again when another sequence's step wrote x in between (the sample kernel writes it at every
    step of its own)."""
    return Plan("embed_x", [_embed_prepared(cfg, 1, Ref("verify_ids"), Ref)])


FIRST_NORM = Ref(buffer_name(NORM_OF["wqkv"], 0))  # layer 0's attention norm: the embedding's prepared input's


def _embed_prepared(cfg: LlamaConfig, rows: int, ids: Ref, act) -> Launch:
    """embed_rows_prepared of `rows` token ids into act("x"), act("xn") and act("x_ss"): a step's first gemv_qkv_rope
    input, prepared as sample prepares it."""
    return Launch(prefill("embed_rows_prepared"), (rows, 1, 1), ROW_THREADS,
                  (ids, Ref("embed"), FIRST_NORM, act("x"), act("xn"), act("x_ss"), i32(cfg.hidden_size),
                   i32(cfg.vocab_size)))


def batch_groups(slots: int) -> int:
    """The groups of at most VERIFY_ROWS rows (a GEMV's TOKENS at most) a batched step of `slots` rows runs in."""
    return -(-slots // VERIFY_ROWS)


def slot_rows_table(slots: int) -> np.ndarray:
    """slot_rows [slots, VERIFY_ROWS, 2] int32: slot s's rows (s, 0), (s, 1), ...: its decode step is the first row,
    a verify step of k drafts the first k + 1 (common.cuh's rows table)."""
    table = np.zeros((slots, VERIFY_ROWS, 2), np.int32)
    table[:, :, 0] = np.arange(slots)[:, None]
    table[:, :, 1] = np.arange(VERIFY_ROWS)[None, :]
    return table


def rope_table(cfg: LlamaConfig, max_seq: int) -> np.ndarray:
    """[max_seq, hd/2, 2] float32 (cos, sin): the reference's own values, so both paths rotate alike."""
    cos, sin = rope_tables(cfg.head_dim, np.arange(max_seq), cfg.rope_theta, cfg.rope_scaling)
    return np.stack([cos, sin], axis=-1).astype(np.float32)


# -- kernels --------------------------------------------------------------------------------------
MAX_SS_PARTS = 32 * 8  # a prepared RMSNorm input's Σ x² parts that gemv_mma.cu adds (32 lanes x SS_LANE_PARTS)


def ss_parts(d: int) -> int:
    """The Σ x² parts of a prepared RMSNorm input of width d (gemv_residual's blocks over d rows)."""
    return cdiv(d, gemv_mma_ops.SS_SPAN)


def gemv_rows(tokens: int = 1) -> int:
    """Weight rows per GEMV block (the same for every row count)."""
    return GEMV_ROWS


def gemv(name: str, tokens: int = 1, bits: int = 16, group: int = 0) -> KernelSpec:
    """A gemv_mma.cu kernel for `tokens` token rows (1: a decode step; k + 1 a verify step; B a batch group) on FP16
    (bits 16) or INT8 / INT4 weights in groups of `group` along K: one kernel, a token row computed alike whatever
    the other rows (its KBLOCK_SCALE form where the groups hold whole k-blocks)."""
    return KernelSpec(gemv_mma_ops.SOURCE, name, gemv_mma_ops.defines(bits, tokens, group))


def attention(name: str, cfg: LlamaConfig) -> KernelSpec:
    return KernelSpec("attention.cu", name, (("HEAD_DIM", cfg.head_dim), ("GROUP", cfg.group_size)))


def attention_prefill_spec(cfg: LlamaConfig) -> KernelSpec:
    """attention_prefill with ROWS_Q = attention_rows_q(cfg); the decode spec has no ROWS_Q."""
    return KernelSpec("attention.cu", "attention_prefill",
                      attention("attention_prefill", cfg).defines + (("ROWS_Q", attention_rows_q(cfg)),))


def attention_prefill_mma_spec(cfg: LlamaConfig) -> KernelSpec:
    return KernelSpec("attention_mma.cu", "attention_prefill_mma", (("HEAD_DIM", cfg.head_dim),
                      ("GROUP", cfg.group_size), ("WARPS", attention_mma_ops.WARPS)))


SAMPLE = KernelSpec("sampling.cu", "sample")


def prefill(name: str) -> KernelSpec:
    return KernelSpec("prefill.cu", name)


i32, f32 = np.int32, np.float32


def _layer(i: int, name: str) -> Ref:
    return Ref(f"layers.{i}.{name}")


GATHER_F16 = KernelSpec("gather.cu", "gather_f16")


class _Weights:
    """How the plan reads one layer's linears from the layout: each one's kernel variant, weight arguments and
    group, and the gather before it under act-order."""

    def __init__(self, layout: Layout, layer: int):
        self.layout, self.layer = layout, layer

    def format(self, field: str):
        return self.layout.linear(self.layer, field).format

    def gemv(self, name: str, field: str, tokens: int) -> tuple[KernelSpec, int, int]:
        """(kernel, output rows per block, threads) of a decode or verify GEMV of `field`."""
        fmt = self.format(field)
        return (gemv(name, tokens, 16 if fmt is None else fmt.bits, 0 if fmt is None else fmt.group),
                gemv_rows(tokens), GEMV_THREADS)

    def gemm(self, field: str, kernel: GemmKernel) -> GemmKernel:
        """The prefill GEMM of `field`: the plan's choice for FP16, gemm_quant.cu for a quantized linear."""
        fmt = self.format(field)
        return kernel if fmt is None else quant_gemm(fmt.bits)

    def weights(self, field: str) -> tuple[Ref, ...]:
        """W, or qweight and qparams."""
        return tuple(Ref(name) for name in self.layout.weight_names(self.layer, field))

    def gemv_args(self, field: str) -> tuple[Ref, Ref]:
        """gemv_mma's weight arguments (W, qparams): qweight and qparams, or the FP16 W twice (its qparams unread)."""
        names = self.layout.weight_names(self.layer, field)
        return (Ref(names[0]), Ref(names[-1]))

    def gemv_group(self, field: str) -> np.int32:
        """gemv_mma's last argument: the group size, 0 for FP16 (unread)."""
        fmt = self.format(field)
        return i32(0 if fmt is None else fmt.group)

    def group(self, field: str) -> tuple:
        """The quantized kernels' last argument, the group size (nothing for FP16)."""
        fmt = self.format(field)
        return () if fmt is None else (i32(fmt.group),)

    def norm(self, field: str) -> Ref:
        """The norm weight of `field`'s RMSNorm (what the kernel that writes x prepares its input with)."""
        return Ref(buffer_name(NORM_OF[field], self.layer))

    def bias(self) -> Ref:
        """The q|k|v bias (zeros for a model without)."""
        return Ref(self.layout.bias_name(self.layer))

    def gathered(self, field: str, inp: Ref, out: Ref, K: int, rows: int) -> tuple[list, Ref]:
        """(the launches, the input ref) for `field`: under act-order `inp` gathered into `out`, else `inp`."""
        perm = self.layout.perm_name(self.layer, field)
        if perm is None:
            return [], inp
        return [Launch(GATHER_F16, (rows, 1, 1), ROW_THREADS, (inp, Ref(perm), out, i32(K)))], out


def decode_plan(model: LlamaConfig | Layout, max_seq: int, sample_vocab: int | None = None, slot: int = 0) -> Plan:
    """One decode step of the sequence in `slot` (its rows table slot_rows[slot]: one row (slot, 0))."""
    layout = as_layout(model)
    check_supported(layout.device)
    return Plan("decode" + _at(slot), _step_launches(layout, max_seq, 1, Ref, sample_vocab, Ref("slot_rows", slot)))


def _at(slot: int) -> str:
    """A plan's name suffix for its slot (none for slot 0): the CUDA backend captures a graph per name."""
    return f"@{slot}" if slot else ""


def batch_plan(model: LlamaConfig | Layout, max_seq: int, rows: int, group: int = 0,
               sample_vocab: int | None = None) -> Plan:
    """A batched decode step of group `group`: `rows` (1..VERIFY_ROWS) sequences, row r the one-row decode step of
    slot batch_rows[group][r] at its position (offset 0), each independent of the others: embed_rows turns each
    row's last token batch_ids[group][r] into its input, then the decode step's launches over the rows, and sample
    in batch mode (verify 0) writes each row's next token back into batch_ids[group][r] and advances its slot."""
    layout = as_layout(model)
    cfg = layout.device
    check_supported(cfg)
    if not 1 <= rows <= VERIFY_ROWS:
        raise KernelError(f"a batched step's group has 1 to {VERIFY_ROWS} rows, not {rows}")

    def act(name: str) -> Ref:  # the verify buffers' first `rows` token rows (a step runs one group at a time)
        return Ref(f"verify_{name}", rows=rows)

    ids = Ref("batch_ids", group)
    embed = _embed_prepared(cfg, rows, ids, act)
    return Plan(f"batch[{rows}]#{group}", [embed] + _step_launches(layout, max_seq, rows, act, sample_vocab,
                                                                  Ref("batch_rows", group), ids))


def verify_plan(model: LlamaConfig | Layout, max_seq: int, k: int, sample_vocab: int | None = None,
                slot: int = 0) -> Plan:
    """A verify step of k drafts (1..MAX_DRAFT): the token rows verify_ids[:k + 1] at positions pos..pos + k
    (the host keeps pos + k < max_seq); the decode step's launches with k + 1 rows, sample accepting."""
    layout = as_layout(model)
    cfg = layout.device
    check_supported(cfg)
    if not 1 <= k <= MAX_DRAFT:
        raise KernelError(f"a verify step checks 1 to {MAX_DRAFT} drafts, not {k}")
    rows = k + 1

    def act(name: str) -> Ref:  # a verify buffer's first `rows` token rows
        return Ref(f"verify_{name}", rows=rows)

    embed = _embed_prepared(cfg, rows, act("ids"), act)
    return Plan(f"verify[{k}]" + _at(slot),
                [embed] + _step_launches(layout, max_seq, rows, act, sample_vocab, Ref("slot_rows", slot)))


def _step_launches(layout: Layout, max_seq: int, rows: int, act, sample_vocab: int | None, step_rows: Ref,
                   batch: Ref | None = None) -> list[Launch]:
    """Every layer, the logits and the sample kernel over `rows` token rows (1: a decode step); act(name) is
    the activation buffer `name` (x, its prepared xn and x_ss, q, attn_part, attn_count, attn_out, h, logits, and the
    gathered xn_perm and attn_out_perm) as the kernels take it; step_rows the rows table (slot, offset per row).
    `batch`: a batched step's tokens (sample in batch mode writes each row's pick there), else a decode or verify
    step."""
    cfg = layout.device
    d, ff = cfg.hidden_size, cfg.intermediate_size
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, f32(cfg.rms_norm_eps)
    window = i32(attention_window(cfg, max_seq))
    launches = []
    prepared = (act("xn"), act("x_ss"))  # x's prepared RMSNorm input (prepare.cuh), as the next RMSNorm GEMV reads it
    for i in range(cfg.num_layers):
        w = _Weights(layout, i)
        # The RMSNorm GEMVs read what the kernel before them prepared (gemv_residual; for a step's first qkv, the
        # embedding's writer: embed_rows_prepared or the sample kernel before), under act-order its xn gathered into
        # the weight's input order beside the same Σ x² parts (a sum that does not depend on the order)
        qkv, qkv_rows, qkv_threads = w.gemv("gemv_qkv_rope", "wqkv", rows)
        o, o_rows, o_threads = w.gemv("gemv_residual", "wo", rows)
        gate_up, gate_up_rows, gate_up_threads = w.gemv("gemv_gate_up_silu", "w_gate_up", rows)
        down, down_rows, down_threads = w.gemv("gemv_residual", "w_down", rows)
        gather_qkv, xn_qkv = w.gathered("wqkv", act("xn"), act("xn_perm"), d, rows)
        gather_o, attn_out = w.gathered("wo", act("attn_out"), act("attn_out_perm"), cfg.q_dim, rows)
        gather_gate_up, xn_gate_up = w.gathered("w_gate_up", act("xn"), act("xn_perm"), d, rows)
        qkv_in, gate_up_in = (xn_qkv, act("x_ss")), (xn_gate_up, act("x_ss"))
        # down prepares the next layer's qkv input, or the logits'
        next_norm = (_Weights(layout, i + 1).norm("wqkv") if i + 1 < cfg.num_layers else Ref("final_norm"))
        launches += gather_qkv + [
            Launch(qkv, (cdiv(cfg.qkv_dim // 2, qkv_rows // 2), 1, 1), qkv_threads,
                   (*qkv_in, *w.gemv_args("wqkv"), w.bias(), act("q"), Ref("k_cache", i),
                    Ref("v_cache", i), Ref("rope"), Ref("state"), step_rows, i32(d), i32(nh), i32(nkv), i32(hd),
                    i32(max_seq), eps, w.gemv_group("wqkv"))),
            Launch(attention("attention_decode", cfg), (nkv, attention_splits(cfg), rows), ATTENTION_THREADS,
                   (act("q"), Ref("k_cache", i), Ref("v_cache", i), act("attn_part"), act("attn_count"),
                    act("attn_out"), Ref("state"), step_rows, i32(max_seq), f32(1.0 / np.sqrt(hd)), window)),
        ] + gather_o + [
            Launch(o, (cdiv(d, o_rows), 1, 1), o_threads,
                   (attn_out, *w.gemv_args("wo"), act("x"), w.norm("w_gate_up"), *prepared, i32(d),
                    i32(cfg.q_dim), w.gemv_group("wo"))),
        ] + gather_gate_up + [
            Launch(gate_up, (cdiv(ff, gate_up_rows // 2), 1, 1), gate_up_threads,
                   (*gate_up_in, *w.gemv_args("w_gate_up"), act("h"), i32(ff), i32(d), eps,
                    w.gemv_group("w_gate_up"))),
            Launch(down, (cdiv(d, down_rows), 1, 1), down_threads,
                   (act("h"), *w.gemv_args("w_down"), act("x"), next_norm, *prepared, i32(d), i32(ff),
                    w.gemv_group("w_down"))),
        ]
    return launches + _logits_and_sample(cfg, act("x"), act("logits"), rows, sample_vocab, step_rows, batch,
                                         prepared)


def _logits_and_sample(cfg: LlamaConfig, x: Ref, logits: Ref = Ref("logits"), rows: int = 1,
                       sample_vocab: int | None = None, step_rows: Ref = Ref("slot_rows", 0),
                       batch: Ref | None = None, prepared: tuple[Ref, Ref] | None = None) -> list[Launch]:
    """logits = lm_head · rmsnorm(x) for `rows` token rows, then the sample kernel over them (1 row: the next
    token; more: a verify step's acceptance). Either way it sets up the next decode step (state, seen, x and its
    prepared input xn, x_ss).
    Only the first sample_vocab ids (default: all) get a logit and can be drawn. `prepared`: x's RMSNorm input as
    the last gemv_residual prepared it (gemv_logits), else gemv_logits_x on x (a prefill's last row)."""
    d, V = cfg.hidden_size, sample_vocab or cfg.vocab_size
    lm_head = Ref("lm_head") if V == cfg.vocab_size else Ref("lm_head", rows=V)  # its first V rows: the twin's W
    picks = Ref("verify_picks", rows=rows) if batch is None else batch
    verify = [Ref("verify_ids", rows=rows), picks, Ref("verify_out", rows=rows + 1), Ref("verify_arrivals")]
    # the next step's input and its prepared form: a batched step's, each row in its own row
    next_x = (Ref("x"), Ref("xn"), Ref("x_ss")) if batch is None else (x, *prepared)
    return [
        Launch(gemv("gemv_logits" + ("" if prepared else "_x"), rows), (cdiv(V, gemv_rows(rows)), 1, 1), GEMV_THREADS,
               (*(prepared or (x, Ref("final_norm"))), lm_head, logits, i32(V), i32(d), f32(cfg.rms_norm_eps))),
        Launch(SAMPLE, (rows, 1, 1), SAMPLE_THREADS,
               (logits, Ref("seen"), Ref("state"), Ref("fparams"), Ref("embed"), FIRST_NORM, *next_x, step_rows,
                *verify, Ref("masks"), i32(V), i32(d), i32(seen_stride(cfg.vocab_size)),
                i32(mask_words(cfg.vocab_size)), i32(batch is None))),
    ]


def _gemm(kernel: GemmKernel, a: Ref, w: tuple[Ref, ...], c: str, m: int, n: int, k: int, accumulate: bool,
          group: tuple = ()) -> Launch:
    return Launch(kernel.spec, kernel.grid(m, n, k), kernel.threads,
                  (a, *w, Ref(c), Ref("gemm_workspace"), Ref("gemm_tile_count"), i32(m), i32(n), i32(k),
                   i32(accumulate), *group), kernel.smem)


def _attention_prefill(cfg: LlamaConfig, kernels: PrefillKernels, max_seq: int, i: int, start: int,
                       n: int, slot: int) -> Launch:
    args = (Ref("q_rows"), Ref("k_cache", (i, slot)), Ref("v_cache", (i, slot)), Ref("attn_rows"), i32(start),
            i32(n), i32(max_seq), f32(1.0 / np.sqrt(cfg.head_dim)), i32(attention_window(cfg, max_seq)))
    if kernels.mma_attention(cfg):
        return Launch(attention_prefill_mma_spec(cfg), attention_mma_ops.grid(cfg.num_kv_heads, n, cfg.group_size),
                      attention_mma_ops.THREADS, args)
    return Launch(attention_prefill_spec(cfg), (cfg.num_kv_heads, cdiv(n, attention_rows_q(cfg)), 1),
                  ATTENTION_THREADS, args)


PREFILL_OUTPUTS = ("sample", "logits", "none")


def prefill_plan(model: LlamaConfig | Layout, max_seq: int, start: int, n: int, output: str = "sample",
                 kernels: PrefillKernels = PrefillKernels(), chunk: int | None = None,
                 sample_vocab: int | None = None, slot: int = 0) -> Plan:
    """Prompt tokens prefill_ids[:n] at positions start..start+n-1 of the sequence in `slot` (n <= chunk: the
    rows runtime_buffers made, default PREFILL_CHUNK), with the GEMM and attention kernels `kernels` names
    (prefill_kernels.py; a quantized linear runs gemm_quant with the mma GEMM's tiles whatever `kernels` says).

    output "sample": the last row's logits go through the decode step's gemv_logits + sample (which
    sets pos = start + n, so the host sets state[POS] = start + n - 1 first); "logits":
    logits_rows[:n] gets every row's logits; "none": only the KV cache is filled (an early chunk).
    """
    layout = as_layout(model)
    cfg = layout.device
    check_supported(cfg)
    if output not in PREFILL_OUTPUTS:
        raise KernelError(f"prefill output {output!r} is not one of {PREFILL_OUTPUTS}")
    chunk = chunk or PREFILL_CHUNK
    if not 0 < n <= chunk or start + n > max_seq:
        raise KernelError(f"prefill chunk of {n} tokens at {start} does not fit (chunk {chunk}, "
                          f"context {max_seq})")
    d, ff, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, f32(cfg.rms_norm_eps)
    rows = lambda name, *args: Launch(prefill(name), (n, 1, 1), ROW_THREADS, args)  # noqa: E731
    gemm = kernels.gemm_kernel
    launches = [rows("embed_rows", Ref("prefill_ids"), Ref("embed"), Ref("x_rows"), i32(d), i32(V))]
    for i in range(cfg.num_layers):
        w = _Weights(layout, i)
        gather_qkv, xn_qkv = w.gathered("wqkv", Ref("xn_rows"), Ref("xn_rows_perm"), d, n)
        gather_o, attn = w.gathered("wo", Ref("attn_rows"), Ref("attn_rows_perm"), cfg.q_dim, n)
        gather_gate_up, xn_gate_up = w.gathered("w_gate_up", Ref("xn_rows"), Ref("xn_rows_perm"), d, n)
        launches += [rows("rmsnorm_rows", Ref("x_rows"), _layer(i, "attn_norm"), Ref("xn_rows"), i32(d), eps)]
        launches += gather_qkv + [
            _gemm(w.gemm("wqkv", gemm), xn_qkv, w.weights("wqkv"), "qkv_rows", n, cfg.qkv_dim, d, False,
                  w.group("wqkv")),
            rows("rope_kv_rows", Ref("qkv_rows"), w.bias(), Ref("rope"), Ref("q_rows"), Ref("k_cache", (i, slot)),
                 Ref("v_cache", (i, slot)), i32(start), i32(nh), i32(nkv), i32(hd), i32(max_seq)),
            _attention_prefill(cfg, kernels, max_seq, i, start, n, slot),
        ] + gather_o + [
            _gemm(w.gemm("wo", gemm), attn, w.weights("wo"), "x_rows", n, d, cfg.q_dim, True, w.group("wo")),
            rows("rmsnorm_rows", Ref("x_rows"), _layer(i, "ffn_norm"), Ref("xn_rows"), i32(d), eps),
        ] + gather_gate_up + [
            _gemm(w.gemm("w_gate_up", gemm), xn_gate_up, w.weights("w_gate_up"), "gu_rows", n, 2 * ff, d, False,
                  w.group("w_gate_up")),
            rows("silu_mul_rows", Ref("gu_rows"), Ref("h_rows"), i32(ff)),
            _gemm(w.gemm("w_down", gemm), Ref("h_rows"), w.weights("w_down"), "x_rows", n, d, ff, True,
                  w.group("w_down")),
        ]
    if output == "logits":
        launches += [rows("rmsnorm_rows", Ref("x_rows"), Ref("final_norm"), Ref("xn_rows"), i32(d), eps),
                     _gemm(gemm, Ref("xn_rows"), (Ref("lm_head"),), "logits_rows", n, V, d, False)]
    elif output == "sample":
        launches += _logits_and_sample(cfg, Ref("x_rows", n - 1), sample_vocab=sample_vocab,
                                       step_rows=Ref("slot_rows", slot))
    return Plan(f"prefill[{start}:{start + n}]" + _at(slot), launches)


# -- log-probabilities (cullama/runtime/logprobs.py) ------------------------------------------------------------
LOGPROBS = KernelSpec("sampling.cu", "logprobs")


def token_logprobs(V: int, rows: int, top: int, slot: int = 0) -> Launch:
    """The logprobs kernel after a step's sample, into logprob_step, with `top` alternatives over the first V ids
    (sample_vocab): 1 row, a decode step's (or a prefill's last row's) logits against the token sample wrote into
    state; k + 1 rows, a verify step's rows against their picks (row r's pick is accepted token r)."""
    if rows == 1:
        return _logprobs(Ref("logits"), V, V, Ref("state"), slot * STATE_LEN + sampling_ops.STATE_TOKEN, 1, top,
                         Ref("logprob_step"))
    return _logprobs(Ref("verify_logits", rows=rows), V, logits_stride(V), Ref("verify_picks", rows=rows),
                     0, rows, top, Ref("logprob_step"))


def batch_logprobs(V: int, rows: int, group: int, top: int) -> Launch:
    """The logprobs kernel after a batched step's sample: each row's logits against its pick (batch_ids[group])."""
    return _logprobs(Ref("verify_logits", rows=rows), V, logits_stride(V), Ref("batch_ids", group), 0, rows,
                     top, Ref("logprob_step"))


def prompt_logprobs(V: int, vocab: int, n: int, top: int) -> Launch:
    """The logprobs kernel over a prefill chunk's logits_rows[:n] (the "logits" output's, a row stride of `vocab`):
    row r against prefill_targets[r] (the next prompt id, -1 for none), the first V ids, into logprob_rows."""
    return _logprobs(Ref("logits_rows"), V, vocab, Ref("prefill_targets"), 0, n, top, Ref("logprob_rows"))


def _logprobs(logits: Ref, V: int, stride: int, targets: Ref, target_at: int, rows: int, top: int,
              out: Ref) -> Launch:
    return Launch(LOGPROBS, (rows, 1, 1), SAMPLE_THREADS,
                  (logits, targets, out, i32(V), i32(stride), i32(target_at), i32(top)))


def with_logprobs(plan: Plan, top: int, launches: list[Launch]) -> Plan:
    """`plan`'s launches and then `launches`, named for its `top` (a CUDA graph is captured per name)."""
    return Plan(f"{plan.name}+logprobs[{top}]", plan.launches + launches)


def scored_prefill_plan(none: Plan, logits: Plan, sample: Plan | None, V: int, vocab: int, n: int, top: int,
                        logprobs: int | None, slot: int = 0) -> Plan:
    """A prefill chunk (of the sequence in `slot`) whose every row is scored, from the plans of the same chunk with
    each output: the "logits" output's launches (every row's logits), the logprobs kernel over them, then for the
    prompt's last chunk (`sample`) the "sample" output's own launches (those after the ones it shares with "none")
    and, with `logprobs`, the sampled token's."""
    launches = logits.launches + [prompt_logprobs(V, vocab, n, top)]
    if sample is not None:
        launches += sample.launches[len(none.launches):]
        if logprobs is not None:
            launches.append(token_logprobs(V, 1, logprobs, slot))
    return Plan(f"{(sample or logits).name}+prompt_logprobs[{top}]", launches)
