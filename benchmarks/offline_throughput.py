"""Offline throughput: hybridserve `LLM.generate` side by side with HF transformers, in one run, on one checkpoint.

Scenarios (`--scenarios`, run in order on the same checkpoint; throughput = requested output tokens / wall time of
one generate() call, prefill included, after a warm-up; temperature 0.6, ignore_eos):
  b1     1 request, prompt 512, 128 new tokens (batch-1 decode)
  b64    64 requests, prompts uniform in [100, 512], 128 new tokens
  nano   nano-vllm's workload: 256 requests, prompt and output lengths uniform in [100, 1024]
With no --model, a random-weight checkpoint with ZAYA1-8B widths (--layers of them, 40 = the real depth) is written
first and deleted at the end. On CUDA and for ZAYA1 the same prompts also go through HF transformers `generate`
(static batches of up to 64, left-padded, after our engine has been freed), and the script prints both rates,
their ratio and the decode bandwidth floor of each scenario. Results also go to --out as JSON.

    python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 --out results.json
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.demo import copy_bundled_tokenizer, write_random_checkpoint

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy bandwidth measured on the lent machines (KINDS.md)


@dataclass(frozen=True)
class Scenario:
    requests: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int


SCENARIOS = {"b1": Scenario(1, 512, 512, 128, 128), "b64": Scenario(64, 100, 512, 128, 128),
             "nano": Scenario(256, 100, 1024, 100, 1024)}


def zaya1_8b_config(layers: int) -> dict:
    return {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"], "torch_dtype": "bfloat16", "vocab_size": 262272,
        "hidden_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "moe_intermediate_size": 2048, "num_experts": 16, "num_experts_per_tok": 1,
        "router_hidden_size": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "eos_token_id": 106, "pad_token_id": 0, "bos_token_id": 2,
    }


def workload(scenario: Scenario, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 20000) for _ in range(rng.randint(scenario.min_input, scenario.max_input))]
               for _ in range(scenario.requests)]
    return prompts, [rng.randint(scenario.min_output, scenario.max_output) for _ in prompts]


def run_ours(model_dir: str, workloads: dict, args) -> dict[str, float]:
    llm = LLM(model_dir, use_tqdm=False, dtype="bfloat16", device=args.device,
              max_running_requests=args.max_running_requests, enforce_eager=args.enforce_eager)
    rates = {}
    for name, (prompts, outputs) in workloads.items():
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i)
                  for i, n in enumerate(outputs)]
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2])  # warm-up
        _sync(args.device)
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _sync(args.device)
        elapsed = time.perf_counter() - start
        assert [len(r.outputs[0].token_ids) for r in results] == outputs
        rates[name] = sum(outputs) / elapsed
        print(f"hybridserve {name}: {rates[name]:.1f} output tok/s", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return rates


def run_hf(model_dir: str, workloads: dict, args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    model.generation_config.eos_token_id = None
    rates = {}
    for name, (prompts, outputs) in workloads.items():
        size = min(args.hf_batch, len(prompts))
        batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
        _hf_generate(model, [prompts[0]], 2, args)  # warm-up
        _sync(args.device)
        start = time.perf_counter()
        for batch in batches:
            _hf_generate(model, [prompts[i] for i in batch], max(outputs[i] for i in batch), args)
        _sync(args.device)
        rates[name] = sum(outputs) / (time.perf_counter() - start)
        print(f"HF transformers {name} (static batches of {size}): {rates[name]:.1f} output tok/s", flush=True)
    return rates


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
    parser.add_argument("--scenarios", nargs="+", default=["b1", "b64"], choices=list(SCENARIOS))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hf-batch", type=int, default=64, help="largest static batch for HF generate")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="our engine without CUDA graphs")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()

    model_dir, temporary = args.model, args.model is None
    if temporary:
        model_dir = tempfile.mkdtemp(prefix="zaya8b-")
        write_random_checkpoint(Path(model_dir), zaya1_8b_config(args.layers))
        copy_bundled_tokenizer(Path(model_dir))
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        workloads = {name: workload(SCENARIOS[name], args.seed) for name in args.scenarios}
        result = {"model": model_dir, "layers": config["num_hidden_layers"], "device": args.device,
                  "cuda_graphs": not args.enforce_eager,
                  "scenarios": {name: {"requests": len(p), "input_tokens": sum(map(len, p)),
                                       "output_tokens": sum(o)} for name, (p, o) in workloads.items()}}
        for name, rate in run_ours(model_dir, workloads, args).items():
            result["scenarios"][name]["ours_tok_s"] = rate
        if args.device.startswith("cuda") and config["model_type"] == "zaya" and not args.skip_hf:
            for name, rate in run_hf(model_dir, workloads, args).items():
                entry = result["scenarios"][name]
                entry["hf_tok_s"], entry["ratio"] = rate, entry["ours_tok_s"] / rate
                sc = SCENARIOS[name]
                context = (sc.min_input + sc.max_input) // 2 + (sc.min_output + sc.max_output) // 4
                entry["floor_tok_s"] = zaya_decode_floor(config, min(sc.requests, args.max_running_requests),
                                                         context)
        print(f"{'scenario':<9} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'floor tok/s':>12} {'of floor':>9}")
        for name, e in result["scenarios"].items():
            if "hf_tok_s" in e:
                print(f"{name:<9} {e['ours_tok_s']:>11.1f} {e['hf_tok_s']:>10.1f} {e['ratio']:>7.2f}x "
                      f"{e['floor_tok_s']:>12.0f} {e['ours_tok_s'] / e['floor_tok_s']:>8.1%}")
            else:
                print(f"{name:<9} {e['ours_tok_s']:>11.1f}")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
