"""Hugging Face ``transformers`` Mamba-2: single-token decode through ``torch.ops.ssd``.

``patch_mamba2(model)`` replaces, on each ``Mamba2Mixer`` instance of the model
(never on the class, so other models are untouched), the recurrent branch of the
mixer's forward: when the model's cache already holds this layer's state and one
token comes in, the SSM update runs as one ``torch.ops.ssd.decode_step`` on the
cache's own recurrent-state tensor, in place. Everything else (prefill, training,
calls without a cache) goes to the original forward unchanged.

Written against transformers 5.24+ (``Mamba2Mixer.forward(hidden_states, cache,
attention_mask)`` with ``cache.get_recurrent_state`` / ``get_conv_state``); on a
release without that API ``patch_mamba2`` refuses with the reason
(``unsupported_reason()``) and leaves the model as it is.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from ..serving import selective_state_update

__all__ = ["patch_mamba2", "unpatch_mamba2", "is_patched", "unsupported_reason"]

_ORIGINAL = "_torch_ssd_original_forward"
SUPPORTED = "transformers>=5.24,<6"


def _modeling():
    try:
        from transformers.models.mamba2 import modeling_mamba2
    except ImportError as err:  # transformers is an optional extra
        raise ImportError(
            "torch_ssd.integrations.transformers needs Hugging Face transformers: "
            "pip install 'torch_ssd[transformers]' (or pip install transformers)"
        ) from err
    return modeling_mamba2


def unsupported_reason() -> str | None:
    """Why the installed transformers cannot be patched, or None when it can.

    The patched forward uses the Mamba-2 cache API of transformers 5.24+
    (``get_conv_state`` / ``get_recurrent_state`` on the cache, ``cache=`` on
    ``Mamba2Mixer.forward``); releases without it would fail mid-generation.
    """
    modeling = _modeling()
    import transformers

    missing = [f"Cache.{name}" for name in ("get_conv_state", "get_recurrent_state")
               if not callable(getattr(transformers.DynamicCache, name, None))]
    if "cache" not in inspect.signature(modeling.Mamba2Mixer.forward).parameters:
        missing.append("Mamba2Mixer.forward(..., cache=...)")
    if not missing:
        return None
    return (f"transformers {transformers.__version__} lacks the Mamba-2 cache API this integration "
            f"is written for ({', '.join(missing)}); it supports {SUPPORTED}")


def _ssm_decode(mixer: nn.Module, hidden_states: torch.Tensor, cache, attention_mask):
    """The mixer's single-token path, with the SSM update on torch.ops.ssd.

    Mirrors the recurrent branch of ``Mamba2Mixer.forward``: in_proj, the model's own
    causal_conv1d_update on the cache's conv state, then the state-space step on the
    cache's recurrent state (updated in place), gated RMSNorm and out_proj.
    """
    modeling = _modeling()
    batch = hidden_states.shape[0]
    dtype = hidden_states.dtype
    layer = mixer.layer_idx
    conv_state = cache.get_conv_state(layer, state_idx=0)
    ssm_state = cache.get_recurrent_state(layer, state_idx=0)
    groups_state = mixer.n_groups * mixer.ssm_state_size

    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    projected = mixer.in_proj(hidden_states)
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)

    xBC = modeling.causal_conv1d_update(
        xBC.transpose(1, 2), conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
        activation=mixer.activation,
    )
    xBC = modeling.apply_mask_to_padding_states(xBC.transpose(1, 2), attention_mask)
    x, B, C = torch.split(xBC, [mixer.intermediate_size, groups_state, groups_state], dim=-1)

    # Per-head A, dt, D and dt_bias: selective_state_update expands them with stride 0 over
    # the head dim (and A over the state dim) instead of materialising copies.
    y = selective_state_update(
        ssm_state,
        x.reshape(batch, mixer.num_heads, mixer.head_dim),
        dt.reshape(batch, mixer.num_heads),
        -torch.exp(mixer.A_log.float()),
        B.reshape(batch, mixer.n_groups, mixer.ssm_state_size),
        C.reshape(batch, mixer.n_groups, mixer.ssm_state_size),
        D=mixer.D,
        dt_bias=mixer.dt_bias,
        dt_softplus=True,
    )
    y = mixer.norm(y.reshape(batch, 1, -1), gate)
    return mixer.out_proj(y.to(dtype))


def _is_decode_step(mixer: nn.Module, hidden_states: torch.Tensor, cache) -> bool:
    if cache is None or hidden_states.shape[1] != 1:
        return False
    layer = mixer.layer_idx
    # A cache recording its past states keeps the original path; caches of
    # transformers releases without that mode have no is_recording_past at all.
    recording = getattr(cache, "is_recording_past", None)
    if recording is not None and recording(layer):
        return False
    return cache.get_conv_state(layer, state_idx=0) is not None and \
        cache.get_recurrent_state(layer, state_idx=0) is not None


def _patched_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    original = getattr(self, _ORIGINAL)
    if "cache_params" in kwargs and cache is None:  # the deprecated name of the cache argument
        cache = kwargs.pop("cache_params")
    if _is_decode_step(self, hidden_states, cache):
        return _ssm_decode(self, hidden_states, cache, attention_mask)
    return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)


def _mixers(model: nn.Module):
    mixer_cls = _modeling().Mamba2Mixer
    return [m for m in model.modules() if isinstance(m, mixer_cls)]


def patch_mamba2(model: nn.Module) -> nn.Module:
    """Route the single-token decode SSM update of every ``Mamba2Mixer`` in ``model``
    through ``torch.ops.ssd.decode_step`` on the model's own cache; returns ``model``.

    Works on ``Mamba2ForCausalLM``, ``Mamba2Model`` or any module containing Mamba-2
    mixers; patching twice is a no-op. ``model.generate(...)``, a hand-written decode
    loop and ``torch.compile(model)`` all take the patched path.
    """
    mixers = _mixers(model)
    if not mixers:
        raise RuntimeError(f"patch_mamba2: {type(model).__name__} contains no transformers Mamba2Mixer layers")
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"patch_mamba2: {reason}")
    for mixer in mixers:
        if _ORIGINAL in mixer.__dict__:
            continue
        # Bound methods stored on the instance: nn.Module.__call__ picks them up and
        # the class (shared with unpatched models) stays as it is.
        setattr(mixer, _ORIGINAL, mixer.forward)
        mixer.forward = types.MethodType(_patched_forward, mixer)
    return model


def unpatch_mamba2(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_mamba2`; returns ``model``."""
    for mixer in _mixers(model):
        if _ORIGINAL in mixer.__dict__:
            del mixer.__dict__["forward"]
            del mixer.__dict__[_ORIGINAL]
    return model


def is_patched(model: nn.Module) -> bool:
    """True when every Mamba-2 mixer of ``model`` is patched."""
    mixers = _mixers(model)
    return bool(mixers) and all(_ORIGINAL in m.__dict__ for m in mixers)
