#!/usr/bin/env bash
# On a CUDA machine: build the extension, run the GPU tests, run the
# compute-sanitizer subset, and run the benchmark; every log goes under $OUT.
#
#   bash tools/device_run.sh [STAGE ...]        (default: build test sanitize bench; -h: this text)
#
# Stages:
#   build       python setup.py build_ext --inplace (CUDA on; ptxas report in build.log)
#   test        pytest tests -q (the suite parametrizes over "cuda"), tests/test_cuda.py included;
#               -n TEST_WORKERS (default 8) through pytest-xdist when present; Python
#               tracebacks on a crash (faulthandler); the counts also from a JUnit report (a
#               line "junit: N passed, ..." even where a cap cut pytest's own summary)
#   sanitize    compute-sanitizer memcheck + racecheck on tools/cuda_sanitize_cases.py,
#               memcheck on tools/replay_fuzz_corpus.py (when present); the three
#               parts alone: memcheck, racecheck, fuzz
#   probe       tools/exception_probe.py (do refused calls crash this environment?); on a
#               crash, the native backtrace from cuda-gdb; compiler versions; in probe.log
#   tune        tools/cuda_tune.py: kernel / block-size sweep against the copy ceiling (+ bit check)
#   t1-floor    tools/cuda_t1_floor.py: where a T = 1 step's time goes under graph replay (the
#               step, its state in L2, every slot padded, a one-element fill), in t1_floor.log
#   host-cost   tools/cuda_host_cost.py: the host's time per plain call of the ops (Python,
#               dispatcher, checks, launch) against stock ops, HOST_ARGS extra arguments, in
#               host_cost.log
#   launch-cost tools/cuda_launch_cost.cu (built here with nvcc): the CUDA runtime's host time per
#               launch against the parameter block's size, <<<>>> / cudaLaunchKernelEx / with the
#               PDL attribute, in launch_cost.log
#   pattern     tools/cuda_pattern_ceiling.py: the step against the simplest kernel of its access
#               pattern (addressed slots read and written back in place, Triton), in pattern.log
#   multi-pattern  tools/cuda_multi_pattern_ceiling.py: the multi-token step against the simplest
#               kernel of its pattern (a row's source slot read once, written to its K slots;
#               Triton), MULTI_PATTERN_ARGS extra arguments, in multi_pattern.log
#   store-model tools/cuda_multi_store_model.py (+ .cu, built there): a model kernel with the widened
#               multi-token kernel's footprint doing only the pattern (copy) or the step's essential
#               work (fp), at set residencies, against the op; STORE_MODEL_ARGS extra arguments, in
#               store_model.log
#   parts       tools/cuda_step_parts.py: the step rebuilt in Triton one part at a time (rows,
#               + per-row inputs, + B / C, full; rows and full also with a head's tiles side by
#               side in the grid), each part's share of the copy, in parts.log
#   build-base, tune-base, host-cost-base, bench-base, bench-quick-base, bench-multi-base
#               the same stages in BASE_TREE, a plain copy of an earlier commit made before the
#               device call (git archive REV | tar -x -C .ab_base; carry it), for a before /
#               after in one call; logs build-base.log, tune-base.log, bench-base.log,
#               bench-multi-base.log (list a pair twice, e.g. "bench-quick bench-quick-base
#               bench-quick bench-quick-base", to see the run-to-run noise; the logs append,
#               the second run's table goes to bench-2.json, bench-base-2.json, ...)
#   builds      build and build-base at once (build-base in a second run of this script)
#   ncu         Nsight Compute on one launch per NCU_CASES entry ("shape:pool:T:config[:K[:y]]", see
#               tools/cuda_profile.py; K: the multi-token step, y: with write_state=False), report
#               in ncu.txt; NCU_ARGS: more ncu arguments (e.g. --section SourceCounters)
#   ncu-source  per NCU_CASES entry (default the bfloat16 single-token lean kernel): the stall
#               reasons in full, and the per-instruction (SASS) page as CSV (ncu-source-<i>.csv)
#               summarised by tools/ncu_source_summary.py (instructions and stall samples by how
#               often each instruction runs: per block, tile, token; the top stalling ones), in
#               ncu-source.txt (each case's CSV is one more file back: a call returns at most 8)
#   bench       python -m torch_ssd (op, CUDA graph, eager and compiled reference, copy)
#   bench-quick the same without torch.compile(reference)
#   bench-multi tools/bench_multi.py (multi-token step; no reference timings), MULTI_ARGS extra
#               arguments (e.g. --y-only, --ab TORCH_SSD_CUDA_MULTI_BULK=0: a knob against the default
#               on the same inputs), MULTI_BUDGET seconds per timing (default 0.15); bench-multi-block: the
#               same with the lean kernels off; bench-multi-bc: once per lean B / C path in BC_PATHS
#               (default "registers staged widened"; TORCH_SSD_CUDA_MULTI_BC), logs bench-multi-<path>.log
#
# Environment: OUT (default ./device_out), TORCH_CUDA_ARCH_LIST (default "9.0"
# here: the build is for this machine's GPU; CI compiles 8.0 and 9.0), PYTHON
# (default python3), TEST_PATHS (default tests), TEST_ARGS / BENCH_ARGS / TUNE_ARGS / HOST_ARGS / PATTERN_ARGS /
# PARTS_ARGS / STORE_MODEL_ARGS (extra arguments),
# FUZZ_CASES (default 60), BUDGET_S and TEST_CAP_S (see below), TORCH_SSD_SYSTEM_CXX (see build),
# PACK=1 (at the end, everything under OUT packed into OUT/device_out.tgz, nothing else left).
# Exit status: non-zero when any stage failed; summary.txt lists each stage's status.
#
# The test stage needs pytest, pytest-timeout and expecttest. A machine without
# network access gets expecttest as a wheel: on a connected machine
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl expecttest
# then, on the GPU machine, before this script:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -uo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment block above, without its '#'
  sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
  exit 0
