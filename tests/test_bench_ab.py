"""tools/bench_ab.py: a knob's settings against the first one, from benchmark JSON files."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_ab  # noqa: E402


def write(tmp_path, value, rnd, graph_us, plain_us):
    rows = [{"shape": "(80,64,128,1)", "pool_dtype": "bf16", "T": 1, "op_s": plain_us * 1e-6,
             "graph_s": graph_us * 1e-6}]
    path = tmp_path / f"bench-ab-{value}-r{rnd}.json"
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_change_of_the_mean_against_the_first_value(tmp_path, capsys):
    files = [write(tmp_path, "0", 1, 4.0, 10.0), write(tmp_path, "0", 2, 4.2, 10.0),
             write(tmp_path, "2", 1, 3.0, 12.0), write(tmp_path, "2", 2, 3.28, 12.0)]
    assert bench_ab.main(["--knob", "K", "--values", "0 2", *map(str, files)]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("(80,64,128,1) bf16 T=1"))
    # (3.0 + 3.28) / 2 = 3.14 against (4.0 + 4.2) / 2 = 4.1: -23.4 %; plain 12 against 10: +20 %.
    assert "0: 4.00,4.20" in line and "2: 3.00,3.28 (-23.4%, plain +20.0%)" in line


def test_a_value_without_files_is_an_error(tmp_path):
    files = [write(tmp_path, "0", 1, 4.0, 10.0)]
    with pytest.raises(SystemExit, match="no files for value"):
        bench_ab.main(["--knob", "K", "--values", "0 1", *map(str, files)])


def test_a_file_not_named_by_the_stage_is_an_error(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="is not named"):
        bench_ab.main(["--knob", "K", "--values", "0", str(path)])
