// gemv_mma.cu — the decode step's matrix-vector products on tensor cores (mma.sync.m16n8k16, FP16 A and B, FP32
// accumulators), for FP16, INT8 and INT4 weights (BITS 16 | 8 | 4; W8A16 / W4A16) and 1 to 16 token rows (TOKENS):
// a decode step (1 row), a speculative verify step (k + 1 rows) and a batched step's group (B rows) run this one
// kernel, with the token rows as the MMA's M (rows past TOKENS are zero) and the weights as B.
//
//   gemv_qkv_rope      q|k|v = W_qkv · rmsnorm(x) + b   + RoPE on q and k, k and v written to the KV cache
//   gemv_residual      x += W · in                  (o_proj on the attention output, down_proj on h; both FP16),
//                      and the next
//                      RMSNorm kernel's input prepared from the new x: xn = fp16(x * norm_w), Σ x² in parts
//   gemv_gate_up_silu  h = silu(W_gate · n) * (W_up · n),  n = rmsnorm(x), h in FP16
//   gemv_logits        logits = W_lm_head · rmsnorm(x)   (FP16 only: the lm_head stays FP16, as AWQ and GPTQ keep it)
//   gemv_logits_x      gemv_logits on x itself (a prefill's last row, whose x a GEMM wrote)
// The RMSNorm kernels read their input prepared (prepare.cuh) by the kernel that wrote x: gemv_residual, or for a
// step's first qkv the embedding's writer (sample, embed_rows_prepared); under act-order the prepared xn gathered into
// the weight's input order (ops/gather.py; Σ x² does not depend on the order).
//
// Weights, unchanged from the formats the prefill GEMMs read (no reshuffle at load): FP16 W [M, K] row-major, or
// cullama/model/quant.py's qweight [M, K * BITS / 32] uint32 (codes interleaved for dequant.cuh) and qparams
// [M, K / group, 2] FP16 (scale, zero). Parameters: one signature for every BITS, (W, qparams) for the weight and
// `group` last (a BITS 16 kernel reads neither qparams nor group; gemv_logits, FP16 only, has neither). Rows are
// [TOKENS, width]: x, q_out and logits float32 (logits at logits_stride(V)); gemv_residual's `in`, h and the prepared
// xn FP16.
//
// Fragments without a reshuffle: the reduction index k is ours to permute as long as A and B permute it alike. Lane
// (g = lane / 4, t = lane % 4) of a warp loads 16 contiguous bytes ("chunk" c = 4 kb + t of k-block kb) of weight row
// n0 + g: E = 8 FP16 values, 16 INT8 or 32 INT4 codes, i.e. STEPS = E / 4 MMA k-steps. The weights are the MMA's A
// (m16: rows g and g + 8 of an m-tile are n-tiles 2J and 2J + 1) and x its B (n8: token rows, a second n8 tile past 8
// rows): in step s the lane's weight pairs are elements 4s, 4s + 1 (a0 / a1) and 4s + 2, 4s + 3 (a2 / a3) of its chunk,
// its x pair b0 / b1 the same k of token row g. So MMA k-index 2t + h <-> element c E + 4s + h and 2t + 8 + h <->
// c E + 4s + 2 + h. Each output is C plus the same 16 products in the same k order as with x as A (aab6b00's first
// form), so the same sums, and up to 8 token rows need one MMA per 16 weight rows and step instead of two.
// FP16: the pairs are words 2s, 2s + 1 of the chunk. INT4 / INT8: quant.py's interleaved order puts codes 2p, 2p + 1
// of a word in one masked pair (dequant.cuh), so the pairs come straight from the loaded words: INT8 one prmt a pair;
// INT4 one lop3 a pair and one shift a word (code_pair4: pairs 1 and 3 masked in place under FP16 64's exponent,
// Marlin's trick with a subtraction where Marlin has an fma, so the exact q - zero without a new instruction).
// The loaded words are used as they are (the prefill GEMMs and the loaders untouched; test_gemv_mma.py reads the formats).
// B for quantized weights is the prefill GEMM's FP16 weight, fp16((q - zero) * scale): code_pair's exact FP16 (q - zero)
// times the scale by one mul.rn.f16x2, so prefill and decode multiply by the same weights, and any group that is a
// multiple of the chunk works (each lane takes its chunk's (scale, zero); the group index by a multiply, group_of).
// The alternative, a fresh FP32 accumulator per group and fmaf(part, scale, acc), needs every MMA's 16 k inside one
// group and costs an FFMA per accumulator per group; the FP16 weight costs one HMUL2 per code pair. Per INT4 code pair
// that is a lop3, a sub and a mul (plus a shift a word): 3.25 lane-instructions per weight byte, the floor of this
// dequantization while B stays fp16((q - zero) * scale).
// A: fp16(x * norm_w) (x * norm_w rounded to FP32 by __fmul_rn, then cvt.rn.f16x2: x rounded to FP16 as HuggingFace's
// FP16 models do), RMSNorm's rsqrt scale applied in the FP32 epilogue. Prepared (X_PREP, the RMSNorm kernels the plans
// launch after a gemv_residual): that kernel's epilogue wrote xn = fp16(x * norm_w) [TOKENS, K] and Σ x² in parts of
// SS_SPAN (32) elements, ssp [TOKENS, ceil(K / 32)] (an fmaf chain each), so each lane loads its chunk of xn as its B
// values as they are (E / 8 16-byte loads a chunk and token row) and the block adds the parts once (prepared_scales:
// the same order in every block and kernel). In gemv_logits_x (X_NORM) every block does that work itself per element
// and token row slot while loading A: the sum of x^2 in FP32 (fmaf), x * norm_w, the norm weight's conversion, half a
// cvt: ~2 lane-instructions a weight byte at INT4 and up to 8 rows, ~3.5 past 8, the same in every block (why the
// quantized kernels have no such form).
// x's fragments are made once per k-block (every step), shared by the n-tiles; token rows past TOKENS stay zero and
// are never loaded. Chunks past K (the last, partial k-block): FP16 weights zero-filled; quantized ones loaded from the
// row's last chunk with a zero scale (+0 weights, no zero fill in the loop); x from the row's last chunk again, out of
// Σ x² (a finite x times +0 adds +0: no sum changes, an accumulator is never -0).
//
// Launch: 1-D grid, THREADS (128) = WARPS (4) warps. A block owns ROWS = 8 NTILES output rows (NTILES n-tiles of 8
// rows, every warp all of them: each A fragment feeds NTILES MMAs); its warps split K, warp w taking k-blocks w,
// w + 4, w + 8, ... (a k-block: 4 chunks of every row), UNROLL k-blocks per batch of loads (NTILES x UNROLL 16-byte
// streaming loads per lane in flight, plus a 4-byte (scale, zero) per chunk when quantized). Then the warps' C
// fragments and RMSNorm partial sums go through shared memory, are added in warp order, and the epilogue runs for
// every (token row, output pair) on all 128 threads.
// Grid: qkv ceil(pairs / PAIRS), residual / logits ceil(M / ROWS), gate_up ceil(ff / PAIRS); ROWS 32 (NTILES 4):
// LLaMA-2-7B: qkv 384, o_proj and down 128, gate_up 688, lm_head 1000 blocks for 132 SMs.
// Input re-reads: each block reads its token rows of the input once (its warps split K): TOKENS * K * 2 bytes (FP16:
// every plan kernel but gemv_logits_x, which reads float32 x, twice that) against ROWS * K * BITS / 8 bytes of weights,
// a ratio of 16 TOKENS / (ROWS BITS): at 16 rows and ROWS 32 that is 0.5 (FP16), 1.0 (INT8) and 2.0 (INT4) from L2 /
// L1 (at 1 row 0.03, 0.06, 0.13; blocks sharing an SM share L1 hits). This is the design's
// known cost at many rows: staging A in shared memory for more rows per block with split-K across blocks would cut
// it (later work, measured first on a GPU).
// Shapes: K % E == 0 (FP16 K % 8, INT8 K % 16, INT4 K % 32), K / E < 46340 (group_of), M K / E < 2^31 (a weight
// under 32 GiB: 32-bit chunk offsets); chunks past K as above; for quantized weights group % E == 0 and K % group
// == 0 (quant.py's contract); any M; qkv's hd a power of two (rope.cuh; plan.check_supported).
// Issue (issue 26: cullama/bench/issue.py's static sm_90 count, lane-instructions per weight byte over the whole
// kernel, LLaMA-2-7B, 1-8 / 9-16 token rows, NTILES 4, 2026-12-07, every RMSNorm GEMV on the prepared input, every
// epilogue round counted): FP16 0.9-1.1 / 1.3-1.5; INT8 (KBLOCK_SCALE) qkv 2.4-2.5 / 3.0-3.1, gate_up 2.3-2.5 /
// 2.9-3.0, o_proj 2.3-2.5 / 2.8-2.9, down 2.2-2.3 / 2.6-2.7; INT4 (KBLOCK_SCALE) qkv 3.9-4.1 / 4.9, gate_up 3.8-4.0 /
// 4.6-4.7, o_proj 3.7-3.9 / 4.4-4.6, down 3.5-3.7 / 4.1-4.2: none over 5.0. Earlier forms: before 32-bit row
// offsets, the epilogues in rounds, prepared_scales without a divergent shuffle and hi_x2 (dequant.cuh), counted as
// then (a 16-row epilogue's second round not counted), INT4 qkv 4.3-4.6 / 4.9-5.0 and gate_up up to 5.12;
// before KBLOCK_SCALE, the prepared input and FP16 inputs for the residual (1c187dc^): INT4 qkv 7.1-7.2 / 8.8-9.0,
// o_proj and down 5.2-5.5 / 5.9-6.1; the in-kernel RMSNorm form that a step's first qkv and act-order linears ran
// until 2026-12-07: INT4 6.2-6.3 / 8.0-8.6. The INT4 floor is its dequantization, a lop3 and a sub per code pair and
// a shift a word (2.25 a byte with KBLOCK_SCALE, 3.25 with the HMUL2 per pair); past 8 rows a second n8 tile doubles
// the MMAs and the input's loads, the epilogues take two rounds and prepared_scales sums 16 rows of parts (INT4 qkv
// at 16 rows: main loop 4.1, epilogue ~0.45, Σ x² parts ~0.3 a byte).
// MIN_BLOCKS 3 / UNROLL 1 for INT4 past 8 rows keeps those variants from spilling (W4_WIDE).
//
// Bit-exactness by construction: every output (token m, row n) is, per warp, the chain of that warp's MMAs over its
// k-blocks in order and the steps in order; an MMA output depends only on its own A row and B column (the executor's
// complete_mma; on a GPU the first device check shows it), rows past TOKENS are zero, and the warps' partials are added
// in warp order with __fadd_rn. So a token row's result does not depend on the other rows or on TOKENS: a verify step's
// rows equal decode steps' and a batched row equals the row alone (tests/runtime/ops/test_gemv_mma.py). The epilogues'
// arithmetic is explicit (__fadd_rn, __fmul_rn, __fdiv_rn). The NumPy twin (cullama/runtime/ops/gemv_mma.py) models
// this order and the executor's MMA (a double sum of C and the 16 products in k order, rounded once) bit for bit.
// Overlap: the first batch of weight loads is issued before pdl_wait(), as before.
#ifndef BITS
#define BITS 16
#endif
#ifndef TOKENS
#define TOKENS 1
#endif
#ifndef NTILES
#define NTILES 4  // n-tiles of 8 output rows per block (each warp covers all of them)
#endif
// INT4 at 9..16 token rows holds two rows' x fragments (32 registers) beside its weights: one k-block a batch and up to
// 168 registers (3 blocks an SM: qkv's 384 blocks still in one wave on 132 SMs), else ptxas spills.
// Past 8 rows FP16 takes 2 k-blocks a batch (sm_120 spills at 4) and INT8 past 8 rows 3 blocks an SM (sm_80, sm_100 spill).
#define W4_WIDE (BITS == 4 && TOKENS > 8)
// KBLOCK_SCALE 1 (quantized weights whose group is a multiple of 4 chunks, 4 ELEMS: INT4 g128 and per channel, INT8
// per channel; the plan chooses it, ops/gemv_mma.py defines()): a k-block's 4 chunks, so all 16 k of each of its MMAs,
// lie in one group, so B is the exact FP16 (q - zero) with no scale multiply per code pair, each k-block's MMAs chain
// from zero and the k-block's sum enters the FP32 accumulator as fmaf(part, scale, acc), the row's scale of that
// group. An HMUL2 per code pair (1.0 a byte INT4, 0.5 INT8) becomes an FFMA per C element per k-block (0.125 a byte
// at up to 8 rows). The weights are then exactly (q - zero) * scale, where the other form (and the prefill GEMM) rounds
// them to FP16 first: decode is the more exact of the two. Such a group divides K, so no k-block is partial.
#ifndef KBLOCK_SCALE
#define KBLOCK_SCALE 0
#endif
#ifndef UNROLL
#define UNROLL (BITS == 16 ? (TOKENS > 8 ? 2 : 4) : W4_WIDE ? 1 : 2)  // k-blocks per warp in one batch of loads
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS (BITS != 16 && TOKENS > 8 ? 3 : 4)  // 128 registers a thread at most (168 at 3)
#endif
#include "common.cuh"
#include "rope.cuh"
#include "dequant.cuh"
#include "mma.cuh"
#include "prepare.cuh"

