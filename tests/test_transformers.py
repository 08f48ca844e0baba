"""Hugging Face transformers Mamba-2 decoding through torch.ops.ssd, and the serving demo.

A tiny randomly initialised Mamba2ForCausalLM (no downloads). Needs the optional
``transformers`` extra; CI installs it, so these run there.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ssd  # noqa: F401  (registers torch.ops.ssd)

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install 'torch_ssd[transformers]')"
)

from torch_ssd.integrations.transformers import (  # noqa: E402
    is_patched,
    patch_mamba2,
    unpatch_mamba2,
    unsupported_reason,
)

# The integration targets one cache API (transformers 5.24+, what CI installs); on other
# releases patch_mamba2 refuses with a reason and these tests have nothing to check.
UNSUPPORTED = unsupported_reason()
pytestmark = pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))

NUM_LAYERS = 2
PROMPT_LEN = 7
NEW_TOKENS = 40


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "falling back to the PyTorch implementation" notices
    yield
    transformers.logging.set_verbosity(verbosity)


def tiny_model(seed=0):
    config = transformers.Mamba2Config(
        vocab_size=96, hidden_size=64, num_hidden_layers=NUM_LAYERS, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, pad_token_id=0, bos_token_id=0, eos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.Mamba2ForCausalLM(config).eval()


def prompt(batch=2, seed=1):
    return torch.randint(1, 96, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


class CountSsdOps(TorchDispatchMode):
    """Counts torch.ops.ssd calls that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ssd":
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def greedy(model, ids, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def decode_loop(model_or_fn, model, ids, steps):
    """Prefill with the eager model, then ``steps`` single-token steps through ``model_or_fn``.
    Returns (tokens, logits of each step, the cache)."""
    with torch.no_grad():
        out = model(ids, use_cache=True, attention_mask=torch.ones_like(ids))
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens, logits = [token], []
        for _ in range(steps):
            out = model_or_fn(input_ids=token, cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, 1), torch.stack(logits), cache


def test_greedy_generation_matches_unpatched():
    ids = prompt()
    expected = greedy(tiny_model(), ids)
    model = patch_mamba2(tiny_model())
    with CountSsdOps() as counter:
        got = greedy(model, ids)
    assert got.shape == (2, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(got, expected)
    # Every token after the first came from a decode step that ran on torch.ops.ssd, once per layer.
    assert counter.calls.get("decode_step", 0) == (NEW_TOKENS - 1) * NUM_LAYERS


def test_decode_step_is_detected_on_caches_without_past_recording():
    # Caches of transformers releases without past-state recording have no
    # is_recording_past (seen on the GPU machine's image); with it, recording wins.
    from torch_ssd.integrations.transformers import _is_decode_step

    class OldCache:
        def get_conv_state(self, layer, state_idx=0):
            return torch.zeros(1)

        def get_recurrent_state(self, layer, state_idx=0):
            return torch.zeros(1)

    class RecordingCache(OldCache):
        def is_recording_past(self, layer):
            return True

    mixer = torch.nn.Module()
    mixer.layer_idx = 0
    one_token = torch.zeros(2, 1, 8)
    assert _is_decode_step(mixer, one_token, OldCache())
    assert not _is_decode_step(mixer, one_token, RecordingCache())
    assert not _is_decode_step(mixer, torch.zeros(2, 3, 8), OldCache())


def test_decode_logits_and_cache_state_match_unpatched():
    ids = prompt(batch=3, seed=2)
    ref_model = tiny_model()
    ref_tokens, ref_logits, ref_cache = decode_loop(ref_model, ref_model, ids, steps=12)
    model = patch_mamba2(tiny_model())
    tokens, logits, cache = decode_loop(model, model, ids, steps=12)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for layer in range(NUM_LAYERS):
        # The op updated the model's own cache tensors in place.
        torch.testing.assert_close(cache.get_recurrent_state(layer), ref_cache.get_recurrent_state(layer),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.get_conv_state(layer), ref_cache.get_conv_state(layer))


def test_patched_model_runs_under_torch_compile():
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor_recording_ops(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return compile_fx(gm, example_inputs)

    model = patch_mamba2(tiny_model())
    ids = prompt()
    eager_tokens, eager_logits, eager_cache = decode_loop(model, model, ids, steps=4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=inductor_recording_ops, fullgraph=True)
    tokens, logits, cache = decode_loop(compiled, model, ids, steps=4)
    torch._dynamo.reset()
    assert len(graphs) == 1  # one graph for every decode step: no break, no recompile
    assert any("ssd.decode_step" in target for target in graphs[0])
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-5)
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(cache.get_recurrent_state(layer), eager_cache.get_recurrent_state(layer),
                                   rtol=1e-4, atol=1e-5)


def test_patch_is_per_model_idempotent_and_reversible():
    ids = prompt()
    patched, plain = tiny_model(), tiny_model()
    assert patch_mamba2(patched) is patched
    patch_mamba2(patched)  # twice is a no-op
    assert is_patched(patched) and not is_patched(plain)
    with CountSsdOps() as counter:
        greedy(plain, ids, new_tokens=4)
    assert counter.calls == {}  # the class is untouched: other models keep their own path
    with CountSsdOps() as counter:
        greedy(patched, ids, new_tokens=4)
    assert counter.calls == {"decode_step": 3 * NUM_LAYERS}
    unpatch_mamba2(patched)
    assert not is_patched(patched)
    with CountSsdOps() as counter:
        greedy(patched, ids, new_tokens=4)
    assert counter.calls == {}


def test_patch_refuses_a_model_without_mamba2_layers():
    with pytest.raises(RuntimeError, match="no transformers Mamba2Mixer"):
        patch_mamba2(torch.nn.Linear(2, 2))


def test_demo_matches_generating_alone(capsys):
    from torch_ssd import demo

    assert demo.main(["--requests", "6", "--batch", "3", "--max-new-tokens", "10", "--max-prompt", "6"]) == 0
    text = capsys.readouterr().out
    assert "OK: all 6 requests match" in text
    assert "tokens/s" in text and "ms per decode step" in text
    assert "slot reuses" in text


def test_demo_detects_a_wrong_decode(monkeypatch, capsys):
    """The demo's check can fail: a decode that mixes up the rows' slots is caught."""
    from torch_ssd import demo

    real = demo.selective_state_update

    def reads_the_wrong_slot(state, *args, state_batch_indices=None, **kwargs):
        shifted = torch.roll(state_batch_indices, 1)  # each row reads and writes its neighbour's slot
        return real(state, *args, state_batch_indices=shifted, **kwargs)

    monkeypatch.setattr(demo, "selective_state_update", reads_the_wrong_slot)
    assert demo.main(["--requests", "4", "--batch", "2", "--max-new-tokens", "8", "--max-prompt", "5"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_a_release_without_the_cache_api_is_refused_with_the_reason(monkeypatch):
    """A transformers whose cache lacks get_conv_state: patch_mamba2 says so and patches nothing."""
    model = tiny_model()
    monkeypatch.setattr(transformers.DynamicCache, "get_conv_state", None)
    with pytest.raises(RuntimeError, match=r"get_conv_state.*transformers>=5\.24"):
        patch_mamba2(model)
    assert not is_patched(model)
