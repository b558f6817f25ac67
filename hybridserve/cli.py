"""Command line: `hybridserve serve` (the OpenAI-compatible HTTP server) and `hybridserve generate` (one-shot)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from hybridserve.parsers import REASONING_FORMATS, TOOL_FORMATS

DEMO_MODEL_NAME = "hybridserve-demo"
DEMOS = {"zaya": "zaya", "ling": "bailing_hybrid"}  # --demo NAME -> the demo checkpoint's model_type
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine options, shared by every subcommand (names follow vLLM / SGLang)."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                        help="HF-layout model directory (default: the built-in demo checkpoint, random weights)")
    parser.add_argument("--demo", choices=sorted(DEMOS), default=None,
                        help="use a built-in demo checkpoint with random weights instead of MODEL_DIR: zaya (the "
                             "default when no MODEL_DIR is given) or ling")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="weight and activation dtype (auto: the checkpoint's torch_dtype)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available) | cpu | cuda | cuda:N")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel ranks: one process (and GPU, on CUDA) per rank, each holding a shard of "
                             "every layer")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="machines the --tp ranks span (--tp / --nnodes ranks on each)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this machine's index: 0 serves, the others only run their tensor-parallel ranks")
    parser.add_argument("--dist-init-addr", default=None,
                        help="host:port where node 0 meets the other nodes' ranks (needed with --nnodes > 1)")
    parser.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=1,
                        help="independent engine replicas behind this server (each with --tp ranks of its own); a "
                             "request goes to the replica that cached its prefix, else the least loaded one")
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
                        help="fraction of the GPU's memory this engine may hold (weights, activations, graphs, "
                             "caches); other processes' use does not count, but the caches never take more than "
                             "is free")
    parser.add_argument("--state-dtype", default="auto", choices=["auto"],
                        help="recurrent-state dtype; only auto for now (each model's own: the ZAYA1 conv window "
                             "in the model dtype, the Ling lightning state in fp32)")
    parser.add_argument("--state-to-kv-ratio", type=float, default=0.9,
                        help="state bytes : KV bytes when the cache budget is split (unless --max-state-slots)")
    parser.add_argument("--max-state-slots", type=int, default=None, help="pin the number of state slots")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step op by op: no CUDA graphs (decode or prefill)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="schedule each step only after the previous one is processed (by default the host "
                             "schedules step N+1 and processes step N while the device runs N+1; outputs are the "
                             "same either way)")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="largest decode batch replayed from a CUDA graph (default: 256 or "
                             "--max-running-requests, whichever is smaller); larger decode steps run eagerly. With "
                             "speculative decoding the verify graphs hold as many tokens: up to max(1, this // "
                             "(K + 1)) requests of 1 + K tokens (K: --speculative-num-draft-tokens)")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=8192,
                        help="prefill and mixed steps of up to 32 rows and this many tokens replay CUDA graphs "
                             "captured for 16, 32, ... 1024 tokens, then multiples of 1024, on models that support it "
                             "(ZAYA1); capped by --max-num-batched-tokens; 0: none (such steps run eagerly, bound by "
                             "the host's kernel launches)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for requests that bring none (and for --load-format dummy weights)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                        help="auto / safetensors: the checkpoint's *.safetensors; dummy: random weights from "
                             "config.json alone, no weight files read (benchmarks of full-size models)")
    parser.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                        help="fp8: quantize a 16-bit checkpoint's projections and experts to FP8 e4m3 as they load "
                             "(per-channel weight scales, per-token activation scales); FP8 checkpoints "
                             "(compressed-tensors, block FP8) need nothing: their config.json says so")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto"],
                        help="the KV cache's dtype: auto = the model's (FP8 KV caches are not served yet)")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "triton", "torch"],
                        help="auto: Triton kernels on CUDA, the pure-torch references elsewhere; torch: references "
                             "everywhere (debugging); triton: fail unless the kernels can run")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-algorithm", type=str.upper, choices=sorted(_SPECULATIVE_METHODS),
                      default=None, help="NEXTN: the model's MTP layer drafts (Ling-2.6); NGRAM: prompt lookup over "
                                         "the request's own tokens (any model). Off by default")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="K",
                      help="draft tokens verified per step and request (needs --speculative-algorithm)")
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None, metavar="N",
                      help="NGRAM: shortest suffix n-gram looked up (default 2)")
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None, metavar="N",
                      help="NGRAM: longest suffix n-gram looked up, tried first (default 4)")
    parser.add_argument("--skip-warmup", action="store_true",
                        help="start serving without first compiling every Triton kernel variant (they then compile "
                             "inside the first requests' steps, seconds each)")


_SPECULATIVE_METHODS = {"NEXTN": "mtp", "NGRAM": "ngram"}
_SPECULATIVE_FLAGS = {"method": "--speculative-algorithm", "num_speculative_tokens": "--speculative-num-draft-tokens",
                      "prompt_lookup_min": "--speculative-ngram-min-match-window-size",
                      "prompt_lookup_max": "--speculative-ngram-max-match-window-size"}


def _speculative_config(args: argparse.Namespace) -> dict | None:
    """EngineConfig.speculative_config from the --speculative-* options."""
    from hybridserve.config import SpeculativeConfig

    ngram = {"prompt_lookup_min": args.speculative_ngram_min_match_window_size,
             "prompt_lookup_max": args.speculative_ngram_max_match_window_size}
    if args.speculative_algorithm is None:
        given = [name for name, value in (("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
                                          *zip(("--speculative-ngram-min-match-window-size",
                                                "--speculative-ngram-max-match-window-size"), ngram.values()))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --speculative-algorithm (NEXTN or NGRAM)")
        return None
    if args.speculative_num_draft_tokens is None:
        raise ValueError("--speculative-algorithm needs --speculative-num-draft-tokens K (drafts per step)")
    method = _SPECULATIVE_METHODS[args.speculative_algorithm]
    config = {"method": method, "num_speculative_tokens": args.speculative_num_draft_tokens}
    if method != "ngram" and any(v is not None for v in ngram.values()):
        raise ValueError("the --speculative-ngram-* options apply to --speculative-algorithm NGRAM only")
    config |= {k: v for k, v in ngram.items() if v is not None}
    SpeculativeConfig.checked(config, _SPECULATIVE_FLAGS)  # a bad value is reported as the flag that gave it
    return config


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the engine options (raises ValueError for options the engine cannot honour)."""
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA GPU is available on this machine; use --device cpu")
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_running_requests=args.max_running_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                chunked_prefill_size=args.chunked_prefill_size, enable_prefix_caching=args.enable_prefix_caching,
                page_size=args.page_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization, state_to_kv_ratio=args.state_to_kv_ratio,
                max_state_slots=args.max_state_slots, seed=args.seed,
                kernel_backend=args.kernel_backend, skip_warmup=args.skip_warmup, enforce_eager=args.enforce_eager,
                cuda_graph_max_bs=args.cuda_graph_max_bs,
                prefill_graph_max_tokens=args.prefill_graph_max_tokens, load_format=args.load_format,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                disable_overlap_schedule=args.disable_overlap_schedule, tensor_parallel_size=args.tp,
                nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                speculative_config=_speculative_config(args))