#if BITS != 16 && BITS != 8 && BITS != 4
#error "BITS must be 16, 8 or 4"
#endif
#if TOKENS < 1 || TOKENS > 16
#error "TOKENS must be 1..16 (the MMA's M)"
#endif
#define THREADS 128
#define WARPS (THREADS / WARP)
#define ROWS (8 * NTILES)
#define PAIRS (ROWS / 2)
#define ELEMS (128 / BITS)  // k elements per 16-byte chunk
#define STEPS (ELEMS / 4)   // MMA k-steps per chunk (4 of each lane's k per step)
#define QUANT (BITS != 16)
#define MTILES (NTILES / 2)         // MMA m-tiles of 16 weight rows (two n-tiles of 8)
#define NCOLS (TOKENS > 8 ? 2 : 1)  // MMA n8 tiles of token rows
#if KBLOCK_SCALE && !QUANT
#error "KBLOCK_SCALE is for quantized weights (BITS 8 or 4)"
#endif
#if NTILES % 2
#error "NTILES must be even (an MMA m-tile is two n-tiles)"
#endif

// The warps' partial sums: dot[w][row][token] and RMSNorm's Σ x² per (warp, lane % 4, token); the token rows'
// RMSNorm scales (prepared input); gemv_residual's new x of the block's rows (its Σ x² part).
struct Partials {
    float dot[WARPS][ROWS][16];
    float ss[WARPS][4][16];
    float scale[16];
    float x[16][ROWS];
};

