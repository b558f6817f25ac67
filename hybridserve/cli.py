"""Command line: `hybridserve serve` (the OpenAI-compatible HTTP server) and `hybridserve generate` (one-shot).

The engine options are generated from EngineConfig's fields and the server's from ServerOptions' (type, default,
help: hybridserve/options.py), under the names vLLM and SGLang users type (`--max-num-seqs`, `--tp-size`,
`--context-length`, ...). `--config FILE.yaml` gives options as a mapping (`max-model-len: 4096`, or with
underscores); options on the command line win over the file's.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from hybridserve.config import EngineConfig
from hybridserve.options import add_options, option_values
from hybridserve.server.settings import LOG_LEVELS, ServerOptions

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "hybridserve-demo"
DEMOS = {"zaya": "zaya", "ling": "bailing_hybrid"}  # --demo NAME -> the demo checkpoint's model_type
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_SPECULATIVE_METHODS = {"NEXTN": "mtp", "NGRAM": "ngram"}
# Switches of vLLM / SGLang for what this server always does: accepted, so their command lines start it.
_ALWAYS_ON = {
    "--enable-auto-tool-choice": "tool_choice 'auto' is always available",
    "--enable-chunked-prefill": "prompts longer than the token budget are always prefilled in chunks "
                                "(--chunked-prefill-size)",
    "--enable-metrics": "Prometheus /metrics is always served",
}
# `hybridserve generate`'s own defaults (greedy, 64 tokens), under the generation config's and the command line's
_GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
_SPECULATIVE_FLAGS = {"method": "--speculative-algorithm", "num_speculative_tokens": "--speculative-num-draft-tokens",
                      "prompt_lookup_min": "--speculative-ngram-min-match-window-size",
                      "prompt_lookup_max": "--speculative-ngram-max-match-window-size"}


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The model, EngineConfig's options and the speculative-decoding flags, shared by every subcommand."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="a Hugging Face Hub id (ORG/NAME) or an HF-layout model directory (default: the "
                             "built-in demo checkpoint, random weights)")
    parser.add_argument("--model", "--model-path", dest="model_option", default=None, metavar="MODEL",
                        help="the same as MODEL (default: MODEL, else the demo)")
    parser.add_argument("--demo", choices=sorted(DEMOS), default=None,
                        help="serve a built-in demo checkpoint with random weights instead of MODEL: zaya, or ling "
                             "(default: zaya when no MODEL is given)")
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="options as a YAML mapping (max-model-len: 4096, ...); the command line's win "
                             "(default: none)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM / SGLang command lines: hybridserve's models are native code, so "
                             "no checkpoint code is ever run (default: off)")
    add_options(parser.add_argument_group("engine"), EngineConfig)
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-algorithm", type=str.upper, choices=sorted(_SPECULATIVE_METHODS),
                      default=None, help="NEXTN: the model's MTP layer drafts (Ling-2.6); NGRAM: prompt lookup over "
                                         "the request's own tokens (any model) (default: off)")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="K",
                      help="draft tokens verified per step and request (needs --speculative-algorithm; default: "
                           "none)")
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None, metavar="N",
                      help="NGRAM: shortest suffix n-gram looked up (default: 2)")
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None, metavar="N",
                      help="NGRAM: longest suffix n-gram looked up, tried first (default: 4)")


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
    return option_values(args, EngineConfig) | {"speculative_config": _speculative_config(args)}


def _model_name(args: argparse.Namespace) -> str | None:
    """MODEL as given (positionally or by --model / --model-path), or None for the demo."""
    if args.model_arg is not None and args.model_option is not None and args.model_arg != args.model_option:
        raise ValueError(f"two models given: {args.model_arg!r} and --model {args.model_option!r}; give one")
    model = args.model_arg or args.model_option
    if model is not None and args.demo is not None:
        raise ValueError("give MODEL or --demo, not both")
    return model


def _model(args: argparse.Namespace) -> str:
    """MODEL as given, or the demo checkpoint's directory (written on first use)."""
    from hybridserve.demo import ensure_demo_checkpoint

    if args.trust_remote_code:
        logger.info("--trust-remote-code: hybridserve's models are native code; no code from the checkpoint is run")
    return _model_name(args) or str(ensure_demo_checkpoint(DEMOS[args.demo or "zaya"]))


def _served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """--served-model-name's names, else MODEL as given, else the demo's name (the Ling demo also answers to
    the zaya demo's, so that examples written for one run on either)."""
    if args.served_model_name:
        return tuple(args.served_model_name)
    model = _model_name(args)
    if model is not None:
        return (model,)
    return (DEMO_MODEL_NAME,) if args.demo in (None, "zaya") else (f"{DEMO_MODEL_NAME}-{args.demo}", DEMO_MODEL_NAME)


def _server_options(args: argparse.Namespace, model_path: str) -> ServerOptions:
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
    return ServerOptions(served_model_names=_served_names(args), model_path=model_path, api_key=args.api_key or None,
                         allowed_hosts=tuple(hosts) if hosts else None, chat_template=chat_template,
                         **option_values(args, ServerOptions))