fi

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # absolute: the *-base stages run in BASE_TREE
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(build test sanitize bench)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0

record() {  # stage, rc, seconds
  local word=ok
  [[ $2 -ne 0 ]] && word="FAILED (exit $2)" && status=1
  printf '%-12s %-18s %5ss\n' "$1" "$word" "$3" | tee -a "$SUMMARY"
}

run_stage() {  # name, log file, command...  (QUIET=1: output to the log only)
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS rc=0
  echo "=== $name: $*" | tee -a "$log"
  if [[ -n "${QUIET:-}" ]]; then
    "$@" >>"$log" 2>&1 || rc=$?
  else
    "$@" 2>&1 | tee -a "$log" || rc=$?
  fi
  record "$name" "$rc" $((SECONDS - t0))
  return "$rc"
}

env_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())"
  nvcc --version | tail -n 2
}

# BUDGET_S: wall-clock seconds for the whole script; a stage that would start
# with less than MIN_STAGE_S left is skipped, and each runs under `timeout` with
# what is left (so the logs come back even when the device call has a hard limit).
BUDGET_S="${BUDGET_S:-0}"
MIN_STAGE_S="${MIN_STAGE_S:-30}"
left() { echo $((BUDGET_S - SECONDS)); }
# A JSON file under OUT no earlier stage of this run wrote: NAME.json, else NAME-2.json, ...
# (a stage listed twice keeps both runs' tables).
json_path() {
  local path="$OUT/$1.json" n=2
  while [[ -e $path ]]; do path="$OUT/$1-$n.json"; n=$((n + 1)); done
  echo "$path"
}
# One NCU_CASES entry ("shape:pool:T:config[:K[:y]]"): ncu_one, Nsight Compute on one launch
# of its kernel (the multi-token one when K is given; y: with write_state=False), and
# profiled, the program it launches.
ncu_case() {
  local shape pool T config K mode kernel=decode_step
  IFS=: read -r shape pool T config K mode <<<"$1"
  [[ -n "$K" ]] && kernel=multi_step
  ncu_one=(ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 4 --launch-count 1)
  profiled=("$PY" tools/cuda_profile.py --shape "$shape" --pool "$pool" --T "$T" --config "$config" --K "${K:-0}")
  [[ $mode == y ]] && profiled+=(--y-only)
}
# Into BASE_TREE for a *-base stage; a missing tree fails the stage (status 2) instead of the script.
enter_base() {
  [[ -d "${BASE_TREE:-}" ]] && pushd "$BASE_TREE" >/dev/null && return 0
  echo "$1: BASE_TREE '${BASE_TREE:-}' is not a directory (make it before the call, see -h)"
  record "$1" 2 0
  return 1
}