// -- the input forms of block_dot -----------------------------------------------------------------------------------
// X_HALF: FP16 rows as they are (gemv_residual's `in`: attention's output for o_proj, gate_up's h for down).
// X_NORM: float32 rows x times the norm weights, RMSNorm's Σ x² taken on the way (gemv_logits_x: a prefill's last
// row). X_PREP: the input prepared once by the kernel that wrote x (prepare.cuh: gemv_residual's epilogue, sample,
// embed_rows_prepared): xn = fp16(x * norm_w) [TOKENS, K] as the MMA's B values as they are, and the Σ x² parts
// ssp [TOKENS, ceil(K / SS_SPAN)] (plan.ss_parts). In X_NORM every block repeats x's work per element and token row
// slot (~2 lane-instructions a weight byte at INT4 and up to 8 rows, ~3.5 past 8); X_PREP leaves a 16-byte load per
// chunk.
enum XForm { X_HALF, X_NORM, X_PREP };
#define SS_LANE_PARTS 8  // parts a lane adds in prepared_scales: up to 32 x 8 parts, d <= 8192 (plan.check_supported)

// -- the rows of a block (index i in 0 .. ROWS - 1): clamped to the last one past the end (computed, never stored) --
enum RowKind { PLAIN_ROWS, QKV_ROWS, GATE_UP_ROWS };

template <int KIND>
__device__ __forceinline__ int block_row(int i, int M, int hd, int n_pairs) {
    if (KIND == PLAIN_ROWS) return min((int)blockIdx.x * ROWS + i, M - 1);
    const int p = min((int)blockIdx.x * PAIRS + i / 2, n_pairs - 1);
    if (KIND == GATE_UP_ROWS) return p + (i % 2) * M;  // (gate r, up ff + r); M = ff, n_pairs = ff
    const int row0 = pair_head(p, hd) * hd + pair_dim(p, hd);  // RoPE pair (j, j + hd / 2) of a head
    return row0 + (i % 2) * (hd / 2);
}

