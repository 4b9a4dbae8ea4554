"""The public API: `Llama.from_pretrained(path)`, then `generate`, `stream` and `logits`.

    llm = cullama.Llama.from_pretrained("path/to/llama-2-7b-hf")
    print(llm.generate("The capital of France is", max_new_tokens=20).text)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import checkpoint, device as devices
from .config import LlamaConfig, from_pretrained as read_config, preset
from .errors import PromptError
from .generate import Generation, GenerationStream, Runner
from .backends import make_backend
from .engine import PlanRunner
from .weights import load_checkpoint, random_weights
from .sampling import SamplingParams
from .tokenizer import Tokenizer

Progress = Callable[[int, int], None]  # (bytes done, bytes total) while weights load


class Llama:
    """A loaded model on one device, with its tokenizer when the checkpoint has one."""

    def __init__(self, config: LlamaConfig, runner: Runner, tokenizer: Tokenizer | None, device: str,
                 notes: Sequence[str] = ()):
        self.config, self.runner, self.tokenizer, self.device = config, runner, tokenizer, device
        self.notes = list(notes)  # things the user should hear once (e.g. a dtype conversion)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str = "auto", max_seq_len: int | None = None,
                        tokenizer: str | os.PathLike | None = None, progress: Progress | None = None) -> "Llama":
        """Load an HF-format LLaMA checkpoint directory (safetensors) onto `device` ("auto", "cpu", "cuda")."""
        device = devices.resolve(device)
        config = read_config(path)
        seq_len = _context(config, max_seq_len)
        tok = None
        if tokenizer is not None or (Path(path) / "tokenizer.model").is_file():
            tok = Tokenizer.from_model_dir(path, override=tokenizer)
        ckpt = checkpoint.open_checkpoint(path, config)
        notes = [ckpt.conversion_note] if ckpt.conversion_note else []
        return cls(config, _make_runner(device, ckpt, seq_len, progress), tok, device, notes)

    @classmethod
    def synthetic(cls, config: LlamaConfig | str, device: str = "auto", max_seq_len: int | None = None,
                  seed: int = 0) -> "Llama":
        """Random weights of a preset's (or any config's) shape, made on the device: no download.
        For benchmarks; there is no tokenizer, so prompts are token ids."""
        config = preset(config) if isinstance(config, str) else config
        device = devices.resolve(device)
        backend = make_backend(device)
        random_weights(backend, config, seed)
        return cls(config, PlanRunner(config, backend, _context(config, max_seq_len)), None, device)

    # -- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Text -> ids with BOS (an empty text is BOS alone); a list of ids is taken as it is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer.model: pass token ids, or name one with --tokenizer")
            return self.tokenizer.encode(prompt, bos=True)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def chat_ids(self, messages: list[dict], system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise PromptError("--chat needs a tokenizer.model")
        return self.tokenizer.chat_ids(messages, system=system)

    # -- generation ------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
               stop: Sequence[str] = (), ignore_eos: bool = False, reuse_cache: bool = False) -> GenerationStream:
        """Iterate over text pieces as they become final; the stream's `.result` is the Generation.

        reuse_cache: skip the prompt prefix the KV cache still holds from the last generation (a chat
        turn then prefills only what is new); off by default, since reused K and V can differ from a
        fresh prefill's in the last FP16 bit."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty, seed=seed)
        params.validate()
        if isinstance(stop, str):
            stop = (stop,)
        detok = self.tokenizer.stream_decoder() if self.tokenizer else None
        return GenerationStream(self.runner, detok, self.encode(prompt), max_new_tokens, params, stop,
                                self.config.eos_token_ids, ignore_eos, reuse_cache)

    def generate(self, prompt: str | Sequence[int], **options) -> Generation:
        """Generate to the end; same options as `stream`."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the logits at every position (resets the KV cache)."""
        ids = self.encode(list(token_ids))
        if not ids:
            raise PromptError("logits() needs at least one token id")
        if len(ids) > self.runner.max_seq_len:
            raise PromptError(f"{len(ids)} tokens do not fit in the context of {self.runner.max_seq_len}")
        return np.asarray(self.runner.logits(ids), dtype=np.float32)


def _context(config: LlamaConfig, max_seq_len: int | None) -> int:
    if max_seq_len is None:
        return config.max_seq_len
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise PromptError(f"--max-seq-len must be an integer >= 2, got {max_seq_len!r}")
    return max_seq_len


def _make_runner(device: str, ckpt: checkpoint.Checkpoint, max_seq_len: int, progress: Progress | None) -> Runner:
    """The same plans on either device: CUDA kernels on a GPU, their NumPy twins on the CPU."""
    backend = make_backend(device)
    load_checkpoint(backend, ckpt, progress)
    return PlanRunner(ckpt.config, backend, max_seq_len)
