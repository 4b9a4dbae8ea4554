"""Backends run plans: `numpy` with the kernels' NumPy twins on the CPU, `cuda` with CuPy on a GPU.

Both hold the same named buffers (plan.weight_buffers + plan.runtime_buffers) and answer:
    allocate(buffers), set(name, array, row=0), read(name), run(plan), replay(plan), read_token()
`replay` is how the decode step runs: the cuda backend captures it once as a CUDA graph.
read_token() and token(slot) raise GenerationError where the sample kernel found no token to draw (every logit
NaN or -inf: cullama.runtime.sampling.NO_TOKEN).
"""


def make_backend(device: str):
    if device == "cuda":
        from .cuda_backend import CudaBackend

        return CudaBackend()
    from .numpy_backend import NumpyBackend

    return NumpyBackend()