// One lane's weight rows and its batch of loads in flight: w[u][j] is its chunk of tile j's row in k-block
// base + WARPS u, p[u][j] that chunk's (scale, zero) word (quantized).
struct Loads {
    const uint4* W;        // the weights as 16-byte chunks
    const uint32_t* P;     // their (scale, zero) words
    int row[NTILES];       // each tile's row: its first chunk, an offset from W (32-bit: 64-bit row pointers took
                           // 8 more registers, and ptxas rebuilt them from the row index in every batch)
    int params[NTILES];    // its first (scale, zero) word, an offset from P
    int vecs, group_vecs;  // chunks per row; chunks per group
    uint32_t magic;        // ceil(2^31 / group_vecs): chunk c's group is umulhi(2 c, magic) (group_of)
    uint4 w[UNROLL][NTILES];
#if QUANT
    uint32_t p[UNROLL][NTILES];
#endif
};

// c / group_vecs without a division in the loop (common.cuh's div_by_magic: exact while c group_vecs < 2^31, so
// K / E < 46340).
__device__ __forceinline__ int group_of(const Loads& b, int c) { return div_by_magic(c, b.magic); }

__device__ __forceinline__ void load_batch(Loads& b, int base) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the batch before the first use
        const int c = 4 * (base + WARPS * u) + t;
        const bool inside = c < b.vecs;
#if QUANT
        // Past K: the row's last chunk, loaded (no zero fill), with a zero scale: weights (q - zero) * 0 = +0. With
        // KBLOCK_SCALE no k-block is partial: only the k-blocks past the last (never used) are clamped.
        const int cc = min(c, b.vecs - 1), group = group_of(b, cc);
#endif
#pragma unroll
        for (int j = 0; j < NTILES; ++j) {
#if QUANT
            b.w[u][j] = load_stream(b.W + (b.row[j] + cc));
            b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;
#else
            b.w[u][j] = inside ? load_stream(b.W + (b.row[j] + c)) : make_uint4(0, 0, 0, 0);
#endif
        }
    }
}

template <int KIND>
__device__ __forceinline__ void first_batch(Loads& b, const void* __restrict__ W, const half_t* __restrict__ qparams,
                                            int K, int group, int M, int hd, int n_pairs) {
    const int g = threadIdx.x % WARP / 4;
    b.vecs = K / ELEMS;
    b.group_vecs = QUANT ? group / ELEMS : 1;  // FP16: no groups (qparams and group unread)
    b.magic = div_magic(b.group_vecs);
    const int groups = group_of(b, b.vecs);  // K / group, without a second division (group % ELEMS == 0)
    b.W = reinterpret_cast<const uint4*>(W);
    b.P = reinterpret_cast<const uint32_t*>(qparams);
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
        const int r = block_row<KIND>(8 * j + g, M, hd, n_pairs);
        b.row[j] = r * b.vecs;
        b.params[j] = QUANT ? r * groups : 0;
    }
    load_batch(b, threadIdx.x / WARP);
}

// The weight pairs (b0: elements 4s, 4s + 1; b1: 4s + 2, 4s + 3) of step s from a lane's chunk w (and its (scale,
// zero) word p when quantized): FP16 as loaded, quantized fp16((q - zero) * scale), or with KBLOCK_SCALE the exact
// FP16 (q - zero) (the scale comes after the k-block's MMAs).
__device__ __forceinline__ void b_fragment(const uint4& w, uint32_t p, int s, uint32_t& b0, uint32_t& b1) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#if BITS == 16
    b0 = words[2 * s], b1 = words[2 * s + 1];
#elif BITS == 8
    const uint32_t bias = zero_bias(p), word = words[s];  // one step a word
    b0 = code_pair<8>(word, bias, 0);
    b1 = code_pair<8>(word, bias, 1);
#else
    const uint32_t bias = zero_bias(p), bias64 = zero_bias64(p);
    const uint32_t word = words[s / 2], pair = 2 * (s % 2);  // two steps a word: pairs 0, 1 then 2, 3
    b0 = code_pair4(word, word >> 8, bias, bias64, pair);
    b1 = code_pair4(word, word >> 8, bias, bias64, pair + 1);
#endif
#if QUANT && !KBLOCK_SCALE
    const uint32_t scale = scale_x2(p);
    b0 = hmul2(b0, scale);
    b1 = hmul2(b1, scale);
#endif
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source -> upper half
    return r;
}

// x's pairs of step s for one token row (X_NORM): x[k .. k + 3] times the norm weights gn as two FP16 pairs; ss += Σ
// x² of those four (inside K).
__device__ __forceinline__ void x_pair(const float* __restrict__ xk, const float (&gn)[4], bool inside, uint32_t (&f)[2],
                                       float& ss) {
    const float4 x4 = *reinterpret_cast<const float4*>(xk);
    float v[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (inside) ss = __fmaf_rn(v[i], v[i], ss);
        v[i] = __fmul_rn(v[i], gn[i]);
    }
    f[0] = pack_f16x2(v[0], v[1]);
    f[1] = pack_f16x2(v[2], v[3]);
}

// The x fragments of chunk c (X_NORM, every step) for token rows g (x0) and g + 8 (x1, TOKENS > 8 and g + 8 <
// TOKENS): once per k-block, shared by every n-tile (the norm weights converted once for both rows). A chunk past K
// (inside false) comes as the row's last chunk again, whose weights are +0 there (load_batch): its products add +0,
// which changes no sum (an accumulator is never -0), and it stays out of Σ x².
__device__ __forceinline__ void x_fragments(const float* __restrict__ x, const half_t* __restrict__ gw, int K, int c,
                                            bool inside, int g, uint32_t (&x0)[STEPS][2], uint32_t (&x1)[STEPS][2],
                                            float& ss0, float& ss1) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
        const int k = c * ELEMS + 4 * s;
        const uint2 g2 = *reinterpret_cast<const uint2*>(gw + k);
        const float gn[4] = {lo_f(g2.x), hi_f(g2.x), lo_f(g2.y), hi_f(g2.y)};
        x_pair(x + (size_t)g * K + k, gn, inside, x0[s], ss0);
        if (TOKENS > 8 && g + 8 < TOKENS) x_pair(x + (size_t)(g + 8) * K + k, gn, inside, x1[s], ss1);
    }
}

