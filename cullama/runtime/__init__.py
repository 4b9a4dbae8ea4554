"""Running the model: kernels compiled (registry), the device, plans (launches as data), the engine, the
backends (CUDA, NumPy twins), the kernels' twins (ops), the CPU executor (emu) and the sampling
specification the sample kernel implements."""
