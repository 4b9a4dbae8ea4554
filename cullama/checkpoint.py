"""Safetensors checkpoints: open, validate, fuse, and write random ones.

A checkpoint directory holds `config.json` and either `model.safetensors`, or shards listed in
`model.safetensors.index.json`, or exactly one `*.safetensors` with another name.

Opening reads only the JSON headers (8-byte little-endian length, then JSON: per tensor `dtype`,
`shape`, `data_offsets` into the data region, plus an optional `__metadata__`) and checks every
tensor the config needs by name, shape and dtype, and every header for sanity, before a single
weight byte is read. Data is then mapped with `np.memmap`: FP16 tensors are zero-copy views of
the page cache; BF16 and F32 tensors are converted to FP16 (a value beyond FP16's range is an
error, never a silent inf).

Conversion is reported, not printed: `Checkpoint.converted_from` holds the source dtypes that
were not FP16 and `Checkpoint.conversion_note` a one-line message the caller (CLI) may print.

Fusion is done once: q|k|v rows into `wqkv`, gate|up rows into `w_gate_up`. `Checkpoint.parts()`
gives the fusion plan as data so that a GPU backend can copy each part straight into a fused
device buffer without building the fused array on the host.

PyTorch pickles (`.bin`, `.pth`, `.pt`) are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .config import LlamaConfig, from_pretrained
from .errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pth", ".pt")
CONVERT_HINT = ("cullama never unpickles weights; convert them once with transformers: "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)")

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# Bytes per element of every safetensors dtype, so that any header (even of a tensor we ignore)
# can be checked for consistent offsets.
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
              "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
              "C64": 8}
# The dtypes cullama reads, and how their bytes are viewed (BF16 has no numpy dtype: its raw bits).
SOURCE_VIEW = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32}
SOURCE_NAME = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
WRITE_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
CONVERT_CHUNK = 1 << 22  # elements converted at a time: bounds the fp32 temporaries to 16 MiB

# How each layer's HF tensors are laid out in the fused arrays: (field, HF parts in row order).
LAYER_PLAN = (
    ("attn_norm", ("input_layernorm",)),
    ("wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("wo", ("self_attn.o_proj",)),
    ("ffn_norm", ("post_attention_layernorm",)),
    ("w_gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    ("w_down", ("mlp.down_proj",)),
)
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [d]              fp16  input_layernorm
    wqkv: np.ndarray  # [qkv_dim, d]     fp16  rows q_proj (q_dim) | k_proj (kv_dim) | v_proj (kv_dim)
    wo: np.ndarray  # [d, q_dim]       fp16  o_proj
    ffn_norm: np.ndarray  # [d]              fp16  post_attention_layernorm
    w_gate_up: np.ndarray  # [2*ff, d]        fp16  rows gate_proj (ff) | up_proj (ff)
    w_down: np.ndarray  # [d, ff]          fp16  down_proj


@dataclass
class Weights:
    """All weights in FP16. Unfused FP16 tensors are read-only memmap views of the files;
    fused and converted ones are ordinary arrays."""

    config: LlamaConfig
    embed: np.ndarray  # [vocab, d] fp16
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d] fp16
    lm_head: np.ndarray  # [vocab, d] fp16 (the embedding itself when tie_word_embeddings)


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes are and what they hold."""

    name: str
    dtype: str  # safetensors spelling: F16, BF16, F32, ...
    shape: tuple[int, ...]
    file: Path
    start: int  # byte offsets into the file's data region (after the header)
    end: int


def layer_name(layer: int, part: str) -> str:
    return f"model.layers.{layer}.{part}.weight"


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config needs, in file order, with its shape."""
    d, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    per_layer = {
        "input_layernorm": (d,),
        "self_attn.q_proj": (config.q_dim, d),
        "self_attn.k_proj": (config.kv_dim, d),
        "self_attn.v_proj": (config.kv_dim, d),
        "self_attn.o_proj": (d, config.q_dim),
        "post_attention_layernorm": (d,),
        "mlp.gate_proj": (ff, d),
        "mlp.up_proj": (ff, d),
        "mlp.down_proj": (d, ff),
    }
    shapes = {EMBED: (vocab, d)}
    for i in range(config.num_layers):
        shapes.update({layer_name(i, part): shape for part, shape in per_layer.items()})
    shapes[FINAL_NORM] = (d,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (vocab, d)
    return shapes


def fused_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every field of Weights / LayerWeights: what a backend allocates."""
    d, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    return {"embed": (vocab, d), "attn_norm": (d,), "wqkv": (config.qkv_dim, d), "wo": (d, config.q_dim),
            "ffn_norm": (d,), "w_gate_up": (2 * ff, d), "w_down": (d, ff), "final_norm": (d,),
            "lm_head": (vocab, d)}


