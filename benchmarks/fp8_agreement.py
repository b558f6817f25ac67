"""FP8 numerics on CUDA: how often the FP8 engine's tokens are the fp32 model's argmax, beside bf16's own rate.

For ZAYA1-8B widths (2 layers, the margins of tests/gpu/test_zaya_gpu.py) and Ling-2.6-flash widths (2 layers:
lightning + dense FFN, MLA + 256-expert MoE), random weights scaled by fan-in, stored in bf16: the oracle is the
same checkpoint in fp32 with every op on its torch reference, teacher-forced over each run's tokens (prompt
positions: top-1 of the prompt logprobs; decode: the greedy picks). The engines: bf16, online FP8
(`quantization="fp8"`: per-channel weight scales, per-token activations) and, for the block layout, the same
weights quantized to a 128x128 block-FP8 checkpoint. The issue's bar: FP8 within 5 points of bf16 on both.

    python benchmarks/fp8_agreement.py [--out results.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ling_decode_agreement import generate, oracle_top1  # noqa: E402
from hybridserve import LLM  # noqa: E402
from hybridserve.demo import write_random_checkpoint  # noqa: E402
from tests.gpu.test_zaya_gpu import ZAYA1_8B_SHAPED, margins_like_a_trained_model  # noqa: E402
from tests.helpers import add_tokenizer  # noqa: E402
from tests.models.fp8_fixtures import LING_QUANTIZED, ZAYA_QUANTIZED, quantize_checkpoint  # noqa: E402
from tests.reference.ling_naive import flash_config, random_ling_checkpoint, write_checkpoint  # noqa: E402

PROMPT_LENGTHS = (33, 97, 211, 300)
COMMON = dict(device="cuda", max_model_len=1024, enable_prefix_caching=False, gpu_memory_utilization=0.3)


def checkpoint(model: str, directory: Path) -> Path:
    """The bf16 random checkpoint of `model` with a tokenizer."""
    if model == "zaya":
        write_random_checkpoint(directory, ZAYA1_8B_SHAPED | {"num_hidden_layers": 2},
                                adjust=margins_like_a_trained_model)
    else:
        config = flash_config(vocab_size=32768, max_position_embeddings=4096)
        write_checkpoint(directory, config, {n: t.bfloat16() for n, t in random_ling_checkpoint(config, 0).items()})
    add_tokenizer(directory)
    return directory


def agreement(engine: LLM, oracle: LLM, prompts: list[list[int]]) -> dict[str, float]:
    """Top-1 agreement with the oracle on prompt positions and on the greedy decode."""
    hits = {"prefill": [0, 0], "decode": [0, 0]}
    for prompt, (tokens, prompt_top1) in zip(prompts, generate(engine, prompts)):
        expected = oracle_top1(oracle, prompt + tokens[:-1])
        for kind, got, want in (("prefill", prompt_top1, expected[:len(prompt) - 1]),
                                ("decode", tokens, expected[len(prompt) - 1:])):
            hits[kind][0] += sum(a == b for a, b in zip(got, want))
            hits[kind][1] += len(got)
    return {kind: h / n for kind, (h, n) in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", nargs="+", default=["zaya", "ling"], choices=["zaya", "ling"])
    args = parser.parse_args()
    rows = []
    for model in args.models:
        root = Path(tempfile.mkdtemp(prefix=f"fp8-agreement-{model}-"))
        source = checkpoint(model, root / "bf16")
        quantize_checkpoint(source, root / "block", root / "block-oracle", "block",
                            ZAYA_QUANTIZED if model == "zaya" else LING_QUANTIZED)
        add_tokenizer(root / "block")
        gen = torch.Generator().manual_seed(0)
        vocab = json.loads((source / "config.json").read_text())["vocab_size"]
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        oracle = LLM(str(source), dtype="float32", kernel_backend="torch", **COMMON)
        for name, directory, options in (("bf16", source, {}), ("fp8 online", source, {"quantization": "fp8"}),
                                         ("fp8 block", root / "block", {})):
            engine = LLM(str(directory), dtype="bfloat16", **COMMON, **options)
            rates = agreement(engine, oracle, prompts)
            rows.append({"model": model, "engine": name, **rates})
            print(f"{model:<5} {name:<11} prefill top-1 {rates['prefill']:6.1%}  decode {rates['decode']:6.1%}",
                  flush=True)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        del oracle
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"prompt_lengths": PROMPT_LENGTHS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
