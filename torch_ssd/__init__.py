"""torch_ssd: Mamba-2 / SSD decode-step kernels as ``torch.ops.ssd`` custom ops.

``import torch_ssd`` registers ``torch.ops.ssd.{load_state, load_bc, store_state,
decode_step, decode_step_out}`` for CPU (and CUDA / MPS where built and present).
"""

from .ops import (  # noqa: F401
    checks_enabled,
    decode_step,
    decode_step_out,
    load_bc,
    load_state,
    set_checks,
    store_state,
)
from . import reference  # noqa: F401

__version__ = "0.1.0"
