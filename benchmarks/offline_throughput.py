"""Offline throughput: the nano-vllm workload through `LLM.generate`, side by side with HF transformers.

Workload (defaults): 256 requests, input and output lengths uniform in [100, 1024], seed 0, temperature 0.6,
ignore_eos; throughput = requested output tokens / wall time of one generate() (prefill included), after a short
warm-up. With no --model, a random-weight checkpoint with ZAYA1-8B widths (--layers of them) is written first. On
CUDA and for ZAYA1 the same prompts also go through HF transformers `generate` (static batches of --hf-batch,
left-padded), and the script prints both rates, their ratio and the decode bandwidth floor. Results also go to
--out as JSON.

    python benchmarks/offline_throughput.py --layers 8 --num-requests 64 --max-input 512 --max-output 256
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.demo import copy_bundled_tokenizer, write_random_checkpoint

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy bandwidth measured on the lent machines (KINDS.md)


def zaya1_8b_config(layers: int) -> dict:
    return {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"], "torch_dtype": "bfloat16", "vocab_size": 262272,
        "hidden_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "moe_intermediate_size": 2048, "num_experts": 16, "num_experts_per_tok": 1,
        "router_hidden_size": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "eos_token_id": 106, "pad_token_id": 0, "bos_token_id": 2,
    }


def workload(args) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 20000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_requests)]
    return prompts, [rng.randint(args.min_output, args.max_output) for _ in prompts]


def run_ours(model_dir: str, prompts, outputs, args) -> float:
    llm = LLM(model_dir, dtype="bfloat16", device=args.device, max_running_requests=args.max_running_requests)
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(outputs)]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2])  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    assert [len(r.outputs[0].token_ids) for r in results] == outputs
    return sum(outputs) / elapsed


def run_hf(model_dir: str, prompts, outputs, args) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    model.generation_config.eos_token_id = None
    batches = [list(range(i, min(i + args.hf_batch, len(prompts)))) for i in range(0, len(prompts), args.hf_batch)]
    _hf_generate(model, [prompts[0]], 2, args)  # warm-up
    _sync(args.device)
    start = time.perf_counter()
    for batch in batches:
        _hf_generate(model, [prompts[i] for i in batch], max(outputs[i] for i in batch), args)
    _sync(args.device)
    return sum(outputs) / (time.perf_counter() - start)


def _hf_generate(model, prompts, new_tokens: int, args) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, pad_token_id=0)


def zaya_decode_floor(config: dict, batch: int, context: int) -> float:
    """Tokens/s if one decode step only had to move its bytes at HBM speed (users_and_perf.md §3.4)."""
    h, layers, e = config["hidden_size"], config["num_hidden_layers"], config["num_experts"]
    cca = h * 1024 + h * 256 + 2 * h * 128 + 1024 * h
    router = h * 256 + 2 * 256 * 256 + 256 * (e + 1)
    expert = 3 * h * config["moe_intermediate_size"]
    touched = e * (1 - (1 - 1 / e) ** batch)
    weights = 2 * (layers * (cca + router + touched * expert) + config["vocab_size"] * h)
    kv = batch * context * layers * 512 * 2
    return batch / ((weights + kv) / HBM_BYTES_PER_S)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF-layout directory (default: random ZAYA1-8B widths)")
    parser.add_argument("--layers", type=int, default=40, help="layers of the random ZAYA1-8B-shaped model")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=100)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=100)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hf-batch", type=int, default=64, help="static batch size for HF generate")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="zaya8b-")
        write_random_checkpoint(Path(model_dir), zaya1_8b_config(args.layers))
        copy_bundled_tokenizer(Path(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    prompts, outputs = workload(args)
    result = {"model": model_dir, "layers": config["num_hidden_layers"], "requests": len(prompts),
              "input_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs), "device": args.device}
    result["ours_tok_s"] = run_ours(model_dir, prompts, outputs, args)
    print(f"hybridserve: {result['ours_tok_s']:.1f} output tok/s")
    if args.device.startswith("cuda") and config["model_type"] == "zaya" and not args.skip_hf:
        result["hf_tok_s"] = run_hf(model_dir, prompts, outputs, args)
        result["ratio"] = result["ours_tok_s"] / result["hf_tok_s"]
        context = (args.min_input + args.max_input) // 2 + (args.min_output + args.max_output) // 4
        result["floor_tok_s"] = {b: zaya_decode_floor(config, b, context) for b in (1, 64, args.max_running_requests)}
        print(f"HF transformers (batch {args.hf_batch}): {result['hf_tok_s']:.1f} output tok/s -> "
              f"hybridserve / HF = {result['ratio']:.2f}x")
        print("decode bandwidth floor (tok/s at batch: " +
              ", ".join(f"{b}: {v:.0f}" for b, v in result["floor_tok_s"].items()) + f"; context ~{context})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
