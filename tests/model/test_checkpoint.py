"""Checkpoints: the goldens and stories260K load and fuse exactly, write_random round-trips in every
dtype and layout, and each way a checkpoint can be broken gives a one-line CheckpointError (ConfigError
for config.json) naming the file, tensor or option at fault.

The safetensors library (`load_file`) is the independent reader that fused arrays are checked against.
"""

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from cullama.model import checkpoint as checkpoint_module
from cullama.model.checkpoint import (EMBED, FINAL_NORM, INDEX_FILE, LM_HEAD, expected_shapes, layer_name,
                                      open_checkpoint, write_random)
from cullama.model.config import LlamaConfig, from_pretrained
from cullama.common.errors import CheckpointError, ConfigError
from cullama.model.layout import fused_shapes, parts
from cullama.model.weights import host_weights, load_weights
from cullama.runtime.load import load_checkpoint

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
# GQA (4 query heads over 2 kv heads) so that q, k and v have different row counts.
SMALL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_seq_len=64, name="small")


def read_all(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of every safetensors file, read by the safetensors library."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# What each fused layer field holds, in row order: model.layers.{i}.<part>.weight.
LAYER_SOURCES = {"attn_norm": ["input_layernorm"],
                 "wqkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "wo": ["self_attn.o_proj"], "ffn_norm": ["post_attention_layernorm"],
                 "w_gate_up": ["mlp.gate_proj", "mlp.up_proj"], "w_down": ["mlp.down_proj"]}


def assert_fused(weights, source: dict[str, np.ndarray], rtol: float = 0.0) -> None:
    """Every field equals its HF tensors converted to fp16, fused by concatenating rows."""
    shapes = fused_shapes(weights.config)

    def same(actual, names, field):
        expected = np.concatenate([source[n].astype(np.float32) for n in names]).astype(np.float16)
        assert actual.dtype == np.float16 and actual.shape == shapes[field], field
        np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=rtol,
                                   atol=1e-7 if rtol else 0, err_msg=f"{field} != {names}")

    same(weights.embed, [EMBED], "embed")
    same(weights.final_norm, [FINAL_NORM], "final_norm")
    if weights.config.tie_word_embeddings:
        assert weights.lm_head is weights.embed
    else:
        same(weights.lm_head, [LM_HEAD], "lm_head")
    assert len(weights.layers) == weights.config.num_layers
    for i, layer in enumerate(weights.layers):
        for field, parts in LAYER_SOURCES.items():
            same(getattr(layer, field), [layer_name(i, part) for part in parts], field)


# ---------------------------------------------------------------------------------------------
# Real checkpoints


@pytest.mark.parametrize("relative, converted", [
    ("golden/tiny-mha", set()),
    ("golden/tiny-gqa-sharded", set()),
    ("models/stories260K", {"float32"}),
])
def test_shared_checkpoints_load_and_fuse(relative, converted):
    directory = SHARED / relative
    if not directory.is_dir():
        pytest.skip(f"shared test data {directory} is absent")
    checkpoint = open_checkpoint(directory)
    assert checkpoint.config == from_pretrained(directory)
    assert checkpoint.converted_from == converted
    assert (checkpoint.conversion_note is None) == (not converted)
    assert_fused(host_weights(checkpoint), read_all(directory))


def test_fp16_tensors_are_zero_copy_maps():
    directory = SHARED / "golden" / "tiny-mha"
    if not directory.is_dir():
        pytest.skip(f"shared test data {directory} is absent")
    checkpoint = open_checkpoint(directory)
    embed = checkpoint.tensor(EMBED)
    assert isinstance(embed, np.memmap) and not embed.flags.writeable
    assert Path(host_weights(checkpoint).embed.filename).resolve() == (directory / "model.safetensors").resolve()


# ---------------------------------------------------------------------------------------------
# write_random


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_write_random_round_trip(tmp_path, dtype, shards):
    directory = write_random(tmp_path, SMALL, seed=3, dtype=dtype, shards=shards)
    checkpoint = open_checkpoint(directory)
    assert checkpoint.config == dataclasses.replace(SMALL, dtype=dtype, name=str(directory / "config.json"))
    assert checkpoint.converted_from == ({"float32"} if dtype == "float32" else set())
    assert len(checkpoint.files) == shards
    assert_fused(host_weights(checkpoint), read_all(directory))


