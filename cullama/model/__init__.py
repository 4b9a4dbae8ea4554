"""The model on disk and in host memory: config, checkpoint readers (safetensors, AWQ, GPTQ), the quantized
format, the device layout, the weights, and the FP32 reference."""
