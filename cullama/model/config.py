"""Model configuration: one frozen dataclass, read from HF `config.json` or taken from a preset.

Three architectures, LLaMA's and two that differ from it in one thing each (config.json's model_type and
`architectures` name it): LlamaForCausalLM (LLaMA 2 and 3.x, TinyLlama), MistralForCausalLM (a sliding attention
window: sliding_window) and Qwen2ForCausalLM (biases on q_proj, k_proj and v_proj). Any other is refused.

HF has written LLaMA configs in several spellings over the years; all of these are read:
- LLaMA-2 era: `torch_dtype`, no `rope_theta` (10000), no `head_dim` (hidden / heads), and
  sometimes no `num_key_value_heads` (= heads, plain multi-head attention);
- current transformers: `dtype`, `rope_parameters: {rope_theta, rope_type}`, `head_dim`.
Presets are chosen by name, never guessed from a path.

config.json is read as strictly as a file from anywhere deserves. Every key cullama reads has its JSON
type checked, and a wrong type is an error naming the key (a string value shown quoted: "494" is not 494):
a size or id is a JSON integer (4096.0 and 1e9 are floats and refused, as true is not 1), a number is an
integer or a float, a flag is true or false (never "false"), a token id list holds integers. Sizes are
range-checked (1 to 2**31 - 1: the kernels index with int32), rms_norm_eps and rope_theta are finite and > 0,
BOS and EOS ids lie in the vocabulary. The HF LLaMA keys that do not change what cullama computes are
type-checked too (pretraining_tp, attention_dropout, initializer_range, use_cache, pad_token_id). Keys that
change what the model computes and that cullama does not run (another architecture, biases other than Qwen2's,
Qwen2's per-layer sliding window, another activation, partial rotary, a RoPE scaling other than linear / dynamic
/ llama3, a quantization other than AWQ's GEMM layout or GPTQ) are refused, never ignored. null means "absent"
only where HF reads it so (num_key_value_heads, head_dim, rope_scaling, rope_parameters, bos/eos_token_id, dtype,
quantization_config, sliding_window, layer_types) or HF does not read it at inference (architectures,
attention_dropout, initializer_range, use_cache, pad_token_id).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from ..common import untrusted
from ..common.errors import ConfigError
from ..common.untrusted import read_json

DTYPES = ("float16", "bfloat16", "float32")
INT32_MAX = 2**31 - 1  # the kernels take sizes and ids as int32
ROPE_SCALINGS = ("linear", "dynamic", "llama3")
QUANT_METHODS = ("awq", "gptq")
QUANT_BITS = {"awq": (4,), "gptq": (4, 8)}
GPTQ_FORMATS = ("gptq", "gptq_v2")  # how qzeros holds a zero: minus one (v1), or as it is (v2)
# Older dumps keep the quantization beside config.json: AutoAWQ's quant_config.json (w_bit, q_group_size, ...) and
# AutoGPTQ's quantize_config.json (bits, group_size, desc_act, sym, ...); config.json's quantization_config wins.
QUANT_FILES = {"quant_config.json": "awq", "quantize_config.json": "gptq"}
# The architectures cullama runs and their config.json model_type: LLaMA (also spelt LLaMAForCausalLM by early
# conversions), Mistral (LLaMA with a sliding attention window) and Qwen2 (LLaMA with q/k/v biases).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURE = "LlamaForCausalLM"  # the default, and what a config without `architectures` of model_type llama is
# config.json's key for each size field of LlamaConfig (also how errors name the field).
SIZE_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
             "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "max_seq_len": "max_position_embeddings"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as HF's rope_scaling / rope_parameters name it (applied by
    reference.rope_tables, which the kernels' table comes from too):
    - linear:  every frequency divided by `factor` (positions interpolated);
    - dynamic: NTK-aware; HF raises the base with the sequence length once it passes `original`
               (its max_position_embeddings), and keeps the default frequencies up to there;
    - llama3:  wavelengths longer than original / low_freq_factor divided by `factor`, shorter than
               original / high_freq_factor kept, a smooth blend between."""

    kind: str  # one of ROPE_SCALINGS
    factor: float
    original: int  # llama3: original_max_position_embeddings; dynamic: max_position_embeddings
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only

    def to_hf_dict(self) -> dict:
        """The keys of rope_parameters beside rope_theta."""
        out = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                    "original_max_position_embeddings": self.original}
        return out


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A quantized checkpoint's scheme, from its quantization_config (cullama/model/quant_checkpoint.py reads the
    tensors it describes):
    - awq:  AutoAWQ's GEMM layout, 4 bits, a zero point per group (zero_point true);
    - gptq: AutoGPTQ / GPTQModel, 4 or 8 bits, symmetric or not (the zeros are read from qzeros either way),
            desc_act (act-order: g_idx orders the input channels), checkpoint_format gptq (qzeros holds zero - 1)
            or gptq_v2 (the zero itself).
    group: inputs per (scale, zero); -1 is one group per row (all of the inputs). Modules whose names contain an
    entry of modules_to_not_convert stay FP16, as HF keeps them."""

    method: str  # one of QUANT_METHODS
    bits: int
    group: int  # group_size; -1: the whole row
    checkpoint_format: str = "gptq"  # gptq only: one of GPTQ_FORMATS
    sym: bool = False  # gptq only
    desc_act: bool = False  # gptq only
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert

    def converts(self, module: str) -> bool:
        """Whether the module (e.g. model.layers.0.self_attn.q_proj) is stored quantized."""
        return not any(part in module for part in self.not_converted)

    @property
    def zero_stored_minus_one(self) -> bool:
        return self.method == "gptq" and self.checkpoint_format == "gptq"

    def describe(self) -> str:
        """e.g. "gptq int4 g128 act-order"."""
        group = "per channel" if self.group == -1 else f"g{self.group}"
        act = " act-order" if self.desc_act else ""
        return f"{self.method} int{self.bits} {group}{act}"

    def to_hf_dict(self) -> dict:
        """quantization_config as AutoAWQ / AutoGPTQ write it."""
        out = {"quant_method": self.method, "bits": self.bits, "group_size": self.group,
               "modules_to_not_convert": list(self.not_converted) or None}
        if self.method == "awq":
            return out | {"zero_point": True, "version": "gemm"}
        return out | {"sym": self.sym, "desc_act": self.desc_act, "checkpoint_format": self.checkpoint_format}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # d, the residual width
    intermediate_size: int  # ff, the SwiGLU width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (< num_heads: grouped-query attention)
    head_dim: int
    max_seq_len: int  # max_position_embeddings: the context the model was trained for
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: HF's "default" RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_ids: tuple[int, ...] = (2,)
    dtype: str = "float16"  # the dtype the checkpoint says it holds
    name: str = "custom"
    quantization: Quantization | None = None  # an AWQ or GPTQ checkpoint's scheme; None: plain weights
    architecture: str = ARCHITECTURE  # one of ARCHITECTURES
    # Mistral: a query at position p attends to the keys p - sliding_window + 1 .. p only (None: all keys 0..p)
    sliding_window: int | None = None

    def __post_init__(self):
        for field, key in SIZE_KEYS.items():
            value = getattr(self, field)
            if type(value) is not int or not 1 <= value <= INT32_MAX:
                raise ConfigError(f"{self.name}: {key} must be an integer from 1 to {INT32_MAX}, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_attention_heads ({self.num_heads}) is not a multiple "
                              f"of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim ({self.head_dim}) must be even for RoPE")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{self.name}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for key, value in (("rms_norm_eps", self.rms_norm_eps), ("rope_theta", self.rope_theta)):
            if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{self.name}: {key} must be a finite number > 0, got {value!r}")
        if type(self.bos_token_id) is not int or not 0 <= self.bos_token_id <= INT32_MAX:
            raise ConfigError(f"{self.name}: bos_token_id must be an integer >= 0, got {self.bos_token_id!r}")
        if self.bos_token_id >= self.vocab_size:
            raise ConfigError(f"{self.name}: bos_token_id {self.bos_token_id} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"{self.name}: eos_token_id {bad[0]} is outside the vocabulary "
                              f"(vocab_size {self.vocab_size})")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"{self.name}: architecture {self.architecture!r} is not one of "
                              f"{', '.join(ARCHITECTURES)}")
        window = self.sliding_window
        if window is not None and (type(window) is not int or not 1 <= window <= INT32_MAX):
            raise ConfigError(f"{self.name}: sliding_window must be null or an integer from 1 to {INT32_MAX}, "
                              f"got {window!r}")

    # Derived sizes, named once so that every module agrees on them.
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused q|k|v projection."""
        return self.q_dim + 2 * self.kv_dim

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def qkv_bias(self) -> bool:
        """Qwen2: q_proj, k_proj and v_proj have biases, added before RoPE (its o_proj and MLP have none)."""
        return self.model_type == "qwen2"

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        d, ff = self.hidden_size, self.intermediate_size
        per_layer = d * self.qkv_dim + self.q_dim * d + 3 * d * ff + 2 * d
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + lm_head

    def decode_weight_bytes(self) -> int:
        """FP16 bytes a decode step must read: every linear weight and the lm_head."""
        d, ff = self.hidden_size, self.intermediate_size
        per_layer = d * self.qkv_dim + self.q_dim * d + 3 * d * ff
        return 2 * (self.num_layers * per_layer + self.vocab_size * d)

    def to_hf_dict(self) -> dict:
        """A current-style HF config.json for this model (used by write_random)."""
        family = {"llama": {"attention_bias": False, "mlp_bias": False},
                  "mistral": {"sliding_window": self.sliding_window},
                  "qwen2": {"use_sliding_window": False, "sliding_window": None}}[self.model_type]
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta,
                                **(self.rope_scaling.to_hf_dict() if self.rope_scaling else {"rope_type": "default"})},
            "hidden_act": "silu",
            **family,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "dtype": self.dtype,
            **({"quantization_config": self.quantization.to_hf_dict()} if self.quantization else {}),
        }