def test_write_random_bfloat16_matches_float32_to_bf16_precision(tmp_path):
    bf16 = write_random(tmp_path / "bf16", SMALL, seed=3, dtype="bfloat16", shards=2)
    f32 = write_random(tmp_path / "f32", SMALL, seed=3, dtype="float32")
    for file in bf16.glob("*.safetensors"):  # the safetensors library accepts our header
        with safe_open(file, framework="np") as handle:
            assert all(handle.get_slice(k).get_dtype() == "BF16" for k in handle.keys())
    checkpoint = open_checkpoint(bf16)
    assert checkpoint.conversion_note == "converting bfloat16 weights to float16"
    assert_fused(host_weights(checkpoint), read_all(f32), rtol=2.0 ** -8)


def test_write_random_is_deterministic_and_layout_independent(tmp_path):
    a = write_random(tmp_path / "a", SMALL, seed=7)
    b = write_random(tmp_path / "b", SMALL, seed=7)
    c = write_random(tmp_path / "c", SMALL, seed=8)
    sharded = write_random(tmp_path / "s", SMALL, seed=7, shards=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    single, split = read_all(a), read_all(sharded)
    assert single.keys() == split.keys() == expected_shapes(SMALL).keys()
    assert all(np.array_equal(single[k], split[k]) for k in single)
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(single)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in single.values())


def test_write_random_statistics(tmp_path):
    weights = load_weights(write_random(tmp_path, SMALL, std=0.05))
    norm = weights.layers[0].attn_norm.astype(np.float32)
    assert abs(norm.mean() - 1) < 0.05 and norm.std() < 0.1
    assert weights.layers[1].w_down.astype(np.float32).std() == pytest.approx(0.05, rel=0.2)


def test_tied_embeddings_share_the_array(tmp_path):
    config = dataclasses.replace(SMALL, tie_word_embeddings=True)
    directory = write_random(tmp_path, config)
    assert "lm_head.weight" not in read_all(directory)
    weights = load_weights(directory)
    assert weights.lm_head is weights.embed


def test_parts_tile_every_fused_array(tmp_path):
    checkpoint = open_checkpoint(write_random(tmp_path, SMALL))
    shapes, fused = expected_shapes(SMALL), fused_shapes(SMALL)
    rows: dict = {}
    for field, layer, row, name in parts(checkpoint.config):
        rows.setdefault((field, layer), []).append((row, shapes[name][0]))
        assert shapes[name][1:] == fused[field][1:]
    assert len(rows) == 3 + 6 * SMALL.num_layers
    for (field, _), spans in rows.items():
        assert [r for r, _ in spans] == list(np.cumsum([0] + [n for _, n in spans[:-1]]))
        assert sum(n for _, n in spans) == fused[field][0]


def test_progress_counts_fp16_bytes(tmp_path):
    calls = []
    weights = load_weights(write_random(tmp_path, SMALL, dtype="bfloat16"), progress=lambda *a: calls.append(a))
    arrays = [weights.embed, weights.final_norm, weights.lm_head]
    arrays += [a for layer in weights.layers for a in vars(layer).values() if a is not None]  # bqkv: Qwen2 only
    total = sum(a.nbytes for a in arrays)
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_harmless_extra_tensors_and_odd_file_name(tmp_path):
    directory = write_random(tmp_path, SMALL)
    add_tensor(directory / "model.safetensors", "model.layers.0.self_attn.rotary_emb.inv_freq",
               np.ones(4, np.float32))
    add_tensor(directory / "model.safetensors", "model.position_ids", np.arange(8, dtype=np.int64))
    (directory / "model.safetensors").rename(directory / "consolidated.safetensors")
    assert_fused(load_weights(directory), read_all(directory))


# ---------------------------------------------------------------------------------------------
# Broken checkpoints. The helpers edit files directly, never through cullama.


def read_raw(file: Path) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def write_raw(file: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(file: Path, edit) -> None:
    header, data = read_raw(file)
    edit(header)
    write_raw(file, header, data)


def edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


ST_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int32": "I32", "int64": "I64",
             "uint16": "BF16"}  # uint16 stands for raw bfloat16 bits


