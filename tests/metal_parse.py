"""Reading facts out of the Metal source, for the tests of the MPS path.

The tests compare what torch_ssd/mps.py marshals with what the kernels declare, so
both sides are read independently: the host names of the kernel instantiations,
the buffer order of each kernel, and the fields of the int64 argument structs.
"""

from __future__ import annotations

import re

_INSTANTIATION = re.compile(r'^SSD_KERNEL\("(?P<name>\w+)",\s*(?P<fn>.+)\)\s*$', re.M)
_PLAIN_KERNEL = re.compile(r"^kernel void (?P<name>\w+)\(", re.M)
_BUFFER_PARAM = re.compile(r"(?P<param>\w+)\s*\[\[buffer\((?P<index>\d+)\)\]\]")
_FIELD = re.compile(r"^\s*long (?P<name>\w+)(?:\[(?P<count>\d+)\])?;", re.M)


def kernels(source: str) -> dict[str, str]:
    """Host name -> the C++ function it names: explicit template instantiations
    (SSD_KERNEL("name", fn<...>)) and kernels that are not templates."""
    found = {m["name"]: m["fn"].strip() for m in _INSTANTIATION.finditer(source)}
    for m in _PLAIN_KERNEL.finditer(source):
        before = source[: m.start()].rstrip().splitlines()
        if before and before[-1].lstrip().startswith("template"):
            continue  # a template: its instantiations are listed by host name
        found[m["name"]] = m["name"]
    return found


def kernel_signature(source: str, function: str) -> str:
    m = re.search(rf"^kernel void {function}\((?P<params>.*?)\)\s*\{{", source, re.M | re.S)
    if m is None:
        raise AssertionError(f"kernel {function} not found in the Metal source")
    return m["params"]


def kernel_buffers(source: str, function: str) -> list[str]:
    """The buffer parameters of a kernel in parameter order; asserts that parameter i
    is [[buffer(i)]] (compile_shader binds argument i to buffer i)."""
    params = [(m["param"], int(m["index"])) for m in _BUFFER_PARAM.finditer(kernel_signature(source, function))]
    for position, (param, index) in enumerate(params):
        assert index == position, f"{function}: parameter {param} is buffer({index}) at position {position}"
    return [param for param, _ in params]


def kernel_args_struct(source: str, function: str) -> str:
    """The struct of a kernel's `constant X& ...` argument block."""
    m = re.search(r"constant (\w+)& \w+ \[\[buffer", kernel_signature(source, function))
    if m is None:
        raise AssertionError(f"kernel {function} takes no constant argument block")
    return m[1]


def instantiation(fn: str) -> tuple[str, list[str]]:
    """'f<A, B, true>' -> ('f', ['A', 'B', 'true']); 'f' -> ('f', [])."""
    m = re.fullmatch(r"(\w+)(?:<(.*)>)?", fn.strip())
    assert m is not None, fn
    return m[1], [part.strip() for part in m[2].split(",")] if m[2] else []


def struct_fields(source: str, struct: str) -> list[tuple[str, int]]:
    """(field, count) of an int64 argument struct, in declaration order."""
    m = re.search(rf"^struct {struct} \{{(?P<body>.*?)^\}};", source, re.M | re.S)
    if m is None:
        raise AssertionError(f"struct {struct} not found in the Metal source")
    body = m["body"]
    declared = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("//")]
    fields = [(f["name"], int(f["count"] or 1)) for f in _FIELD.finditer(body)]
    assert len(fields) == len(declared), f"struct {struct}: every member must be a `long` field: {declared}"
    return fields


def unpack(fields: list[tuple[str, int]], values: list[int]) -> dict[str, int | list[int]]:
    """An int64 argument block as {field: value or [values]}."""
    assert len(values) == sum(count for _, count in fields), (
        f"argument block has {len(values)} values, the struct {sum(c for _, c in fields)}"
    )
    out: dict[str, int | list[int]] = {}
    at = 0
    for name, count in fields:
        out[name] = values[at] if count == 1 else list(values[at : at + count])
        at += count
    return out
