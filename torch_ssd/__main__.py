"""python -m torch_ssd [SUBCOMMAND] [options]

Subcommands:
  bench   (the default) check the ops against the reference, then benchmark the decode step
  demo    a small Mamba-2 decode loop served through torch.ops.ssd

`python -m torch_ssd --help` shows the benchmark's options; `python -m torch_ssd demo --help`
the demo's.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

SUBCOMMANDS = {
    "bench": ("torch_ssd.bench", "check the ops against the reference, then benchmark (default)"),
    "demo": ("torch_ssd.demo", "a small Mamba-2 decode loop served through torch.ops.ssd"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "bench"
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        print(f"python -m torch_ssd: unknown subcommand {argv[0]!r}; choose from "
              f"{', '.join(SUBCOMMANDS)} (default: bench)", file=sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[name]
    if importlib.util.find_spec(module_name) is None:
        print(f"python -m torch_ssd {name}: not available in this version of torch_ssd "
              f"({module_name} is not installed).", file=sys.stderr)
        return 2
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