# One build stage: build (here) or build-base (in BASE_TREE). Status 0 when it built.
build_stage() {
  local stage=$1 log
  # TORCH_SSD_SYSTEM_CXX=1 (the default; 0 turns it off): build with the system
  # gcc/g++ instead of $CC/$CXX. On this
  # workplace's CUDA image $CXX is a wrapper (/opt/gcc/bin/g++) whose links put a
  # static copy of libstdc++ into the extension; refused calls then crashed in
  # libstdc++'s number formatting (two copies of its locale state in one process).
  if [[ "${TORCH_SSD_SYSTEM_CXX:-1}" == 1 ]]; then
    for c in /usr/bin/g++ /usr/bin/g++-13 /usr/bin/g++-14; do
      [[ -x $c ]] && export CXX=$c CC=${c/g++/gcc} && break
    done
  fi
  if [[ $stage == build-base ]]; then
    enter_base "$stage" || return 2
    log="$OUT/build-base.log"
  else
    log="$OUT/build.log"
    env_info >"$OUT/env.txt" 2>&1
    { echo "CC=${CC:-} CXX=${CXX:-}"; "${CXX:-g++}" --version | head -n 1; file -L "${CXX:-g++}"; } >>"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
  fi
  # A CPU-only _C*.so carried from elsewhere must not shadow this build.
  rm -f torch_ssd/_C*.so
  # TORCH_SSD_CPU_CLONES=0, TORCH_SSD_CPU_OPT=1: the CPU kernels without their AVX2 /
  # AVX-512 clones, at -O1 (ssd_cpu.cpp is otherwise the build's longest file by
  # minutes; here the CPU kernels only cross-check, and give the same results).
  local rc=0
  QUIET=1 run_stage "$stage" "$log" "${TO[@]}" env TORCH_SSD_CUDA=1 TORCH_SSD_PTXAS_V=1 MAX_JOBS="$(nproc)" \
    TORCH_SSD_CPU_CLONES="${TORCH_SSD_CPU_CLONES:-0}" TORCH_SSD_CPU_OPT="${TORCH_SSD_CPU_OPT:-1}" \
    "$PY" setup.py build_ext --inplace || { rc=1; grep -E -B2 -A8 "error" "$log" | head -n 80; }
  if [[ $stage == build-base ]]; then
    popd >/dev/null
    return "$rc"
  fi
  [[ $rc -ne 0 ]] && return "$rc"
  grep -E "registers|spill" "$log" | sort | uniq -c | sort -rn | head -n 20
  { echo "=== libraries and libstdc++ copies in the extension"; readelf -d torch_ssd/_C*.so | grep NEEDED
    echo "libstdc++ stream code defined inside: $(nm -C --defined-only torch_ssd/_C*.so | grep -c 'basic_ostream')"
  } 2>&1 | tee -a "$OUT/env.txt"
}

