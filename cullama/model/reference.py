"""The reference LLaMA forward pass: plain NumPy in FP32, written to be read, not to be fast.

It is the oracle for the plans and kernels, and is itself checked against HuggingFace's FP32
logits (../shared/golden). Its weights are the model's (layout.Weights): FP16, or where the model runs quantized
the exact dequantized float32 values the kernels compute with, so it is the oracle of quantized plans too.
One token or many at a time, with a KV cache:

    x = embed[ids]
    for each layer:
        h = rmsnorm(x) * attn_norm
        q, k, v = h @ Wq.T + bq, h @ Wk.T + bk, h @ Wv.T + bv    per head, RoPE (rotate-half) on q and k
        x = x + softmax(q k^T / sqrt(hd) + mask) v @ Wo.T
        h = rmsnorm(x) * ffn_norm
        x = x + (silu(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T
    logits = (rmsnorm(x) * final_norm) @ lm_head.T

The biases are Qwen2's (zero elsewhere); the mask is causal, and with a sliding window W (Mistral) a query at
position p also does not see the keys before p - W + 1, as HF masks them (a key k is seen when p - W < k <= p).
"""

from __future__ import annotations

import math
import numpy as np

from .config import RopeScaling
from ..common.errors import ConfigError, PromptError
from .layout import Weights


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [n, d] float32, weight: [d] -> [n, d] float32."""
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale) * weight


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     positions: int = 0) -> np.ndarray:
    """inv_freq: [head_dim // 2] float32, rotation per position of each pair, as HF computes it (FP32, the
    same operations in the same order), with the config's RoPE scaling applied. `positions`: how many
    positions the table covers (dynamic scaling is exact only up to the model's max_position_embeddings)."""
    if scaling is not None and scaling.kind == "dynamic":
        if positions > scaling.original:
            # HF recomputes every frequency from the sequence length once it passes the original context, so
            # its keys depend on how the sequence was fed (prefill vs token by token): no fixed table is it.
            raise ConfigError(f"rope_scaling 'dynamic' rescales RoPE with the sequence length beyond "
                              f"max_position_embeddings ({scaling.original}), which cullama does not reproduce: "
                              f"use a context of at most {scaling.original} tokens, not {positions}")
        seq_len = scaling.original  # HF: max(seq_len, max_position_embeddings), the original base up to there
        theta = theta * ((scaling.factor * seq_len / scaling.original) - (scaling.factor - 1)) ** (
            head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    if scaling is None or scaling.kind == "dynamic":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths (low frequencies) slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high, original = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(head_dim: int, positions: np.ndarray, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [n, head_dim // 2] float32 for the given positions (HF's inv_freq, computed in FP32)."""
    covered = int(positions.max()) + 1 if len(positions) else 0
    inv_freq = rope_frequencies(head_dim, theta, scaling, covered)
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [n, heads, hd]; dims j and j + hd/2 form one rotating pair."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceModel:
    """FP32 LLaMA with a KV cache. `forward(ids)` appends the ids and returns their logits."""

    def __init__(self, weights: Weights, max_seq_len: int | None = None):
        cfg = self.config = weights.config
        self.max_seq_len = max_seq_len or cfg.max_seq_len
        f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731  (one upcast, done once)
        self.embed = f32(weights.embed)  # [vocab, d]
        self.final_norm = f32(weights.final_norm)  # [d]
        self.lm_head = self.embed if weights.lm_head is weights.embed else f32(weights.lm_head)  # [vocab, d]
        self.layers = [
            dict(attn_norm=f32(lw.attn_norm),  # [d]
                 wqkv=f32(lw.wqkv),  # [q_dim + 2 kv_dim, d]
                 bqkv=None if lw.bqkv is None else f32(lw.bqkv),  # [q_dim + 2 kv_dim] or None
                 wo=f32(lw.wo),  # [d, q_dim]
                 ffn_norm=f32(lw.ffn_norm),  # [d]
                 w_gate_up=f32(lw.w_gate_up),  # [2 ff, d]
                 w_down=f32(lw.w_down))  # [d, ff]
            for lw in weights.layers
        ]
        shape = (cfg.num_layers, self.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = np.zeros(shape, dtype=np.float32)  # [layers, seq, kv_heads, hd]
        self.v_cache = np.zeros(shape, dtype=np.float32)  # [layers, seq, kv_heads, hd]
        self.pos = 0  # tokens already in the cache

    def reset(self) -> None:
        self.pos = 0

    def forward(self, ids) -> np.ndarray:
        """Logits [len(ids), vocab] float32 of the ids, which follow the `pos` tokens already cached."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if self.pos + n > self.max_seq_len:
            raise PromptError(f"{self.pos + n} tokens exceed the context of {self.max_seq_len}")
        if n and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise PromptError(f"token id out of range [0, {cfg.vocab_size})")
        positions = np.arange(self.pos, self.pos + n)
        cos, sin = rope_tables(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)
        x = self.embed[ids]  # [n, d]
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, rmsnorm(x, layer["attn_norm"], cfg.rms_norm_eps), cos, sin)
            h = rmsnorm(x, layer["ffn_norm"], cfg.rms_norm_eps)
            gate, up = np.split(h @ layer["w_gate_up"].T, 2, axis=-1)  # [n, ff] each
            x = x + (silu(gate) * up) @ layer["w_down"].T
        self.pos += n
        return rmsnorm(x, self.final_norm, cfg.rms_norm_eps) @ self.lm_head.T

    def _attention(self, i: int, layer: dict, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        cfg = self.config
        n, hd = h.shape[0], cfg.head_dim
        qkv = h @ layer["wqkv"].T  # [n, q_dim + 2 kv_dim]
        if layer["bqkv"] is not None:
            qkv = qkv + layer["bqkv"]
        q = qkv[:, :cfg.q_dim].reshape(n, cfg.num_heads, hd)
        k = qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(n, cfg.num_kv_heads, hd)
        v = qkv[:, cfg.q_dim + cfg.kv_dim:].reshape(n, cfg.num_kv_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = self.pos + n
        self.k_cache[i, self.pos:end], self.v_cache[i, self.pos:end] = k, v
        keys = np.repeat(self.k_cache[i, :end], cfg.group_size, axis=1)  # [end, heads, hd]
        values = np.repeat(self.v_cache[i, :end], cfg.group_size, axis=1)  # [end, heads, hd]
        scores = np.einsum("qhd,khd->hqk", q, keys) / np.sqrt(np.float32(hd))  # [heads, n, end]
        query = (self.pos + np.arange(n))[:, None]  # [n, 1] each row's position
        hidden = np.arange(end)[None, :] > query  # [n, end] causal mask
        if cfg.sliding_window is not None:
            hidden |= np.arange(end)[None, :] <= query - cfg.sliding_window  # older than the window
        scores = np.where(hidden[None], -np.inf, scores)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, values).reshape(n, cfg.q_dim)  # [n, q_dim]
        return out @ layer["wo"].T
