#!/usr/bin/env python
"""Raise C++ errors many times -- through torch's own ops, then through torch.ops.ssd
(CPU, and CUDA when present) -- and say whether the process survives. A developer
tool for an environment where refused calls crashed the interpreter (run it under
a debugger, e.g. `cuda-gdb -batch -ex run -ex bt --args python tools/exception_probe.py`,
for a native backtrace).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401


def raises(fn) -> bool:
    try:
        fn()
    except RuntimeError:
        return True
    return False


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for label, fn in [("torch view", lambda d: torch.zeros(6, device=d).view(4)),
                      ("ssd.load_state rank", lambda d: torch.ops.ssd.load_state(torch.zeros(3, 4, 5, device=d))),
                      ("ssd.load_bc shape", lambda d: torch.ops.ssd.load_bc(torch.zeros(2, 1, 4, device=d),
                                                                          torch.zeros(2, 1, 5, device=d)))]:
        for device in devices:
            print(f"{label} on {device}: ", end="", flush=True)
            ok = sum(raises(lambda: fn(device)) for _ in range(rounds))
            print(f"{ok}/{rounds} raised, process alive", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