def _serve(args: argparse.Namespace) -> NoReturn:
    from hybridserve.generation_config import load_generation_config
    from hybridserve.hub import local_checkpoint
    from hybridserve.server.app import bind_socket, run_server

    kwargs = _engine_kwargs(args)  # a bad option fails before anything is written or fetched
    model = _model(args)
    options = _server_options(args, model)
    # The model is found (a Hub id downloaded, or looked up in the cache offline; hub.py) and checked before the
    # port opens. Progress bars (a download, the weights loading) only on a terminal: in a log file they would
    # interleave with the log lines.
    config = local_checkpoint(EngineConfig(model=model, use_tqdm=sys.stderr.isatty(), **kwargs))
    if config.node_rank > 0:  # this node only runs tensor-parallel ranks; node 0 serves
        from hybridserve.runtime.tensor_parallel import run_worker_node

        run_worker_node(config)
        sys.exit(0)
    load_generation_config(config.generation_config, config.model)  # a bad --generation-config fails here
    sock = bind_socket(args.host, args.port)  # before the engine starts: a port in use fails at once
    code = run_server(config, options, sock)
    # Nothing is left to clean up: end the process now rather than have the interpreter free the model and the
    # caches object by object, which takes seconds for a large cache.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _generate(args: argparse.Namespace) -> int:
    from hybridserve import LLM, SamplingParams

    kwargs = _engine_kwargs(args)  # a bad option fails before the demo is written or a model fetched
    llm = LLM(_model(args), **kwargs)
    given = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k")
             if getattr(args, name) is not None}
    defaults = {**_GENERATE_DEFAULTS, **llm.engine.generation_config.sampling_defaults}
    params = SamplingParams(**{**defaults, **given}, seed=args.request_seed)
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
                           description="Serve MODEL (a Hub id or a directory; default: the built-in demo) over an "
                                       "OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
                                       "/v1/responses, /v1/models, /health, /metrics, /tokenize, /detokenize, ... "
                                       "(docs/serving.md).")
    _add_engine_options(serve)
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind, 0.0.0.0 for every interface (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help=f"the model's names in the API: the first is the one responses and metrics carry, any "
                             f"is accepted in requests (default: MODEL as given, or {DEMO_MODEL_NAME!r} for the "
                             f"demo; the Ling demo answers to '{DEMO_MODEL_NAME}-ling' and {DEMO_MODEL_NAME!r})")
    server.add_argument("--api-key", default=os.environ.get("HYBRIDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/*, /invocations, the tokenizer routes, "
                             "/flush_cache and /get_model_info (the probes /health, /health_generate, /ping, /metrics "
                             "and /version stay open) (default: $HYBRIDSERVE_API_KEY, else no key)")
    server.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="Host header names to answer (a guard against DNS rebinding); '*' for any (default: "
                             "the loopback names when --host is a loopback address, any otherwise)")
    server.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file that replaces the model's (default: the model's)")
    for flag, why in _ALWAYS_ON.items():
        server.add_argument(flag, action="store_true", help=f"accepted for vLLM / SGLang command lines: {why} "
                                                            "(default: on)")
    add_options(server, ServerOptions)
    serve.set_defaults(run=_serve)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_options(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    model_default = "the generation config's (--generation-config), else"
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"tokens to generate (default: {model_default} {_GENERATE_DEFAULTS['max_tokens']})")
    gen.add_argument("--temperature", type=float, default=None,
                     help=f"0 = greedy (default: {model_default} {_GENERATE_DEFAULTS['temperature']:g})")
    gen.add_argument("--top-p", type=float, default=None,
                     help=f"nucleus sampling threshold (default: {model_default} 1)")
    gen.add_argument("--top-k", type=int, default=None,
                     help=f"sample among the k likeliest tokens (default: {model_default} -1, off)")
    gen.add_argument("--request-seed", type=int, default=None, help="seed of this request's sampling (default: "
                                                                    "--seed's stream)")
    gen.set_defaults(run=_generate)
    parser.subcommands = {"serve": serve, "generate": gen}  # for --config, which applies to one of them
    return parser


def config_file_arguments(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The options of a YAML config file as command-line arguments (placed before the real ones, which win)."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"--config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path} is not valid YAML: {err}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must be a mapping of option names to values")
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    arguments = []
    for key, value in values.items():
        flag = f"--{str(key).replace('_', '-')}"
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}: unknown option {key!r} (see hybridserve serve --help)")
        if action.nargs == 0:  # a switch: true turns it on; false picks its opposite, if it has one
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} takes true or false, not {value!r}")
            opposite = [a for a in parser._actions if a.dest == action.dest and a.const == value]
            if action.const == value:
                arguments.append(flag)
            elif opposite:
                arguments.append(opposite[0].option_strings[0])
            continue
        arguments += [flag, *map(str, value if isinstance(value, list) else [value])]
    return arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a --config file's options in front of it."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    return parser.parse_args([argv[0], *config_file_arguments(parser.subcommands[args.command], args.config),
                              *argv[1:]])


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the server took over the signals (e.g. while writing the demo checkpoint)
        return 130


if __name__ == "__main__":
    sys.exit(main())
