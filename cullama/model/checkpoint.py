"""Safetensors checkpoints: find, validate and read the files, and write random ones.

A checkpoint directory holds `config.json` and either `model.safetensors`, or shards listed in
`model.safetensors.index.json`, or exactly one `*.safetensors` with another name. Shards are plain
file names inside the directory (no `/`, no `..`, ending in `.safetensors`): an index naming any
other file is refused, so nothing outside the directory is ever opened through it. Symbolic links
inside the directory are followed wherever they point (the HuggingFace cache links
`snapshots/<rev>/*` to `blobs/`): whoever placed them chose them.

Opening reads only the JSON headers (8-byte little-endian length, then JSON: per tensor `dtype`,
`shape`, `data_offsets` into the data region, plus an optional `__metadata__`) and checks every
tensor the config needs by name, shape and dtype, and every header for sanity, before a single
weight byte is read. Errors quote what a file holds only through untrusted.shown (short, escaped),
never as raw bytes.

Data is then mapped with `np.memmap` and read a chunk at a time (`Checkpoint.rows`): FP16 rows are
zero-copy views of the page cache, BF16 and F32 rows are converted to FP16 (a value beyond FP16's
range is an error, never a silent inf). Every chunk is checked for NaN and inf while it is in the
CPU cache, in the same pass that copies or converts it; a non-finite weight is an error naming the
tensor and the element. weights.py places the chunks in the fused device layout.

Conversion is reported, not printed: `Checkpoint.converted_from` holds the source dtypes that
were not FP16 and `Checkpoint.conversion_note` a one-line message the caller (CLI) may print.

An AWQ or GPTQ checkpoint (config.quantization) stores its quantized linears as packed int32 and FP16 tensors
in place of `.weight`: their names, dtypes and shapes are checked here too (quant_checkpoint.check), and
`Checkpoint.stored` reads them as they are; quant_checkpoint unpacks them and checks their data.

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

from . import quant_checkpoint
from .config import LlamaConfig, from_pretrained
from ..common.errors import CheckpointError
from ..common.untrusted import parse_json, read_json, shown

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
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
STORED_VIEW = {"F16": np.float16, "I32": np.int32}  # a quantized linear's tensors, read as they are
SOURCE_NAME = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
WRITE_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# Elements read at a time (512 KiB of FP16): a chunk stays in the CPU cache between its finiteness check
# and its copy or conversion, and bounds the FP32 temporaries of a conversion to 1 MiB.
CHUNK = 1 << 18
# The smallest bit pattern of a positive (as int16) and of a negative (as uint16) FP16 inf or NaN.
POSITIVE_NONFINITE, NEGATIVE_NONFINITE = np.int16(0x7C00), np.uint16(0xFC00)
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes are and what they hold."""

    name: str
    dtype: str  # safetensors spelling: F16, BF16, F32, ...
    shape: tuple[int, ...]
    file: Path
    start: int  # byte offsets into the file's data region (after the header)
    end: int


QKV_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # Qwen2's biased projections
BIAS_STD = 0.5  # write_random's biases: as large as a projection's outputs, so that dropping one shows


def layer_name(layer: int, part: str) -> str:
    return f"model.layers.{layer}.{part}.weight"


def bias_name(layer: int, part: str) -> str:
    return f"model.layers.{layer}.{part}.bias"


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
        if config.qkv_bias:  # Qwen2: [rows] of each of q_proj, k_proj, v_proj
            shapes.update({bias_name(i, part): per_layer[part][:1] for part in QKV_PARTS})
    shapes[FINAL_NORM] = (d,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (vocab, d)
    return shapes


def quantized_linear(config: LlamaConfig, name: str) -> bool:
    """Whether the HF tensor `name` (a .weight of expected_shapes) is stored quantized instead: a linear of a
    layer, in an AWQ or GPTQ checkpoint, not kept FP16 by modules_to_not_convert."""
    q = config.quantization
    return (q is not None and LAYER_NAME.match(name) is not None and name.endswith("_proj.weight")
            and q.converts(name.removesuffix(".weight")))


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
            if length > size - 8 or length > MAX_HEADER_BYTES:  # the length itself is not shown: file bytes
                raise _error(file, f"corrupt safetensors header: its header length exceeds the file size ({size} "
                                   f"bytes) or {MAX_HEADER_BYTES >> 20} MiB")
            raw = fh.read(length)
    except OSError as exc:  # permissions, I/O errors (CheckpointError is not an OSError)
        raise _error(file, f"cannot read ({exc.strerror or exc})") from None
    header = parse_json(raw, f"{file}: corrupt safetensors header", CheckpointError)
    if not isinstance(header, dict):
        raise _error(file, "corrupt safetensors header: not a JSON object")
    return 8 + length, header


def _parse_entry(file: Path, name: str, entry) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return _error(file, shown(name), f"corrupt safetensors header: {why}")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad("entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype {shown(dtype)} is not a string")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad(f"shape {shown(shape)} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {shown(offsets)} are not [start, end] with 0 <= start <= end")
    nbytes = math.prod(shape) * ITEM_BYTES.get(dtype, 0)
    if dtype in ITEM_BYTES and offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {shown(offsets)} span {shown(offsets[1] - offsets[0])} bytes but "
                  f"{dtype}{shown(shape)} needs {shown(nbytes)}")
    return TensorInfo(name, dtype, tuple(shape), file, offsets[0], offsets[1])


