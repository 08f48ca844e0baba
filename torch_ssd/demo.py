"""``python -m torch_ssd demo``: continuous batching of a tiny Mamba-2 model on torch.ops.ssd.

A randomly initialised Hugging Face ``Mamba2ForCausalLM`` serves a stream of
requests of different prompt and output lengths. Each request is prefilled alone
with the model's own forward, its conv and SSM states are copied into a
``StatePool`` slot, and from then on it decodes inside one fixed-size batch: every
step is one ``selective_state_update`` per layer over all batch rows, idle rows
pointing at the pool's pad slot. Requests arrive while others are running and
leave when done; their slots go back to the pool and are reused. At the end every
request is generated again alone with ``model.generate`` (greedy, the model's
own code, no torch_ssd) and the tokens must match exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

import torch

from .serving import StatePool, selective_state_update


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


def tiny_mamba2(seed: int, vocab_size: int = 128):
    """A small randomly initialised Mamba2ForCausalLM (hidden 64, 2 layers, 8 heads of 16, N 16, 2 groups)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        pad_token_id=0, bos_token_id=0, eos_token_id=None,  # no EOS: each request runs to its own length
    )
    torch.manual_seed(seed)
    return Mamba2ForCausalLM(config).eval()


class Engine:
    """Fixed-batch decode over a StatePool, driving the modules of a transformers Mamba-2 model."""

    def __init__(self, model, max_batch: int, max_slots: int, device: torch.device):
        from transformers.models.mamba2 import modeling_mamba2

        self._conv_update = modeling_mamba2.causal_conv1d_update
        self.model = model
        self.device = device
        self.max_batch = max_batch
        self.blocks = model.backbone.layers
        mixer = self.blocks[0].mixer
        self.pool = StatePool(
            len(self.blocks), max_slots, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size,
            dtype=torch.float32, device=device, conv_dim=mixer.conv_dim, conv_width=mixer.conv_kernel_size,
            index_dtype=torch.int64,  # index_select / index_copy_ on the conv pools want int64
        )
        # Per-head A, computed once; expanded with stride 0 inside selective_state_update.
        self.A = [-torch.exp(b.mixer.A_log.float()) for b in self.blocks]

    @torch.no_grad()
    def prefill(self, req: Request) -> None:
        """Run the prompt alone through the model, move its states into a fresh slot, emit token 1."""
        req.slot = self.pool.allocate()
        ids = torch.tensor([req.prompt], device=self.device)
        out = self.model(ids, use_cache=True, attention_mask=torch.ones_like(ids))
        for layer in range(len(self.blocks)):
            self.pool.conv_pools[layer][req.slot].copy_(out.cache.get_conv_state(layer)[0])
            self.pool.ssm_pools[layer][req.slot].copy_(out.cache.get_recurrent_state(layer)[0])
        req.output.append(int(out.logits[0, -1].argmax()))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
        """One token for every batch row (pad rows included); returns logits (batch, vocab)."""
        backbone = self.model.backbone
        hidden = backbone.embeddings(tokens).unsqueeze(1)  # (batch, 1, hidden)
        for layer, block in enumerate(self.blocks):
            residual = hidden.float() if block.residual_in_fp32 else hidden
            normed = block.norm(hidden.to(dtype=block.norm.weight.dtype))
            hidden = residual + self._mixer(layer, block.mixer, normed, slot_idx)
        hidden = backbone.norm_f(hidden)
        return self.model.lm_head(hidden.to(self.model.lm_head.weight.dtype))[:, 0].float()

    def _mixer(self, layer: int, mixer, hidden: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
        batch = hidden.shape[0]
        gate, xBC, dt = mixer.in_proj(hidden).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], -1)
        # Conv window: gather the rows' slots, roll them with the model's own update, scatter back.
        # Pad rows gather and scatter the pool's scratch row, so no row needs a branch.
        conv_pool = self.pool.conv_pools[layer]
        window = conv_pool.index_select(0, slot_idx)
        xBC = self._conv_update(xBC.transpose(1, 2), window, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                                activation=mixer.activation).transpose(1, 2)
        conv_pool.index_copy_(0, slot_idx, window)
        groups_state = mixer.n_groups * mixer.ssm_state_size
        x, B, C = xBC.split([mixer.intermediate_size, groups_state, groups_state], -1)
        y = selective_state_update(
            self.pool.ssm_pools[layer],
            x.reshape(batch, mixer.num_heads, mixer.head_dim),
            dt.reshape(batch, mixer.num_heads),
            self.A[layer],
            B.reshape(batch, mixer.n_groups, mixer.ssm_state_size),
            C.reshape(batch, mixer.n_groups, mixer.ssm_state_size),
            D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True,
            state_batch_indices=slot_idx, pad_slot_id=self.pool.pad_slot_id,
        )
        y = mixer.norm(y.reshape(batch, 1, -1), gate)
        return mixer.out_proj(y)