// The prepared x fragments of chunk c (every step) for token rows g (x0) and g + 8 (x1, TOKENS > 8 and g + 8 <
// TOKENS): the chunk's ELEMS halves of xn as they are (the pairs of step s are words 2s, 2s + 1, as for FP16 weights).
// A chunk past K comes as the row's last chunk again, whose weights are +0 there (load_batch).
__device__ __forceinline__ void xn_fragments(const half_t* __restrict__ xn, int K, int c, int g,
                                             uint32_t (&x0)[STEPS][2], uint32_t (&x1)[STEPS][2]) {
#pragma unroll
    for (int i = 0; i < ELEMS / 8; ++i) {
        const uint4 w0 = *(reinterpret_cast<const uint4*>(xn + (size_t)g * K + (size_t)c * ELEMS) + i);
        x0[2 * i][0] = w0.x, x0[2 * i][1] = w0.y, x0[2 * i + 1][0] = w0.z, x0[2 * i + 1][1] = w0.w;
        if (TOKENS > 8 && g + 8 < TOKENS) {
            const uint4 w1 = *(reinterpret_cast<const uint4*>(xn + (size_t)(g + 8) * K + (size_t)c * ELEMS) + i);
            x1[2 * i][0] = w1.x, x1[2 * i][1] = w1.y, x1[2 * i + 1][0] = w1.z, x1[2 * i + 1][1] = w1.w;
        }
    }
}

// The warp's products over its k-blocks, then every warp's partials into shared memory (after a barrier, sum_dot /
// sum_ss read them). The MMA takes the weights as A (m-tile J: rows 16J + g and 16J + g + 8 = n-tiles 2J and 2J + 1)
// and x as B (n8 tile n: token rows 8n .. 8n + 7): each output is the same 16 products in the same k order as with x
// as A, so the same sums (the executor's and the twin's), and a launch of up to 8 token rows issues half the MMAs.
template <int FORM>
__device__ __forceinline__ void block_dot(Loads& b, int K, const void* __restrict__ input,
                                          const half_t* __restrict__ gw, Partials& part) {
    const float* __restrict__ x = static_cast<const float*>(input);
    const half_t* __restrict__ xn = static_cast<const half_t*>(input);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    const int kblocks = (b.vecs + 3) / 4;
    float acc[MTILES][NCOLS][4];
#pragma unroll
    for (int J = 0; J < MTILES; ++J)
#pragma unroll
        for (int n = 0; n < NCOLS; ++n) acc[J][n][0] = acc[J][n][1] = acc[J][n][2] = acc[J][n][3] = 0.f;
    float ss0 = 0.f, ss1 = 0.f;  // Σ x² of token rows g and g + 8 over this lane's k
    // x's fragments: zero for token rows past TOKENS (never loaded, never written), and past K.
    uint32_t x0[STEPS][2], x1[STEPS][2];
#pragma unroll
    for (int s = 0; s < STEPS; ++s) x0[s][0] = x0[s][1] = x1[s][0] = x1[s][1] = 0u;
    for (int base = warp; base < kblocks; base += WARPS * UNROLL) {
        if (base != warp) load_batch(b, base);  // the first batch is in flight
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int kb = base + WARPS * u;
            if (kb >= kblocks) continue;  // not break: a break can keep the loop from unrolling
            const int c = 4 * kb + t;
            if (FORM == X_PREP || FORM == X_HALF) {
                if (g < TOKENS) xn_fragments(xn, K, min(c, b.vecs - 1), g, x0, x1);
            } else if (g < TOKENS) {
                x_fragments(x, gw, K, min(c, b.vecs - 1), c < b.vecs, g, x0, x1, ss0, ss1);
            }
#if KBLOCK_SCALE
            float part[MTILES][NCOLS][4];  // this k-block's sums, unscaled: chained from zero
#pragma unroll
            for (int J = 0; J < MTILES; ++J)
#pragma unroll
                for (int n = 0; n < NCOLS; ++n) part[J][n][0] = part[J][n][1] = part[J][n][2] = part[J][n][3] = 0.f;
#else
            float (&part)[MTILES][NCOLS][4] = acc;  // the products go straight into the accumulators
#endif
#pragma unroll
            for (int s = 0; s < STEPS; ++s) {
#pragma unroll
                for (int J = 0; J < MTILES; ++J) {
                    uint32_t a[4];  // a0, a2: row g of n-tile 2J; a1, a3: of n-tile 2J + 1
#if QUANT
                    b_fragment(b.w[u][2 * J], b.p[u][2 * J], s, a[0], a[2]);
                    b_fragment(b.w[u][2 * J + 1], b.p[u][2 * J + 1], s, a[1], a[3]);
#else
                    b_fragment(b.w[u][2 * J], 0u, s, a[0], a[2]);
                    b_fragment(b.w[u][2 * J + 1], 0u, s, a[1], a[3]);
#endif
                    mma_16816(part[J][0], a, x0[s][0], x0[s][1]);
                    if (TOKENS > 8) mma_16816(part[J][NCOLS - 1], a, x1[s][0], x1[s][1]);
                }
            }
#if KBLOCK_SCALE
            // C element e of m-tile J is row g of n-tile 2J + e / 2: the lane's own row, whose (scale, zero) word it
            // loaded for this k-block (all 4 chunks in one group: every lane t has the same one)
#pragma unroll
            for (int J = 0; J < MTILES; ++J)
#pragma unroll
                for (int n = 0; n < NCOLS; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[J][n][e] = __fmaf_rn(part[J][n][e], lo_f(b.p[u][2 * J + e / 2]), acc[J][n][e]);
#endif
        }
    }
    // C fragment of m-tile J, n8 tile n: rows 16J + g (acc[J][n][0..1]) and 16J + g + 8 (acc[J][n][2..3]), token rows
    // 8n + 2t and 8n + 2t + 1.
#pragma unroll
    for (int J = 0; J < MTILES; ++J)
#pragma unroll
        for (int n = 0; n < NCOLS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) part.dot[warp][16 * J + 8 * (e / 2) + g][8 * n + 2 * t + e % 2] = acc[J][n][e];
    if (FORM == X_NORM) {  // the other forms take no Σ x² here (X_PREP's is prepared_scales')
        part.ss[warp][t][g] = ss0;
        part.ss[warp][t][g + 8] = ss1;
    }
    __syncthreads();
}

