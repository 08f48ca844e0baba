"""Adapters that route third-party models' decode steps through ``torch.ops.ssd``.

Each adapter lives in its own module and imports its framework lazily, so
``import torch_ssd`` never needs them:

- ``torch_ssd.integrations.transformers.patch_mamba2(model)`` (Hugging Face
  ``transformers``; install the ``transformers`` extra).
"""
