"""Accuracy of quantized models, on the CPU (no GPU needed): docs/quantization.md's tables, from ../shared's
checkpoints.

    python benchmarks/quant_accuracy.py [--shared DIR] [--sample-tokens N]

- The AWQ and GPTQ goldens (packed by AutoAWQ's and AutoGPTQ's own code): the largest difference between cullama's
  prompt logits and HuggingFace's FP32 logits on the weights as those projects dequantize them, relative to the
  largest logit, and the greedy tokens that agree with HuggingFace's before the first difference.
- int8 and int4 quantized on load against FP16 on the same checkpoint (tiny-mha, tiny-gqa-sharded, stories260K): the
  largest logit deviation (relative to the largest FP16 logit) and its rms, on the same ids (a prompt and FP16's
  greedy continuation; stories260K: its documented greedy text); the share of those positions whose top-1 token
  agrees with FP16's; and how many greedy tokens agree before the first difference.
- stories260K's perplexity in FP16, int8 and int4 on two texts: its documented greedy output (real English as the
  model writes it, so a low, optimistic perplexity) and a sample of the FP16 model at temperature 1 (seed 1234):
  the model's own distribution, so the perplexity is about exp(its entropy), and quantization can only raise it
  on average. Its tokenizer cannot encode other text as the model was trained (shared/models/stories260K/README.md).
Everything runs through the public API (Llama.logits, Llama.generate), so the numbers are what a user gets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import cullama

PROMPT = [1, 5, 9, 33, 77, 100, 42]  # ids every golden's vocabulary holds
QUANTIZE = ("int8", "int4")


def deviation(base, quantized, ids) -> tuple[float, float, float]:
    """(max |logit difference| / max |FP16 logit|, rms difference, share of positions with the same top-1) of two
    models on the same ids."""
    a, b = base.logits(ids), quantized.logits(ids)
    return (float(np.abs(a - b).max() / np.abs(a).max()), float(np.sqrt(np.mean((a - b) ** 2))),
            float(np.mean(a.argmax(-1) == b.argmax(-1))))


def perplexity(llm, ids) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each given the ones before it (float64 log-softmax)."""
    logits = llm.logits(ids).astype(np.float64)[:-1]
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    return float(np.exp(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))


def same_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def golden_rows(shared: Path) -> list[str]:
    rows = []
    for name in ("tiny-awq-g64", "tiny-gptq-asym-g128"):
        directory = shared / "golden" / name
        cases = json.loads((shared / "golden" / f"{name}.golden.json").read_text())["cases"]
        llm = cullama.Llama.from_pretrained(directory, device="cpu")
        with np.load(shared / "golden" / f"{name}.golden.npz") as npz:
            worst = max(float(np.abs(llm.logits(c["prompt_ids"]) - npz[c["logits_key"]]).max()
                              / np.abs(npz[c["logits_key"]]).max()) for c in cases)
        agree = sum(same_prefix(llm.generate(c["prompt_ids"], max_new_tokens=24, ignore_eos=True).token_ids,
                                c["greedy_ids"]) for c in cases)
        rows.append(f"| {name} | {llm.layout.describe()} | {worst:.4f} | {agree} of {24 * len(cases)} |")
    return rows


def on_load_rows(shared: Path) -> list[str]:
    rows = []
    stories = shared / "models" / "stories260K"
    documented = json.loads((stories / "expected_greedy.json").read_text())
    for directory in (shared / "golden" / "tiny-mha", shared / "golden" / "tiny-gqa-sharded", stories):
        base = cullama.Llama.from_pretrained(directory, device="cpu")
        if directory == stories:
            prompt, n = documented["prompt_ids"], len(documented["ids"])
        else:
            prompt, n = PROMPT, 24
        greedy = base.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids
        ids = prompt + (documented["ids"] if directory == stories else greedy)
        for quantize in QUANTIZE:
            llm = cullama.Llama.from_pretrained(directory, device="cpu", quantize=quantize)
            worst, rms, top1 = deviation(base, llm, ids)
            agree = same_prefix(llm.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids, greedy)
            rows.append(f"| {directory.name} | {llm.layout.describe()} | {worst:.4f} | {rms:.4f} | {top1:.3f} | "
                        f"{agree} of {n} |")
    return rows


def perplexity_rows(shared: Path, sample_tokens: int) -> list[str]:
    stories = shared / "models" / "stories260K"
    documented = json.loads((stories / "expected_greedy.json").read_text())
    text = documented["prompt_ids"] + documented["ids"]
    base = cullama.Llama.from_pretrained(stories, device="cpu")
    sample = [1] + base.generate([1], max_new_tokens=sample_tokens, temperature=1.0, seed=1234,
                                 ignore_eos=True).token_ids
    rows = []
    for quantize in (None, *QUANTIZE):
        llm = base if quantize is None else cullama.Llama.from_pretrained(stories, device="cpu", quantize=quantize)
        rows.append(f"| {llm.layout.describe()} | {perplexity(llm, text):.3f} | {perplexity(llm, sample):.3f} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", type=Path, default=Path(__file__).resolve().parents[2] / "shared",
                        help="the shared test data [default: ../shared beside the repo]")
    parser.add_argument("--sample-tokens", type=int, default=400, help="tokens of the sampled text [default: 400]")
    args = parser.parse_args(argv)
    print("| golden | weights | max logit difference / max logit | greedy tokens agreeing before the first "
          "difference |\n| --- | --- | --- | --- |")
    print("\n".join(golden_rows(args.shared)))
    print("\n| checkpoint | weights | max logit deviation / max logit | rms deviation | top-1 agreement | "
          "greedy tokens agreeing before the first difference |\n| --- | --- | --- | --- | --- | --- |")
    print("\n".join(on_load_rows(args.shared)))
    print("\n| stories260K | perplexity, documented greedy text (257 ids) | perplexity, sampled text "
          f"({args.sample_tokens + 1} ids) |\n| --- | --- | --- |")
    print("\n".join(perplexity_rows(args.shared, args.sample_tokens)))


if __name__ == "__main__":
    main()