for stage in "${STAGES[@]}"; do
  if [[ $BUDGET_S -gt 0 ]]; then
    if [[ $(left) -lt $MIN_STAGE_S ]]; then
      record "$stage" 124 0
      echo "($stage skipped: $(left)s of the budget left)" | tee -a "$SUMMARY"
      continue
    fi
    limit=$(left)
    # TEST_CAP_S: at most this long for the test stage, leaving time for later ones.
    [[ $stage == test && -n "${TEST_CAP_S:-}" && ${TEST_CAP_S} -lt $limit ]] && limit=$TEST_CAP_S
    TO=(timeout --signal=INT --kill-after=10 "$limit")
  else
    TO=()
  fi
  case "$stage" in
    build | build-base)
      build_stage "$stage" || { [[ $stage == build ]] && break; }
      ;;
    builds)
      # build and build-base at once: build-base in a second run of this script (its own
      # OUT folder; its log and summary line moved here after), build in this one.
      base_out="$OUT/.build-base"
      mkdir -p "$base_out"
      OUT="$base_out" BUDGET_S=0 PACK=0 "${TO[@]}" bash "$SELF" build-base >"$base_out/stdout.txt" 2>&1 &
      base_pid=$!
      build_stage build
      build_rc=$?
      # Its status line joins this summary; on a failure, the end of its output (which
      # holds that line) is shown instead.
      if wait "$base_pid"; then
        tee -a "$SUMMARY" <"$base_out/summary.txt"
      else
        status=1
        sed '/^=== summary/,$d' "$base_out/stdout.txt" | tail -n 20
        cat "$base_out/summary.txt" >>"$SUMMARY"
      fi
      mv -f "$base_out/build-base.log" "$OUT/build-base.log" 2>/dev/null
      rm -rf "$base_out"
      [[ $build_rc -ne 0 ]] && break
      ;;
    test)
      XDIST=()
      "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_WORKERS:-8}")
      junit="$(mktemp -d)/junit.xml"
      run_stage test "$OUT/test.log" "${TO[@]}" "$PY" -X faulthandler -m pytest ${TEST_PATHS:-tests} -q -p no:cacheprovider \
        --timeout=600 -rfE --junitxml="$junit" "${XDIST[@]}" ${TEST_ARGS:-}
      # The counts from the JUnit report, written when the tests end: they survive a cap
      # that interrupts pytest's exit (torch's compile workers can take a while to stop).
      # The report stays outside $OUT (a device call returns at most 8 files).
      "$PY" - "$junit" <<'PYEOF' 2>&1 | tee -a "$OUT/test.log"
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"junit: no report ({e})")
suite = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"junit: {n - f - e - s} passed, {f} failed, {e} errors, {s} skipped")
PYEOF
      ;;
    sanitize | memcheck | racecheck | fuzz)
      log="$OUT/sanitize.log"
      if [[ $stage == sanitize || $stage == memcheck ]]; then
        run_stage memcheck "$log" "${TO[@]}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
          compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" tools/cuda_sanitize_cases.py
      fi
      if [[ $stage == sanitize || $stage == racecheck ]]; then
        run_stage racecheck "$log" "${TO[@]}" compute-sanitizer --tool racecheck --error-exitcode 9 \
          "$PY" tools/cuda_sanitize_cases.py
      fi
      if [[ ($stage == sanitize || $stage == fuzz) && -f tools/replay_fuzz_corpus.py ]]; then
        run_stage fuzz-memcheck "$log" "${TO[@]}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
          compute-sanitizer --tool memcheck --error-exitcode 9 \
          "$PY" tools/replay_fuzz_corpus.py --device cuda --cases "${FUZZ_CASES:-60}"
      fi
      ;;
    tune)
      run_stage tune "$OUT/tune.log" "${TO[@]}" "$PY" tools/cuda_tune.py ${TUNE_ARGS:-}
      ;;
    t1-floor)
      run_stage t1-floor "$OUT/t1_floor.log" "${TO[@]}" "$PY" tools/cuda_t1_floor.py
      ;;
    host-cost)
      run_stage host-cost "$OUT/host_cost.log" "${TO[@]}" "$PY" tools/cuda_host_cost.py ${HOST_ARGS:-}
      ;;
    launch-cost)
      run_stage launch-cost "$OUT/launch_cost.log" "${TO[@]}" bash -c \
        'nvcc -O2 -arch=sm_90 tools/cuda_launch_cost.cu -o "$1" && "$1"' _ "$(mktemp -d)/launch_cost"
      ;;
    pattern)
      run_stage pattern "$OUT/pattern.log" "${TO[@]}" "$PY" tools/cuda_pattern_ceiling.py ${PATTERN_ARGS:-}
      ;;
    multi-pattern)
      run_stage multi-pattern "$OUT/multi_pattern.log" "${TO[@]}" "$PY" tools/cuda_multi_pattern_ceiling.py \
        ${MULTI_PATTERN_ARGS:-}
      ;;
    store-model)
      run_stage store-model "$OUT/store_model.log" "${TO[@]}" "$PY" tools/cuda_multi_store_model.py \
        ${STORE_MODEL_ARGS:-}
      ;;
    parts)
      run_stage parts "$OUT/parts.log" "${TO[@]}" "$PY" tools/cuda_step_parts.py ${PARTS_ARGS:-}
      ;;
    host-cost-base)
      enter_base "$stage" || continue
      run_stage host-cost-base "$OUT/host_cost-base.log" "${TO[@]}" "$PY" tools/cuda_host_cost.py ${HOST_ARGS:-}
      popd >/dev/null
      ;;
    tune-base)
      enter_base "$stage" || continue
      run_stage tune-base "$OUT/tune-base.log" "${TO[@]}" "$PY" tools/cuda_tune.py ${TUNE_ARGS:-}
      popd >/dev/null
      ;;
    probe)
      { echo "CC=${CC:-} CXX=${CXX:-}"; "${CXX:-g++}" --version | head -n 1
        "$PY" -c "import torch; print(torch.__config__.show())" | grep -i -E "gcc|compiler|abi"; } >>"$OUT/probe.log" 2>&1
      run_stage probe "$OUT/probe.log" "${TO[@]}" "$PY" tools/exception_probe.py 30 ||
        "${TO[@]}" cuda-gdb -batch -ex run -ex bt --args "$PY" tools/exception_probe.py 30 >>"$OUT/probe.log" 2>&1
      tail -n 25 "$OUT/probe.log"
      ;;
    ncu)
      for case in ${NCU_CASES:-80,64,128,1:fp32:64:pipe 80,64,128,1:bf16:64:pipe}; do
        ncu_case "$case"
        run_stage "ncu" "$OUT/ncu.txt" "${TO[@]}" "${ncu_one[@]}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats --section InstructionStats \
          ${NCU_ARGS:-} "${profiled[@]}"
      done
      ;;
    ncu-source)
      i=0
      for case in ${NCU_CASES:-80,64,128,1:bf16:64:lean}; do
        ncu_case "$case"
        csv="$OUT/ncu-source-$i.csv"
        echo "=== case $i: $case" >>"$OUT/ncu-source.txt"
        run_stage "ncu-source" "$OUT/ncu-source.txt" "${TO[@]}" "${ncu_one[@]}" --section WarpStateStats \
          --print-details all "${profiled[@]}"
        # The per-instruction page as CSV into its own file (bash -c: the redirection inside the timeout).
        run_stage "ncu-source" "$OUT/ncu-source.txt" "${TO[@]}" bash -c '"$@" >"$0"' "$csv" "${ncu_one[@]}" \
          --section SourceCounters --page source --print-source sass --csv "${profiled[@]}" &&
          "$PY" tools/ncu_source_summary.py "$csv" >>"$OUT/ncu-source.txt" 2>&1
        i=$((i + 1))
      done
      ;;
    bench | bench-quick | bench-base | bench-quick-base)
      # *-base: the same in BASE_TREE (built by build-base), logs bench-base.log / .json.
      log=bench
      if [[ $stage == *-base ]]; then enter_base "$stage" || continue; log=bench-base; fi
      compile=()
      [[ $stage == bench-quick* ]] && compile=(--no-compile)
      run_stage "$stage" "$OUT/$log.log" "${TO[@]}" "$PY" -m torch_ssd --device cuda --no-progress "${compile[@]}" \
        --json "$(json_path "$log")" ${BENCH_ARGS:-}
      [[ $stage == *-base ]] && popd >/dev/null
      ;;
    bench-multi | bench-multi-block | bench-multi-base)
      # bench-multi-block: the same with the lean kernels off (TORCH_SSD_CUDA_KERNEL=block), for comparison;
      # bench-multi-base: the same in BASE_TREE.
      kernel=""
      [[ $stage == bench-multi-block ]] && kernel=block
      if [[ $stage == bench-multi-base ]]; then enter_base "$stage" || continue; fi
      run_stage "$stage" "$OUT/$stage.log" "${TO[@]}" env TORCH_SSD_CUDA_KERNEL="$kernel" "$PY" tools/bench_multi.py \
        --device cuda --no-compile --no-reference --budget "${MULTI_BUDGET:-0.15}" --json "$(json_path "$stage")" \
        ${MULTI_ARGS:-}
      [[ $stage == bench-multi-base ]] && popd >/dev/null
      ;;
    bench-multi-bc)
      for path in ${BC_PATHS:-registers staged widened}; do
        run_stage "$stage-$path" "$OUT/bench-multi-$path.log" "${TO[@]}" env TORCH_SSD_CUDA_MULTI_BC="$path" \
          "$PY" tools/bench_multi.py --device cuda --no-compile --no-reference --budget "${MULTI_BUDGET:-0.15}" \
          ${MULTI_ARGS:-}
      done
      ;;
    *)
      echo "device_run.sh: unknown stage '$stage'" >&2
      status=2
      ;;
  esac
done

echo "=== summary"
cat "$SUMMARY"
# PACK=1: everything under $OUT in one archive, $OUT/device_out.tgz, and nothing else
# beside it (a device call returns at most 8 files).
if [[ "${PACK:-0}" == 1 ]]; then
  pack="$(mktemp -d)/device_out.tgz"
  tar czf "$pack" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$pack" "$OUT/device_out.tgz"
fi
exit "$status"