def make_requests(num: int, vocab_size: int, seed: int, max_prompt: int, max_new: int) -> list[Request]:
    rng = random.Random(seed)
    requests, step = [], 0
    for rid in range(num):
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(2, max_prompt))]
        requests.append(Request(rid, prompt, rng.randint(2, max_new), step))
        step += rng.choice((0, 1, 2, 3))  # sometimes several arrive together, sometimes none
    return requests


def serve(engine: Engine, requests: list[Request]) -> dict:
    """Continuous batching: admit on arrival when a row is free, decode, retire finished rows."""
    pending = sorted(requests, key=lambda r: r.arrival_step)
    rows: list[Request | None] = [None] * engine.max_batch
    tokens = torch.zeros(engine.max_batch, dtype=torch.long, device=engine.device)
    stats = dict(steps=0, decode_s=0.0, decode_tokens=0, pad_rows=0, prefill_s=0.0, admissions={})
    step = 0
    while pending or any(r is not None for r in rows):
        # Admit everything that has arrived while a row and a slot are free.
        while pending and pending[0].arrival_step <= step and None in rows and engine.pool.num_free:
            req = pending.pop(0)
            t0 = time.perf_counter()
            engine.prefill(req)
            stats["prefill_s"] += time.perf_counter() - t0
            stats["admissions"][req.slot] = stats["admissions"].get(req.slot, 0) + 1
            if req.done:
                engine.pool.free(req.slot)
            else:
                rows[rows.index(None)] = req
        live = [r for r in rows if r is not None]
        if live:
            # Pad rows carry a dummy token; their results are never read.
            tokens.copy_(torch.tensor([r.output[-1] if r is not None else 0 for r in rows]))
            slot_idx = engine.pool.indices([r.slot if r is not None else None for r in rows])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = engine.decode(tokens, slot_idx)
            next_tokens = logits.argmax(-1).tolist()  # syncs the device
            stats["decode_s"] += time.perf_counter() - t0
            stats["steps"] += 1
            stats["decode_tokens"] += len(live)
            stats["pad_rows"] += engine.max_batch - len(live)
            for i, r in enumerate(rows):
                if r is None:
                    continue
                r.output.append(next_tokens[i])
                if r.done:
                    engine.pool.free(r.slot)
                    rows[i] = None
        step += 1
    return stats


@torch.no_grad()
def generate_alone(model, req: Request, device: torch.device) -> list[int]:
    ids = torch.tensor([req.prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new_tokens,
                         min_new_tokens=req.max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(req.prompt):].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_ssd demo", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="number of requests (default 12)")
    parser.add_argument("--batch", type=int, default=4, help="fixed decode batch size (default 4)")
    parser.add_argument("--slots", type=int, default=None, help="state pool slots (default: --batch)")
    parser.add_argument("--max-prompt", type=int, default=12, help="longest prompt (default 12)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="longest output (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or mps (default cpu)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.requests < 1:
        parser.error("--batch and --requests must be at least 1")
    slots = args.batch if args.slots is None else args.slots
    if slots < 1:
        parser.error("--slots must be at least 1")

    try:
        import transformers
    except ImportError:
        print("the demo needs Hugging Face transformers: pip install 'torch_ssd[transformers]'", file=sys.stderr)
        return 2
    from .integrations.transformers import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        print(f"the demo cannot run: {reason}", file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()  # no "falling back to PyTorch" notices in the demo output

    device = torch.device(args.device)
    model = tiny_mamba2(args.seed).to(device)
    requests = make_requests(args.requests, model.config.vocab_size, args.seed, args.max_prompt,
                             args.max_new_tokens)
    engine = Engine(model, args.batch, slots, device)
    print(f"model: Mamba2ForCausalLM, {len(engine.blocks)} layers, {engine.pool!r}")
    print(f"requests: {len(requests)}, prompts {min(len(r.prompt) for r in requests)}-"
          f"{max(len(r.prompt) for r in requests)} tokens, outputs {min(r.max_new_tokens for r in requests)}-"
          f"{max(r.max_new_tokens for r in requests)} tokens, batch {args.batch}")

    stats = serve(engine, requests)

    mismatches = 0
    for req in requests:
        expected = generate_alone(model, req, device)
        if req.output != expected:
            mismatches += 1
            print(f"request {req.rid}: MISMATCH\n  batched: {req.output}\n  alone:   {expected}")
    reused = sum(n - 1 for n in stats["admissions"].values())
    steps = max(stats["steps"], 1)
    print(f"decode: {stats['steps']} steps, {stats['decode_tokens']} tokens, {stats['pad_rows']} pad rows, "
          f"{len(stats['admissions'])} slots used, {reused} slot reuses")
    print(f"decode: {stats['decode_tokens'] / max(stats['decode_s'], 1e-9):.1f} tokens/s, "
          f"{1e3 * stats['decode_s'] / steps:.3f} ms per decode step (batch {args.batch}, {device.type})")
    print(f"prefill (each request alone, model's own forward): {1e3 * stats['prefill_s']:.1f} ms total")
    if mismatches:
        print(f"FAILED: {mismatches} of {len(requests)} requests differ from generating them alone")
        return 1
    print(f"OK: all {len(requests)} requests match generating each alone, token for token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