def _error(*where_and_what) -> CheckpointError:
    """One line, `where: what`, whatever the pieces contain."""
    return CheckpointError(" ".join(": ".join(str(p) for p in where_and_what).split()))


# ---------------------------------------------------------------------------------------------
# Reading headers


def _read_header(file: Path) -> tuple[int, dict]:
    """Return (bytes before the data region, parsed JSON header), reading nothing else."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _error(file, f"corrupt safetensors header: the file is only {size} bytes long")
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8 or length > MAX_HEADER_BYTES:
                raise _error(file, f"corrupt safetensors header: header length {length} exceeds the file "
                                   f"size {size}")
            raw = fh.read(length)
    except OSError as exc:  # permissions, I/O errors (CheckpointError is not an OSError)
        raise _error(file, f"cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(file, f"corrupt safetensors header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _error(file, "corrupt safetensors header: not a JSON object")
    return 8 + length, header


def _parse_entry(file: Path, name: str, entry) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return _error(file, name, f"corrupt safetensors header: {why}")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad("entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not [start, end] with 0 <= start <= end")
    nbytes = math.prod(shape) * ITEM_BYTES.get(dtype, 0)
    if dtype in ITEM_BYTES and offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but {dtype}{shape} "
                  f"needs {nbytes}")
    return TensorInfo(name, dtype, tuple(shape), file, offsets[0], offsets[1])


def _read_file_infos(file: Path) -> tuple[int, int, list[TensorInfo]]:
    """Parse and sanity-check one file's header: (data offset, data size, tensors)."""
    data_start, header = _read_header(file)
    data_size = file.stat().st_size - data_start
    infos = [_parse_entry(file, name, entry) for name, entry in header.items() if name != "__metadata__"]
    previous = None
    for info in sorted(infos, key=lambda i: (i.start, i.end)):
        if info.end > data_size:
            raise _error(file, info.name, f"truncated file: the tensor ends at data byte {info.end} "
                                          f"but the file holds only {data_size} data bytes")
        if previous is not None and info.start < previous.end:
            raise _error(file, info.name, f"corrupt safetensors header: data_offsets overlap {previous.name}")
        if info.end > info.start:  # empty tensors take no room and overlap nothing
            previous = info
    return data_start, data_size, infos


# ---------------------------------------------------------------------------------------------
# Finding the weight files


