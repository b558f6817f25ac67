"""`python -m benchmarks.offline ab`: two builds of a checkout timed in alternating throughput runs (A B B A), the
patch applied for its build's runs only and the tree left as it was, also after a failed run; a patch that does not
apply is refused before anything runs. Runs on a copy of the checkout (the patch edits its files) at the demo widths
on CPU, as a command: the tests import nothing from benchmarks/."""
from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # scheduled first: tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
TARGET = "benchmarks/offline/throughput.py"
LABEL = 'f"random {args.model_type} ({args.width} widths)"'
SMOKE = ["--device", "cpu", "--width", "demo", "--layers", "2", "--load-format", "dummy", "--scenarios", "smoke",
         "--skip-hf", "--repeats", "1", "--dtype", "float32"]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the checkout's code, and in it `label.patch`: throughput's model label changed to "patched ..."."""
    copy = tmp_path / "checkout"
    for package in ("hybridserve", "benchmarks"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = (copy / TARGET).read_text()
    assert before.count(LABEL) == 1
    after = before.replace(LABEL, LABEL.replace("random", "patched"))
    diff = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{TARGET}", f"b/{TARGET}")
    (copy / "label.patch").write_text("".join(diff))
    return copy


def _ab(checkout: Path, *options: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.offline", "ab", *options], cwd=checkout,
                          capture_output=True, text=True, timeout=timeout)


def _labels(result: dict) -> list[tuple[str, str]]:
    return [(run["build"], run["result"]["model"].split()[0]) for run in result["runs"]]


def test_builds_alternate_and_the_tree_is_left_as_it_was(checkout: Path) -> None:
    before, out = (checkout / TARGET).read_text(), checkout / "ab.json"
    done = _ab(checkout, "--patch", "label.patch", "--rounds", "2", "--out", str(out), "--", *SMOKE)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["builds"] == ["as is", "with label.patch"]
    assert _labels(result) == [("as is", "random"), ("with label.patch", "patched"), ("with label.patch", "patched"),
                               ("as is", "random")]
    assert (checkout / TARGET).read_text() == before
    rates = {build: sorted(run["result"]["scenarios"]["smoke"]["ours_tok_s"] for run in result["runs"]
                           if run["build"] == build) for build in result["builds"]}
    row = result["summary"]["smoke"]["ours_tok_s"]
    assert {build: sorted(v) for build, v in row["runs"].items()} == rates
    medians = [sum(rates[build]) / 2 for build in result["builds"]]  # the median of two
    assert row["median"] == dict(zip(result["builds"], medians))
    assert row["ratio"] == pytest.approx(medians[1] / medians[0], rel=1e-12)


def test_reverse_takes_a_change_in_the_tree_back_for_the_other_build(checkout: Path) -> None:
    subprocess.run(["git", "apply", "label.patch"], cwd=checkout, check=True)
    changed, out = (checkout / TARGET).read_text(), checkout / "ab.json"
    done = _ab(checkout, "--patch", "label.patch", "--reverse", "--rounds", "1", "--out", str(out), "--", *SMOKE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _labels(json.loads(out.read_text())) == [("as is", "patched"), ("without label.patch", "random")]
    assert (checkout / TARGET).read_text() == changed


def test_a_failed_run_is_recorded_and_the_patch_still_taken_back(checkout: Path) -> None:
    before, out = (checkout / TARGET).read_text(), checkout / "ab.json"
    done = _ab(checkout, "--patch", "label.patch", "--rounds", "1", "--out", str(out), "--", *SMOKE[:-2],
               "--dtype", "float64")  # throughput's parser refuses it: every run fails
    assert done.returncode == 1
    runs = json.loads(out.read_text())["runs"]
    assert [run["build"] for run in runs] == ["as is", "with label.patch"]
    assert all("exit status 2" in run["result"]["error"] and "float64" in run["result"]["output_tail"] for run in runs)
    assert (checkout / TARGET).read_text() == before


def test_bad_invocations_are_refused_before_any_run(checkout: Path) -> None:
    (checkout / "stale.patch").write_text((checkout / "label.patch").read_text().replace("random", "nowhere"))
    for options, message in (
            (["--patch", "stale.patch", "--", *SMOKE], "does not apply to this tree"),
            (["--patch", "label.patch", "--reverse", "--", *SMOKE], "does not take back from this tree"),
            (["--patch", "missing.patch", "--", *SMOKE], "no such file"),
            (["--patch", "label.patch", "--", *SMOKE, "--out", "x.json"], "--out after --"),
            (["--patch", "label.patch", "--rounds", "0", "--", *SMOKE], "--rounds must be at least 1")):
        done = _ab(checkout, *options, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (options, done.stderr[-500:])
    assert not (checkout / "x.json").exists()
