"""Command line: `hybridserve generate` (one-shot completion)."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF-layout model directory (default: the built-in demo checkpoint, random weights)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weight and activation dtype (auto: the checkpoint's torch_dtype)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-running-requests", type=int, default=256, help="requests decoded together")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per forward pass")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="cache budget on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory the engine may use")
    parser.add_argument("--max-state-slots", type=int, default=None, help="pin the number of state slots")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_running_requests=args.max_running_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                page_size=args.page_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, max_state_slots=args.max_state_slots,
                seed=args.seed)


def _generate(args: argparse.Namespace) -> int:
    from hybridserve import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description="Inference and serving for hybrid LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_options(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--request-seed", type=int, default=None, help="seed of this request's sampling")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
