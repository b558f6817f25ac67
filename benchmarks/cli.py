"""What the entry points' command lines share: one entry, several modes (`python -m benchmarks.ENTRY MODE
[options]` runs MODE's module's `main()`, whose own parser reads the options, so `MODE --help` lists them), and the
options that pick the benchmarked model."""
from __future__ import annotations

import argparse
import importlib
import sys


def run_mode(entry: str, modes: dict[str, tuple[str, str]], argv: list[str] | None = None) -> None:
    """`modes`: name -> (module, what it measures). Without a known mode: the list of modes (exit 2, or 0 for
    --help)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in modes:
        width = max(map(len, modes))
        lines = [f"usage: python -m benchmarks.{entry} MODE [options]   (MODE --help lists its options)", "modes:"]
        lines += [f"  {name:<{width}}  {about}" for name, (_, about) in modes.items()]
        asked = argv[:1] in (["-h"], ["--help"])
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        raise SystemExit(0 if asked else 2)
    mode, *options = argv
    sys.argv = [f"python -m benchmarks.{entry} {mode}", *options]
    importlib.import_module(modes[mode][0]).main()


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, or the random model's --model-type, --width and --layers (hybridserve.demo.make_random_model)."""
    parser.add_argument("--model", default=None, help="HF-layout directory with its tokenizer (default: a random "
                                                      "model, see above)")
    parser.add_argument("--model-type", default="zaya", choices=["zaya", "ling"], help="the random model's family")
    parser.add_argument("--width", default="full", choices=["full", "demo"],
                        help="the random model's widths: ZAYA1-8B / Ling-2.6-flash, or the tiny demo ones")
    parser.add_argument("--layers", type=int, default=None, help="layers of the random model (default: real depth)")
