"""The operator schemas are the API (DESIGN.md section 1): pinned character for character."""

import torch
from expecttest import assert_expected_inline

import torch_ssd  # noqa: F401  (registers torch.ops.ssd)


def schema(name: str) -> str:
    return str(getattr(torch.ops.ssd, name).default._schema)


def test_load_state_schema():
    assert_expected_inline(
        schema("load_state"),
        """ssd::load_state(Tensor ssm_pool, Tensor? slot_idx=None, int pad_slot_id=-1) -> Tensor""",
    )


def test_load_bc_schema():
    assert_expected_inline(schema("load_bc"), """ssd::load_bc(Tensor B, Tensor C) -> (Tensor, Tensor)""")


def test_store_state_schema():
    assert_expected_inline(
        schema("store_state"),
        """ssd::store_state(Tensor state, Tensor(a!) ssm_pool, Tensor? slot_idx=None, int pad_slot_id=-1) -> ()""",
    )


def test_decode_step_schema():
    assert_expected_inline(
        schema("decode_step"),
        """ssd::decode_step(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1) -> Tensor""",
    )


def test_decode_step_out_schema():
    assert_expected_inline(
        schema("decode_step_out"),
        """ssd::decode_step_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, Tensor? dst_slot_idx, int pad_slot_id, Tensor(b!) out) -> ()""",
    )


def test_only_the_five_ops():
    """No stray overloads: each op has exactly its default overload."""
    for name in ("load_state", "load_bc", "store_state", "decode_step", "decode_step_out"):
        assert getattr(torch.ops.ssd, name).overloads() == ["default"], name


def test_mutated_arguments_are_not_returned():
    """Mutated tensors are marked (a!)/(b!) and never returned (section 1)."""
    for name in ("store_state", "decode_step", "decode_step_out"):
        s = getattr(torch.ops.ssd, name).default._schema
        mutated = [a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated, name
        assert all(r.alias_info is None for r in s.returns), name
