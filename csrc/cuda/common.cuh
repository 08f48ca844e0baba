// Pieces the CUDA kernels of torch_ssd share: the thread mapping along the dstate
// (N) axis, the warp-parallel "last writer" test, dtype dispatch and launch helpers.
//
// Thread mapping along N (one rule for every layout, so results never depend on
// strides): a row of N elements is split into chunks of VEC = 16 / sizeof(element)
// elements (one 16-byte access on the unit-stride path). `lanes` consecutive
// lanes of a warp (a power of two, at most 32) share one row; lane `li` takes
// chunks li, li + lanes, li + 2 * lanes, ... (so each warp instruction reads whole
// 32-byte sectors), a batch of them (the chunks_per_batch of make_row_map) whose
// loads are all issued before the first is used. A warp therefore covers 32 / lanes rows at a time.
// The last chunk, when N % VEC != 0, is the tail and always goes through the
// partial path of the dstate I/O owner. A lane sums its chunks in order; the
// lanes of a row are then summed by a fixed shuffle tree.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

// dstate_io.h's vector paths return early, leaving the scalar loop after them
// unreachable in device code: that is by design.
#pragma nv_diag_suppress 128
#include "../dstate_io.h"
#include "../ssd.h"
#include "../step.h"

namespace ssd {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kChunksPerBatch = 8;  // independent 16-byte loads per thread in flight

// Launch knobs (TORCH_SSD_CUDA_*: comparisons, tuning sweeps and tests) are read from the
// environment on every call, so that one process can compare settings. Every knob goes
// through these three readers; a value they do not accept leaves the default.

// An on / off knob: environment variable `name` = "1" / "0" forces it on / off, anything
// else (or unset) leaves `by_default`.
inline bool env_switch(const char* name, bool by_default) {
  const char* env = std::getenv(name);
  if (env && (env[0] == '0' || env[0] == '1')) return env[0] == '1';
  return by_default;
}

// A numeric knob: the value of `name` when it is a whole decimal number in [lo, hi];
// nothing when unset, not a number or out of range.
inline std::optional<int> env_int(const char* name, int lo, int hi) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v < lo || v > hi) return std::nullopt;
  return static_cast<int>(v);
}

// A knob naming a choice: whether `name` is set to exactly `value`.
inline bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env && std::string(env) == value;
}

// Elements of T in one 16-byte access.
template <typename T>
constexpr int vec_of() {
  return static_cast<int>(16 / sizeof(T));
}

// How the lanes of a warp cover one row of n elements read in chunks of vec.
struct RowMap {
  int n = 0;                // elements in the row
  int nfull = 0;            // whole chunks
  int rest = 0;             // elements of the tail chunk (0: no tail)
  int lanes = 1;            // lanes per row: a power of two <= 32
  int lanes_log2 = 0;
  int chunks_per_lane = 0;  // ceil(chunks / lanes)

  SSD_HD int rows_per_warp() const { return kWarp >> lanes_log2; }
  SSD_HD int chunks() const { return nfull + (rest > 0 ? 1 : 0); }
};

inline RowMap make_row_map(int64_t n, int vec, int chunks_per_batch = kChunksPerBatch) {
  TORCH_CHECK(n < (int64_t{1} << 30), "ssd (CUDA): the state size N = ", n, " is too large");
  RowMap m;
  m.n = static_cast<int>(n);
  m.nfull = m.n / vec;
  m.rest = m.n - m.nfull * vec;
  const int chunks = m.chunks();
  const int want_lanes = (chunks + chunks_per_batch - 1) / chunks_per_batch;
  while (m.lanes < kWarp && m.lanes < want_lanes) m.lanes *= 2, ++m.lanes_log2;
  m.chunks_per_lane = (chunks + m.lanes - 1) / m.lanes;
  return m;
}