// The epilogue's items 0 .. ITEMS - 1 (token row x output), thread t taking items t, t + THREADS, ...: in rounds whose
// count the compiler knows, where `item = threadIdx.x; item < ITEMS; item += THREADS` left a loop of run-time trip
// count with a remainder copy of the body (0.06 lane-instructions a byte at INT4 and 16 rows in gemv_residual), and
// one that cullama/bench/issue.py can only count once where 9 to 16 token rows take two rounds.
template <int ITEMS, typename Body>
__device__ __forceinline__ void for_items(Body body) {
#pragma unroll
    for (int round = 0; round < (ITEMS + THREADS - 1) / THREADS; ++round) {
        const int item = threadIdx.x + round * THREADS;
        if (item < ITEMS) body(item);
    }
}

// Output row i's dot product for token row tok: the warps' partials in warp order.
__device__ __forceinline__ float sum_dot(const Partials& part, int i, int tok) {
    float d = part.dot[0][i][tok];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) d = __fadd_rn(d, part.dot[w][i][tok]);
    return d;
}

// The prepared input's RMSNorm scales rsqrt(Σ x² / K + eps) into part.scale (warp w: token rows w, w + WARPS, ...;
// read after block_dot's barrier): per lane its parts l, l + 32, ... of ssp in order, then the lanes' sums in a
// butterfly (lane l + lane l ^ 1, then ^ 2, ^ 4, ^ 8, ^ 16: the same tree on every lane, as a + b == b + a), so every
// kernel that reads these parts gets the same scale. The warp's rows go together, part by part (one bounds check a
// part for all of them, up to four independent chains); a row past TOKENS (the last of some warps) sums the last
// row again, unused, so that no load waits on a second predicate and every shuffle runs on the whole warp (a
// `break` there made ptxas add a divergent-shuffle fallback). Lane i keeps the sum of the warp's i-th row and the
// divisions and square roots run once, on those lanes (inside the loop over rows they cost 0.3 lane-instructions a
// weight byte at INT4 and 16 rows).
__device__ __forceinline__ void prepared_scales(Partials& part, const float* __restrict__ ssp, int K, float eps) {
    constexpr int WARP_ROWS = (TOKENS + WARPS - 1) / WARPS;  // token rows a warp sums
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, parts = (K + SS_SPAN - 1) / SS_SPAN;
    float v[WARP_ROWS];  // the lane's sums of rows warp, warp + WARPS, ...
#pragma unroll
    for (int t = 0; t < WARP_ROWS; ++t) v[t] = 0.f;
#pragma unroll
    for (int j = 0; j < SS_LANE_PARTS; ++j) {  // unrolled, the parts past the last skipped
        const int i = lane + WARP * j;
        if (i >= parts) continue;
#pragma unroll
        for (int t = 0; t < WARP_ROWS; ++t) {
            const int tok = min(warp + WARPS * t, TOKENS - 1);  // past TOKENS: the last row again, its sum unused
            v[t] = __fadd_rn(v[t], ssp[tok * parts + i]);
        }
    }
    float mine = 0.f;  // lane i: the sum of this warp's i-th token row (tok = warp + WARPS i)
#pragma unroll
    for (int t = 0; t < WARP_ROWS; ++t) {
#pragma unroll
        for (int m = 1; m < WARP; m *= 2) v[t] = __fadd_rn(v[t], __shfl_xor_sync(0xffffffffu, v[t], m));
        if (lane == t) mine = v[t];
    }
    const int tok = warp + WARPS * lane;  // lane i: the scale of the warp's i-th row, one division for all of them
    if (lane < WARP_ROWS && tok < TOKENS) part.scale[tok] = rsqrtf(__fadd_rn(__fdiv_rn(mine, (float)K), eps));
}

// Token row tok's RMSNorm scale rsqrt(Σ x² / K + eps): the partials in (warp, lane % 4) order (X_NORM).
__device__ __forceinline__ float rms_scale(const Partials& part, int tok, int K, float eps) {
    float ss = part.ss[0][0][tok];
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            if (w || t) ss = __fadd_rn(ss, part.ss[w][t][tok]);
        }
    }
    return rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)K), eps));
}

__device__ __forceinline__ float silu(float a) { return __fdiv_rn(a, __fadd_rn(1.f, expf(-a))); }

// The RMSNorm kernels' input, in two forms: gemv_logits_x takes (x [TOKENS, d] float32, norm_w [d] FP16) and does
// the norm's work per block (X_NORM); the others take what the kernel that wrote x prepared, (xn [TOKENS, d] FP16 =
// x * norm_w, ssp [TOKENS, ceil(d / SS_SPAN)] float32: Σ x² in parts), and only load it (X_PREP). `in` and `aux`
// are the pair.
template <int FORM>
__device__ __forceinline__ float norm_scale(const Partials& part, int tok, int K, float eps) {
    return FORM == X_PREP ? part.scale[tok] : rms_scale(part, tok, K, eps);
}

