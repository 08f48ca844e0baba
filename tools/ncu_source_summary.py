#!/usr/bin/env python
"""Where a kernel's instructions and stalls go, from Nsight Compute's per-instruction
(SASS) page. A developer tool; tools/device_run.sh's `ncu-source` stage writes the CSV:

    ncu --kernel-name regex:multi_step --launch-skip 4 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python tools/cuda_profile.py ... > source.csv
    python tools/ncu_source_summary.py source.csv

Instructions that ran equally often belong to the same part of the kernel (once per
block, per tile, per token, ...): the report groups them by that count, with each
group's share of the executed instructions and of the stall samples and its most
common opcodes, then lists the instructions with the most stall samples and their
main stall reason. Offsets are from the kernel's first instruction (the same offsets
as `cuobjdump -sass` of the build).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys
from dataclasses import dataclass, field


@dataclass
class Instruction:
    offset: int
    sass: str
    executed: float
    samples: float
    stalls: dict[str, float] = field(default_factory=dict)

    @property
    def opcode(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.sass.strip()).split(" ")[0]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(text: str) -> tuple[str, list[Instruction]]:
    """The kernel name and its instructions from ncu's source-page CSV (one kernel)."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    kernel = ""
    while rows and rows[0] and rows[0][0] != "Address":
        if rows[0][0] == "Kernel Name" and len(rows[0]) > 1:
            kernel = rows[0][1]
        rows.pop(0)
    if not rows:
        raise ValueError("no 'Address' header: not the CSV of ncu --page source --print-source sass --csv")
    header = {name: i for i, name in enumerate(rows[0])}
    for needed in ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"):
        if needed not in header:
            raise ValueError(f"column {needed!r} missing (collect --section SourceCounters)")
    stall_columns = [n for n in header if n.startswith("stall_") and not n.endswith("(Not Issued)")]
    body = [r for r in rows[1:] if len(r) == len(rows[0]) and r[0].startswith("0x")]
    if not body:
        raise ValueError("no instruction rows")
    base = int(body[0][0], 16)
    instructions = [
        Instruction(int(r[0], 16) - base, r[header["Source"]], _number(r[header["Instructions Executed"]]),
                    _number(r[header["Warp Stall Sampling (All Samples)"]]),
                    {n[len("stall_"):]: _number(r[header[n]]) for n in stall_columns})
        for r in body]
    return kernel, instructions


def report(kernel: str, instructions: list[Instruction], top: int = 20, groups: int = 12) -> str:
    executed = sum(i.executed for i in instructions) or 1.0
    samples = sum(i.samples for i in instructions) or 1.0
    out = [f"kernel: {kernel}" if kernel else "kernel: (unnamed)",
           f"{len(instructions)} instructions, {executed:,.0f} warp instructions executed, "
           f"{samples:,.0f} stall samples", "",
           "by executions per instruction (one group: one part of the kernel, e.g. once per tile or token)",
           f"{'executions':>12} {'instr':>6} {'% executed':>10} {'% samples':>9}  opcodes"]
    by_count: dict[float, list[Instruction]] = collections.defaultdict(list)
    for ins in instructions:
        if ins.executed > 0:
            by_count[ins.executed].append(ins)
    ranked = sorted(by_count.items(), key=lambda kv: -kv[0] * len(kv[1]))
    for count, members in ranked[:groups]:
        ops = collections.Counter(i.opcode for i in members).most_common(6)
        out.append(f"{count:12,.0f} {len(members):6d} {100 * count * len(members) / executed:10.1f} "
                   f"{100 * sum(i.samples for i in members) / samples:9.1f}  "
                   + ", ".join(f"{op} {n}" for op, n in ops))
    if len(ranked) > groups:
        rest = ranked[groups:]
        out.append(f"{'(others)':>12} {sum(len(m) for _, m in rest):6d} "
                   f"{100 * sum(c * len(m) for c, m in rest) / executed:10.1f} "
                   f"{100 * sum(i.samples for _, m in rest for i in m) / samples:9.1f}")
    out += ["", f"the {top} instructions with the most stall samples",
            f"{'offset':>8} {'% samples':>9} {'executions':>12}  {'main stall':<22} sass"]
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        if ins.samples <= 0:
            break
        reason, n = max(ins.stalls.items(), key=lambda kv: kv[1], default=("-", 0.0))
        main = f"{reason} {100 * n / ins.samples:.0f} %" if n > 0 else "-"
        out.append(f"{ins.offset:#8x} {100 * ins.samples / samples:9.1f} {ins.executed:12,.0f}  {main:<22} "
                   f"{ins.sass.strip()}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output (one kernel)")
    ap.add_argument("--top", type=int, default=20, help="instructions listed by stall samples")
    ap.add_argument("--groups", type=int, default=12, help="execution-count groups listed")
    args = ap.parse_args(argv)
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        try:
            kernel, instructions = parse(f.read())
        except ValueError as e:
            print(f"ncu_source_summary: {args.csv}: {e}", file=sys.stderr)
            return 2
    print(report(kernel, instructions, top=args.top, groups=args.groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
