"""tools/device_run.sh's orchestration, run here with a stand-in Python (no GPU, no build).

The device calls rely on it: `builds` (build and build-base at once), the *-base stages
running in BASE_TREE, a missing BASE_TREE failing only its stages, PACK=1 leaving a single
archive in OUT, a bench stage listed twice keeping both JSON tables. The script is copied into a scratch tree, so its build stage's clean-up
(`rm -f torch_ssd/_C*.so`) never touches this checkout.
"""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils' timeout",
)

# Records where it ran and with what, writes the file after --json; `setup.py build_ext`
# fails with status 3 in a tree named in FAKE_FAIL_IN.
FAKE_PYTHON = """#!/bin/sh
echo "fake-python cwd=$PWD args=$*"
prev=
for a in "$@"; do
  [ "$prev" = --json ] && echo "{}" > "$a"
  prev=$a
done
case "$*" in
  *build_ext*)
    mkdir -p torch_ssd && : > torch_ssd/_C.so
    case "$PWD" in *"${FAKE_FAIL_IN:-/nowhere/}"*) exit 3 ;; esac ;;
esac
exit 0
"""


@pytest.fixture
def scratch(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "device_run.sh", tree / "tools" / "device_run.sh")
    (tree / ".ab_base").mkdir()
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tree, fake


# Settings device_run.sh reads: the caller's own (e.g. PACK=1 when this file runs inside a device
# call) must not leak into these runs.
SCRIPT_SETTINGS = ("OUT", "PACK", "PYTHON", "BASE_TREE", "BUDGET_S", "TEST_CAP_S", "TEST_PATHS",
                   "TEST_ARGS", "TEST_WORKERS", "BENCH_ARGS", "TUNE_ARGS", "PATTERN_ARGS", "PARTS_ARGS",
                   "MULTI_ARGS", "MULTI_BUDGET", "BC_PATHS", "FUZZ_CASES", "NCU_CASES", "NCU_ARGS")


def run(tree, fake, out, stages, **env):
    full = {k: v for k, v in os.environ.items() if k not in SCRIPT_SETTINGS}
    full.update(PYTHON=str(fake), OUT=str(out), BASE_TREE=".ab_base")
    full.update(env)
    return subprocess.run(["bash", "tools/device_run.sh", *stages], cwd=tree, env=full,
                          capture_output=True, text=True, timeout=120)


def summary_lines(text):
    return {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.strip()}


def run_summary(tree, fake, tmp_path, stages, **env):
    """run() with OUT = tmp_path/out: the result, OUT, and summary.txt's status per stage."""
    out = tmp_path / "out"
    r = run(tree, fake, out, stages, **env)
    return r, out, summary_lines((out / "summary.txt").read_text())


def test_builds_and_base_stages_packed(scratch, tmp_path):
    tree, fake = scratch
    out = tmp_path / "out"
    r = run(tree, fake, out, ["builds", "bench-quick", "bench-quick-base"], PACK="1", BUDGET_S="100")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["device_out.tgz"]
    unpacked = tmp_path / "unpacked"
    with tarfile.open(out / "device_out.tgz") as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    names = {p.name for p in unpacked.iterdir()}
    assert {"build.log", "build-base.log", "bench.log", "bench-base.log", "summary.txt"} <= names
    assert ".build-base" not in names  # the second run's scratch folder is gone
    status = summary_lines((unpacked / "summary.txt").read_text())
    assert set(status) == {"build", "build-base", "bench-quick", "bench-quick-base"}
    assert all(v.startswith("ok") for v in status.values()), status
    # Each build ran in its own tree; the base benchmark in BASE_TREE.
    assert f"cwd={tree} " in (unpacked / "build.log").read_text()
    assert f"cwd={tree / '.ab_base'} " in (unpacked / "build-base.log").read_text()
    assert f"cwd={tree / '.ab_base'} " in (unpacked / "bench-base.log").read_text()
    assert f"cwd={tree} " in (unpacked / "bench.log").read_text()


def test_failed_base_build_fails_only_its_stage(scratch, tmp_path):
    tree, fake = scratch
    r, out, status = run_summary(tree, fake, tmp_path, ["builds", "bench-quick"], FAKE_FAIL_IN=".ab_base")
    assert r.returncode != 0
    assert status["build"].startswith("ok")
    assert status["build-base"].startswith("FAILED (exit 3)")
    assert status["bench-quick"].startswith("ok")  # the script went on


def test_missing_base_tree(scratch, tmp_path):
    tree, fake = scratch
    r, out, status = run_summary(tree, fake, tmp_path, ["builds", "bench-quick-base"], BASE_TREE=".missing")
    assert r.returncode != 0
    assert "BASE_TREE '.missing' is not a directory" in r.stdout
    assert status["build"].startswith("ok")
    assert status["build-base"].startswith("FAILED (exit 2)")
    assert status["bench-quick-base"].startswith("FAILED (exit 2)")


def test_failed_build_stops_the_script(scratch, tmp_path):
    tree, fake = scratch
    r, out, status = run_summary(tree, fake, tmp_path, ["build", "bench-quick"], FAKE_FAIL_IN=str(tree))
    assert r.returncode != 0
    assert status["build"].startswith("FAILED (exit 3)")
    assert "bench-quick" not in status


def test_a_stage_listed_twice_keeps_both_tables(scratch, tmp_path):
    tree, fake = scratch
    r, out, status = run_summary(tree, fake, tmp_path, ["build", "bench-quick", "bench-multi", "bench-quick",
                                                        "bench-multi"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert {"bench.json", "bench-2.json", "bench-multi.json", "bench-multi-2.json"} <= {p.name for p in out.iterdir()}
    assert f"--json {out / 'bench-2.json'}" in (out / "bench.log").read_text()
