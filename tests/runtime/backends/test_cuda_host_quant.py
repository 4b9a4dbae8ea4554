"""The CUDA backend's host code on quantized layouts (loading qweight / qparams / perm buffers, the synthetic fill
kernels, graph capture and replay, verify), end to end on the CPU: CuPy is tests/fake_cupy.py, whose kernels are
the NumPy twins, so every result must equal the numpy backend's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from cullama import Llama
from cullama.model import layout as layouts
from cullama.runtime.backends.cuda_backend import CudaBackend
from cullama.model.config import Quantization, preset
from cullama.kernels_cu import SOURCE_DIR
from tests.quant_checkpoints import CONFIG, write
from tests.runtime.backends.test_cuda_host import fake  # noqa: F401  (the fixture)

# The fake CuPy reads each kernel's parameters from its source: these run once kernels_cu holds the quantized kernels.
MISSING = sorted({"gemv_mma.cu", "gemm_quant.cu", "gather.cu"} - {p.name for p in SOURCE_DIR.glob("*.cu")})
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"kernels_cu has no {', '.join(MISSING)} yet (branch qkernels)")

GREEDY_40 = dict(max_new_tokens=40, ignore_eos=True)


def same_weights(gpu, cpu) -> None:
    for buffer in gpu.layout.buffers():
        np.testing.assert_array_equal(gpu.backend.read(buffer.name), cpu.backend.read(buffer.name),
                                      err_msg=buffer.name)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_on_load_equals_the_numpy_backend_bit_for_bit(fake, stories_dir, quantize):  # noqa: F811
    gpu = Llama.from_pretrained(stories_dir, device="cuda", quantize=quantize)
    cpu = Llama.from_pretrained(stories_dir, device="cpu", quantize=quantize)
    assert isinstance(gpu.runner.backend, CudaBackend)
    same_weights(gpu.runner, cpu.runner)
    out = gpu.generate([1], **GREEDY_40)
    assert out.token_ids == cpu.generate([1], **GREEDY_40).token_ids
    np.testing.assert_array_equal(gpu.runner.backend.read("logits"), cpu.runner.backend.read("logits"))
    assert gpu.generate([1], speculative="ngram", draft_tokens=4, **GREEDY_40).token_ids == out.token_ids


def test_an_act_order_checkpoint_equals_the_numpy_backend_bit_for_bit(fake, tmp_path):  # noqa: F811
    write(tmp_path, CONFIG, Quantization("gptq", 4, 64, "gptq", sym=False, desc_act=True))
    gpu, cpu = Llama.from_pretrained(tmp_path, device="cuda"), Llama.from_pretrained(tmp_path, device="cpu")
    assert "layers.0.wqkv.perm" in gpu.runner.backend.arrays
    same_weights(gpu.runner, cpu.runner)
    prompt = list(range(3, 40))
    np.testing.assert_array_equal(gpu.logits(prompt), cpu.logits(prompt))
    assert gpu.generate([1, 2, 3], **GREEDY_40).token_ids == cpu.generate([1, 2, 3], **GREEDY_40).token_ids


def test_synthetic_quantized_weights_are_made_on_the_device_as_on_the_cpu(fake):  # noqa: F811
    gpu = Llama.synthetic("tiny", device="cuda", quantize="int4", seed=4)
    cpu = Llama.synthetic("tiny", device="cpu", quantize="int4", seed=4)
    assert gpu.layout == layouts.on_load(preset("tiny"), "int4")
    same_weights(gpu.runner, cpu.runner)
    assert gpu.generate([5, 6, 7], **GREEDY_40).token_ids == cpu.generate([5, 6, 7], **GREEDY_40).token_ids
