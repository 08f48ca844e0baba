#!/usr/bin/env python
"""One launch knob's settings against each other, from the benchmark's JSON files.

    python tools/bench_ab.py --knob NAME --values "0 1 2" OUT/bench-ab-*.json

Each file is `python -m torch_ssd --json` output named bench-ab-<value>-r<round>.json
(`tools/device_run.sh ab` writes them: every value in turn, round after round, on one
build). Prints, per (shape, pool dtype, T), each value's time per round under graph replay
and with plain launches, and the change of its mean against the first value's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"bench-ab-(?P<value>.+)-r(?P<round>\d+)\.json$")


def load(paths: list[Path]) -> dict[str, dict[int, list[dict]]]:
    """value -> round -> the file's rows."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for path in paths:
        m = NAME.search(path.name)
        if m is None:
            raise SystemExit(f"bench_ab: {path} is not named bench-ab-<value>-r<round>.json")
        runs.setdefault(m["value"], {})[int(m["round"])] = json.loads(path.read_text())["rows"]
    return runs


def table(runs: dict[str, dict[int, list[dict]]], values: list[str]) -> list[str]:
    missing = [v for v in values if v not in runs]
    if missing:
        raise SystemExit(f"bench_ab: no files for value(s) {' '.join(missing)}")
    # case -> value -> (graph seconds per round, plain seconds per round)
    times: dict[tuple, dict[str, tuple[list[float], list[float]]]] = {}
    for value in values:
        for _, rows in sorted(runs[value].items()):
            for row in rows:
                case = (row["shape"], row["pool_dtype"], row["T"])
                graph, plain = times.setdefault(case, {}).setdefault(value, ([], []))
                if row.get("graph_s"):
                    graph.append(row["graph_s"] * 1e6)
                plain.append(row["op_s"] * 1e6)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def change(xs: list[float], ref: list[float]) -> str:
        return f"{(mean(xs) / mean(ref) - 1) * 100:+.1f}%" if xs and ref else "-"

    lines = [f"us per step by value ({' / '.join(values)}), rounds joined by ','; change of the mean "
             f"against {values[0]}"]
    for case in sorted(times):
        by_value = times[case]
        ref_graph, ref_plain = by_value.get(values[0], ([], []))
        cells = []
        for value in values:
            graph, plain = by_value.get(value, ([], []))
            runs_text = ",".join(f"{g:.2f}" for g in graph) or "-"
            cell = f"{value}: {runs_text}"
            if value != values[0]:
                cell += f" ({change(graph, ref_graph)}, plain {change(plain, ref_plain)})"
            cells.append(cell)
        lines.append(f"{case[0]} {case[1]} T={case[2]} graph | " + " | ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--knob", required=True, help="the environment variable the files differ in")
    parser.add_argument("--values", required=True, help="its values, space-separated; the first is the reference")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(f"knob {args.knob}")
    for line in table(load(args.files), args.values.split()):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