def _read_file_infos(file: Path) -> tuple[int, int, list[TensorInfo]]:
    """Parse and sanity-check one file's header: (data offset, data size, tensors)."""
    data_start, header = _read_header(file)
    data_size = file.stat().st_size - data_start
    infos = [_parse_entry(file, name, entry) for name, entry in header.items() if name != "__metadata__"]
    previous = None
    for info in sorted(infos, key=lambda i: (i.start, i.end)):
        if info.end > data_size:
            raise _error(file, shown(info.name), f"truncated file: the tensor ends at data byte {shown(info.end)} "
                                                 f"but the file holds only {data_size} data bytes")
        if previous is not None and info.start < previous.end:
            raise _error(file, shown(info.name), f"corrupt safetensors header: data_offsets overlap "
                                                 f"{shown(previous.name)}")
        if info.end > info.start:  # empty tensors take no room and overlap nothing
            previous = info
    return data_start, data_size, infos


# ---------------------------------------------------------------------------------------------
# Finding the weight files


def _shard_file(index: Path, tensor: str, shard: str) -> Path:
    """The file an index entry names: a plain `*.safetensors` name inside the index's directory, nothing
    else (an absolute path, `..`, a sub-directory or another kind of file could read anything)."""
    plain = (shard not in ("", ".", "..") and "/" not in shard and "\\" not in shard and "\0" not in shard
             and shard.isprintable() and shard.endswith(SUFFIX))
    if not plain:
        raise _error(index, f"weight_map entry {shown(tensor)} names the shard {shown(shard)}, which is not a "
                            f"plain *{SUFFIX} file name inside {index.parent}")
    return index.parent / shard


