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
from .multi import decode_step_multi, decode_step_multi_out, decode_step_varlen, decode_step_varlen_out  # noqa: F401
from . import reference_multi  # noqa: F401
from .serving import StatePool, selective_state_update  # noqa: F401

import torch as _torch

if _torch.backends.mps.is_available():
    from . import mps  # noqa: F401  (registers the Metal kernels for the MPS dispatch key)

__version__ = "0.1.0"
