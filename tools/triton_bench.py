"""What the Triton developer tools (cuda_pattern_ceiling.py, cuda_step_parts.py) share:
torch_ssd importable from a checkout, Triton where it is installed (`triton` and `tl`
are None without it), and the same-run copy their tables are measured against."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401
from torch_ssd import bench

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def missing_requirement(tool: str) -> str | None:
    """Why `tool` cannot run here (no CUDA device, no Triton), or None."""
    if not torch.cuda.is_available():
        return f"{tool}: needs a CUDA device"
    if triton is None:
        return f"{tool}: needs Triton"
    return None


def start(device: torch.device, seconds: float) -> tuple[bench.Timer, float]:
    """The tools' timer and the same-run copy bandwidth (bytes/s), with the header line
    that names the copy, the GPU and the torch and Triton versions."""
    timer = bench.Timer(device, budget_s=seconds, min_samples=5, max_samples=100)
    copy_Bps = bench.copy_bandwidth(device, bench.copy_ceiling_bytes(device), timer)
    print(f"copy {copy_Bps / 1e9:.1f} GB/s | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {triton.__version__}")
    return timer, copy_Bps