def _shards_from_index(index: Path) -> tuple[list[Path], dict[str, str]]:
    raw = read_json(index, CheckpointError)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _error(index, "no weight_map object mapping tensor names to shard files")
    files = {shard: _shard_file(index, tensor, shard) for tensor, shard in weight_map.items()}
    for shard, file in sorted(files.items()):
        if not file.is_file():
            raise _error(index, f"shard {shard} is missing from {index.parent}")
    return [files[shard] for shard in sorted(files)], weight_map


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight_map when sharded."""
    if (directory / INDEX_FILE).is_file():
        return _shards_from_index(directory / INDEX_FILE)
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE], None
    found = sorted(p for p in directory.glob(f"*{SUFFIX}") if p.is_file())
    if len(found) == 1:
        return found, None
    if found:
        raise _error(directory, f"{len(found)} {SUFFIX} files but no {INDEX_FILE} to say which to load")
    pickles = sorted(shown(p.name) for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
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
                raise _error(file, shown(info.name), f"tensor also stored in {infos[info.name].file.name}")
            infos[info.name] = info
    for name, shard in (weight_map or {}).items():
        if name not in infos or infos[name].file.name != shard:
            raise _error(files[0].parent / shard, shown(name), "the index lists this tensor here but the file "
                                                               "lacks it")
    return infos, regions


# ---------------------------------------------------------------------------------------------
# Validation against the config


def _validate(config: LlamaConfig, infos: dict[str, TensorInfo], where: Path) -> None:
    expected = expected_shapes(config)
    for name, info in infos.items():
        if name.endswith(".bias") and name not in expected:
            which = "Qwen2's are on q_proj, k_proj and v_proj only" if config.qkv_bias else \
                f"{config.architecture} has no biases"
            raise _error(info.file, shown(name), f"bias tensors are not supported ({which})")
        layer = LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= config.num_layers:
            raise _error(info.file, shown(name), f"layer beyond num_hidden_layers={config.num_layers} of the config")
    for name, shape in expected.items():
        packed = f"{name.removesuffix('.weight')}.qweight"
        if name in infos and packed in infos:  # both forms of one linear: which is meant cannot be told
            raise _error(infos[name].file, f"{name} and {packed} are both stored: a linear is either FP16 or "
                                           "quantized, not both (which one is meant?)")
        if quantized_linear(config, name):
            found = lambda n: (infos[n].dtype, infos[n].shape) if n in infos else None  # noqa: E731
            quant_checkpoint.check(config.quantization, name.removesuffix(".weight"), *shape, found, where)
            continue
        info = infos.get(name)
        if info is None:
            raise _error(where, f"missing tensor {name}")
        if info.dtype not in SOURCE_VIEW:
            raise _error(info.file, name, f"dtype {shown(info.dtype)} is not supported (only F16, BF16, F32)")
        if info.shape != shape:
            raise _error(info.file, name, f"expected shape {list(shape)}, found {shown(list(info.shape))}")


def _map_data(file: Path, data_start: int, data_size: int) -> np.ndarray:
    """The file's data region as read-only bytes: mapped, nothing read yet."""
    if data_size == 0:  # mmap refuses empty regions
        return np.empty(0, np.uint8)
    return np.memmap(file, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,))