// Chunks per thread in flight in the decode-step kernels, per pool type (measured
// on an H200, BENCHMARKS.md): float32 rows 8 chunks deep, 16-bit rows -- whose 16
// bytes hold twice the elements, so twice the arithmetic -- 4 deep. The mapping
// along N, and so the order of the y sum, follows from this and N alone: every
// decode-step kernel (single- and multi-token, every layout) must use step_row_map
// so that they all give the same bits.
template <typename PoolT>
constexpr int step_chunks_per_batch() {
  return sizeof(PoolT) == 4 ? 8 : 4;
}

// TORCH_SSD_CUDA_CHUNKS=1..8 sets the chunks per lane (fewer: more lanes per row)
// for tuning sweeps (tools/cuda_tune.py); read on every call, the same for every
// kernel, so they keep giving each other's bits.
constexpr int kMaxChunksPerLaneKnob = 8;

template <typename PoolT>
inline RowMap step_row_map(int64_t n) {
  const int per_batch =
      env_int("TORCH_SSD_CUDA_CHUNKS", 1, kMaxChunksPerLaneKnob).value_or(step_chunks_per_batch<PoolT>());
  return make_row_map(n, vec_of<PoolT>(), per_batch);
}

// Whether every row along the last dim of t starts on an `align`-byte boundary and
// has unit stride, so chunks of align bytes can be read with aligned vector loads.
// Decided once per call on the host; the other case takes the scalar gather path,
// which computes the same bits (same mapping, same reduction).
inline bool rows_aligned(const at::Tensor& t, int64_t align) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % align != 0) return false;
  const int64_t d = t.dim();
  if (t.size(d - 1) > 1 && t.stride(d - 1) != 1) return false;
  for (int64_t i = 0; i + 1 < d; ++i)
    if (t.size(i) > 1 && (t.stride(i) * t.element_size()) % align != 0) return false;
  return true;
}

// Rows read and written with 16-byte vectors (the pool, the loaders' operands).
inline bool rows_vectorizable(const at::Tensor& t) { return rows_aligned(t, 16); }

// The pool element type as a template argument.
template <typename Fn>
void with_elem_type(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kBFloat16: fn(c10::BFloat16{}); break;
    case Dtype::kFloat16: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

template <typename Fn>
void with_bool(bool value, Fn&& fn) {
  if (value) fn(std::true_type{});
  else fn(std::false_type{});
}

// Multiprocessors of the current device, read once per device. (Only c10's CUDA
// headers are used: ATen's pull in the CUDA math libraries' headers, which a
// compile-only CI toolkit need not have.)
inline int num_sms() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  const int device = c10::cuda::current_device();
  if (device >= kMaxDevices) return 132;
  if (cached[device] == 0) {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cached[device] = count;
  }
  return cached[device];
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Whether the current device is sm_90 or later (read once per device).
inline bool device_is_sm90() {
  constexpr int kMaxDevices = 64;
  static int major[kMaxDevices] = {};
  const int device = c10::cuda::current_device();
  if (device >= kMaxDevices) return false;
  if (major[device] == 0) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device));
    major[device] = value;
  }
  return major[device] >= 9;
}

// Programmatic dependent launch (sm_90+): a kernel launched with it may be
// scheduled while the kernel before it in the stream finishes, and waits for that
// kernel's results (wait_for_prior_grid) only where it first reads or writes global
// memory -- what it hides is the launch gap between back-to-back steps. On by default
// where the device has it; TORCH_SSD_CUDA_PDL=0 turns it off (read on every call).
inline bool use_pdl() {
  return env_switch("TORCH_SSD_CUDA_PDL", true) && device_is_sm90();
}

// Launch `kernel` on `stream`, with programmatic dependent launch when pdl is set
// (the kernel must then call wait_for_prior_grid before its first global access).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Raise a kernel's dynamic shared-memory limit when a large N needs more than the
// default 48 KB (not a stream operation: safe during graph capture).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  TORCH_CHECK(bytes <= 227 * 1024, "ssd (CUDA): the state size N is too large for shared memory");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

// ---------------------------------------------------------------------------
// The lean kernels (decode_step_lean, multi_step_lean): the serving engines' case.
// ---------------------------------------------------------------------------

