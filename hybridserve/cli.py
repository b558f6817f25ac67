"""Command line: `hybridserve serve` (the OpenAI-compatible HTTP server) and `hybridserve generate` (one-shot)."""
from __future__ import annotations

import argparse
import logging
import sys

DEMO_MODEL_NAME = "hybridserve-demo"


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine options, shared by every subcommand (names follow vLLM / SGLang)."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                        help="HF-layout model directory (default: the built-in demo checkpoint, random weights)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weight and activation dtype (auto: the checkpoint's torch_dtype)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda | cuda:N")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel GPUs; only 1 is supported for now")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's, lowered to what the KV cache holds)")
    parser.add_argument("--max-running-requests", type=int, default=256, help="requests decoded together")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="tokens per forward pass (prefill chunks + decode rows)")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="most prompt tokens of one request per step (default: the token budget)")
    caching = parser.add_mutually_exclusive_group()
    caching.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                         default=True, help="reuse KV pages and state checkpoints of shared prefixes (default)")
    caching.add_argument("--disable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                         help="compute every prompt from scratch")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="cache budget (KV + state) on CPU (default 1 GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory the engine may use in total")
    parser.add_argument("--state-dtype", default="auto", choices=["auto"],
                        help="recurrent-state dtype; only auto for now (each model's own: the ZAYA1 conv window "
                             "in the model dtype, the Ling lightning state in fp32)")
    parser.add_argument("--state-to-kv-ratio", type=float, default=0.9,
                        help="state bytes : KV bytes when the cache budget is split (unless --max-state-slots)")
    parser.add_argument("--max-state-slots", type=int, default=None, help="pin the number of state slots")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="accepted for vLLM compatibility; a no-op, as the engine has no CUDA graphs yet")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"],
                        help="auto: Triton kernels on CUDA, the pure-torch references elsewhere; torch: references "
                             "everywhere (debugging); triton: fail unless the kernels can run")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the engine options (raises ValueError for options the engine cannot honour)."""
    if args.tp != 1:
        raise ValueError(f"--tp {args.tp}: tensor parallelism is not supported yet; run with --tp 1")
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_running_requests=args.max_running_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                chunked_prefill_size=args.chunked_prefill_size, enable_prefix_caching=args.enable_prefix_caching,
                page_size=args.page_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, state_to_kv_ratio=args.state_to_kv_ratio,
                max_state_slots=args.max_state_slots, seed=args.seed,
                kernel_backend=args.kernel_backend)


def _serve(args: argparse.Namespace) -> int:
    from hybridserve.config import EngineConfig
    from hybridserve.demo import ensure_demo_checkpoint
    from hybridserve.server.app import run_server

    config = EngineConfig(model=args.model or str(ensure_demo_checkpoint()), **_engine_kwargs(args))
    return run_server(config, args.served_model_name or args.model or DEMO_MODEL_NAME, args.host, args.port)


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
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)",
                           description="Serve MODEL_DIR (or the built-in demo) over an OpenAI-compatible HTTP API: "
                                       "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                                       "/tokenize, /detokenize, /tokenizer_info.")
    _add_engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help=f"model id in the API (default: MODEL_DIR as given, or {DEMO_MODEL_NAME!r})")
    serve.set_defaults(run=_serve)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_options(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1 = off)")
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
