#!/usr/bin/env bash
# Compile-only check of the CUDA sources (CI has no GPU): builds torch_ssd._C with
# the CUDA kernels against a CUDA build of torch in a venv of its own, with this
# machine's nvcc, in a copy of the tree (the in-place CPU build is left alone),
# then imports the result and checks that every op has a CUDA kernel.
#
#   bash tools/ci_cuda_build.sh
#
# Environment:
#   TORCH_SSD_CUDA_VENV   venv holding the CUDA torch (default ~/.cache/torch_ssd/venv-cuda;
#                         created on first use: `pip install torch==2.14.1`, from local disk)
#   TORCH_SSD_CUDA_BUILD  build tree (default ~/.cache/torch_ssd/cuda-build; incremental)
#   TORCH_CUDA_ARCH_LIST  targets (default "8.0;9.0")
#   CUDA_HOME             the CUDA toolkit (default /usr/local/cuda, else where nvcc on PATH lives)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/torch_ssd"
VENV="${TORCH_SSD_CUDA_VENV:-$CACHE/venv-cuda}"
BUILD="${TORCH_SSD_CUDA_BUILD:-$CACHE/cuda-build}"
TORCH_CUDA_VERSION="${TORCH_SSD_CUDA_TORCH:-2.14.1}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"

# The toolkit: CUDA_HOME if set, else /usr/local/cuda, else the one nvcc on PATH
# lives in (a wrapper script on PATH is not a toolkit: its lib64 has no cudart).
if [[ -z "${CUDA_HOME:-}" ]]; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME="$(cd "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." && pwd)"
  fi
fi
NVCC="${CUDA_HOME:-/nonexistent}/bin/nvcc"
if [[ ! -x "$NVCC" ]]; then
  echo "ci_cuda_build: no CUDA toolkit found (set CUDA_HOME)" >&2
  exit 1
fi
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"
echo "ci_cuda_build: $("$NVCC" --version | tail -n 2 | head -n 1), CUDA_HOME=$CUDA_HOME, arch list $TORCH_CUDA_ARCH_LIST"

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_CUDA_VERSION') and torch.version.cuda else 1)" 2>/dev/null; then
  echo "ci_cuda_build: creating $VENV with torch==$TORCH_CUDA_VERSION (CUDA build)"
  mkdir -p "$(dirname "$VENV")"
  PY="${PYTHON:-$(command -v python3)}"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH_CUDA_VERSION" ninja setuptools numpy
fi
"$VENV/bin/python" -c "import torch; print('ci_cuda_build: torch', torch.__version__, 'CUDA', torch.version.cuda)" 2>&1 \
  | grep -v "No CUDA runtime"

# Mirror the sources into the build tree, keeping timestamps so ninja rebuilds
# only what changed.
mkdir -p "$BUILD"
rm -rf "$BUILD/csrc" "$BUILD/torch_ssd"
cp -rp "$ROOT/csrc" "$ROOT/setup.py" "$BUILD/"
mkdir -p "$BUILD/torch_ssd"
find "$ROOT/torch_ssd" -maxdepth 1 -name '*.py' -exec cp -p {} "$BUILD/torch_ssd/" \;
for sub in "$ROOT"/torch_ssd/*/; do
  [[ -d "$sub" && "$(basename "$sub")" != __pycache__ ]] && cp -rp "$sub" "$BUILD/torch_ssd/"
done

cd "$BUILD"
rc=0
TORCH_SSD_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" TORCH_SSD_PTXAS_V="${TORCH_SSD_PTXAS_V:-}" \
  "$VENV/bin/python" setup.py -q build_ext --inplace >build.log 2>&1 || rc=$?
grep -v -e "No CUDA runtime" -e "^copying " build.log || true
if [[ $rc != 0 ]]; then
  echo "ci_cuda_build: FAILED, the CUDA build exited with $rc (log: $BUILD/build.log)" >&2
  exit 1
fi
ls torch_ssd/_C*.so >/dev/null 2>&1 || { echo "ci_cuda_build: FAILED, no extension built" >&2; exit 1; }
# A stale .so from an earlier build must not pass for this one.
newest_src="$(find csrc setup.py -type f -newer torch_ssd/_C*.so | head -n 1)"
if [[ -n "$newest_src" ]]; then
  echo "ci_cuda_build: FAILED, $newest_src is newer than the built extension" >&2
  exit 1
fi

"$VENV/bin/python" - <<'EOF' 2>&1 | grep -v "No CUDA runtime"
import torch
import torch_ssd  # noqa: F401  (loads the CUDA build: registers torch.ops.ssd.*)
ops = ["load_state", "load_bc", "store_state", "decode_step", "decode_step_out",
       "decode_step_multi", "decode_step_multi_out", "decode_step_varlen", "decode_step_varlen_out"]
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"ssd::{op}", "CUDA")]
if missing:
    raise SystemExit(f"ci_cuda_build: FAILED, no CUDA kernel for {missing}")
print("ci_cuda_build: OK, CUDA kernels registered for", ", ".join(ops))
EOF
