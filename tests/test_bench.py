"""The main job (`python -m torch_ssd`, torch_ssd/bench.py): its input rotation, its exit
statuses, and a run end to end on tiny shapes (timings are printed, never asserted); the
multi-token benchmark's (tools/bench_multi.py) A/B of environment settings."""

import argparse
import json
import os
import sys

import pytest
import torch

from torch_ssd import bench


class _Sized:
    def __init__(self, nbytes):
        self._nbytes = nbytes

    def nbytes(self):
        return self._nbytes


@pytest.mark.parametrize("rotate, max_sets, want", [(250, 64, 3), (300, 64, 3), (301, 64, 4), (0, 64, 1),
                                                   (10_000, 5, 5)])
def test_rotating_sets_span_the_rotation_bytes(rotate, max_sets, want):
    made = []

    def make():
        made.append(_Sized(100))
        return made[-1]

    sets = bench.rotating_sets(make, rotate, max_sets=max_sets)
    assert len(sets) == want and sets == made  # the probe first, each set made once


def test_input_set_sweep_covers_every_case_in_order():
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cpu")
    cases = list(bench.input_set_sweep(["4,8,16,1"], ["fp32", "bf16"], [2, 3], device, gen))
    assert [(str(shape), name, pool_dtype, T) for shape, name, pool_dtype, T, _ in cases] == [
        ("(4,8,16,1)", "fp32", torch.float32, 2), ("(4,8,16,1)", "fp32", torch.float32, 3),
        ("(4,8,16,1)", "bf16", torch.bfloat16, 2), ("(4,8,16,1)", "bf16", torch.bfloat16, 3)]
    for shape, _, pool_dtype, T, sets in cases:
        assert len(sets) == min(64, -(-bench.rotation_bytes(device) // sets[0].nbytes()))
        assert all(s.pool.dtype == pool_dtype and s.pool.shape == (2 * T, 4, 8, 16) for s in sets)


def test_step_bytes_counts_each_addressed_state_twice():
    shape = bench.Shape.parse("4,8,16,2")
    f32 = bench.step_bytes(shape, 3, torch.float32, torch.bfloat16)
    bf16 = bench.step_bytes(shape, 3, torch.bfloat16, torch.bfloat16)
    assert f32 - bf16 == 2 * 3 * 4 * 8 * 16 * 2  # read + write of T states, 2 bytes per element apart


def test_main_job_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--shapes", "4,8,16,1", "--T", "2", "3", "--quick", "--no-compile",
                     "--no-progress", "--seconds", "0.01", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "(H,P,N,G) = (4,8,16,1)" in printed and "%copy" in printed
    result = json.loads(out.read_text())
    rows = {(r["T"], r["pool_dtype"]): r for r in result["rows"]}
    assert set(rows) == {(2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")}
    shape = bench.Shape.parse("4,8,16,1")
    for (T, pool), row in rows.items():
        assert row["bytes_per_step"] == bench.step_bytes(shape, T, bench.DTYPES[pool], torch.bfloat16)
        assert row["op_s"] > 0 and row["ref_s"] > 0 and row["compiled_s"] is None
    assert result["copy_GBps"] > 0


@pytest.mark.parametrize("argv", [["--T", "0"], ["--T", "2", "-1"]])
def test_main_job_refuses_a_non_positive_T(argv, capsys):
    assert bench.main(["--device", "cpu", "--check-only", "--no-progress"] + argv) == 2
    assert "--T: every T must be positive" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_main_job_says_when_cuda_is_missing(capsys):
    assert bench.main(["--device", "cuda", "--no-progress"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_sweep_args_give_the_tools_defaults_and_take_overrides():
    ap = argparse.ArgumentParser()
    bench.add_sweep_args(ap, T=[64, 256], seconds=0.2)
    got = ap.parse_args([])
    assert (got.shapes, got.pool_dtypes, got.T, got.seconds) == (bench.MODEL_SHAPES, ["fp32", "bf16"], [64, 256], 0.2)
    got = ap.parse_args(["--T", "1", "16", "--pool-dtypes", "bf16", "--seconds", "0.05"])
    assert (got.T, got.pool_dtypes, got.seconds) == ([1, 16], ["bf16"], 0.05)


def _load_tool(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_bench_multi_env_settings_are_set_for_a_timing_then_restored(monkeypatch):
    bench_multi = _load_tool("bench_multi")
    monkeypatch.setenv("TORCH_SSD_TEST_A", "kept")
    monkeypatch.delenv("TORCH_SSD_TEST_B", raising=False)
    setting = bench_multi.EnvSetting("TORCH_SSD_TEST_A=1,TORCH_SSD_TEST_B=2")
    with setting:
        assert (os.environ["TORCH_SSD_TEST_A"], os.environ["TORCH_SSD_TEST_B"]) == ("1", "2")
    assert os.environ["TORCH_SSD_TEST_A"] == "kept"
    assert "TORCH_SSD_TEST_B" not in os.environ
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        bench_multi.EnvSetting("TORCH_SSD_TEST_A")


def test_bench_multi_times_each_env_setting_and_the_y_only_form(tmp_path, capsys):
    bench_multi = _load_tool("bench_multi")
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--shapes", "4,8,16,1", "--K", "2", "--T", "2", "--pool-dtype", "fp32",
            "--budget", "0.01", "--no-reference", "--json", str(out), "--ab", "TORCH_SSD_TEST_AB=1", "--y-only"]
    assert bench_multi.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and set(rows[0]["ab_s"]) == {"default", "TORCH_SSD_TEST_AB=1"}
    assert all(t > 0 for t in rows[0]["ab_s"].values()) and rows[0]["y_only_s"] > 0
    # y only moves the state once: K = 2 writes of 2 * 4 * 8 * 16 float32 elements fewer.
    assert rows[0]["bytes"] - rows[0]["y_only_bytes"] == 2 * (2 * 4 * 8 * 16 * 4)
    printed = capsys.readouterr().out
    assert "TORCH_SSD_TEST_AB=1:" in printed and "y only (write_state=False)" in printed
    assert "write-only (fill) bandwidth" in printed
    assert "TORCH_SSD_TEST_AB" not in os.environ


_NCU_SOURCE_CSV = '''==PROF== Connected to process 1 (python3)
"Kernel Name","void k(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_short_sb","stall_long_sb (Not Issued)"
"0x7f0000000100","  LDG.E.U16 R2, desc[UR4][R4.64]","1","40","0","0","0"
"0x7f0000000110","  IMAD.U32 R0, R2, 0x10000, RZ","30","40","29","1","29"
"0x7f0000000120","  FFMA R1, R0, R0, R1","6","400","0","5","0"
"0x7f0000000130","  @P0   BRA 0x7f0000000120","3","400","0","0","0"
"0x7f0000000140","  EXIT","0","0","0","0","0"
==PROF== Disconnected from process 1
'''


def test_ncu_source_summary_groups_instructions_by_executions_and_ranks_stalls(tmp_path, capsys):
    summary = _load_tool("ncu_source_summary")
    kernel, instructions = summary.parse(_NCU_SOURCE_CSV)
    assert kernel == "void k(int)"
    assert [(i.offset, i.opcode, i.executed) for i in instructions] == [
        (0x0, "LDG.E.U16", 40), (0x10, "IMAD.U32", 40), (0x20, "FFMA", 400), (0x30, "BRA", 400), (0x40, "EXIT", 0)]
    assert instructions[1].stalls == {"long_sb": 29, "short_sb": 1}  # the Not-Issued column is not a reason
    text = summary.report(kernel, instructions, top=2)
    lines = text.splitlines()
    groups = [line.split() for line in lines[lines.index(next(x for x in lines if x.strip().startswith("executions"))) + 1:]
              if line.strip() and line.split()[0].replace(",", "").isdigit()][:2]
    # 800 of 880 executions in the loop (two instructions, 400 each), 9 of 40 samples
    assert groups[0][:4] == ["400", "2", "90.9", "22.5"] and groups[1][:4] == ["40", "2", "9.1", "77.5"]
    top = lines[-2:]
    assert top[0].split()[:5] == ["0x10", "75.0", "40", "long_sb", "97"] and "IMAD.U32 R0" in top[0]
    assert top[1].split()[:3] == ["0x20", "15.0", "400"] and "short_sb 83 %" in top[1]
    path = tmp_path / "source.csv"
    path.write_text(_NCU_SOURCE_CSV)
    assert summary.main([str(path), "--top", "1"]) == 0
    assert "IMAD.U32 R0" in capsys.readouterr().out
    path.write_text("Metric Name,Metric Value\nDuration,1\n")  # a details page, not the source page
    assert summary.main([str(path)]) == 2
    assert "Address" in capsys.readouterr().err