// TORCH_SSD_CUDA_KERNEL=block / =pipe turn the lean kernels off (comparisons, tests).
inline bool want_lean() {
  return !env_is("TORCH_SSD_CUDA_KERNEL", "block") && !env_is("TORCH_SSD_CUDA_KERNEL", "pipe");
}

inline bool same_type(std::initializer_list<at::Tensor> tensors, const at::Tensor& like) {
  for (const at::Tensor& t : tensors)
    if (t.scalar_type() != like.scalar_type()) return false;
  return true;
}

// Whether a lean kernel covers the call: unit-stride pool rows that split evenly
// over a row's lanes (4 or 8 chunks each), A broadcast along N, x, z, dt, B, C and
// y of one type (bfloat16 or float32), B and C rows aligned for chunk loads, and a
// grid of (H, grid_rows, tiles along P) within CUDA's limits.
template <typename PoolT>
bool lean_applies(const Dims& d, const RowMap& m, bool unit, bool a_per_n, int64_t grid_rows, const at::Tensor& x,
                  const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                  const c10::optional<at::Tensor>& z, const at::Tensor& y) {
  const int64_t chunk_bytes = std::min<int64_t>(16, vec_of<PoolT>() * B.element_size());
  return unit && !a_per_n && d.N > 0 && m.rest == 0 && m.nfull == m.lanes * m.chunks_per_lane &&
         (m.chunks_per_lane == 4 || m.chunks_per_lane == 8) && x.scalar_type() != at::kHalf &&
         grid_rows <= 65535 && d.P <= 65535 && d.H < (int64_t{1} << 31) && same_type({B, C, dt, y}, x) &&
         (!z.has_value() || same_type({*z}, x)) && rows_aligned(B, chunk_bytes) && rows_aligned(C, chunk_bytes);
}

// The step's rows (T * H * P) per multiprocessor: the load the lean kernels' launch
// choices are picked from.
inline int64_t lean_rows_per_sm(const Dims& d) { return d.T * d.H * d.P / num_sms(); }

// Block order of the lean kernels: a head's tiles side by side in the grid ((tiles, H,
// rows): consecutive blocks on consecutive bytes of a slot) or the heads' order ((H,
// rows, tiles)). `env_name` ("1" / "0") forces either over `by_default`; H above 65535
// (the grid's y limit) keeps the heads' order.
inline bool lean_tiles_inner(const char* env_name, bool by_default, int64_t H) {
  return H <= 65535 && env_switch(env_name, by_default);
}

// The lanes per row that the lean kernels are also compiled for, fixed (N = 128, the
// usual state size: 4 lanes of 32 elements with any pool type; which pool types, each
// launch decides): chunk offsets, the y tree and the row arithmetic fold into constants.
// Other rows read map.lanes at run time. `env_name` = "0" takes the run-time form for
// them too (A / B runs; env_switch).
constexpr int kFixedLanes = 4;
constexpr int log2_of(int v) { return v <= 1 ? 0 : 1 + log2_of(v / 2); }
inline bool use_fixed_lanes(const RowMap& map, const char* env_name) {
  return map.lanes == kFixedLanes && env_switch(env_name, true);
}

inline dim3 lean_grid(bool tiles_inner, int64_t H, int64_t rows, int64_t tiles) {
  const unsigned h = static_cast<unsigned>(H), r = static_cast<unsigned>(rows), n = static_cast<unsigned>(tiles);
  return tiles_inner ? dim3(n, h, r) : dim3(h, r, n);
}

#if defined(__CUDACC__)

// last_writer (step.h) computed by a whole warp: lane l scans rows t+1+l, t+1+l+32,
// ... instead of one thread scanning all later rows. Same answer; every lane of the
// warp must call it with the same arguments.
__device__ __forceinline__ bool warp_last_writer(const SlotRef& dst_idx, const SlotRef& src_idx,
                                                 bool has_src, int64_t T, int64_t S,
                                                 int64_t pad_slot_id, int64_t t, int64_t dst) {
  if (!slot_addressable(dst, S, pad_slot_id)) return false;
  if (dst_idx.data == nullptr) return true;
  bool later = false;
  for (int64_t u = t + 1 + (threadIdx.x & (kWarp - 1)); u < T; u += kWarp) {
    if (dst_idx.slot(u, u) == dst && (!has_src || slot_addressable(src_idx.slot(u, u), S, pad_slot_id)))
      later = true;
  }
  return !__any_sync(kFullMask, later);
}

