"""The token loops over a runner: generate / stream, speculative decoding and its drafters, batches."""
