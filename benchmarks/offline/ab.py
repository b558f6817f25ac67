"""Two builds of this checkout timed side by side in one run: `throughput` on the tree as it is and on the tree with a
patch applied (or, with --reverse, taken back: the build before a change already in the tree), alternating A B B A
... over --rounds so that a machine's drift falls on both builds alike. The issues ask for a change's effect as a
ratio measured in one run (before against after); this is that run, as one command on the GPU machine.

    git diff > /tmp/change.patch      # or `git show COMMIT > ...` and --reverse on a tree that has COMMIT
    python -m benchmarks.offline ab --patch /tmp/change.patch [--reverse] [--rounds 2] [--timeout 240] \\
        [--out FILE] -- --layers 40 --scenarios b1 b64 --repeats 2 [any other throughput option but --out]

Each run is `python -m benchmarks.offline throughput ...` in a process of its own (a build's modules and Triton
kernels are loaded once per process), the patch applied with `git apply` just before a run of its build and taken
back right after, also when the run fails or times out; a failed run is recorded and the others go on. Prints and
writes (--out) every run's result in call order and, per scenario, each build's medians of the output rate and of
the rate after the first tokens, and the second build's ratio to the first."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose builds are timed: the patch applies to its tree
RATES = ("ours_tok_s", "ours_decode_tok_s")  # throughput's output rate, and its rate after the first tokens


def _git_apply(patch: Path, reverse: bool, check: bool = False) -> subprocess.CompletedProcess:
    command = ["git", "apply", *(["--reverse"] if reverse else []), *(["--check"] if check else []), str(patch)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


@contextmanager
def _patched(patch: Path | None, reverse: bool):
    """The tree with `patch` applied (reversed with `reverse`) inside the block and as it was after it; None: as is."""
    if patch is None:
        yield
        return
    applied = _git_apply(patch, reverse)
    if applied.returncode:
        raise RuntimeError(f"git apply {patch} failed: {applied.stderr.strip()}")
    try:
        yield
    finally:
        restored = _git_apply(patch, not reverse)
        if restored.returncode:
            raise RuntimeError(f"taking {patch} back failed, the tree is left patched: {restored.stderr.strip()}")


def call_order(rounds: int) -> list[int]:
    """Build indices in call order: A B, then B A, then A B ..."""
    return [build for r in range(rounds) for build in ((0, 1) if r % 2 == 0 else (1, 0))]


def _run(options: list[str], timeout: float, out: Path) -> dict:
    """One throughput run: its result JSON, or {"error": ...} with the end of its output."""
    command = [sys.executable, "-m", "benchmarks.offline", "throughput", *options, "--out", str(out)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    if done.returncode or not out.exists():
        return {"error": f"exit status {done.returncode}", "output_tail": (done.stdout + done.stderr)[-2000:]}
    return json.loads(out.read_text())


def summary(builds: list[str], runs: list[dict]) -> dict:
    """Per scenario and rate: each build's rates in call order, their median, and the second build's median over
    the first's (None where a build has no rate)."""
    scenarios = {}
    for run in runs:
        for name, entry in run["result"].get("scenarios", {}).items():
            for rate in RATES:
                if entry.get(rate) is not None:
                    per_build = scenarios.setdefault(name, {}).setdefault(rate, {build: [] for build in builds})
                    per_build[run["build"]].append(entry[rate])
    table = {}
    for name, rates in scenarios.items():
        for rate, per_build in rates.items():
            medians = {build: statistics.median(v) if v else None for build, v in per_build.items()}
            first, second = (medians[build] for build in builds)
            table.setdefault(name, {})[rate] = {"runs": per_build, "median": medians,
                                                "ratio": second / first if first and second else None}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="python -m benchmarks.offline ab --patch FILE [options] -- THROUGHPUT_OPTIONS")
    parser.add_argument("--patch", type=Path, required=True, help="a patch of this tree (`git diff` / `git show`)")
    parser.add_argument("--reverse", action="store_true",
                        help="the tree already has the change: the other build takes the patch back")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each build, alternating A B B A ...")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    parser.add_argument("--out", default=None, help="write the runs and the summary here as JSON")
    parser.add_argument("throughput", nargs=argparse.REMAINDER, help="after --: the throughput options of every run")
    args = parser.parse_args()
    options = args.throughput[1:] if args.throughput[:1] == ["--"] else args.throughput
    if "--out" in options:
        parser.error("--out after --: each run's result is written by this command; give --out before --")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    patch = args.patch.resolve()
    if not patch.is_file():
        parser.error(f"--patch {args.patch}: no such file")
    check = _git_apply(patch, args.reverse, check=True)
    if check.returncode:
        parser.error(f"--patch {args.patch} does not {'take back from' if args.reverse else 'apply to'} this tree: "
                     f"{check.stderr.strip()}")
    builds = ["as is", f"{'without' if args.reverse else 'with'} {args.patch.name}"]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, build in enumerate(call_order(args.rounds)):
            with _patched(patch if build else None, args.reverse):
                result = _run(options, args.timeout, Path(scratch) / f"run-{index}.json")
            runs.append({"build": builds[build], "result": result})
            print(f"run {index + 1} ({builds[build]}): "
                  + (result["error"] if "error" in result else ", ".join(
                      f"{name} {entry['ours_tok_s']:.1f} tok/s" for name, entry in result["scenarios"].items())),
                  flush=True)
    table = summary(builds, runs)
    print(f"{'scenario':<10} {'rate':<18} {builds[0]:>14} {builds[1][:24]:>24} {'ratio':>7}")
    for name, rates in table.items():
        for rate, row in rates.items():
            first, second = (row["median"][build] for build in builds)
            cells = [f"{v:.1f}" if v is not None else "-" for v in (first, second)]
            ratio = f"{row['ratio']:.4f}" if row["ratio"] is not None else "-"
            print(f"{name:<10} {rate:<18} {cells[0]:>14} {cells[1]:>24} {ratio:>7}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "patch": str(args.patch), "reverse": args.reverse, "builds": builds, "throughput_options": options,
            "runs": runs, "summary": table}, indent=1))
    if any("error" in run["result"] for run in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