// This block's place in a lean_grid: head, row, tile (along P), and the grid's heads
// and tiles.
struct LeanBlock {
  uint32_t h, row, tile, heads, tiles;
};
__device__ __forceinline__ LeanBlock lean_block(bool tiles_inner) {
  if (tiles_inner) return {blockIdx.y, blockIdx.z, blockIdx.x, gridDim.y, gridDim.x};
  return {blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.z};
}

// Programmatic dependent launch, device side (no-ops before sm_90): wait until the
// previous kernel in the stream has finished and its writes are visible; let the
// next kernel's blocks be scheduled once every block of this one has said so.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The kernel's parameter block, every 64-byte line of it read first and waited for.
// An instruction that takes a parameter as an operand stalls its warp on a miss in
// the constant cache; a lean T = 1 step first touches some ten lines of its
// parameters one after another along its chain (ncu: ~15 % of a warp's cycles).
// Two ways (`params` a __grid_constant__ kernel parameter):
//  - indexed: one load, lane l reading line l (its lanes' addresses are served one at a
//    time; under ncu the operand reads after it still miss, but wait less: it warms a
//    level of the constant caches that both paths share);
//  - operands: each line read as an instruction operand, one after another (fills the
//    operand cache that the kernel's own reads use, each miss in turn).
// Never-true check (a word equal to its own complement) in PTX: C++ folds it away;
// taken by the whole warp or none: a per-lane branch costs the kernel its
// warp-uniform code.
__device__ __forceinline__ void keep_param_word(uint32_t v) {
  uint32_t bad;
  asm volatile("{\n\t.reg .pred eq;\n\tsetp.eq.u32 eq, %1, %2;\n\tselp.u32 %0, 1, 0, eq;\n\t}"
               : "=r"(bad) : "r"(v), "r"(~v));
  if (__any_sync(0xffffffffu, bad)) __trap();
}
constexpr uint32_t kParamLine = 64;
template <typename Params>
__device__ __forceinline__ void touch_param_lines_indexed(const Params& params) {
  constexpr uint32_t kLast = (sizeof(Params) - 1) / 4;
  keep_param_word(reinterpret_cast<const uint32_t*>(&params)[min((threadIdx.x & 31u) * (kParamLine / 4), kLast)]);
}
template <typename Params>
__device__ __forceinline__ void touch_param_lines_operands(const Params& params) {
  constexpr uint32_t kLast = (sizeof(Params) - 1) / 4;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&params);
  uint32_t v = 0;
#pragma unroll
  for (uint32_t line = 0; line * kParamLine < sizeof(Params); ++line) v ^= words[min(line * (kParamLine / 4), kLast)];
  keep_param_word(v);
}

