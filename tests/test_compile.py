"""torch.compile(fullgraph=True, dynamic=True) of a multi-step decode loop
(DESIGN.md section 5): no graph break, one compile for every T, results equal to
eager, and the post-grad graph updates the pool in place with no copy of it.

Compiling is slow on two cores: one loop, compiled once per device."""

import re

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.compile_fx as compile_fx
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline
from torch._inductor.utils import run_and_get_code

import torch_ssd  # noqa: F401  (registers torch.ops.ssd)

# Sizes that differ pairwise (and from every T below) so duck sizing merges none of them.
STEPS, S, H, P, N, G = 3, 23, 4, 6, 19, 2
T_VALUES = (5, 7, 9)


def decode_loop(pool, xs, dts, A_per_head, Bs, Cs, D, zs, dt_bias, src, dst, out):
    """STEPS decode steps on the same slots; the last one writes new slots into a
    caller's buffer; then the loader verbs copy the new slots back."""
    A = A_per_head.view(-1, 1, 1).expand(-1, pool.shape[2], pool.shape[3])  # stride 0, as models do
    ys = []
    for k in range(STEPS - 1):
        ys.append(torch.ops.ssd.decode_step(pool, xs[k], dts[k], A, Bs[k], Cs[k], D, zs[k], dt_bias, True, src))
    torch.ops.ssd.decode_step_out(pool, xs[-1], dts[-1], A, Bs[-1], Cs[-1], D, zs[-1], dt_bias, True, src, dst,
                                  -1, out)
    state = torch.ops.ssd.load_state(pool, dst)
    B32, C32 = torch.ops.ssd.load_bc(Bs[0], Cs[0])
    torch.ops.ssd.store_state(state, pool, src)
    return torch.stack(ys), state, B32, C32


def loop_inputs(T, device, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(S, generator=g)
    src = perm[:T].clone()
    src[1] = -1  # a pad row
    inputs = [
        torch.randn(S, H, P, N, generator=g).to(torch.bfloat16),  # pool
        torch.randn(STEPS, T, H, P, generator=g),  # xs
        torch.randn(STEPS, T, H, P, generator=g) - 1.0,  # dts (softplus)
        -torch.rand(H, generator=g) - 0.5,  # A per head
        torch.randn(STEPS, T, G, N, generator=g).to(torch.bfloat16),  # Bs
        torch.randn(STEPS, T, G, N, generator=g).to(torch.bfloat16),  # Cs
        torch.randn(H, P, generator=g),  # D
        torch.randn(STEPS, T, H, P, generator=g),  # zs
        torch.randn(H, P, generator=g) - 0.5,  # dt_bias
        src,
        perm[T : 2 * T].clone(),  # dst
        torch.zeros(T, H, P),  # out
    ]
    return [t.to(device) for t in inputs]


def clone_all(tensors):
    return [t.clone() for t in tensors]


class PostGradCapture:
    """Records every graph after Inductor's post-grad passes (re-inplacing included):
    the graph whose nodes become kernels."""

    def __init__(self):
        self.graphs = []
        self._original = compile_fx._recursive_post_grad_passes

    def __call__(self, gm, is_inference=False):
        self._original(gm, is_inference)
        self.graphs.append(gm)


def readable(gm) -> str:
    """The graph's code without the source-line comments (they move with edits)."""
    text = gm.print_readable(print_output=False)
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(line for line in lines if line.strip() and not line.strip().startswith("# File:"))


SSD_MUTATING = (torch.ops.ssd.decode_step.default, torch.ops.ssd.decode_step_out.default,
                torch.ops.ssd.store_state.default)


def assert_updates_pool_in_place(gm):
    graph = gm.graph
    mutating = [n for n in graph.nodes if n.op == "call_function" and n.target in SSD_MUTATING]
    assert len(mutating) == STEPS + 1, [n.format_node() for n in graph.nodes]
    pool_arg = lambda n: n.args[1] if n.target is torch.ops.ssd.store_state.default else n.args[0]  # noqa: E731
    pools = {pool_arg(n) for n in mutating}
    assert len(pools) == 1, "every step must update the same pool tensor"
    (pool,) = pools
    assert pool.op == "placeholder", f"the pool reaching the kernels is {pool.format_node()}, not the input"
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        assert "auto_functionalized" not in name, f"not re-inplaced: {n.format_node()}"
        assert n.target not in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default,
                                torch.ops.aten.copy.default), f"a copy in the graph: {n.format_node()}"
        if n.target is torch.ops.aten.copy_.default:
            # Functionalization writes mutated inputs back with copy_; after
            # re-inplacing it must be the no-op self-copy that Inductor drops.
            assert n.args[0] is n.args[1], f"a copy into an input: {n.format_node()}"


@pytest.fixture
def fresh_compile(monkeypatch):
    """No cached artifacts (the passes must run), no compiled frames left over."""
    torch._dynamo.reset()
    capture = PostGradCapture()
    monkeypatch.setattr(compile_fx, "_recursive_post_grad_passes", capture)
    with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield capture
    torch._dynamo.reset()