def add_tensor(file: Path, name: str, array: np.ndarray) -> None:
    """Append the array's bytes and point `name` at them (replacing any entry of that name)."""
    header, data = read_raw(file)
    header[name] = {"dtype": ST_DTYPES[array.dtype.name], "shape": list(array.shape),
                    "data_offsets": [len(data), len(data) + array.nbytes]}
    write_raw(file, header, data + array.tobytes())


def shard(directory: Path, k: int) -> Path:
    return directory / f"model-{k:05d}-of-00004.safetensors"


WEIGHTS = "model.safetensors"
UP1, Q0 = layer_name(1, "mlp.up_proj"), layer_name(0, "self_attn.q_proj")
NORM0, NORM0_FFN = layer_name(0, "input_layernorm"), layer_name(0, "post_attention_layernorm")
BREAKERS = {}


def breaks(error, *needles, **write_options):
    """Register a way to break a fresh SMALL checkpoint (written with write_options): loading it must
    raise `error` with every needle in the message. A breaker may return another path to load."""
    def register(breaker):
        BREAKERS[breaker.__name__] = (breaker, error, needles, write_options)
        return staticmethod(breaker)
    return register


class Breakers:
    """The registry of broken checkpoints, one small function each (d: the checkpoint directory)."""

    @breaks(CheckpointError, "nowhere", "no such")
    def missing_directory(d):
        return d / "nowhere"

    @breaks(ConfigError, "config.json", "missing")
    def missing_config(d):
        (d / "config.json").unlink()

    @breaks(ConfigError, "config.json", "not valid JSON")
    def malformed_config(d):
        (d / "config.json").write_text("{")

    @breaks(ConfigError, "config.json", "model_type")
    def unsupported_model_type(d):
        edit_json(d / "config.json", model_type="gpt2")

    @breaks(ConfigError, "config.json", "rope_scaling.rope_type", "yarn")
    def unsupported_rope_scaling(d):
        edit_json(d / "config.json", rope_scaling={"rope_type": "yarn", "factor": 2.0})

    @breaks(ConfigError, "config.json", "attention_bias")
    def attention_bias(d):
        edit_json(d / "config.json", attention_bias=True)

    @breaks(CheckpointError, INDEX_FILE, "model-00002-of-00004.safetensors", shards=4)
    def missing_shard(d):
        shard(d, 2).unlink()

    @breaks(CheckpointError, INDEX_FILE, "JSON", shards=4)
    def index_not_json(d):
        (d / INDEX_FILE).write_text('{"weight_map": ')

    @breaks(CheckpointError, INDEX_FILE, "nested too deeply", shards=4)
    def index_nested_100k_levels(d):
        (d / INDEX_FILE).write_text("[" * 100_000 + "]" * 100_000)

    @breaks(CheckpointError, WEIGHTS, "nested too deeply")
    def header_nested_100k_levels(d):
        (d / WEIGHTS).write_bytes(struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000)

    @breaks(CheckpointError, WEIGHTS, "no such model directory", "it is a file")
    def model_path_is_a_file(d):
        return d / WEIGHTS

    @breaks(CheckpointError, INDEX_FILE, "weight_map", shards=4)
    def index_without_weight_map(d):
        (d / INDEX_FILE).write_text("{}")

    @breaks(CheckpointError, "model-00003-of-00004.safetensors", EMBED, shards=4)
    def index_names_the_wrong_shard(d):
        index = json.loads((d / INDEX_FILE).read_text())
        edit_json(d / INDEX_FILE, weight_map=index["weight_map"] | {EMBED: shard(d, 3).name})

    @breaks(CheckpointError, EMBED, "also stored", shards=4)
    def tensor_in_two_shards(d):
        add_tensor(shard(d, 4), EMBED, np.zeros((64, 32), np.float16))

    @breaks(CheckpointError, WEIGHTS, UP1)
    def missing_tensor(d):
        edit_header(d / WEIGHTS, lambda header: header.pop(UP1))

    @breaks(CheckpointError, INDEX_FILE, UP1, shards=4)
    def missing_tensor_sharded(d):
        edit_header(shard(d, 3), lambda header: header.pop(UP1))
        index = json.loads((d / INDEX_FILE).read_text())
        edit_json(d / INDEX_FILE, weight_map={k: v for k, v in index["weight_map"].items() if k != UP1})

    @breaks(CheckpointError, WEIGHTS, LM_HEAD)
    def missing_untied_lm_head(d):
        edit_header(d / WEIGHTS, lambda header: header.pop(LM_HEAD))

    @breaks(CheckpointError, WEIGHTS, UP1, "expected shape [48, 32], found [32, 48]")
    def wrong_shape(d):
        edit_header(d / WEIGHTS, lambda header: header[UP1].update(shape=[32, 48]))

    @breaks(CheckpointError, WEIGHTS, Q0, "I32")
    def int32_dtype(d):
        add_tensor(d / WEIGHTS, Q0, np.zeros((32, 32), np.int32))

    @breaks(CheckpointError, WEIGHTS, NORM0, "F64")
    def float64_dtype(d):
        add_tensor(d / WEIGHTS, NORM0, np.ones(32))

    @breaks(CheckpointError, WEIGHTS, "model.layers.0.self_attn.q_proj.bias")
    def bias_tensor(d):
        add_tensor(d / WEIGHTS, "model.layers.0.self_attn.q_proj.bias", np.zeros(32, np.float16))

    @breaks(CheckpointError, WEIGHTS, "model.layers.5.", "num_hidden_layers=2")
    def more_layers_than_config(d):
        add_tensor(d / WEIGHTS, layer_name(5, "input_layernorm"), np.ones(32, np.float16))

    @breaks(CheckpointError, WEIGHTS, LM_HEAD, "truncated")
    def truncated_file(d):
        (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:-10])  # lm_head is stored last

    @breaks(CheckpointError, WEIGHTS, "only 2 bytes")
    def shorter_than_header_length(d):
        (d / WEIGHTS).write_bytes(b"\x01\x00")

    @breaks(CheckpointError, WEIGHTS, "header length")
    def header_length_beyond_file(d):
        (d / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + (d / WEIGHTS).read_bytes()[8:])

    @breaks(CheckpointError, WEIGHTS, "not valid JSON")
    def header_not_json(d):
        (d / WEIGHTS).write_bytes(struct.pack("<Q", 6) + b"\xff{nope" + bytes(64))

    @breaks(CheckpointError, WEIGHTS, "overlap")
    def overlapping_offsets(d):
        edit_header(d / WEIGHTS, lambda h: h[NORM0_FFN].update(data_offsets=h[NORM0]["data_offsets"]))

    @breaks(CheckpointError, WEIGHTS, NORM0, "data_offsets")
    def reversed_offsets(d):
        edit_header(d / WEIGHTS, lambda h: h[NORM0].update(data_offsets=h[NORM0]["data_offsets"][::-1]))

    @breaks(CheckpointError, WEIGHTS, NORM0, "needs 64")
    def offsets_disagree_with_shape(d):
        edit_header(d / WEIGHTS, lambda h: h[NORM0].update(data_offsets=[0, 2]))

    @breaks(CheckpointError, WEIGHTS, NORM0, "shape")
    def entry_without_shape(d):
        edit_header(d / WEIGHTS, lambda h: h[NORM0].pop("shape"))

    @breaks(CheckpointError, "no weight files")
    def no_weight_files(d):
        (d / WEIGHTS).unlink()

    @breaks(CheckpointError, "pytorch_model.bin", "safe_serialization=True")
    def pickle_weights_only(d):
        (d / WEIGHTS).unlink()
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")

    @breaks(CheckpointError, "2 .safetensors files", INDEX_FILE)
    def two_files_without_index(d):
        shutil.copy(d / WEIGHTS, d / "a.safetensors")
        (d / WEIGHTS).rename(d / "b.safetensors")

    @breaks(CheckpointError, WEIGHTS, NORM0, "bfloat16 value 65536 overflows", dtype="bfloat16")
    def bfloat16_overflow(d):
        add_tensor(d / WEIGHTS, NORM0, np.full(32, 0x4780, np.uint16))  # the bits of 65536.0

    @breaks(CheckpointError, WEIGHTS, UP1, "float32 value 1e+06 overflows", dtype="float32")
    def float32_overflow(d):
        add_tensor(d / WEIGHTS, UP1, np.full((48, 32), 1e6, np.float32))


