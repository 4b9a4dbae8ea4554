"""Model configuration: one frozen dataclass, read from HF `config.json` or taken from a preset.

HF has written LLaMA configs in several spellings over the years; all of these are read:
- LLaMA-2 era: `torch_dtype`, no `rope_theta` (10000), no `head_dim` (hidden / heads), and
  sometimes no `num_key_value_heads` (= heads, plain multi-head attention);
- current transformers: `dtype`, `rope_parameters: {rope_theta, rope_type}`, `head_dim`.
Presets are chosen by name, never guessed from a path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .errors import ConfigError

DTYPES = ("float16", "bfloat16", "float32")


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
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_ids: tuple[int, ...] = (2,)
    dtype: str = "float16"  # the dtype the checkpoint says it holds
    name: str = "custom"

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_seq_len")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_attention_heads ({self.num_heads}) is not a multiple "
                              f"of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim ({self.head_dim}) must be even for RoPE")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{self.name}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError(f"{self.name}: rms_norm_eps and rope_theta must be positive")

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
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "dtype": self.dtype,
        }


PRESETS: dict[str, LlamaConfig] = {
    "llama-2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                              max_seq_len=4096, name="llama-2-7b"),
    "llama-2-13b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                               num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
                               max_seq_len=4096, name="llama-2-13b"),
    # Small enough for the CPU (CI, `cullama bench --device cpu`), with GQA so both paths run.
    "tiny": LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=4,
                        num_heads=8, num_kv_heads=2, head_dim=32, max_seq_len=1024, name="tiny"),
}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def _require(raw: dict, key: str, source: str):
    if key not in raw:
        raise ConfigError(f"{source}: missing required key {key!r}")
    return raw[key]


def _check_supported(raw: dict, source: str) -> None:
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (only 'llama')")
    scaling = raw.get("rope_scaling")
    if scaling not in (None, {}) and not (isinstance(scaling, dict)
                                         and scaling.get("rope_type", scaling.get("type")) == "default"):
        raise ConfigError(f"{source}: rope_scaling {json.dumps(scaling)} is not supported")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_type", "default") != "default":
        raise ConfigError(f"{source}: rope_parameters.rope_type {params['rope_type']!r} is not supported")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{source}: {key}=true is not supported (LLaMA has no biases)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def from_hf_dict(raw: dict, source: str = "config.json") -> LlamaConfig:
    """Build a config from the parsed JSON of an HF LLaMA config; `source` names it in errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    _check_supported(raw, source)
    hidden = _require(raw, "hidden_size", source)
    heads = _require(raw, "num_attention_heads", source)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        raise ConfigError(f"{source}: hidden_size and num_attention_heads must be integers")
    head_dim = raw.get("head_dim") or hidden // heads
    eos = raw.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float16"
    try:
        return LlamaConfig(
            vocab_size=_require(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", source),
            num_layers=_require(raw, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_seq_len=raw.get("max_position_embeddings", 4096),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=_rope_theta(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", 1) if raw.get("bos_token_id") is not None else 1,
            eos_token_ids=eos_ids,
            dtype=str(dtype),
            name=source,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def from_pretrained(path: str | os.PathLike) -> LlamaConfig:
    """Read `config.json` from a checkpoint directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: no such model directory")
    file = directory / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file}: missing (a HuggingFace LLaMA checkpoint needs its config.json)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    return from_hf_dict(raw, source=str(file))
