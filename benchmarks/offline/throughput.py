"""Offline throughput: hybridserve `LLM.generate` side by side with HF transformers, in one run, on one model.

Scenarios (`--scenarios`, run in order on the same model; throughput = requested output tokens / wall time of one
generate() call, prefill included, after a warm-up; ours: the median of `--repeats` such calls (default 5; a 128-step
batch-1 run varied by +-7% from call to call on the H200), every call's rate in the JSON; temperature 0.6,
ignore_eos; a decode scenario whose requests all ask for the same number of tokens also times their first tokens
alone, `--repeats` times after an untimed call, and reports the rate of the tokens after them, which is what the
decode floor bounds):
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
decode step must move over HBM bandwidth: by default the device-to-device copy rate measured on the GPU it runs on,
`--hbm-bytes-per-s` to fix it); on CUDA and for ZAYA1 the same prompts also go through HF transformers
`generate` (static batches of up to 64, left-padded, after our engine has been freed); Ling-2.6 has no HF model
class here (n/a). Results also go to --out as JSON. `--json-grammar` runs each of our scenarios a second time with
a JSON schema on every request (an array of at least 100000 short strings, so every draw stays masked to its last
token) and reports both rates: with no grammar, structured output must cost nothing.

FP8 (e4m3 weights, W8A8): `--quantization fp8` has our engine quantize the model's projections and experts as they
load (per-channel scales; with dummy weights, random FP8 ones); `--fp8-checkpoint channel|block` writes the random
model's config.json with the quantization_config of a compressed-tensors per-channel or a block-FP8 checkpoint
(load format dummy: Ling-2.6-flash FP8 at full size without its 108 GB). The floors then count one byte per FP8
weight. `--compare-bf16` runs our engine on the 16-bit weights too, in the same run, and reports FP8 / bf16.

The floors count the routed experts a step would read if its tokens chose uniformly (what a load-balanced model
approaches); random weights route less evenly and read fewer. `--count-experts` runs each batched decode scenario
once more, eagerly, counts the distinct experts each MoE layer reads (benchmarks/offline/expert_spread.py) and
reports the floor at that count beside the uniform one: the fraction of the bytes this run really moved.

Speculative decoding (`--speculative-algorithm NGRAM|NEXTN --speculative-num-draft-tokens K`, K defaults to 4; NEXTN
gives the random Ling model its MTP layer): every decode scenario runs three engines on the same prompts, plain
(overlap and CUDA graphs as usual), speculative (its acceptance rate and accepted length from the same run) and
forced acceptance: drafts replayed from the plain run's outputs (keyed by prompt) and every one accepted
(`set_draft_source(..., force_acceptance=True)`), so its rate is the upper bound speculation can reach, i.e. what
verification costs (with NEXTN the MTP layer still drafts, as it would). Accepting by the target's own draws would
not do: verify rows round differently from plain decode rows in bf16 (other kernels and GEMM shapes), and on a
random model whose top logits nearly tie, a row whose draw differs from the replayed token once has every later
draft rejected (Ling-2.6-flash at batch 16 accepted 12% of the plain run's own tokens that way).

    python -m benchmarks.offline throughput --layers 40 --scenarios b1 b64 prefill --out results.json
    python -m benchmarks.offline throughput --model-type ling --layers 16 --scenarios b1 b64 prefill
    python -m benchmarks.offline throughput --layers 40 --scenarios b1 b64 --json-grammar --skip-hf
    python -m benchmarks.offline throughput --layers 40 --scenarios b1 b16 --temperature 0 --skip-hf \\
        --speculative-algorithm NGRAM --speculative-num-draft-tokens 4
    python -m benchmarks.offline throughput --layers 40 --scenarios b1 b64 --quantization fp8 --compare-bf16 --skip-hf
    python -m benchmarks.offline throughput --model-type ling --mtp-layer --fp8-checkpoint block --scenarios b1 b64 \\
        prefill
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cli import add_model_options
from benchmarks.offline.expert_spread import count_experts
from benchmarks.offline.hf_baseline import run_hf
from benchmarks.offline.scenarios import BENCH_GRAMMAR, SCENARIOS, counted_tokens, unit, workload
from benchmarks.offline.timing import GCPauses, copy_rate, gpu_state, sync
from hybridserve import LLM, SamplingParams
from hybridserve.demo import make_random_model
from hybridserve.models.bandwidth_floor import HBM_BYTES_PER_S, decode_floor, expected_experts
from hybridserve.models.released import FP8_CHECKPOINTS
from hybridserve.engine.drafts import ReplayDrafts

SPEC_STATS = ("spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens")


def run_ours(model_dir: str, workloads: dict, args, speculative: dict | None = None,
             forced: dict[str, list[list[int]]] | None = None, quantization: str | None = None) -> dict[str, dict]:
    """Per scenario (and per `name+json` with --json-grammar, without speculation): tok/s, the generated tokens,
    and with `speculative` the acceptance measured on the timed run. `forced` (per scenario, the outputs of a plain
    run): drafts replayed from them, keyed by prompt, and every one accepted. `quantization`: the engine's option
    (online FP8)."""
    llm = LLM(model_dir, **_engine_options(args, quantization), max_running_requests=args.max_running_requests,
              enforce_eager=args.enforce_eager, prefill_graph_max_tokens=args.prefill_graph_max_tokens,
              speculative_config=speculative)
    kind = "" if speculative is None else " speculative" + (" forced" if forced else "")
    results = {}
    for name, (prompts, outputs) in workloads.items():
        for grammar in (None, BENCH_GRAMMAR) if args.json_grammar and speculative is None else (None,):
            params = _sampling_params(outputs, args, grammar)
            label = name if grammar is None else f"{name}+json"
            if forced is not None:
                llm.engine.set_draft_source(ReplayDrafts({tuple(p): t for p, t in zip(prompts, forced[name])},
                                                         key=lambda request: tuple(request.prompt_token_ids)),
                                            force_acceptance=True)
            entry = results[label] = _timed_run(llm, name, prompts, outputs, params, args, speculative is not None)
            line = f"hybridserve{kind} {label}: {entry['tok_s']:.1f} {unit(name)}"
            if speculative is not None:
                line += f", acceptance {_ratio(entry['acceptance_rate'])}, {entry['verify_rows']} verifying " \
                        "request-steps"
            print(line, flush=True)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    return results


def _engine_options(args, quantization: str | None) -> dict:
    """The LLM options every engine of a run shares."""
    return dict(use_tqdm=False, dtype=args.dtype, device=args.device, load_format=args.load_format,
                quantization=quantization, seed=args.seed, tensor_parallel_size=args.tp,
                enable_prefix_caching=False)  # the repeats and the warm-up reuse the prompts: no cached prefill


def _sampling_params(outputs: list[int], args, grammar=None) -> list[SamplingParams]:
    return [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i,
                           structured_output=grammar) for i, n in enumerate(outputs)]


def _timed_run(llm: LLM, name: str, prompts: list[list[int]], outputs: list[int], params: list[SamplingParams],
               args, speculative: bool) -> dict:
    """`--repeats` timed generates after a two-request warm-up (and grammar compile): the median tok/s (and every
    run's), the generated tokens, and with speculation the runs' acceptance rate, tokens per verifying
    request-step and the number of those."""
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2])
    before = llm.engine.stats()
    rates, gpu, collections = [], [], []
    for _ in range(args.repeats):
        sync(args.device)
        with GCPauses() as pauses:
            start = time.perf_counter()
            generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            sync(args.device)
            rates.append(counted_tokens(name, prompts, outputs) / (time.perf_counter() - start))
        collections.append(pauses.summary())
        gpu.append(gpu_state(args.device))
        tokens = [r.outputs[0].token_ids for r in generated]
        assert [len(t) for t in tokens] == outputs
    entry = {"tok_s": statistics.median(rates), "tok_s_runs": rates, "tokens": tokens, "gc_runs": collections}
    # The split is reported for plain runs only; after a speculative run's timed calls it would also add its own
    # steps to the acceptance counts read below.
    plain = not speculative and all(p.structured_output is None for p in params)
    if plain and not SCENARIOS[name].prefill and min(outputs) == max(outputs) > 1:
        entry.update(_first_token_split(llm, prompts, params, sum(outputs) / entry["tok_s"], args))
    if any(gpu):
        entry["gpu_after_runs"] = gpu
    if speculative:
        rows, drafts, accepted = (llm.engine.stats()[k] - before[k] for k in SPEC_STATS)
        # Tokens a verifying request gains per step (accepted drafts + the bonus); None: nothing verified.
        entry["acceptance_rate"] = accepted / drafts if drafts else None
        entry["mean_accept_length"] = (accepted + rows) / rows if rows else None
        entry["verify_rows"] = rows
    return entry


def _first_token_split(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], seconds: float,
                       args) -> dict:
    """A scenario's rate split at its first tokens, where every request asks for the same n tokens: the median of
    `--repeats` generates of the first tokens alone (the prompts' prefill, their sampling and the host's work around
    them), and the rate of the tokens after them, requests * (n - 1) / (`seconds`, the median full call, minus
    that; None where the first tokens alone took as long: timing noise on a few tokens). The decode floor bounds the
    second only: a prefill reads every expert's weights. (With more requests than run at once, later prompts'
    prefills overlap earlier requests' decode steps, and the split is approximate.) An untimed call first: the first
    call of a shape pays one-time costs (on a CPU, once, longer than a whole 4-token call)."""
    first_only = [dataclasses.replace(p, max_tokens=1) for p in params]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests, first_only)
    times = []
    for _ in range(args.repeats):
        sync(args.device)
        start = time.perf_counter()
        llm.generate(requests, first_only)
        sync(args.device)
        times.append(time.perf_counter() - start)
    first = statistics.median(times)
    after = sum(p.max_tokens - 1 for p in params)
    return {"first_token_ms": 1e3 * first, "decode_tok_s": after / (seconds - first) if seconds > first else None}


def _ratio(value: float | None, width: int = 0) -> str:
    return f"{'-' if value is None else f'{value:.1%}':>{width}}"


def _length(value: float | None, width: int = 0) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>{width}}"


def _parse_args() -> argparse.Namespace:
    """The options, checked, with the load format's default filled in and `speculative` (the engine's
    speculative_config, or None) added."""
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
    parser.add_argument("--hbm-bytes-per-s", type=float, default=None,
                        help="the floors' HBM rate (default: measured, a device-to-device copy on the GPU; off CUDA "
                             "an H200's 4.3e12)")
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
    parser.add_argument("--count-experts", action="store_true",
                        help="count the experts each batched decode scenario's MoE layers read (an eager run more) "
                             "and report the floor at that count beside the uniform-routing one")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    args.load_format = args.load_format or ("dummy" if args.model_type == "ling" else "auto")
    fp8 = args.quantization is not None or args.fp8_checkpoint is not None
    if args.fp8_checkpoint is not None and (args.load_format != "dummy" or args.model is not None):
        parser.error("--fp8-checkpoint describes the random model's dummy weights: it needs --load-format dummy")
    if args.count_experts and args.tp > 1:
        parser.error("--count-experts watches the experts' calls in this process: it needs --tp 1")
    if args.compare_bf16 and (not fp8 or args.fp8_checkpoint is not None):
        parser.error("--compare-bf16 compares --quantization fp8 with the same 16-bit weights")
    if args.mtp_layer and (args.model_type != "ling" or args.model is not None):
        parser.error("--mtp-layer applies to the random Ling model only")
    args.speculative = None
    if args.speculative_algorithm is not None:
        args.speculative = {"method": "mtp" if args.speculative_algorithm == "NEXTN" else "ngram",
                            "num_speculative_tokens": 4 if args.num_draft_tokens is None else args.num_draft_tokens}
    elif args.num_draft_tokens is not None:  # ignored, it would report plain runs as if K drafts were verified
        parser.error("--speculative-num-draft-tokens (--num-draft-tokens) needs --speculative-algorithm (NGRAM or "
                     "NEXTN)")
    return args


def main() -> None:
    args = _parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's weights and memory plan
    speculative = args.speculative
    fp8 = args.quantization is not None or args.fp8_checkpoint is not None
    temporary = args.model is None
    model_dir = make_random_model(args.model_type, args.width, args.layers, args.load_format,
                                  mtp=args.mtp_layer or args.speculative_algorithm == "NEXTN",
                                  fp8_checkpoint=args.fp8_checkpoint) \
        if temporary else args.model
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        zaya = config["model_type"] == "zaya"
        workloads = {name: workload(SCENARIOS[name], args.seed) for name in args.scenarios}
        bandwidth = args.hbm_bytes_per_s or (copy_rate(args.device) if args.device.startswith("cuda")
                                             else HBM_BYTES_PER_S)
        result = {"model": args.model or f"random {args.model_type} ({args.width} widths)",
                  "layers": config["num_hidden_layers"], "device": args.device, "load_format": args.load_format,
                  "cuda_graphs": not args.enforce_eager,
                  "prefill_graph_max_tokens": 0 if args.enforce_eager else args.prefill_graph_max_tokens,
                  "tensor_parallel_size": args.tp, "hbm_bytes_per_s": bandwidth,
                  "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                  "quantization": args.quantization,
                  "quantization_config": config.get("quantization_config"),
                  "scenarios": {name: {"requests": len(p), "input_tokens": sum(map(len, p)),
                                       "output_tokens": sum(o), "unit": unit(name)}
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
            if "decode_tok_s" in run:
                entry["ours_first_token_ms"], entry["ours_decode_tok_s"] = run["first_token_ms"], run["decode_tok_s"]
            if "gpu_after_runs" in run:
                entry["gpu_after_runs"] = run["gpu_after_runs"]
            sc = SCENARIOS[name]
            if not sc.prefill:
                context = (sc.min_input + sc.max_input) // 2 + (sc.min_output + sc.max_output) // 4
                # Each of the --tp GPUs streams its shard: the bytes per step are split, the bandwidth multiplied.
                batch = min(sc.requests, args.max_running_requests)
                entry["floor_tok_s"] = args.tp * decode_floor(config, batch, context, fp8, bandwidth)
                if args.count_experts and batch > 1 and batch == sc.requests:
                    prompts, outputs = workloads[name]
                    touched = count_experts(model_dir, prompts, _sampling_params(outputs, args),
                                            _engine_options(args, args.quantization))
                    entry["experts_touched"], entry["experts_expected"] = touched, expected_experts(config, batch)
                    if touched is not None:
                        entry["floor_tok_s_at_touched"] = args.tp * decode_floor(config, batch, context, fp8,
                                                                                 bandwidth, touched)
        if not zaya:
            for entry in result["scenarios"].values():
                entry["hf_tok_s"] = "n/a"  # no Ling-2.6 model class in transformers here
        elif args.device.startswith("cuda") and not args.skip_hf:
            for name, rate in run_hf(model_dir, workloads, args).items():
                entry = result["scenarios"][name]
                entry["hf_tok_s"], entry["ratio"] = rate, entry["ours_tok_s"] / rate
        _print_report(result)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)


def _print_report(result: dict) -> None:
    """The result's tables: ours vs HF and the floor (FP8 vs bf16, with and without a JSON grammar), then plain vs
    speculative vs forced acceptance."""
    print(f"decode floors at {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({result['gpu'] or 'not measured'})")
    print(f"{'scenario':<9} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8} {'floor tok/s':>12} {'of floor':>9}")
    for name, e in result["scenarios"].items():
        hf = e.get("hf_tok_s", "-")
        hf_text = f"{hf:>10.1f} {e['ratio']:>7.2f}x" if isinstance(hf, float) else f"{hf:>10} {'-':>8}"
        floor = f"{e['floor_tok_s']:>12.0f} {e['ours_tok_s'] / e['floor_tok_s']:>8.1%}" if "floor_tok_s" in e \
            else f"{'-':>12} {'-':>9}"
        print(f"{name:<9} {e['ours_tok_s']:>11.1f} {hf_text} {floor}  ({e['unit']})")
        if e.get("floor_tok_s_at_touched"):
            print(f"{name:<9} {e['experts_touched']:.1f} experts a MoE layer read (the floor counts "
                  f"{e['experts_expected']:.1f}): floor {e['floor_tok_s_at_touched']:.0f} tok/s, ours "
                  f"{e['ours_tok_s'] / e['floor_tok_s_at_touched']:.1%} of it")
        if e.get("ours_decode_tok_s") is not None:
            share = f", {e['ours_decode_tok_s'] / e['floor_tok_s']:.1%} of the floor" if "floor_tok_s" in e else ""
            print(f"{name:<9} first tokens alone {e['ours_first_token_ms']:.1f} ms; the tokens after them "
                  f"{e['ours_decode_tok_s']:.1f} tok/s{share}")
        elif "ours_first_token_ms" in e:
            print(f"{name:<9} first tokens alone {e['ours_first_token_ms']:.1f} ms, as long as the whole call: no "
                  f"rate after them (timing noise)")
        if "bf16_tok_s" in e:
            print(f"{name + ' bf16':<9} {e['bf16_tok_s']:>11.1f}  (FP8 / bf16: {e['fp8_over_bf16']:.2f}x)")
        if "ours_json_tok_s" in e:
            print(f"{name + '+json':<9} {e['ours_json_tok_s']:>11.1f}  (every request under a JSON grammar: "
                  f"{e['json_cost']:.1%} slower)")
    if "speculative" in result:
        print(f"{'scenario':<9} {'plain tok/s':>12} {'spec tok/s':>11} {'accepted':>9} {'tok/verify':>11} "
              f"{'forced tok/s':>13} {'accepted':>9} {'tok/verify':>11}")
        for name, e in result["scenarios"].items():
            if "spec_tok_s" in e:
                print(f"{name:<9} {e['ours_tok_s']:>12.1f} {e['spec_tok_s']:>11.1f} "
                      f"{_ratio(e['spec_acceptance_rate'], 9)} {_length(e['spec_mean_accept_length'], 11)} "
                      f"{e['forced_tok_s']:>13.1f} {_ratio(e['forced_acceptance_rate'], 9)} "
                      f"{_length(e['forced_mean_accept_length'], 11)}")