PRESETS: dict[str, LlamaConfig] = {
    "llama-2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                              max_seq_len=4096, name="llama-2-7b"),
    "llama-2-13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                               num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
                               max_seq_len=4096, name="llama-2-13b"),
    # The shapes people run today (issue 18), random weights for `cullama bench --synthetic NAME`: LLaMA-3-8B
    # (8 KV heads, a 128,256-id vocabulary), LLaMA-3.2-1B (head_dim 64, tied embeddings, llama3 RoPE), Mistral-7B
    # v0.1 (a sliding window of 4096), Qwen2.5-7B (q/k/v biases, 7 query heads per KV head, 152,064 ids).
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=8192, rope_theta=500000.0,
                             bos_token_id=128000, eos_token_ids=(128001,), name="llama3-8b"),
    "llama3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                               num_heads=32, num_kv_heads=8, head_dim=64, max_seq_len=131072, rope_theta=500000.0,
                               rope_scaling=RopeScaling("llama3", 32.0, 8192, 1.0, 4.0), tie_word_embeddings=True,
                               bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), name="llama3.2-1b"),
    "mistral-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=32768,
                              architecture="MistralForCausalLM", sliding_window=4096, name="mistral-7b"),
    "qwen2.5-7b": LlamaConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, max_seq_len=32768, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, bos_token_id=151643, eos_token_ids=(151645, 151643),
                              architecture="Qwen2ForCausalLM", name="qwen2.5-7b"),
    # Small enough for the CPU (CI, `cullama bench --device cpu`), with GQA so both paths run.
    "tiny": LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
                        num_heads=8, num_kv_heads=2, head_dim=32, max_seq_len=1024, name="tiny"),
}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