def _shards_from_index(index: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(index, f"not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _error(index, "no weight_map object mapping tensor names to shard files")
    shards = []
    for shard in sorted(set(weight_map.values())):
        file = index.parent / shard
        if not file.is_file():
            raise _error(index, f"shard {shard} is missing from {index.parent}")
        shards.append(file)
    return shards, weight_map


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight_map when sharded."""
    if (directory / INDEX_FILE).is_file():
        return _shards_from_index(directory / INDEX_FILE)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE], None
    found = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if len(found) == 1:
        return found, None
    if found:
        raise _error(directory, f"{len(found)} .safetensors files but no {INDEX_FILE} to say which to load")
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _error(directory, f"only PyTorch pickle weights ({', '.join(pickles)}); {CONVERT_HINT}")
    raise _error(directory, f"no weight files (expected {SINGLE_FILE} or {INDEX_FILE})")


def _collect_infos(files: list[Path], weight_map: dict[str, str] | None):
    """Read every header: (name -> TensorInfo, file -> (data offset, data size))."""
    infos: dict[str, TensorInfo] = {}
    regions: dict[Path, tuple[int, int]] = {}
    for file in files:
        data_start, data_size, file_infos = _read_file_infos(file)
        regions[file] = (data_start, data_size)
        for info in file_infos:
            if info.name in infos:
                raise _error(file, info.name, f"tensor also stored in {infos[info.name].file.name}")
            infos[info.name] = info
    for name, shard in (weight_map or {}).items():
        if name not in infos or infos[name].file.name != Path(shard).name:
            raise _error(files[0].parent / shard, name, "the index lists this tensor here but the file lacks it")
    return infos, regions


# ---------------------------------------------------------------------------------------------
# Validation against the config


def _validate(config: LlamaConfig, infos: dict[str, TensorInfo], where: Path) -> None:
    expected = expected_shapes(config)
    for name, info in infos.items():
        if name.endswith(".bias"):
            raise _error(info.file, name, "bias tensors are not supported (LLaMA has no biases)")
        layer = LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= config.num_layers:
            raise _error(info.file, name, f"layer beyond num_hidden_layers={config.num_layers} of the config")
    for name, shape in expected.items():
        info = infos.get(name)
        if info is None:
            raise _error(where, f"missing tensor {name}")
        if info.dtype not in SOURCE_VIEW:
            raise _error(info.file, name, f"dtype {info.dtype} is not supported (only F16, BF16, F32)")
        if info.shape != shape:
            raise _error(info.file, name, f"expected shape {list(shape)}, found {list(info.shape)}")


def _map_data(file: Path, data_start: int, data_size: int) -> np.ndarray:
    """The file's data region as read-only bytes: mapped, nothing read yet."""
    if data_size == 0:  # mmap refuses empty regions
        return np.empty(0, np.uint8)
    return np.memmap(file, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,))


# ---------------------------------------------------------------------------------------------
# Converting to FP16


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 is the top half of an FP32: shift its bits back into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _convert_into(dst: np.ndarray, src: np.ndarray, info: TensorInfo) -> None:
    """dst[...] = fp16(src), in chunks; a finite value that overflows FP16 is an error."""
    assert dst.flags.c_contiguous and dst.shape == src.shape
    flat_dst, flat_src = dst.reshape(-1), src.reshape(-1)
    for start in range(0, flat_src.size, CONVERT_CHUNK):
        wide = flat_src[start:start + CONVERT_CHUNK]
        if info.dtype == "BF16":
            wide = _widen_bf16(wide)
        out = flat_dst[start:start + CONVERT_CHUNK]
        with np.errstate(over="ignore"):
            out[...] = wide
        overflow = np.isinf(out) & np.isfinite(wide)
        if overflow.any():
            value = float(wide[overflow][0])
            raise _error(info.file, info.name, f"{SOURCE_NAME[info.dtype]} value {value:g} overflows "
                                               "float16 (max 65504)")


# ---------------------------------------------------------------------------------------------
# The checkpoint


class Checkpoint:
    """A validated checkpoint whose files are mapped but not read. Build it with open_checkpoint."""

    def __init__(self, directory: Path, config: LlamaConfig, infos: dict[str, TensorInfo],
                 maps: dict[Path, np.ndarray]):
        self.directory = directory
        self.config = config
        self.files = list(maps)
        self._infos = infos
        self._maps = maps
        used = {infos[name].dtype for name in expected_shapes(config)}
        self.converted_from = {SOURCE_NAME[d] for d in used if d != "F16"}  # e.g. {"bfloat16"}

    @property
    def conversion_note(self) -> str | None:
        """One line for the caller to print when load() converts, else None."""
        if not self.converted_from:
            return None
        return f"converting {' and '.join(sorted(self.converted_from))} weights to float16"

    def _info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise _error(self.directory, f"no tensor {name} in the checkpoint")
        return self._infos[name]

    def _source(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes viewed in its stored dtype (BF16 as uint16 bits): zero copy."""
        data = self._maps[info.file][info.start:info.end]
        return data.view(SOURCE_VIEW[info.dtype]).reshape(info.shape)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor as FP16: a read-only memmap view when stored as FP16, else a converted copy."""
        info = self._info(name)
        source = self._source(info)
        if info.dtype == "F16":
            return source
        out = np.empty(info.shape, np.float16)
        _convert_into(out, source, info)
        return out

    def _read_into(self, dst: np.ndarray, name: str) -> None:
        info = self._info(name)
        source = self._source(info)
        if info.dtype == "F16":
            np.copyto(dst, source)
        else:
            _convert_into(dst, source, info)

    def parts(self) -> Iterator[tuple[str, int | None, int, str]]:
        """The fusion plan: (field, layer index or None, first row in the field, HF tensor name).

        `field` names a Weights / LayerWeights attribute, whose shape is fused_shapes()[field].
        A tied lm_head's part is the embedding tensor itself.
        """
        shapes = expected_shapes(self.config)
        yield "embed", None, 0, EMBED
        for i in range(self.config.num_layers):
            for field, hf_parts in LAYER_PLAN:
                row = 0
                for part in hf_parts:
                    name = layer_name(i, part)
                    yield field, i, row, name
                    row += shapes[name][0]
        yield "final_norm", None, 0, FINAL_NORM
        yield "lm_head", None, 0, EMBED if self.config.tie_word_embeddings else LM_HEAD

    def load(self, progress: Callable[[int, int], None] | None = None) -> Weights:
        """All weights in FP16, q|k|v and gate|up fused. progress(done_bytes, total_bytes) is
        called after each tensor, counting FP16 bytes."""
        plan = list(self.parts())
        shapes, fused = expected_shapes(self.config), fused_shapes(self.config)
        total = sum(2 * math.prod(shapes[name]) for *_, name in plan)
        done = 0
        arrays: dict[tuple[str, int | None], np.ndarray] = {}
        whole: dict[str, np.ndarray] = {}  # tensors used as they are, by HF name (tied lm_head)
        for field, layer, row, name in plan:
            if shapes[name] == fused[field]:  # a part that is the whole field: no copy needed
                if name not in whole:
                    whole[name] = self.tensor(name)
                arrays[field, layer] = whole[name]
            else:
                if (field, layer) not in arrays:
                    arrays[field, layer] = np.empty(fused[field], np.float16)
                self._read_into(arrays[field, layer][row:row + shapes[name][0]], name)
            done += 2 * math.prod(shapes[name])
            if progress is not None:
                progress(done, total)
        layers = [LayerWeights(**{field: arrays[field, i] for field, _ in LAYER_PLAN})
                  for i in range(self.config.num_layers)]
        return Weights(config=self.config, embed=arrays["embed", None], layers=layers,
                       final_norm=arrays["final_norm", None], lm_head=arrays["lm_head", None])


def open_checkpoint(path: str | os.PathLike, config: LlamaConfig | None = None) -> Checkpoint:
    """Find, parse and validate a checkpoint; map its files. Reads headers only.

    `config` defaults to the directory's config.json (ConfigError when missing or bad). When the
    config ties the embeddings, lm_head is the embedding and any stored lm_head.weight is ignored,
    as in HuggingFace.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise _error(directory, "no such checkpoint directory")
    if config is None:
        config = from_pretrained(directory)
    files, weight_map = _weight_files(directory)
    infos, regions = _collect_infos(files, weight_map)
    _validate(config, infos, directory / INDEX_FILE if weight_map is not None else files[0])
    maps = {file: _map_data(file, *regions[file]) for file in files}
    return Checkpoint(directory, config, infos, maps)


def load_weights(path: str | os.PathLike, config: LlamaConfig | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Weights:
    """open_checkpoint + load, for callers that do not need the note or the fusion plan."""
    return open_checkpoint(path, config).load(progress)


# ---------------------------------------------------------------------------------------------
# Writing random checkpoints (tests, synthetic benchmarks)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    # Seeded per tensor name, so values do not depend on the dtype or on how files are sharded.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if name.endswith("norm.weight"):
        values += np.float32(1.0)  # RMSNorm gains sit around 1
    return values


def _encode(values: np.ndarray, st_dtype: str) -> np.ndarray:
    """fp32 values in the stored dtype; BF16 as its bits, rounded to nearest even."""
    if st_dtype == "F16":
        return values.astype(np.float16)
    if st_dtype == "F32":
        return values
    bits = values.view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def _write_safetensors(file: Path, tensors: dict[str, tuple[int, ...]], st_dtype: str,
                       make: Callable[[str, tuple[int, ...]], np.ndarray]) -> None:
    """Write the header first, then stream each tensor: only one is ever in memory.
    (safetensors.numpy.save_file needs them all at once, and has no BF16.)"""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        nbytes = math.prod(shape) * ITEM_BYTES[st_dtype]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data region 8-byte aligned, as safetensors does
    with open(file, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in tensors.items():
            _encode(make(name, shape), st_dtype).tofile(fh)


def _layer_groups(config: LlamaConfig) -> list[dict[str, tuple[int, ...]]]:
    """Tensors in the units that shards split on: embedding, each layer, then norm + head."""
    shapes = expected_shapes(config)
    groups = [{EMBED: shapes[EMBED]}]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        groups.append({n: s for n, s in shapes.items() if n.startswith(prefix)})
    groups.append({n: s for n, s in shapes.items() if n in (FINAL_NORM, LM_HEAD)})
    return groups


def write_random(path: str | os.PathLike, config: LlamaConfig, seed: int = 0, dtype: str = "float16",
                 shards: int = 1, std: float = 0.02) -> Path:
    """Write config.json and random weights in the HF layout; return the directory.

    Deterministic for a seed. Linear weights ~ normal(0, std), norm weights ~ 1 + normal(0, std).
    Files of the same names are overwritten; other files in the directory are left alone.
    """
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(WRITE_DTYPES)}")
    groups = _layer_groups(config)
    if not 1 <= shards <= len(groups):
        raise ValueError(f"shards must be between 1 and {len(groups)} for {config.num_layers} layers")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k in range(shards):
        chunk = groups[k * len(groups) // shards:(k + 1) * len(groups) // shards]
        tensors = {name: shape for group in chunk for name, shape in group.items()}
        file = SINGLE_FILE if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        _write_safetensors(directory / file, tensors, WRITE_DTYPES[dtype],
                           lambda name, shape: _random_tensor(name, shape, seed, std))
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(math.prod(s) * ITEM_BYTES[WRITE_DTYPES[dtype]] for s in tensors.values())
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = dataclasses.replace(config, dtype=dtype).to_hf_dict()
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return directory
