"""The benchmarks of record: `cullama bench` (latency, batch, speculative) and `cullama kernels`."""