REQUIRED = object()  # a key without a default
# Keys that HF reads as "absent" when they are null, or does not read at inference (elsewhere null is a wrong
# type; pretraining_tp is read: HF compares it with 1).
NULL_IS_ABSENT = {"num_key_value_heads", "head_dim", "rope_scaling", "rope_parameters", "bos_token_id",
                  "dtype", "torch_dtype", "architectures", "attention_dropout", "initializer_range", "use_cache",
                  "pad_token_id", "sliding_window", "layer_types", "max_window_layers"}


def shown(value) -> str:
    """A config value for a message, in its JSON spelling: a string quoted ("494", not 494)."""
    return untrusted.shown(value, quote=True)


class _Keys:
    """Typed reads of one JSON object of config.json; every error names the file and the key (with
    `prefix`, e.g. "rope_scaling.", for a nested object)."""

    def __init__(self, raw: dict, source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{key} {what}")

    def get(self, key: str, default=REQUIRED):
        value = self.raw.get(key)
        if key not in self.raw or (value is None and key in NULL_IS_ABSENT):
            if default is REQUIRED:
                raise ConfigError(f"{self.source}: missing required key '{self.prefix}{key}'")
            return default
        return value

    def integer(self, key: str, default=REQUIRED, low: int = 1) -> int:
        value = self.get(key, default)
        if type(value) is not int:  # bool is an int subclass, 4096.0 a float: both refused
            raise self.error(key, f"must be an integer, got {shown(value)}")
        if not low <= value <= INT32_MAX:
            raise self.error(key, f"must be from {low} to {INT32_MAX}, got {shown(value)}")
        return value

    def number(self, key: str, default=REQUIRED) -> float:
        """A finite number > 0 (integer or float)."""
        value, number = self._real(key, default)
        if not (math.isfinite(number) and number > 0):
            raise self.error(key, f"must be a finite number > 0, got {shown(value)}")
        return number

    def bounded(self, key: str, default: float, low: float, high: float = math.inf) -> float:
        """A finite number from low to high (integer or float)."""
        value, number = self._real(key, default)
        if not (math.isfinite(number) and low <= number <= high):
            span = f"from {low:g} to {high:g}" if math.isfinite(high) else f">= {low:g}"
            raise self.error(key, f"must be a finite number {span}, got {shown(value)}")
        return number

    def _real(self, key: str, default) -> tuple[object, float]:
        """(the value as written, as a float): a JSON integer or float, else an error naming `key`."""
        value = self.get(key, default)
        if type(value) not in (int, float):
            raise self.error(key, f"must be a number, got {shown(value)}")
        return value, float(value) if abs(value) < 1e300 else math.inf  # a JSON integer may be beyond any float

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if type(value) is not bool:
            raise self.error(key, f"must be true or false, got {shown(value)}")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...], why: str = "") -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {shown(value)}")
        if value not in choices:
            raise self.error(key, f"{shown(value)} is not supported (cullama runs {', '.join(choices)}{why})")
        return value

    def token_ids(self, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        """An id or a list of ids (EOS: generation stops at any of them); null is none."""
        value = self.raw.get(key, list(default))
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if not all(type(i) is int for i in ids):
            raise self.error(key, f"must be an integer or a list of integers, got {shown(value)}")
        return tuple(ids)

    def nested(self, key: str) -> "_Keys | None":
        value = self.get(key, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, f"must be a JSON object, got {shown(value)}")
        return _Keys(value, self.source, f"{self.prefix}{key}.")


def _architecture(keys: _Keys) -> str:
    """The architecture config.json describes (one of ARCHITECTURES), from model_type, which HF's Auto classes go
    by, and `architectures`, which vLLM, TGI and HF pipelines pick the model's code by: they must agree (a config
    naming another architecture, a classification head say, was written for it). Another one is refused."""
    architectures = keys.get("architectures", [])
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise keys.error("architectures", f"must be a list of strings, got {shown(architectures)}")
    known = {a.lower(): a for a in ARCHITECTURES}
    named = [known[a.lower()] for a in architectures if a.lower() in known]
    if architectures and not named:
        raise keys.error("architectures", f"{shown(architectures)} is not supported (cullama runs "
                                          f"{', '.join(ARCHITECTURES)})")
    model_type = keys.choice("model_type", REQUIRED, tuple(ARCHITECTURES.values()))
    architecture = named[0] if named else next(a for a, kind in ARCHITECTURES.items() if kind == model_type)
    if ARCHITECTURES[architecture] != model_type:
        raise keys.error("architectures", f"{shown(architectures)} is not model_type {shown(model_type)}'s "
                                          f"architecture")
    return architecture


def _family(keys: _Keys, architecture: str, num_layers: int) -> int | None:
    """The keys by which a family's model differs from LLaMA, checked: cullama runs what each one computes or
    refuses it. Returns the sliding window (None: every key attended).
    - LLaMA: attention_bias / mlp_bias (biases on every projection) are refused.
    - Mistral: sliding_window, null (full attention, Mistral v0.2 on) or a window of 1 or more keys.
    - Qwen2: q/k/v biases always (its o_proj and MLP have none); use_sliding_window true (a window on the layers
      from max_window_layers on, Qwen2's own rule) is refused, false leaves sliding_window unread, as HF does.
    layer_types (transformers 5: each layer's attention) must say the same of every layer."""
    keys.choice("hidden_act", "silu", ("silu",))
    kind = ARCHITECTURES[architecture]
    window = None
    if kind == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if keys.flag(key, False):
                raise keys.error(key, "= true is not supported (LLaMA has no biases)")
    elif kind == "mistral":
        value = keys.get("sliding_window", None)
        if value is not None and (type(value) is not int or not 1 <= value <= INT32_MAX):
            raise keys.error("sliding_window", f"must be null (full attention) or a window of 1 to {INT32_MAX} "
                                               f"keys, got {shown(value)}")
        window = value
    else:
        if keys.flag("use_sliding_window", False):
            raise keys.error("use_sliding_window", "= true is not supported (Qwen2's sliding window on the layers "
                                                   "from max_window_layers on)")
        keys.integer("max_window_layers", 0, low=0)
    layer_types = keys.get("layer_types", None)
    if layer_types is not None:
        every = "sliding_attention" if window else "full_attention"
        if layer_types != [every] * num_layers:
            raise keys.error("layer_types", f"{shown(layer_types)} is not supported (cullama runs "
                                            f"{shown(every)} on each of the {num_layers} layers here)")
    return window


def _check_unused(keys: _Keys) -> None:
    """The HF LLaMA keys that do not change what cullama computes, type-checked all the same (a config.json
    with a wrong type there is malformed). pretraining_tp > 1 only makes HF compute its matmuls in slices,
    the same math; attention_dropout and initializer_range are for training; cullama never pads (one
    sequence), so pad_token_id, an integer or null, may be -1 or past the vocabulary, as published configs
    have it."""
    keys.integer("pretraining_tp", 1)
    keys.bounded("attention_dropout", 0.0, 0.0, 1.0)
    keys.bounded("initializer_range", 0.02, 0.0)
    keys.flag("use_cache", True)
    pad = keys.get("pad_token_id", None)
    if pad is not None and type(pad) is not int:
        raise keys.error("pad_token_id", f"must be an integer or null, got {shown(pad)}")


def _rope(keys: _Keys, max_position: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling. As in HF 5: a non-empty rope_scaling (the old spelling) is taken over
    rope_parameters; its rope_theta, else the top-level one, else 10000; rope_type, else type."""
    scaling, parameters = keys.nested("rope_scaling"), keys.nested("rope_parameters")
    spec = scaling if scaling is not None and scaling.raw else parameters
    theta = keys.number("rope_theta", 10000.0)
    for source in (keys, spec or keys):
        if source.get("partial_rotary_factor", 1.0) != 1.0:
            raise source.error("partial_rotary_factor", "is not supported (LLaMA rotates the whole head)")
    if spec is None:
        return theta, None
    theta = spec.number("rope_theta", theta)
    kind_key = "rope_type" if "rope_type" in spec.raw else "type"
    kind = spec.choice(kind_key, "default", ("default", *ROPE_SCALINGS),
                       why=" RoPE; yarn and longrope are not implemented")
    if kind == "default":
        return theta, None
    factor = spec.number("factor")
    if kind != "llama3":
        return theta, RopeScaling(kind, factor, max_position)
    low, high = spec.number("low_freq_factor"), spec.number("high_freq_factor")
    if not low < high:
        raise spec.error("high_freq_factor", f"({high:g}) must exceed low_freq_factor ({low:g})")
    original = spec.integer("original_max_position_embeddings", max_position)
    return theta, RopeScaling(kind, factor, original, low, high)


def _quantization(keys: _Keys | None, method: str | None = None) -> Quantization | None:
    """The quantization scheme of quantization_config (or of an older dump's own file, whose method is known
    from its name: `method`). Anything cullama does not read is refused naming the key."""
    if keys is None:
        return None
    method = keys.choice("quant_method", method or REQUIRED, QUANT_METHODS,
                         why=" checkpoints; bitsandbytes, fp8, compressed-tensors and others are not read")
    bits_key = "w_bit" if "w_bit" in keys.raw else "bits"  # AutoAWQ's quant_config.json spells them so
    group_key = "q_group_size" if "q_group_size" in keys.raw else "group_size"
    bits = keys.integer(bits_key)
    if bits not in QUANT_BITS[method]:
        raise keys.error(bits_key, f"{bits} is not supported ({method}: {' or '.join(map(str, QUANT_BITS[method]))} "
                                   "bits)")
    group = keys.integer(group_key, low=-1)
    if group == 0:
        raise keys.error(group_key, "must be -1 (one group per row) or a group size >= 1, got 0")
    not_converted = keys.get("modules_to_not_convert", None)
    if not_converted is not None and (not isinstance(not_converted, list)
                                      or not all(isinstance(m, str) for m in not_converted)):
        raise keys.error("modules_to_not_convert", f"must be a list of module names, got {shown(not_converted)}")
    common = dict(method=method, bits=bits, group=group, not_converted=tuple(not_converted or ()))
    if method == "awq":
        version = keys.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise keys.error("version", f"{shown(version)} is not supported (cullama reads AWQ's gemm layout)")
        if not keys.flag("zero_point", True):
            raise keys.error("zero_point", "= false is not supported (cullama reads AWQ with zero points)")
        return Quantization(**common)
    if keys.flag("is_marlin_format", False):
        raise keys.error("is_marlin_format", "= true is not supported (Marlin's repacked layout; cullama reads "
                                             "the gptq and gptq_v2 layouts)")
    if keys.get("dynamic", None):
        raise keys.error("dynamic", "is not supported (per-module bits and group sizes)")
    if keys.flag("lm_head", False):
        raise keys.error("lm_head", "= true is not supported (cullama keeps the lm_head FP16)")
    format_key = "format" if "checkpoint_format" not in keys.raw and "format" in keys.raw else "checkpoint_format"
    return Quantization(**common, checkpoint_format=keys.choice(format_key, "gptq", GPTQ_FORMATS),
                        sym=keys.flag("sym", True), desc_act=keys.flag("desc_act", False))


def from_hf_dict(raw: dict, source: str = "config.json", quant: tuple[dict, str, str] | None = None) -> LlamaConfig:
    """Build a config from the parsed JSON of an HF LLaMA config; `source` names it in errors. `quant`: an older
    dump's own quantization file (its JSON, its name for errors, its method), read when config.json has no
    quantization_config."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    keys = _Keys(raw, source)
    architecture = _architecture(keys)
    _check_unused(keys)
    hidden, heads = keys.integer("hidden_size"), keys.integer("num_attention_heads")
    num_layers = keys.integer("num_hidden_layers")
    window = _family(keys, architecture, num_layers)
    vocab, max_position = keys.integer("vocab_size"), keys.integer("max_position_embeddings", 4096)
    head_dim = keys.integer("head_dim", hidden // heads)
    theta, scaling = _rope(keys, max_position)
    dtype_key = "dtype" if keys.get("dtype", None) is not None else "torch_dtype"
    quantization = _quantization(keys.nested("quantization_config"))
    if quantization is None and quant is not None:
        quant_raw, quant_source, method = quant
        if not isinstance(quant_raw, dict):
            raise ConfigError(f"{quant_source}: expected a JSON object, got {type(quant_raw).__name__}")
        quantization = _quantization(_Keys(quant_raw, quant_source), method)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=keys.integer("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=keys.integer("num_key_value_heads", heads),  # ranges across keys: __post_init__
        head_dim=head_dim,
        max_seq_len=max_position,
        rms_norm_eps=keys.number("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=keys.flag("tie_word_embeddings", False),
        bos_token_id=keys.integer("bos_token_id", 1, low=0),
        eos_token_ids=keys.token_ids("eos_token_id", (2,)),
        dtype=keys.choice(dtype_key, "float16", DTYPES),
        name=source,
        quantization=quantization,
        architecture=architecture,
        sliding_window=window,
    )


def from_pretrained(path: str | os.PathLike) -> LlamaConfig:
    """Read `config.json` from a checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        hint = " (it is a file: name the checkpoint directory that holds it)" if directory.is_file() else ""
        raise ConfigError(f"{directory}: no such model directory{hint}")
    file = directory / "config.json"
    if not file.is_file():
        what = "a directory" if file.is_dir() else "not a regular file" if file.exists() else \
            "a broken symbolic link" if file.is_symlink() else "missing"
        raise ConfigError(f"{file}: {what} (a HuggingFace LLaMA checkpoint needs its config.json)")
    quant = next(((read_json(directory / name, ConfigError), str(directory / name), method)
                  for name, method in QUANT_FILES.items() if (directory / name).is_file()), None)
    return _with_generation_eos(from_hf_dict(read_json(file, ConfigError), source=str(file), quant=quant), directory)


def _with_generation_eos(config: LlamaConfig, directory: Path) -> LlamaConfig:
    """The EOS ids of config.json, then those only generation_config.json lists (HF's generate stops on the
    latter: LLaMA-3.1 instruct on any of 128001, 128008 and 128009, which some of its config.json lack)."""
    file = directory / "generation_config.json"
    if not file.is_file():
        return config
    raw = read_json(file, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    keys = _Keys(raw, str(file))
    extra = keys.token_ids("eos_token_id", ())
    bad = [t for t in extra if not 0 <= t < config.vocab_size]
    if bad:
        raise keys.error("eos_token_id", f"{bad[0]} is outside the vocabulary (vocab_size {config.vocab_size})")
    return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
