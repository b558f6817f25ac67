"""Run the GPU tests on a CUDA machine, each test file in a pytest process of its own: an illegal memory access
poisons the CUDA context of the process it happens in, so one faulting kernel must not hide the other files' results.

The files: every tests/**/test_*.py whose module-level `pytestmark` carries `pytest.mark.gpu` (read from the
source, nothing imported), in two groups that run side by side:
  engines  the files marked gpu(engine=True): each builds LLMs whose memory plans count what the device holds, so
           two run at a time (--engine-jobs);
  kernels  the other gpu files and the kernel tests of tests/ops (interpreted on CPU, compiled on the GPU here),
           four at a time (--kernel-jobs).
`all` is both groups; on a fresh H200 they took longer together than the device tool's 600 s a command, so run one
group per call. `--files` runs the files named instead, each in its group's pool by its marker.

Each file has --file-timeout seconds (default 450) and the whole run --limit seconds (default 520): a file still
running at the limit is stopped and one not started yet is reported as such, so that the summary and the logs still
come back from a call that ran out of time. pytest runs with `-o addopts=` (pyproject's asks for pytest-xdist workers,
which the device image lacks) and `-s` (the tests print what they measured). Logs go to OUT/logs (OUT: --out, else
$OUT, else gpu-out), bundled into OUT/gpu-tests-GROUP.tgz at the end (the device tool brings back at most 8 files);
one line per file (rc, seconds, pytest's counts) is printed as each ends, and all of them at the end and in
OUT/gpu-tests-GROUP.txt (GROUP: the group's name, or "files").

    python tests/gpu/run.py kernels
    python tests/gpu/run.py engines
    python tests/gpu/run.py --files tests/gpu/test_pdl_gpu.py tests/ops/test_conv_kernel.py --show 'largest|pool'
    python tests/gpu/run.py all --list                 # the files of each group, nothing run
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = "tests/ops/test_*.py"
PYTEST = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-s"]
COUNTS = re.compile(r"\d+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b.*")


def gpu_marker(source: str) -> dict | None:
    """The keywords of the `pytest.mark.gpu` in a module's `pytestmark` ({} when it has none), None if it has no
    such marker."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            for part in ast.walk(node.value):
                call = part if isinstance(part, ast.Call) else None
                mark = call.func if call is not None else part
                if isinstance(mark, ast.Attribute) and mark.attr == "gpu" and isinstance(mark.value, ast.Attribute) \
                        and mark.value.attr == "mark":
                    return {k.arg: ast.literal_eval(k.value) for k in call.keywords} if call is not None else {}
    return None


def groups(files: list[str] | None = None) -> dict[str, list[str]]:
    """{"engines": [...], "kernels": [...]}: `files` (default: the gpu-marked test files and the kernel tests),
    relative to the repository root, by their marker."""
    if files is None:
        marked = [p for p in sorted(ROOT.glob("tests/**/test_*.py")) if gpu_marker(p.read_text()) is not None]
        paths = list(dict.fromkeys(marked + sorted(ROOT.glob(KERNEL_TESTS))))
    else:
        paths = [(ROOT / f).resolve() for f in files]
    found: dict[str, list[str]] = {"engines": [], "kernels": []}
    for path in paths:
        marker = gpu_marker(path.read_text()) or {}
        found["engines" if marker.get("engine") else "kernels"].append(str(path.relative_to(ROOT)))
    return found


@dataclass
class Outcome:
    file: str
    rc: str  # pytest's exit status, "timeout", "stopped" (SIGTERM), or "not run" (no time left to start it)
    seconds: float = 0.0
    counts: str = ""

    def line(self) -> str:
        return f"{self.file:<48} rc={self.rc:<8} {self.seconds:5.0f} s  {self.counts}"


class Runner:
    """Runs files until `deadline` (time.monotonic()), each in its own process group, logs in `logs`."""

    def __init__(self, logs: Path, deadline: float, file_timeout: float):
        self.logs, self.deadline, self.file_timeout = logs, deadline, file_timeout
        self.running: set[subprocess.Popen] = set()
        self.stopped: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def run(self, file: str) -> Outcome:
        budget = min(self.file_timeout, self.deadline - time.monotonic())
        if budget <= 0:
            return self._report(Outcome(file, "not run"))
        log = self.logs / f"{Path(file).stem}.log"
        start = time.monotonic()
        with open(log, "wb") as out:
            process = subprocess.Popen([*PYTEST, file], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                       process_group=0)  # a group of its own: a timeout stops its children too
            with self.lock:
                self.running.add(process)
            try:
                rc = str(process.wait(timeout=budget))
            except subprocess.TimeoutExpired:
                self.stop(process)
                rc = "timeout"
            with self.lock:
                self.running.discard(process)
                rc = "stopped" if process in self.stopped else rc
        counts = [m.group(0).strip(" =") for m in map(COUNTS.search, log.read_text(errors="replace").splitlines()) if m]
        return self._report(Outcome(file, rc, time.monotonic() - start, counts[-1] if counts else ""))

    @staticmethod
    def stop(process: subprocess.Popen) -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()

    def stop_all(self) -> None:
        """Stop the files running and start no more (SIGTERM: the caller's own time is up)."""
        self.deadline = 0.0
        with self.lock:
            running = list(self.running)
            self.stopped.update(running)
        for process in running:
            self.stop(process)

    @staticmethod
    def _report(outcome: Outcome) -> Outcome:
        print(outcome.line(), flush=True)
        return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("group", nargs="?", default="all", choices=["all", "engines", "kernels"])
    parser.add_argument("--files", nargs="+", default=None, help="these test files instead of a group")
    parser.add_argument("--list", action="store_true", help="print the files of each group and exit")
    parser.add_argument("--limit", type=float, default=520, help="seconds for the whole run")
    parser.add_argument("--file-timeout", type=float, default=450, help="seconds for one file")
    parser.add_argument("--engine-jobs", type=int, default=2)
    parser.add_argument("--kernel-jobs", type=int, default=4)
    parser.add_argument("--show", default=None, metavar="REGEX", help="afterwards, print the log lines that match")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-out"))
    args = parser.parse_args()
    deadline = time.monotonic() + args.limit
    selected = groups(args.files)
    if args.files is None and args.group != "all":
        selected = {args.group: selected[args.group]}
    if args.list:
        for name, files in selected.items():
            print(f"{name}:", *files, sep="\n  ")
        return
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    os.environ.update(NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")  # the children's environment
    runner = Runner(logs, deadline, args.file_timeout)
    signal.signal(signal.SIGTERM, lambda *_: runner.stop_all())  # then the summary and the logs as usual
    jobs = {"engines": args.engine_jobs, "kernels": args.kernel_jobs}
    pools = [ThreadPoolExecutor(jobs[name]) for name in selected]
    futures = [pool.submit(runner.run, file) for pool, files in zip(pools, selected.values()) for file in files]
    outcomes = sorted((f.result() for f in futures), key=lambda o: o.file)
    summary = "\n".join(o.line() for o in outcomes)
    print(f"\n{summary}")
    name = "gpu-tests-" + ("files" if args.files else args.group)
    (args.out / f"{name}.txt").write_text(summary + "\n")
    if args.show:
        pattern = re.compile(args.show)
        for log in sorted(logs.glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if pattern.search(line):
                    print(f"{log.stem}: {line}")
    with tarfile.open(args.out / f"{name}.tgz", "w:gz") as bundle:
        bundle.add(logs, arcname="logs")
    shutil.rmtree(logs)
    sys.exit(0 if all(o.rc == "0" for o in outcomes) else 1)


if __name__ == "__main__":
    main()