@pytest.mark.parametrize("case", BREAKERS)
def test_broken_checkpoint_gives_one_line_naming_the_fault(tmp_path, case):
    breaker, error, needles, write_options = BREAKERS[case]
    directory = write_random(tmp_path / "ckpt", SMALL, **write_options)
    path = breaker(directory) or directory
    with pytest.raises(error) as info:
        load_weights(path)
    message = str(info.value)
    assert "\n" not in message
    assert all(needle in message for needle in needles), message


def test_unknown_tensor_name(tmp_path):
    with pytest.raises(CheckpointError, match="no tensor model.nope"):
        open_checkpoint(write_random(tmp_path, SMALL)).tensor("model.nope")


def test_write_random_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_random(tmp_path, SMALL, dtype="int8")
    with pytest.raises(ValueError, match="shards"):
        write_random(tmp_path, SMALL, shards=5)


# ---------------------------------------------------------------------------------------------
# Hostile indexes and headers: nothing outside the directory is opened, no file's bytes are echoed


def point_shard_at(directory: Path, shard_name: str) -> None:
    """Make the index name `shard_name` for every tensor of shard 1."""
    index = json.loads((directory / INDEX_FILE).read_text())
    first = shard(directory, 1).name
    edit_json(directory / INDEX_FILE, weight_map={k: (shard_name if v == first else v)
                                                  for k, v in index["weight_map"].items()})