def test_compiled_decode_loop(device, fresh_compile):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_loop, backend=counter, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    code = None
    for i, T in enumerate(T_VALUES):
        eager_inputs = loop_inputs(T, device, seed=T)
        compiled_inputs = clone_all(eager_inputs)
        want = decode_loop(*eager_inputs)
        if i == 0:
            got, code = run_and_get_code(compiled, *compiled_inputs)
        else:
            got = compiled(*compiled_inputs)
        for name, g, w in zip(("ys", "state", "B32", "C32"), got, want):
            assert torch.equal(g, w), f"T={T}: compiled {name} differs from eager"
        assert torch.equal(compiled_inputs[0], eager_inputs[0]), f"T={T}: compiled pool differs from eager"
        assert torch.equal(compiled_inputs[-1], eager_inputs[-1]), f"T={T}: compiled out differs from eager"
        assert not torch.equal(compiled_inputs[0], loop_inputs(T, device, seed=T)[0]), "the pool was not updated"

    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} compiles for T in {T_VALUES}"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])

    assert len(fresh_compile.graphs) == 1
    gm = fresh_compile.graphs[0]
    assert_updates_pool_in_place(gm)
    # The generated program copies neither the pool nor anything else.
    wrapper = "\n".join(code)
    assert not re.search(r"\bcopy_\(|\.clone\(|aten\.copy", wrapper), wrapper
    if device == "cpu":
        assert_expected_inline(readable(gm), """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "Sym(s89)", arg1_1: "f32[s89]", arg2_1: "Sym(s22)", arg3_1: "Sym(s96)", arg4_1: "Sym(s65)", arg5_1: "bf16[s22, s89, s96, s65]", arg6_1: "Sym(s83)", arg7_1: "Sym(s90)", arg8_1: "f32[s83, s90, s89, s96]", arg9_1: "f32[s83, s90, s89, s96]", arg10_1: "Sym(s54)", arg11_1: "bf16[s83, s90, s54, s65]", arg12_1: "bf16[s83, s90, s54, s65]", arg13_1: "f32[s83, s90, s89, s96]", arg14_1: "f32[s89, s96]", arg15_1: "f32[s89, s96]", arg16_1: "i64[s90]", arg17_1: "i64[s90]", arg18_1: "f32[s90, s89, s96]"):
        select: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg8_1, 0, 0)
        select_1: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg9_1, 0, 0)
        view: "f32[s89, 1, 1]" = torch.ops.aten.reshape.default(arg1_1, [-1, 1, 1]);  arg1_1 = None
        expand: "f32[s89, s96, s65]" = torch.ops.aten.expand.default(view, [-1, arg3_1, arg4_1]);  view = arg4_1 = None
        select_2: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg11_1, 0, 0)
        select_3: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg12_1, 0, 0)
        select_4: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg13_1, 0, 0)
        decode_step_default_1: "f32[s90, s89, s96]" = torch.ops.ssd.decode_step.default(arg5_1, select, select_1, expand, select_2, select_3, arg14_1, select_4, arg15_1, True, arg16_1);  select = select_1 = select_2 = select_3 = select_4 = None
        select_5: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg8_1, 0, 1)
        select_6: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg9_1, 0, 1)
        select_7: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg11_1, 0, 1)
        select_8: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg12_1, 0, 1)
        select_9: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg13_1, 0, 1)
        decode_step_default: "f32[s90, s89, s96]" = torch.ops.ssd.decode_step.default(arg5_1, select_5, select_6, expand, select_7, select_8, arg14_1, select_9, arg15_1, True, arg16_1);  select_5 = select_6 = select_7 = select_8 = select_9 = None
        select_10: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg8_1, 0, -1);  arg8_1 = None
        select_11: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg9_1, 0, -1);  arg9_1 = None
        select_12: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg11_1, 0, -1)
        select_13: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg12_1, 0, -1)
        select_14: "f32[s90, s89, s96]" = torch.ops.aten.select.int(arg13_1, 0, -1);  arg13_1 = None
        decode_step_out_default = torch.ops.ssd.decode_step_out.default(arg5_1, select_10, select_11, expand, select_12, select_13, arg14_1, select_14, arg15_1, True, arg16_1, arg17_1, -1, arg18_1);  select_10 = select_11 = expand = select_12 = select_13 = arg14_1 = select_14 = arg15_1 = decode_step_out_default = None
        select_15: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg11_1, 0, 0);  arg11_1 = None
        select_16: "bf16[s90, s54, s65]" = torch.ops.aten.select.int(arg12_1, 0, 0);  arg12_1 = None
        load_bc = torch.ops.ssd.load_bc.default(select_15, select_16);  select_15 = select_16 = None
        getitem_7: "f32[s90, s54, s65]" = load_bc[0]
        getitem_8: "f32[s90, s54, s65]" = load_bc[1];  load_bc = None
        load_state: "f32[s90, s89, s96, s65]" = torch.ops.ssd.load_state.default(arg5_1, arg17_1);  arg17_1 = None
        store_state_default = torch.ops.ssd.store_state.default(load_state, arg5_1, arg16_1);  arg16_1 = store_state_default = None
        cat: "f32[2*s90, s89, s96]" = torch.ops.aten.cat.default([decode_step_default_1, decode_step_default]);  decode_step_default_1 = decode_step_default = None
        view_1: "f32[2, s90, s89, s96]" = torch.ops.aten.reshape.default(cat, [2, arg7_1, arg0_1, arg3_1]);  cat = arg7_1 = arg0_1 = arg3_1 = None
        copy_: "bf16[s22, s89, s96, s65]" = torch.ops.aten.copy_.default(arg5_1, arg5_1);  arg5_1 = copy_ = None
        copy__1: "f32[s90, s89, s96]" = torch.ops.aten.copy_.default(arg18_1, arg18_1);  arg18_1 = copy__1 = None
        return (view_1, load_state, getitem_7, getitem_8)""")