# ---------------------------------------------------------------------------------------------
# Reading FP16 rows: conversion and the finiteness check


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 is the top half of an FP32: shift its bits back into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _RowReader:
    """Turns one tensor's stored rows into checked FP16 rows, CHUNK elements at a time."""

    def __init__(self, info: TensorInfo, source: np.ndarray):
        self.info, self.source = info, source  # source: [rows, ...] in the stored dtype (BF16 as bits)
        self.row_size = math.prod(info.shape[1:])  # elements per row (1 for a vector)
        # [max(CHUNK, a row)] converted: a chunk is whole rows, one at least
        self.converted = None if info.dtype == "F16" else np.empty(max(CHUNK, self.row_size), np.float16)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        step = max(1, CHUNK // max(1, self.row_size))
        for row in range(0, len(self.source), step):
            rows = self.source[row:row + step]
            if self.converted is None:
                self._check(rows, rows, row)
                yield row, rows
            else:
                yield row, self._convert(rows, row)

    def _check(self, fp16: np.ndarray, stored: np.ndarray, row: int) -> None:
        """A CheckpointError at the first inf or NaN of `fp16` (rows of the tensor from `row` on; `stored`: the
        same rows as the file holds them). inf and NaN are the FP16 bit patterns 0x7C00-0x7FFF and 0xFC00-0xFFFF:
        the top of the int16 range and the top of the uint16 range, so two integer max reductions over the
        chunk, with no temporary, find them (np.isfinite on FP16 costs several times more)."""
        bits = fp16.reshape(-1).view(np.uint16)
        if bits.max(initial=0) < NEGATIVE_NONFINITE and bits.view(np.int16).max(initial=0) < POSITIVE_NONFINITE:
            return
        flat = int(np.flatnonzero((bits & 0x7FFF) >= POSITIVE_NONFINITE)[0])
        element = stored.reshape(-1)[flat:flat + 1]
        value = float((_widen_bf16(element) if self.info.dtype == "BF16" else element)[0])
        if math.isfinite(value):
            raise _error(self.info.file, self.info.name, f"{SOURCE_NAME[self.info.dtype]} value {value:g} "
                                                         "overflows float16 (max 65504)")
        where = ", ".join(map(str, np.unravel_index(row * self.row_size + flat, self.info.shape)))
        raise _error(self.info.file, self.info.name, f"holds {value} at [{where}] (NaN and inf weights are refused)")

    def _convert(self, rows: np.ndarray, row: int) -> np.ndarray:
        """rows converted to FP16 (valid until the next chunk), checked like FP16 rows: a NaN, an inf, or a
        finite value beyond FP16's range is an error."""
        wide = rows.reshape(-1)
        if self.info.dtype == "BF16":
            wide = _widen_bf16(wide)
        out = self.converted[:wide.size]
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = wide
        self._check(out, rows, row)
        return out.reshape(rows.shape)


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
        used = {infos[name].dtype for name in expected_shapes(config) if not quantized_linear(config, name)}
        self.converted_from = {SOURCE_NAME[d] for d in used if d != "F16"}  # e.g. {"bfloat16"}

    @property
    def conversion_note(self) -> str | None:
        """One line for the caller to print when loading converts, else None."""
        if not self.converted_from:
            return None
        return f"converting {' and '.join(sorted(self.converted_from))} weights to float16"

    def _info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise _error(self.directory, f"no tensor {shown(name)} in the checkpoint")
        return self._infos[name]

    def _source(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes viewed in its stored dtype (BF16 as uint16 bits): zero copy."""
        data = self._maps[info.file][info.start:info.end]
        return data.view(SOURCE_VIEW[info.dtype]).reshape(info.shape)

    def rows(self, name: str) -> Iterator[tuple[int, np.ndarray]]:
        """The tensor as FP16, a chunk of rows at a time: (first row, rows). FP16 rows are read-only views of
        the map, converted rows a buffer that the next chunk reuses (copy them at once). Each chunk is checked
        finite (CheckpointError naming the tensor and the element) just before it is handed out."""
        info = self._info(name)
        return iter(_RowReader(info, self._source(info)))

    def stored(self, name: str) -> np.ndarray:
        """A quantized linear's tensor (qweight, qzeros, scales, g_idx) as stored: a read-only int32 or FP16
        memmap view, unchecked (quant_checkpoint checks what it reads)."""
        info = self._info(name)
        return self._maps[info.file][info.start:info.end].view(STORED_VIEW[info.dtype]).reshape(info.shape)

    def tensor(self, name: str) -> np.ndarray:
        """A whole tensor as FP16, checked: a read-only memmap view when stored as FP16 (the check is the
        pass that pages it in), else a converted copy."""
        info = self._info(name)
        if info.dtype == "F16":
            for _ in self.rows(name):
                pass
            return self._source(info)
        out = np.empty(info.shape, np.float16)
        for row, rows in self.rows(name):
            out[row:row + len(rows)] = rows
        return out


def open_checkpoint(path: str | os.PathLike, config: LlamaConfig | None = None) -> Checkpoint:
    """Find, parse and validate a checkpoint; map its files. Reads headers only.

    `config` defaults to the directory's config.json (ConfigError when missing or bad). When the
    config ties the embeddings, lm_head is the embedding and any stored lm_head.weight is ignored,
    as in HuggingFace.
    """
    directory = Path(path)
    if not directory.is_dir():
        hint = " (it is a file: name the checkpoint directory that holds it)" if directory.is_file() else ""
        raise _error(directory, f"no such model directory{hint}")
    if config is None:
        config = from_pretrained(directory)
    files, weight_map = _weight_files(directory)
    infos, regions = _collect_infos(files, weight_map)
    _validate(config, infos, directory / INDEX_FILE if weight_map is not None else files[0])
    maps = {file: _map_data(file, *regions[file]) for file in files}
    return Checkpoint(directory, config, infos, maps)


# ---------------------------------------------------------------------------------------------
# Writing random checkpoints (tests, synthetic benchmarks)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    # Seeded per tensor name, so values do not depend on the dtype or on how files are sharded.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(BIAS_STD if name.endswith(".bias") else std)
    if name.endswith("norm.weight"):
        values += np.float32(1.0)  # RMSNorm gains sit around 1
    return values


def _encode(values: np.ndarray, st_dtype: str) -> np.ndarray:
    """fp32 values in the stored dtype; BF16 as its bits, rounded to nearest even, NaN as the quiet NaN (the
    rounding's carry would turn a NaN's payload into inf or zero), as PyTorch's conversion does."""
    if st_dtype == "F16":
        return values.astype(np.float16)
    if st_dtype == "F32":
        return values
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


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

    Deterministic for a seed. Linear weights ~ normal(0, std), norm weights ~ 1 + normal(0, std), Qwen2's q/k/v
    biases ~ normal(0, BIAS_STD).
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
    hf_config = dataclasses.replace(config, dtype=dtype, quantization=None).to_hf_dict()  # plain weights
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return directory