def _model_dir(args: argparse.Namespace) -> str:
    """MODEL_DIR, or the demo checkpoint (written on first use)."""
    from hybridserve.demo import ensure_demo_checkpoint

    if args.model is not None and args.demo is not None:
        raise ValueError("give MODEL_DIR or --demo, not both")
    return args.model or str(ensure_demo_checkpoint(DEMOS[args.demo or "zaya"]))


def _served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return args.model
    return DEMO_MODEL_NAME if args.demo in (None, "zaya") else f"{DEMO_MODEL_NAME}-{args.demo}"


def _server_options(args: argparse.Namespace):
    from hybridserve.server.state import ServerOptions

    for name in ("max_request_body_bytes", "max_n", "default_max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text()
        except OSError as err:
            raise ValueError(f"--chat-template {args.chat_template}: {err.strerror or err}") from None
    hosts = args.allowed_hosts
    if hosts is None:  # loopback servers answer loopback names only (no DNS rebinding from a browser)
        hosts = list(_LOOPBACK) if args.host in _LOOPBACK else None
    elif "*" in hosts:
        hosts = None
    return ServerOptions(served_model_name=_served_name(args), api_key=args.api_key or None,
                         allowed_hosts=tuple(hosts) if hosts else None,
                         max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                         default_max_tokens=args.default_max_tokens,
                         trust_request_chat_template=args.trust_request_chat_template, chat_template=chat_template,
                         data_parallel_size=args.dp, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser, response_store_size=args.responses_store_size,
                         response_store_ttl_s=args.responses_store_ttl)


def _serve(args: argparse.Namespace) -> NoReturn:
    from hybridserve.config import EngineConfig
    from hybridserve.server.app import bind_socket, run_server

    kwargs, options = _engine_kwargs(args), _server_options(args)
    if args.node_rank > 0:  # this node only runs tensor-parallel ranks; node 0 serves
        from hybridserve.runtime.tensor_parallel import run_worker_node

        run_worker_node(EngineConfig(model=_model_dir(args), use_tqdm=False, **kwargs))
        sys.exit(0)
    sock = bind_socket(args.host, args.port)  # before anything loads: a port in use fails at once
    # The weight-loading bar only on a terminal: in a log file it would interleave with the log lines.
    config = EngineConfig(model=_model_dir(args), use_tqdm=sys.stderr.isatty(), **kwargs)
    code = run_server(config, options, sock)
    # Nothing is left to clean up: end the process now rather than have the interpreter free the model and the
    # caches object by object, which takes seconds for a large cache.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _generate(args: argparse.Namespace) -> int:
    from hybridserve import LLM, SamplingParams

    kwargs = _engine_kwargs(args)
    llm = LLM(_model_dir(args), **kwargs)
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
                       help=f"model id in the API (default: MODEL_DIR as given, or {DEMO_MODEL_NAME!r} / "
                            f"'{DEMO_MODEL_NAME}-ling' for the demos)")
    serve.add_argument("--api-key", default=os.environ.get("HYBRIDSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* and the tokenizer routes (/health and "
                            "/metrics stay open); default: $HYBRIDSERVE_API_KEY, else no key")
    serve.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                       help="Host header names to answer (a guard against DNS rebinding); default: the loopback "
                            "names when --host is a loopback address, any otherwise; '*' for any")
    serve.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                       help="larger request bodies get a 413 before they are read (default 4 MiB)")
    serve.add_argument("--max-n", type=int, default=256,
                       help="most sequences (prompts x n) one request may ask for")
    serve.add_argument("--default-max-tokens", type=int, default=4096,
                       help="tokens generated for requests that set no max_tokens (chat) or max_tokens: null; "
                            "generation also stops at the end of the context")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file that replaces the model's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept chat_template in requests (it runs as code on the server; refused by default)")
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_FORMATS),
                       help="how tool calls are written in the model's output (default: the model's own: zaya for "
                            "ZAYA1, ling for Ling-2.6)")
    serve.add_argument("--responses-store-size", type=int, default=1000,
                       help="Responses-API responses kept in memory for previous_response_id and GET "
                            "/v1/responses/{id} (the oldest dropped first; 0: none)")
    serve.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                       help="how long a stored response is kept")
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_FORMATS),
                       help="split <think>...</think> reasoning into reasoning_content (default: off, the "
                            "reasoning stays in the content)")
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the server took over the signals (e.g. while writing the demo checkpoint)
        return 130


if __name__ == "__main__":
    sys.exit(main())