template <int FORM>
__device__ __forceinline__ void norm_input(Loads& loads, int K, const void* __restrict__ in,
                                           const void* __restrict__ aux, float eps, Partials& part) {
    if (FORM == X_PREP) prepared_scales(part, static_cast<const float*>(aux), K, eps);  // read after block_dot's sync
    block_dot<FORM>(loads, K, in, FORM == X_PREP ? nullptr : static_cast<const half_t*>(aux), part);
}

// The weight parameters, one signature for every BITS: W is the FP16 W [M, K] or quant.py's qweight [M, K BITS / 32]
// uint32 (read as 16-byte chunks either way), qparams its (scale, zero) pairs and group its group size; a BITS 16
// kernel reads neither (the plan passes W and 0): first_batch ignores them.
// grid: ceil(pairs / PAIRS), pairs = (n_heads + 2 n_kv_heads) hd / 2. W_qkv [(n_heads + 2 n_kv_heads) hd, d]. bias
// [(n_heads + 2 n_kv_heads) hd] FP16 (Qwen2's; zeros for a model without), added before RoPE; q_out [TOKENS, n_heads
// hd] float32 (after RoPE); k_cache, v_cache [slots, n_kv_heads, max_seq, hd] FP16 (this layer's), token row t's
// written in its slot at its position (state [slots, 8], step_rows [TOKENS, 2]: common.cuh); rope [max_seq, hd/2, 2].
// Each kernel's prologue stands in its own body (the tests read what it touches before pdl_wait: weights only):
// pdl_launch_dependents (the next kernel may start streaming its weights), the first batch of weight loads, then
// pdl_wait (everything after it may read what the previous kernel wrote); the rest is these templates'.
template <int FORM>
__device__ __forceinline__ void qkv_rope(Loads& loads, const void* __restrict__ in, const void* __restrict__ aux,
                                         const half_t* __restrict__ bias, float* __restrict__ q_out,
                                         half_t* __restrict__ k_cache, half_t* __restrict__ v_cache,
                                         const float* __restrict__ rope, const int* __restrict__ state,
                                         const int* __restrict__ step_rows, int d, int n_heads, int n_kv_heads, int hd,
                                         int max_seq, float eps, Partials& part) {
    const int half_hd = hd / 2, n_pairs = (n_heads + 2 * n_kv_heads) * half_hd;
    norm_input<FORM>(loads, d, in, aux, eps, part);
    // A thread's pair is the same in every round (THREADS is a multiple of PAIRS): its rows and bias once
    static_assert(THREADS % PAIRS == 0, "a thread's pair must not change between rounds");
    const int i = threadIdx.x % PAIRS, pair = (int)blockIdx.x * PAIRS + i;
    const int p = min(pair, n_pairs - 1);  // clamped for the bias loads; a pair past the matrix stores nothing
    const int row0 = pair_head(p, hd) * hd + pair_dim(p, hd);  // the pair's rows: row0, row0 + hd / 2 (block_row)
    const float b0 = h2f(bias[row0]), b1 = h2f(bias[row0 + half_hd]);
    for_items<TOKENS * PAIRS>([&](int item) {
        const int tok = item / PAIRS;
        if (pair >= n_pairs) return;
        const float scale = norm_scale<FORM>(part, tok, d, eps);
        // Rounded products and adds, never contracted: every token row scales and adds alike
        const float y0 = __fadd_rn(__fmul_rn(sum_dot(part, 2 * i, tok), scale), b0);
        const float y1 = __fadd_rn(__fmul_rn(sum_dot(part, 2 * i + 1, tok), scale), b1);
        const int pos = row_pos(step_rows, state, tok);
        const size_t slot_off = (size_t)row_slot(step_rows, tok) * n_kv_heads * max_seq * hd;  // the row's slot
        rope_store_pair(p, y0, y1, rope + pos * half_hd * 2, q_out + (size_t)tok * n_heads * hd, k_cache + slot_off,
                        v_cache + slot_off, pos, n_heads, n_kv_heads, hd, max_seq);
    });
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_qkv_rope(const half_t* __restrict__ xn, const float* __restrict__ ssp, const uint4* __restrict__ W,
              const half_t* __restrict__ qparams, const half_t* __restrict__ bias, float* __restrict__ q_out,
              half_t* __restrict__ k_cache, half_t* __restrict__ v_cache, const float* __restrict__ rope,
              const int* __restrict__ state, const int* __restrict__ step_rows, int d, int n_heads, int n_kv_heads,
              int hd, int max_seq, float eps, int group) {
    __shared__ Partials part;
    pdl_launch_dependents();
    Loads loads;
    first_batch<QKV_ROWS>(loads, W, qparams, d, group, 0, hd, (n_heads + 2 * n_kv_heads) * (hd / 2));
    pdl_wait();
    qkv_rope<X_PREP>(loads, xn, ssp, bias, q_out, k_cache, v_cache, rope, state, step_rows, d, n_heads, n_kv_heads,
                     hd, max_seq, eps, part);
}

// grid: ceil(M / ROWS). x [TOKENS, M] float32 += W [M, K] · in [TOKENS, K] (FP16: attention's output for o_proj,
// gate_up's h for down); then the next RMSNorm kernel's input prepared from the new x (X_PREP): xn [TOKENS, M] FP16 =
// fp16(x * norm_w) (norm_w [M]: that kernel's norm weights, rounded as the X_NORM form rounds them) and ssp [TOKENS,
// ceil(M / SS_SPAN)] float32, part b the Σ x² of rows b SS_SPAN .. (fmaf in row order): one part a block at the
// plans' 32 rows a block.
template <int FORM>
__device__ __forceinline__ void residual(Loads& loads, const void* __restrict__ in, float* __restrict__ x,
                                         const half_t* __restrict__ norm_w, half_t* __restrict__ xn,
                                         float* __restrict__ ssp, int M, int K, Partials& part) {
    block_dot<FORM>(loads, K, in, nullptr, part);
    for_items<TOKENS * ROWS>([&](int item) {
        const int tok = item / ROWS, i = item % ROWS, row = blockIdx.x * ROWS + i;
        if (row >= M) return;
        const float v = __fadd_rn(x[(size_t)tok * M + row], sum_dot(part, i, tok));
        x[(size_t)tok * M + row] = v;
        xn[(size_t)tok * M + row] = norm_input(v, norm_w[row]);
        part.x[tok][i] = v;
    });
    __syncthreads();
#if ROWS % SS_SPAN == 0
    constexpr int PER_BLOCK = ROWS / SS_SPAN;  // parts a block writes
    if (threadIdx.x < TOKENS * PER_BLOCK) {
        const int tok = threadIdx.x / PER_BLOCK, p = threadIdx.x % PER_BLOCK, parts = (M + SS_SPAN - 1) / SS_SPAN;
        const int first = (int)blockIdx.x * ROWS + p * SS_SPAN, rows = M - first;  // the part's rows from `first`
        const float ss = ss_part([&](int i) { return part.x[tok][p * SS_SPAN + i]; }, rows);
        if (rows > 0) ssp[(size_t)tok * parts + first / SS_SPAN] = ss;
    }
#endif  // NTILES 2 (16 rows a block: a sweep's candidate, no plan's) leaves ssp as it is
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_residual(const half_t* __restrict__ in, const uint4* __restrict__ W, const half_t* __restrict__ qparams,
              float* __restrict__ x, const half_t* __restrict__ norm_w, half_t* __restrict__ xn,
              float* __restrict__ ssp, int M, int K, int group) {
    __shared__ Partials part;
    pdl_launch_dependents();
    Loads loads;
    first_batch<PLAIN_ROWS>(loads, W, qparams, K, group, M, 0, 0);
    pdl_wait();
    residual<X_HALF>(loads, in, x, norm_w, xn, ssp, M, K, part);
}

// grid: ceil(ff / PAIRS). W [2 ff, d]: gate rows then up rows. h [TOKENS, ff] FP16 (down's input, as it multiplies
// it: rounded once here instead of in every block of down).
template <int FORM>
__device__ __forceinline__ void gate_up_silu(Loads& loads, const void* __restrict__ in, const void* __restrict__ aux,
                                             half_t* __restrict__ h, int ff, int d, float eps, Partials& part) {
    norm_input<FORM>(loads, d, in, aux, eps, part);
    for_items<TOKENS * PAIRS>([&](int item) {
        const int tok = item / PAIRS, i = item % PAIRS, r = blockIdx.x * PAIRS + i;
        if (r >= ff) return;
        const float scale = norm_scale<FORM>(part, tok, d, eps);
        const float gate = __fmul_rn(sum_dot(part, 2 * i, tok), scale);
        const float up = __fmul_rn(sum_dot(part, 2 * i + 1, tok), scale);
        h[(size_t)tok * ff + r] = f2h(__fmul_rn(silu(gate), up));
    });
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_gate_up_silu(const half_t* __restrict__ xn, const float* __restrict__ ssp, const uint4* __restrict__ W,
                  const half_t* __restrict__ qparams, half_t* __restrict__ h, int ff, int d, float eps, int group) {
    __shared__ Partials part;
    pdl_launch_dependents();
    Loads loads;
    first_batch<GATE_UP_ROWS>(loads, W, qparams, d, group, ff, 0, ff);
    pdl_wait();
    gate_up_silu<X_PREP>(loads, xn, ssp, h, ff, d, eps, part);
}

#if !QUANT
// grid: ceil(V / ROWS). logits [TOKENS, V] float32 (rows at logits_stride(V)) = W [V, d] · rmsnorm(x [TOKENS, d]).
template <int FORM>
__device__ __forceinline__ void logits_rows(Loads& loads, const void* __restrict__ in, const void* __restrict__ aux,
                                            float* __restrict__ logits, int V, int d, float eps, Partials& part) {
    norm_input<FORM>(loads, d, in, aux, eps, part);
    for_items<TOKENS * ROWS>([&](int item) {
        const int tok = item / ROWS, i = item % ROWS, row = blockIdx.x * ROWS + i;
        if (row < V) {
            const float scale = norm_scale<FORM>(part, tok, d, eps);
            logits[(size_t)tok * logits_stride(V) + row] = __fmul_rn(sum_dot(part, i, tok), scale);
        }
    });
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_logits(const half_t* __restrict__ xn, const float* __restrict__ ssp, const half_t* __restrict__ W,
            float* __restrict__ logits, int V, int d, float eps) {
    __shared__ Partials part;
    pdl_launch_dependents();
    Loads loads;
    first_batch<PLAIN_ROWS>(loads, W, nullptr, d, 0, V, 0, 0);
    pdl_wait();
    logits_rows<X_PREP>(loads, xn, ssp, logits, V, d, eps, part);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemv_logits_x(const float* __restrict__ x, const half_t* __restrict__ norm_w, const half_t* __restrict__ W,
              float* __restrict__ logits, int V, int d, float eps) {
    __shared__ Partials part;
    pdl_launch_dependents();
    Loads loads;
    first_batch<PLAIN_ROWS>(loads, W, nullptr, d, 0, V, 0, 0);
    pdl_wait();
    logits_rows<X_NORM>(loads, x, norm_w, logits, V, d, eps, part);
}
#endif
