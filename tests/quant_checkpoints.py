"""AWQ- and GPTQ-format test checkpoints, packed here from the formats' definitions (issue 16, the docstring of
cullama/model/quant_checkpoint.py) and nothing of cullama's reader: random codes, zeros, scales and act-order orders
whose weights the tests know exactly (Truth.weight), written as AutoAWQ / AutoGPTQ / GPTQModel store them.

    truth = write(path, CONFIG, Quantization("gptq", 4, 64, desc_act=True))
    truth["model.layers.0.self_attn.q_proj"].weight()   # float32 [N, K]: (q - zero[g_idx]) * scale[g_idx]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from cullama.model.checkpoint import EMBED, FINAL_NORM, LM_HEAD, expected_shapes
from cullama.model.config import LlamaConfig, Quantization

AWQ_NIBBLE_OUTPUT = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (of 8) that nibble i of an AWQ word holds
FUSED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

# Small enough for seconds on the CPU; every K (d, q_dim, ff) a multiple of 128, so groups 32, 64 and 128 divide.
CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_seq_len=128, name="quant-test")


@dataclasses.dataclass
class Truth:
    """One quantized linear as the tests made it: codes [N, K] in the model's input order, zeros and scales [G, N]
    (zeros the true zero points, whatever the file stores), g_idx [K] (each input's group)."""

    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray

    def weight(self) -> np.ndarray:
        """W [N, K] float32, straight from the definition: (q - zero[g_idx[k]]) * scale[g_idx[k]] (exact)."""
        zero = self.zeros.T[:, self.g_idx].astype(np.float32)  # [N, K]
        scale = self.scales.T[:, self.g_idx].astype(np.float32)  # [N, K]
        return (self.codes.astype(np.float32) - zero) * scale


def pack_bits(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """values [..., n] (each < 2**bits) -> int32 words [..., n * bits / 32]: field e of word w (bits e*bits ..)
    holds value w E + order[e] (E = 32 / bits; plain order by default)."""
    per_word = 32 // bits
    order = order or range(per_word)
    v = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per_word)
    words = np.zeros(v.shape[:-1], np.uint64)
    for field, index in enumerate(order):
        words |= v[..., index] << np.uint64(bits * field)
    return words.astype(np.uint32).view(np.int32)


def make_truth(rng, q: Quantization, N: int, K: int, g_idx: np.ndarray) -> Truth:
    top = (1 << q.bits) - 1
    G = K // (K if q.group == -1 else q.group)
    codes = rng.integers(0, top + 1, (N, K), dtype=np.uint8)
    if q.sym:
        zeros = np.full((G, N), 1 << (q.bits - 1), np.int32)
    elif q.method == "gptq" and q.checkpoint_format == "gptq":
        zeros = rng.integers(1, top + 2, (G, N), dtype=np.int32)  # stored minus one: 1 .. 2**bits
        zeros[0, :2] = top + 1  # the wrapped case: stored 2**bits - 1 (4 bits: 15) means 2**bits (16)
    else:
        zeros = rng.integers(0, top + 1, (G, N), dtype=np.int32)
    code_std = (1 << q.bits) / np.sqrt(12)
    scales = (rng.uniform(0.5, 1.5, (G, N)) * 0.03 / code_std).astype(np.float16)
    return Truth(codes, zeros, scales, g_idx)


def stored_tensors(q: Quantization, module: str, t: Truth) -> dict[str, np.ndarray]:
    """The tensors a quantizer writes for one linear."""
    if q.method == "awq":  # packed along the outputs, 8 to a word in AWQ's nibble order
        return {f"{module}.qweight": pack_bits(t.codes.T, 4, AWQ_NIBBLE_OUTPUT),  # [K, N / 8]
                f"{module}.qzeros": pack_bits(t.zeros, 4, AWQ_NIBBLE_OUTPUT),  # [G, N / 8]
                f"{module}.scales": t.scales}  # [G, N]
    stored_zeros = t.zeros - 1 if q.checkpoint_format == "gptq" else t.zeros
    stored_zeros = stored_zeros & ((1 << q.bits) - 1)  # v1: zero 0 would be stored as -1, all ones
    return {f"{module}.qweight": np.ascontiguousarray(pack_bits(t.codes, q.bits).T),  # [K bits / 32, N]
            f"{module}.qzeros": pack_bits(stored_zeros, q.bits),  # [G, N bits / 32]
            f"{module}.scales": t.scales,  # [G, N]
            f"{module}.g_idx": t.g_idx.astype(np.int32)}  # [K]


def write(path, config: LlamaConfig, q: Quantization, seed: int = 0, quant_file: str | None = None) -> dict[str, Truth]:
    """Write config.json (with quantization_config, or with `quant_file` the older dumps' own file) and
    model.safetensors; return the truth of every quantized linear by module name. Act-order (desc_act): each
    input of a fused linear's parts has one random group order (they share an input), o_proj and down_proj
    their own."""
    rng = np.random.default_rng(seed)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, truths, orders = {}, {}, {}
    for name, shape in expected_shapes(config).items():
        module = name.removesuffix(".weight")
        if len(shape) == 1 or name in (EMBED, LM_HEAD, FINAL_NORM) or not q.converts(module):
            values = rng.standard_normal(shape).astype(np.float32) * 0.05
            tensors[name] = (values + (1 if len(shape) == 1 else 0)).astype(np.float16)
            continue
        N, K = shape
        g = K if q.group == -1 else q.group
        layer, part = module.split(".")[2], module.rsplit(".", 1)[1]
        key = (layer, FUSED_INPUT.get(part, part))
        if key not in orders:
            order = np.arange(K) // g
            orders[key] = rng.permutation(order) if q.desc_act else order
        truths[module] = make_truth(rng, q, N, K, orders[key])
        tensors.update(stored_tensors(q, module, truths[module]))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict() | {"quantization_config": q.to_hf_dict()}
    if quant_file is not None:  # an older dump: the scheme beside config.json, in its own spelling
        del hf["quantization_config"]
        own = q.to_hf_dict()
        if quant_file == "quant_config.json":
            own = {"w_bit": q.bits, "q_group_size": q.group, "zero_point": True, "version": "GEMM"}
        (directory / quant_file).write_text(json.dumps(own))
    (directory / "config.json").write_text(json.dumps(hf, indent=1))
    return truths


def variants() -> list[Quantization]:
    """Every format variant the issue lists: AWQ 4-bit g32/64/128; GPTQ 4 and 8 bits, sym and asym, groups
    32/64/128/-1, desc_act off and on, gptq and gptq_v2."""
    out = [Quantization("awq", 4, g) for g in (32, 64, 128)]
    for bits in (4, 8):
        for group in (32, 64, 128, -1):
            for sym in (False, True):
                for desc_act in (False, True):
                    for fmt in ("gptq", "gptq_v2"):
                        if group == -1 and desc_act:
                            continue  # one group: any order is the same grouping
                        out.append(Quantization("gptq", bits, group, fmt, sym, desc_act))
    return out