@pytest.mark.parametrize("name", ["/proc/self/environ", "../../../../etc/passwd", "/etc/passwd", "sub/x.safetensors",
                                  "..", ".", "", "a\\..\\b.safetensors", "nul\0.safetensors", "config.json",
                                  "model-00001-of-00004.safetensors\n"])
def test_index_shards_must_be_plain_names_in_the_directory(tmp_path, name):
    directory = write_random(tmp_path / "ckpt", SMALL, shards=4)
    point_shard_at(directory, name)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory / INDEX_FILE) in message and "plain" in message
    assert EMBED in message  # the entry at fault


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_valid_shard_outside_the_directory_is_refused(tmp_path, where):
    directory = write_random(tmp_path / "ckpt", SMALL, shards=4)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(shard(directory, 1), outside / shard(directory, 1).name)
    shard(directory, 1).unlink()
    target = outside / shard(directory, 1).name
    point_shard_at(directory, str(target) if where == "absolute" else f"../elsewhere/{target.name}")
    with pytest.raises(CheckpointError, match="not a plain"):
        open_checkpoint(directory)


def test_huggingface_cache_symlinks_resolving_elsewhere_load(tmp_path):
    # snapshots/<rev>/* -> ../../blobs/<hash>, as huggingface_hub lays out its cache
    source = write_random(tmp_path / "written", SMALL, shards=3)
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        blob = blobs / f"{i:040x}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    checkpoint = open_checkpoint(snapshot)
    assert len(checkpoint.files) == 3 and all(f.parent == snapshot and f.is_symlink() for f in checkpoint.files)
    assert_fused(host_weights(checkpoint), {k: v for f in blobs.glob("*") if f.stat().st_size > 8 and
                                            f.read_bytes()[8:9] == b"{" for k, v in load_file(f).items()})


def test_header_length_from_a_symlinked_proc_file_is_not_echoed(tmp_path):
    environ = Path("/proc/self/environ")
    if not environ.is_file():
        pytest.skip("no /proc/self/environ on this system")
    directory = write_random(tmp_path, SMALL)
    (directory / WEIGHTS).unlink()
    (directory / WEIGHTS).symlink_to(environ)  # a link placed in the directory is followed
    first8 = environ.read_bytes()[:8]
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(directory)
    message = str(info.value)
    assert "header length" in message and "\n" not in message
    assert str(struct.unpack("<Q", first8.ljust(8, b"\0"))[0]) not in message