// Warming L2 before wait_for_prior_grid: `bytes` (a multiple of 16) from `p`
// (16-byte aligned) are fetched into L2 by the copy engine of the multiprocessor
// (sm_90; elsewhere nothing). L2 is where every multiprocessor's reads and writes
// meet, so a line fetched into it early cannot make a later read stale: whatever
// the previous kernel writes lands there too. A hint: nothing comes back.
__device__ __forceinline__ void prefetch_l2_bytes(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Bulk copies from shared to global memory (sm_90's cp.async.bulk): the copy engine
// writes the bytes while the warp goes on computing, instead of the warp's stores
// waiting in the memory pipeline that its shared-memory loads also use. `bytes` a
// multiple of 16, both addresses 16-byte aligned. The written lines are evict-first in
// L2, as the lean kernels' 16-byte state stores (store_chunk_streaming): no later access
// of the kernel reads them, and its inputs stay. Before sm_90 (where the host never asks
// for them) plain 16-byte stores.
__device__ __forceinline__ void bulk_store(void* global, const void* smem, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n" ::"l"(global),
               "r"(src), "r"(bytes), "l"(policy)
               : "memory");
#else
  for (uint32_t i = 0; i < bytes; i += 16)
    *reinterpret_cast<uint4*>(static_cast<char*>(global) + i) =
        *reinterpret_cast<const uint4*>(static_cast<const char*>(smem) + i);
#endif
}

// Shared-memory writes made by this thread become visible to the bulk copies issued
// after it (with a barrier between: another thread may issue them).
__device__ __forceinline__ void bulk_fence_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Close this thread's group of bulk copies issued so far.
__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Wait until all of this thread's groups but the kPending most recent have read
// their shared memory (which may then be written again).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Wait until all of this thread's bulk copies are complete (written to global memory).
__device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// A slot index read before wait_for_prior_grid, for prefetch addresses only: it
// may predate the previous kernel's writes. Read through L2 only (ld.global.cg),
// so that no L1 line of it outlives the wait and the real read sees the new value.
__device__ __forceinline__ int64_t peek_slot(const SlotRef& r, int64_t t) {
  if (r.data == nullptr) return t;
  return r.is_int64 ? static_cast<int64_t>(__ldcg(static_cast<const long long*>(r.data) + t * r.stride))
                    : static_cast<int64_t>(__ldcg(static_cast<const int*>(r.data) + t * r.stride));
}

// Chunk c of B and C from their widened float32 rows in shared memory (16-byte
// aligned), as the per-element loop of every decode-step kernel takes them.
template <int VEC>
__device__ __forceinline__ void bc_chunk(const float* Bs, const float* Cs, int c, float (&b)[VEC],
                                         float (&cc)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC / 4; ++i) {
    const float4 bv = reinterpret_cast<const float4*>(Bs + c * VEC)[i];
    const float4 cv = reinterpret_cast<const float4*>(Cs + c * VEC)[i];
    b[4 * i] = bv.x, b[4 * i + 1] = bv.y, b[4 * i + 2] = bv.z, b[4 * i + 3] = bv.w;
    cc[4 * i] = cv.x, cc[4 * i + 1] = cv.y, cc[4 * i + 2] = cv.z, cc[4 * i + 3] = cv.w;
  }
}

// The tree reduction over the `lanes` lanes of one row (xor butterfly: every lane
// ends with the same sum, since float addition is commutative).
__device__ __forceinline__ float row_sum(float v, int lanes) {
  for (int off = lanes >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}
// The same for ROWS rows at once, each summed in row_sum's order (the same bits): the
// rows' shuffles interleave, so each step waits for one shuffle's latency, not ROWS.
// (row_sum itself written as row_sums<1> changed the single-token kernels' sm_90 code.)
template <int ROWS>
__device__ __forceinline__ void row_sums(float (&v)[ROWS], int lanes) {
  for (int off = lanes >> 1; off > 0; off >>= 1) {
    float other[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) other[r] = __shfl_xor_sync(kFullMask, v[r], off);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) v[r] += other[r];
  }
}

// A per-channel scalar whose type is known only at run time (dt_bias, D, A), in two
// steps: its bits, with no branch around the load (an absent operand reads as 0), then
// its value. A kernel issues all of its scalars' loads before converting any: a load
// and its conversion inside one branch (load_scalar's switch, or `if (present)`) make
// the warp wait for that load before the next one goes out.
__device__ __forceinline__ uint32_t scalar_bits(const OperandRef& o, int64_t i0, int64_t i1) {
  const int64_t at = i0 * o.stride[0] + i1 * o.stride[1];
  if (!o.present()) return 0u;
  return o.dtype == Dtype::kFloat32 ? static_cast<const uint32_t*>(o.data)[at]
                                    : static_cast<const uint16_t*>(o.data)[at];
}
__device__ __forceinline__ float scalar_value(uint32_t bits, Dtype dtype) {
  if (dtype == Dtype::kBFloat16) return widen(c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()));
  if (dtype == Dtype::kFloat16) return widen(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
  return __uint_as_float(bits);
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace ssd
