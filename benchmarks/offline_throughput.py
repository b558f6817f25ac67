"""Offline throughput: hybridserve `LLM.generate` side by side with HF transformers, in one run, on one model.

Scenarios (`--scenarios`, run in order on the same model; throughput = requested output tokens / wall time of one
generate() call, prefill included, after a warm-up; ours: the median of `--repeats` such calls (default 5; a 128-step
batch-1 run varied by +-7% from call to call on the H200), every call's rate in the JSON; temperature 0.6,
ignore_eos):
  b1       1 request, prompt 512, 128 new tokens (batch-1 decode)
  b16      16 requests, prompts uniform in [100, 512], 128 new tokens
  b64      64 requests, prompts uniform in [100, 512], 128 new tokens
  nano     nano-vllm's workload: 256 requests, prompt and output lengths uniform in [100, 1024]
  prefill  64 prompts x 512 tokens, 1 new token: reported as prefill (prompt) tok/s
  smoke    2 requests, prompts of 16-32 tokens, 4 new tokens (a quick check that the script runs, e.g. on CPU)
Prefix caching is off in our engine: the warm-up and every repeat send the same prompts, and a cached prompt would
skip its prefill (the prefill scenario measured 4x its real rate that way).
With no --model, a random model of `--model-type` is made in a temporary directory (deleted at the end): ZAYA1-8B
widths (`--layers`, default 40 = the real depth) or Ling-2.6-flash widths (`--layers` a multiple of its layer group
of 8, default 32: 7 lightning layers then one MLA layer per group); `--width demo` takes the demo checkpoints' tiny
widths instead (CPU smoke tests). `--load-format dummy` (the default for Ling, whose checkpoint would not fit on
disk) writes only config.json and the tokenizer and has the engine draw random weights on the device; `auto`
writes a random safetensors checkpoint first. Every decode scenario reports its bandwidth floor (the bytes one
decode step must move over HBM bandwidth); on CUDA and for ZAYA1 the same prompts also go through HF transformers
`generate` (static batches of up to 64, left-padded, after our engine has been freed); Ling-2.6 has no HF model
class here (n/a). Results also go to --out as JSON. `--json-grammar` runs each of our scenarios a second time with
a JSON schema on every request (an array of at least 100000 short strings, so every draw stays masked to its last
token) and reports both rates: with no grammar, structured output must cost nothing.

FP8 (e4m3 weights, W8A8): `--quantization fp8` has our engine quantize the model's projections and experts as they
load (per-channel scales; with dummy weights, random FP8 ones); `--fp8-checkpoint channel|block` writes the random
model's config.json with the quantization_config of a compressed-tensors per-channel or a block-FP8 checkpoint
(load format dummy: Ling-2.6-flash FP8 at full size without its 108 GB). The floors then count one byte per FP8
weight. `--compare-bf16` runs our engine on the 16-bit weights too, in the same run, and reports FP8 / bf16.

Speculative decoding (`--speculative-algorithm NGRAM|NEXTN --speculative-num-draft-tokens K`, K defaults to 4; NEXTN
gives the random Ling model its MTP layer): every decode scenario runs three engines on the same prompts, plain
(overlap and CUDA graphs as usual), speculative (its acceptance rate and accepted length from the same run) and
forced acceptance: drafts replayed from the plain run's outputs (keyed by prompt) and every one accepted
(`set_draft_source(..., force_acceptance=True)`), so its rate is the upper bound speculation can reach, i.e. what
verification costs (with NEXTN the MTP layer still drafts, as it would). Accepting by the target's own draws would
not do: verify rows round differently from plain decode rows in bf16 (other kernels and GEMM shapes), and on a
random model whose top logits nearly tie, a row whose draw differs from the replayed token once has every later
draft rejected (Ling-2.6-flash at batch 16 accepted 12% of the plain run's own tokens that way).

    python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 prefill --out results.json
    python benchmarks/offline_throughput.py --model-type ling --layers 16 --scenarios b1 b64 prefill
    python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 --json-grammar --skip-hf
    python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b16 --temperature 0 --skip-hf \\
        --speculative-algorithm NGRAM --speculative-num-draft-tokens 4
    python benchmarks/offline_throughput.py --layers 40 --scenarios b1 b64 --quantization fp8 --compare-bf16 --skip-hf
    python benchmarks/offline_throughput.py --model-type ling --mtp-layer --fp8-checkpoint block --scenarios b1 b64 prefill
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import shutil
import statistics
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: hybridserve, tests.reference

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.demo import (  # noqa: E402
    copy_bundled_tokenizer,
    demo_ling_config,
    demo_zaya_config,
    write_random_checkpoint,
)
from hybridserve.engine.drafts import ReplayDrafts  # noqa: E402
from hybridserve.models.ling_config import parse_ling_config  # noqa: E402
from hybridserve.structured import StructuredOutputParams  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy bandwidth measured on the lent machines (KINDS.md)


@dataclass(frozen=True)
class Scenario:
    requests: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    prefill: bool = False  # rate = prompt tokens / s (else output tokens / s)


SCENARIOS = {"b1": Scenario(1, 512, 512, 128, 128), "b16": Scenario(16, 100, 512, 128, 128),
             "b64": Scenario(64, 100, 512, 128, 128),
             "nano": Scenario(256, 100, 1024, 100, 1024), "prefill": Scenario(64, 512, 512, 1, 1, prefill=True),
             "smoke": Scenario(2, 16, 32, 4, 4)}
DEMO_VOCAB, DEMO_EOS = 151680, [151645]  # the bundled tokenizer's (the demo checkpoints' widths)
# --json-grammar: a JSON language no output completes within the budgets above, so every draw is masked.
BENCH_GRAMMAR = StructuredOutputParams(json={"type": "array", "items": {"type": "string", "maxLength": 16},
                                             "minItems": 100000})


def zaya1_8b_config(layers: int) -> dict:
    return {
        "model_type": "zaya", "architectures": ["ZayaForCausalLM"], "torch_dtype": "bfloat16", "vocab_size": 262272,
        "hidden_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "moe_intermediate_size": 2048, "num_experts": 16, "num_experts_per_tok": 1,
        "router_hidden_size": 256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "eos_token_id": 106, "pad_token_id": 0, "bos_token_id": 2,
    }


def ling_flash_config(layers: int, mtp: bool = False) -> dict:
    """Ling-2.6-flash: the widths of tests/reference/ling_naive.flash_config, its real vocabulary and layer groups
    of 8 (MLA layers 7, 15, ...), `layers` main layers, and its MTP layer only if `mtp` (the drafts of NEXTN)."""
    from tests.reference.ling_naive import flash_config

    return flash_config(num_hidden_layers=layers, layer_group_size=8, vocab_size=157184, torch_dtype="bfloat16",
                        max_position_embeddings=131072, eos_token_id=[156892, 156895], pad_token_id=156892,
                        num_nextn_predict_layers=int(mtp))


def model_config(model_type: str, width: str, layers: int | None, mtp: bool = False) -> dict:
    """The random model's config.json: full widths or the demo checkpoints' tiny ones, with `layers` layers (Ling:
    and its MTP layer if `mtp`)."""
    if model_type == "zaya":
        layers = layers or 40
        if width == "full":
            return zaya1_8b_config(layers)
        return demo_zaya_config(DEMO_VOCAB, DEMO_EOS) | {"num_hidden_layers": layers,
                                                         "layer_types": ["hybrid"] * layers}
    layers = layers or 32
    if width == "full":
        return ling_flash_config(layers, mtp)
    return demo_ling_config(DEMO_VOCAB, DEMO_EOS) | {"num_hidden_layers": layers, "num_nextn_predict_layers": int(mtp)}


FP8_CHECKPOINTS = {  # --fp8-checkpoint -> the quantization_config a checkpoint of that layout carries
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "symmetric": True,
                                                       "dynamic": False, "strategy": "channel"},
                    "input_activations": {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": True,
                                          "strategy": "token"}}}},
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def make_random_model(model_type: str, width: str, layers: int | None, load_format: str, mtp: bool = False,
                      fp8_checkpoint: str | None = None) -> str:
    """A temporary directory (the caller deletes it) with the random model of `model_config` and the bundled
    tokenizer: config.json alone for load_format dummy (the engine draws the weights), else a random checkpoint.
    `fp8_checkpoint` (dummy only): config.json says the weights are FP8 in that layout."""
    model_dir = tempfile.mkdtemp(prefix=f"{model_type}-bench-")
    config = model_config(model_type, width, layers, mtp)
    if fp8_checkpoint is not None:
        config["quantization_config"] = FP8_CHECKPOINTS[fp8_checkpoint]
    if load_format == "dummy":
        (Path(model_dir) / "config.json").write_text(json.dumps(config, indent=2))
    else:
        write_random_checkpoint(Path(model_dir), config)
    copy_bundled_tokenizer(Path(model_dir))
    return model_dir


def workload(scenario: Scenario, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 20000) for _ in range(rng.randint(scenario.min_input, scenario.max_input))]
               for _ in range(scenario.requests)]
    return prompts, [rng.randint(scenario.min_output, scenario.max_output) for _ in prompts]


SPEC_STATS = ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens")


def run_ours(model_dir: str, workloads: dict, args, speculative: dict | None = None,
             forced: dict[str, list[list[int]]] | None = None, quantization: str | None = None) -> dict[str, dict]:
    """Per scenario (and per `name+json` with --json-grammar, without speculation): tok/s, the generated tokens,
    and with `speculative` the acceptance measured on the timed run. `forced` (per scenario, the outputs of a plain
    run): drafts replayed from them, keyed by prompt, and every one accepted. `quantization`: the engine's option
    (online FP8)."""
    llm = LLM(model_dir, use_tqdm=False, dtype=args.dtype, device=args.device, load_format=args.load_format,
              quantization=quantization,
              max_running_requests=args.max_running_requests, enforce_eager=args.enforce_eager, seed=args.seed,
              prefill_graph_max_tokens=args.prefill_graph_max_tokens,
              tensor_parallel_size=args.tp, speculative_config=speculative,
              enable_prefix_caching=False)  # the repeats and the warm-up reuse the prompts: no cached prefill
    kind = "" if speculative is None else " speculative" + (" forced" if forced else "")
    results = {}
    for name, (prompts, outputs) in workloads.items():
        for grammar in (None, BENCH_GRAMMAR) if args.json_grammar and speculative is None else (None,):
            params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i,
                                     structured_output=grammar) for i, n in enumerate(outputs)]
            label = name if grammar is None else f"{name}+json"
            if forced is not None:
                llm.engine.set_draft_source(ReplayDrafts({tuple(p): t for p, t in zip(prompts, forced[name])},
                                                         key=lambda request: tuple(request.prompt_token_ids)),
                                            force_acceptance=True)
            entry = results[label] = _timed_run(llm, name, prompts, outputs, params, args, speculative is not None)
            line = f"hybridserve{kind} {label}: {entry['tok_s']:.1f} {_unit(name)}"
            if speculative is not None:
                line += f", acceptance {_ratio(entry['acceptance_rate'])}, {entry['verify_rows']} verifying " \
                        "request-steps"
            print(line, flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return results


def _timed_run(llm: LLM, name: str, prompts: list[list[int]], outputs: list[int], params: list[SamplingParams],
               args, speculative: bool) -> dict:
    """`--repeats` timed generates after a two-request warm-up (and grammar compile): the median tok/s (and every
    run's), the generated tokens, and with speculation the runs' acceptance rate, tokens per verifying
    request-step and the number of those."""
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2])
    before = llm.engine.stats()
    rates, gpu, collections = [], [], []
    for _ in range(args.repeats):
        _sync(args.device)
        with GCPauses() as pauses:
            start = time.perf_counter()
            generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            _sync(args.device)
            rates.append(_tokens(name, prompts, outputs) / (time.perf_counter() - start))
        collections.append(pauses.summary())
        gpu.append(_gpu_state(args.device))
        tokens = [r.outputs[0].token_ids for r in generated]
        assert [len(t) for t in tokens] == outputs
    entry = {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens": tokens, "gc_runs": collections}
    if any(gpu):
        entry["gpu_after_runs"] = gpu
    if speculative:
        rows, drafts, accepted = (llm.engine.stats()[k] - before[k] for k in SPEC_STATS)
        # Tokens a verifying request gains per step (accepted drafts + the bonus); None: nothing verified.
        entry["acceptance_rate"] = accepted / drafts if drafts else None
        entry["mean_accept_length"] = (accepted + rows) / rows if rows else None
        entry["verify_rows"] = rows
    return entry


def run_hf(model_dir: str, workloads: dict, args) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format == "dummy":  # no weights on disk: HF's own random init (the timing does not depend on it)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device)
    model.eval()
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
        rates[name] = _tokens(name, prompts, outputs) / (time.perf_counter() - start)
        print(f"HF transformers {name} (static batches of {size}): {rates[name]:.1f} {_unit(name)}", flush=True)
    return rates


def _tokens(name: str, prompts: list[list[int]], outputs: list[int]) -> int:
    return sum(map(len, prompts)) if SCENARIOS[name].prefill else sum(outputs)


def _ratio(value: float | None, width: int = 0) -> str:
    return f"{'-' if value is None else f'{value:.1%}':>{width}}"


def _length(value: float | None, width: int = 0) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>{width}}"


def _unit(name: str) -> str:
    return "prefill tok/s" if SCENARIOS[name].prefill else "output tok/s"


def _hf_generate(model, prompts, new_tokens: int, args) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, pad_token_id=0)


def zaya_decode_floor(config: dict, batch: int, context: int, fp8: bool = False) -> float:
    """Tokens/s if one decode step only had to move its bytes at HBM speed (users_and_perf.md §3.4). `fp8`: the
    projections and experts take one byte a weight (the router and the LM head stay as they are)."""
    h, layers, e = config["hidden_size"], config["num_hidden_layers"], config["num_experts"]
    cca = h * 1024 + h * 256 + 2 * h * 128 + 1024 * h
    router = h * 256 + 2 * 256 * 256 + 256 * (e + 1)
    expert = 3 * h * config["moe_intermediate_size"]
    touched = e * (1 - (1 - 1 / e) ** batch)
    quantized = (1 if fp8 else 2) * layers * (cca + touched * expert)
    weights = quantized + 2 * (layers * router + config["vocab_size"] * h)
    kv = batch * context * layers * 512 * 2
    return batch / ((weights + kv) / HBM_BYTES_PER_S)


def ling_decode_floor(config: dict, batch: int, context: int, fp8: bool = False) -> float:
    """Tokens/s if one decode step only had to move its bytes (`ling_decode_bytes`) at HBM speed."""
    return batch / (sum(ling_decode_bytes(config, batch, context, fp8).values()) / HBM_BYTES_PER_S)


def ling_decode_bytes(config: dict, batch: int, context: int, fp8: bool = False) -> dict[str, float]:
    """Bytes one Ling decode step moves: the weights it touches (bf16, or with `fp8` one byte for the projections
    and experts but MLA's kv_b_proj; routers fp32; routed experts as the expected number of distinct ones the batch
    picks; norms left out), every MLA layer's latent KV of the context (bf16) and every lightning layer's fp32
    state (read and written)."""
    c = parse_ling_config(config)
    h, heads, qk = c.hidden_size, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    lightning = 5 * heads * c.head_dim * h  # Q|K|V|G in, dense out
    q = c.q_lora_rank * h + heads * qk * c.q_lora_rank if c.q_lora_rank else heads * qk * h
    w = 1 if fp8 else 2  # bytes per projection or expert weight
    kv_b = 2 * heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    mla = w * (q + (c.kv_lora_rank + c.qk_rope_head_dim) * h + heads * c.v_head_dim * h) + kv_b
    touched = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
    moe = w * (touched * 3 * c.moe_intermediate_size + 3 * c.shared_expert_width) * h + 4 * c.num_experts * h
    dense = w * 3 * c.intermediate_size * h
    weights = sum((mla if c.is_mla(i) else w * lightning) + (dense if c.is_dense(i) else moe)
                  for i in range(c.num_layers)) + 2 * c.vocab_size * h  # + the LM head
    kv = batch * context * len(c.mla_layers) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    states = batch * len(c.lightning_layers) * heads * c.head_dim ** 2 * 4 * 2
    return {"weights": weights, "kv": kv, "states": states}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class GCPauses:
    """Python's garbage collections during a timed call (gc.callbacks): per generation, how many and how long. A
    full (generation 2) collection walks every tracked object of a process that imported torch and transformers
    (83 ms for 214k objects on a CPU test machine): one inside a timed call moves its rate."""

    def __init__(self):
        self.runs: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """{"gen0": [count, ms], "gen1": ..., "gen2": ...}"""
        return {f"gen{g}": [sum(1 for k, _ in self.runs if k == g),
                            round(1e3 * sum(s for k, s in self.runs if k == g), 3)] for g in range(3)}


def _gpu_state(device: str) -> dict | None:
    """Right after a timed run: the caching allocator's counters so far (retries = a failed cudaMalloc that freed
    the cache and tried again; device allocs / frees = cudaMalloc / cudaFree calls) and, through NVML, the SM clock
    (MHz), power (W) and temperature (C): whether a slower repeat thrashed the allocator or ran at lower clocks (the
    40-layer prefill gave 144k, then 99k and 99k tok/s). None off CUDA."""
    if not device.startswith("cuda"):
        return None
    stats = torch.cuda.memory_stats(device)
    state = {"alloc_retries": stats.get("num_alloc_retries"), "device_allocs": stats.get("num_device_alloc"),
             "device_frees": stats.get("num_device_free")}
    try:
        state |= {"sm_clock_mhz": torch.cuda.clock_rate(device), "power_w": torch.cuda.power_draw(device) / 1000,
                  "temperature_c": torch.cuda.temperature(device)}
    except Exception:  # NVML missing or refused (e.g. in a container): the allocator's counters stand alone
        pass
    return state


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, or the random model's --model-type, --width and --layers (see make_random_model)."""
    parser.add_argument("--model", default=None, help="HF-layout directory with its tokenizer (default: a random "
                                                      "model, see above)")
    parser.add_argument("--model-type", default="zaya", choices=["zaya", "ling"], help="the random model's family")
    parser.add_argument("--width", default="full", choices=["full", "demo"],
                        help="the random model's widths: ZAYA1-8B / Ling-2.6-flash, or the tiny demo ones")
    parser.add_argument("--layers", type=int, default=None, help="layers of the random model (default: real depth)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                        help="dummy: random weights drawn by the engine from config.json alone (default for ling); "
                             "auto: a random safetensors checkpoint is written first (default for zaya)")
    parser.add_argument("--scenarios", nargs="+", default=["b1", "b64"], choices=list(SCENARIOS))
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hf-batch", type=int, default=64, help="largest static batch for HF generate")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="our engine without CUDA graphs")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=8192,
                        help="prefill and mixed steps of up to this many tokens replay CUDA graphs (0: eager)")
    parser.add_argument("--tp", type=int, default=1,
                        help="our engine's tensor-parallel size (the floor is then that of --tp GPUs)")
    parser.add_argument("--json-grammar", action="store_true",
                        help="also run each scenario with a JSON grammar on every request (structured output)")
    parser.add_argument("--speculative-algorithm", type=str.upper, default=None, choices=["NGRAM", "NEXTN"],
                        help="also run speculative decoding (and its forced-acceptance bound) beside the plain run")
    parser.add_argument("--speculative-num-draft-tokens", "--num-draft-tokens", dest="num_draft_tokens", type=int,
                        default=None, metavar="K", help="draft tokens per verify step (default 4; needs "
                                                        "--speculative-algorithm)")
    parser.add_argument("--mtp-layer", action="store_true",
                        help="the random Ling model carries its MTP layer (as released: loaded, in the memory plan) "
                             "even without NEXTN drafts")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per scenario of our engine; the median is reported (and every run's rate). "
                             "Five: on the H200 pool one call of three gave 91k, 132k and 146k tok/s of prefill")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="our engine quantizes the projections and experts to FP8 as they load (online)")
    parser.add_argument("--fp8-checkpoint", default=None, choices=sorted(FP8_CHECKPOINTS),
                        help="the random model is an FP8 checkpoint of this layout (needs --load-format dummy)")
    parser.add_argument("--compare-bf16", action="store_true",
                        help="with FP8: also run our engine on the 16-bit weights and report FP8 / bf16")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's weights and memory plan
    args.load_format = args.load_format or ("dummy" if args.model_type == "ling" else "auto")
    fp8 = args.quantization is not None or args.fp8_checkpoint is not None
    if args.fp8_checkpoint is not None and (args.load_format != "dummy" or args.model is not None):
        parser.error("--fp8-checkpoint describes the random model's dummy weights: it needs --load-format dummy")
    if args.compare_bf16 and (not fp8 or args.fp8_checkpoint is not None):
        parser.error("--compare-bf16 compares --quantization fp8 with the same 16-bit weights")
    if args.mtp_layer and (args.model_type != "ling" or args.model is not None):
        parser.error("--mtp-layer applies to the random Ling model only")
    speculative = None
    if args.speculative_algorithm is not None:
        speculative = {"method": "mtp" if args.speculative_algorithm == "NEXTN" else "ngram",
                       "num_speculative_tokens": 4 if args.num_draft_tokens is None else args.num_draft_tokens}
    elif args.num_draft_tokens is not None:  # ignored, it would report plain runs as if K drafts were verified
        parser.error("--speculative-num-draft-tokens (--num-draft-tokens) needs --speculative-algorithm (NGRAM or "
                     "NEXTN)")

    temporary = args.model is None
    model_dir = make_random_model(args.model_type, args.width, args.layers, args.load_format,
                                  mtp=args.mtp_layer or args.speculative_algorithm == "NEXTN",
                                  fp8_checkpoint=args.fp8_checkpoint) \
        if temporary else args.model
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        zaya = config["model_type"] == "zaya"
        workloads = {name: workload(SCENARIOS[name], args.seed) for name in args.scenarios}
        result = {"model": args.model or f"random {args.model_type} ({args.width} widths)",
                  "layers": config["num_hidden_layers"], "device": args.device, "load_format": args.load_format,
                  "cuda_graphs": not args.enforce_eager,
                  "prefill_graph_max_tokens": 0 if args.enforce_eager else args.prefill_graph_max_tokens,
                  "tensor_parallel_size": args.tp, "quantization": args.quantization,
                  "quantization_config": config.get("quantization_config"),
                  "scenarios": {name: {"requests": len(p), "input_tokens": sum(map(len, p)),
                                       "output_tokens": sum(o), "unit": _unit(name)}
                                for name, (p, o) in workloads.items()}}
        plain = run_ours(model_dir, workloads, args, quantization=args.quantization)
        if args.compare_bf16:
            for name, run in run_ours(model_dir, workloads, args).items():
                if "+" in name:  # --json-grammar's runs: compared without FP8 only
                    continue
                entry = result["scenarios"][name]
                entry["bf16_tok_s"], entry["fp8_over_bf16"] = run["tok_s"], plain[name]["tok_s"] / run["tok_s"]
        if speculative is not None:
            result["speculative"] = speculative
            decode = {name: w for name, w in workloads.items() if not SCENARIOS[name].prefill}
            spec = run_ours(model_dir, decode, args, speculative, quantization=args.quantization)
            forced = run_ours(model_dir, decode, args, speculative, {n: plain[n]["tokens"] for n in decode},
                              args.quantization)
            for name in decode:
                result["scenarios"][name].update(
                    spec_tok_s=spec[name]["tok_s"], spec_acceptance_rate=spec[name]["acceptance_rate"],
                    spec_mean_accept_length=spec[name]["mean_accept_length"], forced_tok_s=forced[name]["tok_s"],
                    forced_acceptance_rate=forced[name]["acceptance_rate"],
                    forced_mean_accept_length=forced[name]["mean_accept_length"])
        for label, run in plain.items():
            name, _, grammar = label.partition("+")
            entry = result["scenarios"][name]
            rate = run["tok_s"]
            if grammar:  # --json-grammar: the same scenario with a JSON grammar on every request
                entry["ours_json_tok_s"], entry["json_cost"] = rate, 1 - rate / entry["ours_tok_s"]
                continue
            entry["ours_tok_s"], entry["ours_tok_s_runs"], entry["gc_runs"] = rate, run["tok_s_runs"], run["gc_runs"]
            if "gpu_after_runs" in run:
                entry["gpu_after_runs"] = run["gpu_after_runs"]
            sc = SCENARIOS[name]
            if not sc.prefill:
                context = (sc.min_input + sc.max_input) // 2 + (sc.min_output + sc.max_output) // 4
                floor = zaya_decode_floor if zaya else ling_decode_floor
                # Each of the --tp GPUs streams its shard: the bytes per step are split, the bandwidth multiplied.
                entry["floor_tok_s"] = args.tp * floor(config, min(sc.requests, args.max_running_requests), context,
                                                       fp8)
        if not zaya:
            for entry in result["scenarios"].values():
                entry["hf_tok_s"] = "n/a"  # no Ling-2.6 model class in transformers here
        elif args.device.startswith("cuda") and not args.skip_hf:
            for name, rate in run_hf(model_dir, workloads, args).items():
                entry = result["scenarios"][name]
                entry["hf_tok_s"], entry["ratio"] = rate, entry["ours_tok_s"] / rate
        print(f"{'scenario':<9} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'floor tok/s':>12} {'of floor':>9}")
        for name, e in result["scenarios"].items():
            hf = e.get("hf_tok_s", "-")
            hf_text = f"{hf:>10.1f} {e['ratio']:>7.2f}x" if isinstance(hf, float) else f"{hf:>10} {'-':>8}"
            floor = f"{e['floor_tok_s']:>12.0f} {e['ours_tok_s'] / e['floor_tok_s']:>8.1%}" if "floor_tok_s" in e \
                else f"{'-':>12} {'-':>9}"
            print(f"{name:<9} {e['ours_tok_s']:>11.1f} {hf_text} {floor}  ({e['unit']})")
            if "bf16_tok_s" in e:
                print(f"{name + ' bf16':<9} {e['bf16_tok_s']:>11.1f}  (FP8 / bf16: {e['fp8_over_bf16']:.2f}x)")
            if "ours_json_tok_s" in e:
                print(f"{name + '+json':<9} {e['ours_json_tok_s']:>11.1f}  (every request under a JSON grammar: "
                      f"{e['json_cost']:.1%} slower)")
        if speculative is not None:
            print(f"{'scenario':<9} {'plain tok/s':>12} {'spec tok/s':>11} {'accepted':>9} {'tok/verify':>11} "
                  f"{'forced tok/s':>13} {'accepted':>9} {'tok/verify':>11}")
            for name, e in result["scenarios"].items():
                if "spec_tok_s" in e:
                    print(f"{name:<9} {e['ours_tok_s']:>12.1f} {e['spec_tok_s']:>11.1f} "
                          f"{_ratio(e['spec_acceptance_rate'], 9)} {_length(e['spec_mean_accept_length'], 11)} "
                          f"{e['forced_tok_s']:>13.1f} {_ratio(e['forced_acceptance_rate'], 9)} "
                          f"{_length(e['forced_mean_accept_length'], 11)}")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