@pytest.mark.parametrize("edit, needle", [
    (lambda h: h[NORM0].update(dtype="\x1b[31m" + "SECRET" * 50), "dtype"),
    (lambda h: h[NORM0].update(shape=["SECRET" * 50]), "shape"),
    (lambda h: h[NORM0].update(data_offsets=["SECRET" * 50, 1]), "data_offsets"),
    (lambda h: h.update({"model.layers.7.\nbad\x1b[2J" + "SECRET" * 50: h[NORM0]}), "model.layers.7.\\nbad"),
])
def test_header_fragments_are_shown_short_and_escaped(tmp_path, edit, needle):
    directory = write_random(tmp_path, SMALL)
    edit_header(directory / WEIGHTS, edit)
    with pytest.raises(CheckpointError) as info:
        load_weights(directory)
    message = str(info.value)
    assert needle in message and "\n" not in message and "\x1b" not in message
    assert message.count("SECRET") <= 10 and len(message) < len(str(directory)) + 250


# ---------------------------------------------------------------------------------------------
# Non-finite weights are refused at load, with the tensor's name and the element


V0, DOWN1 = layer_name(0, "self_attn.v_proj"), layer_name(1, "mlp.down_proj")


def poison(directory: Path, name: str, value: float, at: tuple[int, int], dtype: str) -> None:
    """Overwrite one element of a stored tensor, in place (dtype: the file's)."""
    header, data = read_raw(directory / WEIGHTS)
    entry = header[name]
    flat = at[0] * entry["shape"][1] + at[1]
    if dtype == "bfloat16":
        raw = (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = np.array([value], dtype).tobytes()
    offset = entry["data_offsets"][0] + flat * len(raw)
    write_raw(directory / WEIGHTS, header, data[:offset] + raw + data[offset + len(raw):])


class CopyingBackend:
    """The GPU branch of load_checkpoint (allocate, then set rows), with NumPy arrays as device memory."""

    device = "cuda"

    def __init__(self):
        self.arrays = {}

    def allocate(self, buffers):
        self.arrays.update({b.name: np.zeros(b.shape, b.dtype) for b in buffers})

    def set(self, name, array, row=0):
        self.arrays[name][row:row + len(array)] = array


def load_on_host(directory):
    return load_weights(directory)


def load_on_device(directory):
    load_checkpoint(CopyingBackend(), open_checkpoint(directory))


def read_tensor(directory):
    checkpoint = open_checkpoint(directory)
    for name in expected_shapes(checkpoint.config):
        checkpoint.tensor(name)


@pytest.mark.parametrize("load", [load_on_host, load_on_device, read_tensor])
@pytest.mark.parametrize("dtype, name, value, at", [
    ("float16", Q0, np.nan, (3, 5)),
    ("float16", V0, -np.inf, (15, 31)),
    ("float32", DOWN1, np.inf, (31, 47)),
    ("float32", Q0, np.nan, (0, 0)),
    ("bfloat16", DOWN1, np.inf, (7, 9)),
    ("bfloat16", UP1, np.nan, (47, 0)),
])
def test_non_finite_weight_is_refused_naming_tensor_and_element(tmp_path, monkeypatch, load, dtype, name, value, at):
    monkeypatch.setattr(checkpoint_module, "CHUNK", 100)  # several chunks per tensor: the element index is exact
    directory = write_random(tmp_path, SMALL, dtype=dtype)
    poison(directory, name, value, at, dtype)
    with pytest.raises(CheckpointError) as info:
        load(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory / WEIGHTS) in message and name in message
    assert f"{float(value)} at [{at[0]}, {at[1]}]" in message, message


def test_chunked_reads_fuse_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "CHUNK", 100)  # 3 rows of 32 at a time, tensors of 8 to 64 rows
    for dtype in ("float16", "bfloat16"):
        directory = write_random(tmp_path / dtype, SMALL, dtype=dtype, shards=2)
        assert_fused(load_weights(directory), read_all(write_random(tmp_path / "f32", SMALL, dtype="float32")),
                     rtol=0 if dtype == "float16" else 2.0 ** -8)
        backend = CopyingBackend()
        load_checkpoint(backend, open_checkpoint(directory))
        weights = load_weights(directory)
        assert np.array_equal(backend.arrays["layers.1.w_gate_up"], weights.layers[1].w_gate_up)
        assert np.array_equal(backend.arrays["lm_head"], weights.lm_head)
