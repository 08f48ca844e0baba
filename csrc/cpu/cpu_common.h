// What the CPU kernel files share: the per-ISA compilation of the hot loops, the
// chunk width (which fixes the order in which y is reduced), and the run-time
// dtype / layout dispatch into templates.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dstate_io.h"
#include "../step.h"

namespace ssd {
namespace cpu {

// The hot loops are compiled twice on x86-64 Linux: for AVX2 (x86-64-v3) and for
// the baseline ISA, picked at load time (an ifunc). Mul and add round the same in
// every ISA (and -ffp-contract=off keeps FMA out), so the clones give
// bit-identical results.
// The step on half-precision pools has a third, AVX-512 clone: its masked adds and
// three-way logic make the bfloat16 rounding of the state shorter, about 10% faster
// here (float pools, bound by memory rather than instructions, gained nothing).
// (setup.py's TORCH_SSD_CPU_CLONES=0 defines SSD_CPU_NO_CLONES: baseline only, a faster build.)
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(SSD_CPU_NO_CLONES)
#define SSD_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define SSD_CPU_CLONES_AVX512 __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SSD_CPU_CLONES
#define SSD_CPU_CLONES_AVX512
#endif
// Only code inlined into an SSD_CPU_CLONES function gets its instruction set, so
// the templates and the dispatch lambdas under it are forced inline.
#define SSD_CPU_INLINE inline __attribute__((always_inline))
#define SSD_CPU_INLINE_LAMBDA __attribute__((always_inline))

// Floats per chunk: four SSE or two AVX registers. Every CPU kernel reduces y over
// these 16 lanes with one fixed tree, so their results agree bit for bit.
constexpr int kVec = 16;

// Whether a row reads a slot that another row writes in the same call. The
// contract leaves such a call's result unspecified (docs/failure_contract.md);
// the CPU kernels then run the rows one after another in index order, as one
// thread would, so the answer is still the same every time. reads and writes are
// (slot, row) pairs of addressable slots; reads is sorted here.
inline bool cross_row_hazard(std::vector<std::pair<int64_t, int64_t>>& reads,
                             const std::vector<std::pair<int64_t, int64_t>>& writes) {
  std::sort(reads.begin(), reads.end());
  for (const auto& [slot, row] : writes) {
    auto it = std::lower_bound(reads.begin(), reads.end(), std::make_pair(slot, int64_t{INT64_MIN}));
    for (; it != reads.end() && it->first == slot; ++it)
      if (it->second != row) return true;
  }
  return false;
}

template <typename Fn>
SSD_CPU_INLINE void with_dtype(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kBFloat16: fn(c10::BFloat16{}); break;
    case Dtype::kFloat16: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

template <typename Fn>
SSD_CPU_INLINE void with_flag(bool flag, Fn&& fn) {
  if (flag) fn(std::true_type{});
  else fn(std::false_type{});
}

// Widen one row into float scratch with its whole chunks in the lane order of
// pool type Order (dstate_io.h), through the dstate I/O owner.
template <typename Order>
SSD_CPU_INLINE void widen_row_ordered(const OperandRef& r, int64_t offset, int64_t stride, int64_t n, float* out) {
  with_dtype(r.dtype, [&](auto tag) SSD_CPU_INLINE_LAMBDA {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(r.data) + offset;
    with_flag(stride == 1, [&](auto unit) SSD_CPU_INLINE_LAMBDA {
      load_row_ordered<Order, decltype(unit)::value>(p, stride, n, out);
    });
  });
}

// Widen one row whose dtype is known only at run time (B, C, x, D, z, a
// per-element A) into contiguous float32 scratch in natural element order.
SSD_CPU_INLINE void widen_row(const OperandRef& r, int64_t offset, int64_t stride, int64_t n, float* out) {
  widen_row_ordered<float>(r, offset, stride, n, out);
}

// Ask for the cache lines of a unit-stride row of n elements (into L2 and outward).
// The step kernels request a (row, head) pair's rows one pair ahead: slots are
// random, so no hardware prefetcher sees them coming.
template <typename T>
SSD_CPU_INLINE void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// Where the state rows of (row, head) pair th + 1 start, for prefetch_row; nullptr
// past `end`, for a strided pool, or when that pair's source slot (src_of(row)) is
// not addressable.
template <bool kUnit, typename PoolT, typename SrcOf>
SSD_CPU_INLINE const PoolT* next_pair_rows(const StepParams& s, const PoolT* pool, int64_t th, int64_t end,
                                           SrcOf&& src_of) {
  if (!kUnit || th + 1 >= end) return nullptr;
  const int64_t src = src_of((th + 1) / s.H);
  return slot_addressable(src, s.S, s.pad_slot_id) ? pool + s.pool_offset(src, (th + 1) % s.H, 0) : nullptr;
}

// The helpers below take and return vectors; always inlined, so GCC's note
// about the AVX calling convention (-Wpsabi) does not apply.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// The fixed reduction tree of the 16 lanes of y's partial sums (lane v holds the
// terms of the elements n with n % 16 == v).
SSD_CPU_INLINE float reduce_lanes(float* acc) {
  for (int w = kVec / 2; w > 0; w /= 2)
    for (int v = 0; v < w; ++v) acc[v] += acc[v + w];
  return acc[0];
}

// Round a float row into a row whose dtype is known only at run time (y).
SSD_CPU_INLINE void narrow_row(void* base, Dtype dtype, int64_t offset, int64_t stride, int64_t n, const float* in) {
  with_dtype(dtype, [&](auto tag) SSD_CPU_INLINE_LAMBDA {
    using T = decltype(tag);
    T* p = static_cast<T*>(base) + offset;
    with_flag(stride == 1, [&](auto unit) SSD_CPU_INLINE_LAMBDA {
      store_row<kVec, decltype(unit)::value>(in, 1, p, stride, n);
    });
  });
}

// exp(v) of a float, evaluated in double and rounded once to float (so within
// about half an ulp): the CPU kernels' own exp for silu. It is written once for a
// vector of lanes V, and a scalar is V = double: plain IEEE double arithmetic and
// no FMA, so the vector and scalar forms, and every instruction set, agree bit
// for bit -- which libm's expf does not promise across its own variants.
template <typename V, typename I>
SSD_CPU_INLINE V exp_in_double(V d) {
  const double kShift = 0x1.8p52;  // t - kShift is d / ln 2 rounded to an integer
  const double kLn2Hi = 0x1.62e42fee00000p-1, kLn2Lo = 0x1.a39ef35793c76p-33;  // ln 2 = hi + lo, k * hi exact
  d = d > 90.0 ? V{} + 90.0 : d;      // exp(90) overflows float: inf
  d = d < -110.0 ? V{} - 110.0 : d;   // exp(-110) underflows float: 0; NaN passes both
  const V t = d * 0x1.71547652b82fep0 + kShift;
  const V k = t - kShift;
  const V r = (d - k * kLn2Hi) - k * kLn2Lo;  // |r| <= ln 2 / 2
  // e^r by its Taylor series to r^9 (truncation below 1e-11 relative).
  V p = r * (1.0 / 362880) + (1.0 / 40320);
  p = p * r + (1.0 / 5040);
  p = p * r + (1.0 / 720);
  p = p * r + (1.0 / 120);
  p = p * r + (1.0 / 24);
  p = p * r + (1.0 / 6);
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // 2^k from the integer in t's low bits: k + 1023 in the exponent field.
  I bits;
  __builtin_memcpy(&bits, &t, sizeof bits);
  const int64_t kShiftBits = 0x4338000000000000;  // the bits of kShift
  const I scale_bits = (bits - kShiftBits + 1023) << 52;
  V scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

SSD_CPU_INLINE float cpu_exp(float v) {
  return static_cast<float>(exp_in_double<double, int64_t>(static_cast<double>(v)));
}

// finish_y()'s gate, z * sigmoid(z), with cpu_exp.
SSD_CPU_INLINE float silu(float z) { return z / (1.0f + cpu_exp(-z)); }

// step.h's finish_y(), with cpu_exp: what every CPU kernel computes for y.
SSD_CPU_INLINE float finish_y_cpu(const StepParams& s, float sum, int64_t t, int64_t h, int64_t p, float xv) {
  float y = sum;
  if (s.D.present()) y += s.D.at(h, p) * xv;
  if (s.z.present()) y *= silu(s.z.at(t, h, p));
  return y;
}

// y[i] *= silu(z[i]) for n values, four lanes at a time (bit for bit the scalar silu).
SSD_CPU_INLINE void gate_row(float* y, const float* z, int64_t n) {
  typedef float F32x4 __attribute__((vector_size(16)));
  typedef double F64x4 __attribute__((vector_size(32)));
  typedef int64_t I64x4 __attribute__((vector_size(32)));
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    F32x4 zv, yv;
    __builtin_memcpy(&zv, z + i, sizeof zv);
    __builtin_memcpy(&yv, y + i, sizeof yv);
    const F32x4 e = __builtin_convertvector(exp_in_double<F64x4, I64x4>(__builtin_convertvector(-zv, F64x4)), F32x4);
    yv *= zv / (1.0f + e);
    __builtin_memcpy(y + i, &yv, sizeof yv);
  }
  for (; i < n; ++i) y[i] *= silu(z[i]);
}

// finish_y_cpu() for the P channels of head h of row t at once: y holds the sums
// over N and becomes y; x holds x; scratch is P floats.
SSD_CPU_INLINE void finish_y_row(const StepParams& s, int64_t t, int64_t h, const float* x, float* scratch,
                                 float* y) {
  const int64_t P = s.P;
  if (s.D.present()) {
    widen_row(s.D, h * s.D.stride[0], s.D.stride[1], P, scratch);
    for (int64_t p = 0; p < P; ++p) y[p] += scratch[p] * x[p];
  }
  if (s.z.present()) {
    widen_row(s.z, t * s.z.stride[0] + h * s.z.stride[1], s.z.stride[2], P, scratch);
    gate_row(y, scratch, P);
  }
}

// The channel scalars of head h of row t, P channels at a time (into P floats
// each): x, dt (+ dt_bias, softplus), dt * x, and exp(A * dt) when with_dA (A
// constant along N, and N > 0: an empty A is never read). Per-head dt / dt_bias / A
// (stride 0 over P) give the same value for every p: softplus and exp are then
// evaluated once per head, not once per channel.
SSD_CPU_INLINE void channel_scalars(const StepParams& s, int64_t t, int64_t h, bool with_dA, float* xs, float* dtv,
                                    float* dtx, float* dA) {
  const int64_t P = s.P;
  const bool dt_per_head = s.dt.stride[2] == 0 && (!s.dt_bias.present() || s.dt_bias.stride[1] == 0);
  widen_row(s.x, t * s.x.stride[0] + h * s.x.stride[1], s.x.stride[2], P, xs);
  if (dt_per_head) std::fill(dtv, dtv + P, channel_dt(s, t, h, 0));
  else for (int64_t p = 0; p < P; ++p) dtv[p] = channel_dt(s, t, h, p);
  for (int64_t p = 0; p < P; ++p) dtx[p] = dtv[p] * xs[p];
  if (!with_dA) return;
  const auto A = [&](int64_t p) SSD_CPU_INLINE_LAMBDA {
    return load_scalar(s.A.data, h * s.A.stride[0] + p * s.A.stride[1], s.A.dtype);
  };
  if (dt_per_head && s.A.stride[1] == 0) std::fill(dA, dA + P, decay(A(0), dtv[0]));
  else for (int64_t p = 0; p < P; ++p) dA[p] = decay(A(p), dtv[p]);
}

// step.h's advance(), lane by lane.
SSD_CPU_INLINE HostF32x8 advance_lanes(HostF32x8 state, HostF32x8 dA, HostF32x8 dtx, HostF32x8 b) {
  return state * dA + dtx * b;
}

// One term of y's partial sums, acc + state * c, lane by lane (the scalar tail
// adds its terms in the same form).
SSD_CPU_INLINE HostF32x8 accumulate_lanes(HostF32x8 acc, HostF32x8 state, HostF32x8 c) { return acc + state * c; }

// One token on one chunk (in a pool type's lane order): the state advances and y's
// partial sums take state * C -- the step of every CPU kernel.
SSD_CPU_INLINE void advance_chunk(HostChunk& st, HostChunk& acc, const HostChunk& dA, HostF32x8 dtx,
                                  const HostChunk& b, const HostChunk& c) {
  st.lo = advance_lanes(st.lo, dA.lo, dtx, b.lo);
  st.hi = advance_lanes(st.hi, dA.hi, dtx, b.hi);
  acc.lo = accumulate_lanes(acc.lo, st.lo, c.lo);
  acc.hi = accumulate_lanes(acc.hi, st.hi, c.hi);
}

// reduce_lanes' tree on partial sums held in a chunk in Order's lane order,
// without leaving the registers: the same additions of the same values.
template <typename Order>
SSD_CPU_INLINE float reduce_chunk(const HostChunk& acc) {
  typedef float F32x4 __attribute__((vector_size(16)));
  typedef float F32x2 __attribute__((vector_size(8)));
  if constexpr (ChunkOrder<Order>::kPaired) {
    // lo = even elements E, hi = odd ones O. reduce_lanes' first three levels
    // add E and O separately -- (E[j] + E[j+4]), then [0,1] + [2,3], then [0] + [1]
    // -- and the last level adds the two results.
    const HostF32x8 s4 = __builtin_shufflevector(acc.lo, acc.hi, 0, 1, 2, 3, 8, 9, 10, 11) +
                         __builtin_shufflevector(acc.lo, acc.hi, 4, 5, 6, 7, 12, 13, 14, 15);
    const F32x4 s2 = __builtin_shufflevector(s4, s4, 0, 1, 4, 5) + __builtin_shufflevector(s4, s4, 2, 3, 6, 7);
    const F32x2 s1 = __builtin_shufflevector(s2, s2, 0, 2) + __builtin_shufflevector(s2, s2, 1, 3);
    return s1[0] + s1[1];
  } else {
    const HostF32x8 s8 = acc.lo + acc.hi;
    const F32x4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    const F32x2 s2 = __builtin_shufflevector(s4, s4, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3);
    return s2[0] + s2[1];
  }
}

// A chunk's partial sums as reduce_lanes' array (lane v = element v).
template <typename Order>
SSD_CPU_INLINE void chunk_to_lanes(const HostChunk& acc, float* lanes) {
  float o[kVec];
  __builtin_memcpy(o, &acc.lo, sizeof acc.lo);
  __builtin_memcpy(o + 8, &acc.hi, sizeof acc.hi);
  for (int v = 0; v < kVec; ++v) lanes[v] = o[chunk_lane<Order>(v)];
}

// One channel (t, h, p): advance its N elements of state from `in`, store them
// to `out` when kWrite, and return y's sum over N of state * C. Bf, Cf (and Af
// when kAPerN) are float rows whose whole chunks are in PoolT's lane order.
// The multi-token kernel carries a channel's state between its tokens in float32,
// in `carry` (whole chunks as held, HostChunk's halves in turn, then the tail
// elements): kFromCarry reads the state from there instead of `in`, kToCarry
// leaves the advanced state there too.
template <typename PoolT, bool kUnit, bool kAPerN, bool kWrite, bool kFromCarry = false, bool kToCarry = false>
SSD_CPU_INLINE float step_channel(const PoolT* in, PoolT* out, int64_t stride, int64_t N, const float* Bf,
                                  const float* Cf, const float* Af, float dtv, float dA_splat, float dtx,
                                  float* carry = nullptr) {
  const int64_t full = N / kVec;
  const int rest = static_cast<int>(N - full * kVec);
  const int64_t step = kVec * (kUnit ? 1 : stride);
  const HostF32x8 dtx8 = host_splat(dtx);
  HostChunk dA{host_splat(dA_splat), host_splat(dA_splat)};
  HostChunk acc{host_splat(0.0f), host_splat(0.0f)};
  for (int64_t c = 0; c < full; ++c) {
    HostChunk st;
    if constexpr (kFromCarry) st = load_ordered_chunk(carry + c * kVec);
    else load_chunk<kUnit>(in + c * step, stride, st);
    const HostChunk b = load_ordered_chunk(Bf + c * kVec), cc = load_ordered_chunk(Cf + c * kVec);
    if constexpr (kAPerN) {
      float d[kVec];
      for (int v = 0; v < kVec; ++v) d[v] = decay(Af[c * kVec + v], dtv);
      dA = load_ordered_chunk(d);
    }
    advance_chunk(st, acc, dA, dtx8, b, cc);
    if constexpr (kToCarry) store_chunk<true>(carry + c * kVec, 1, st);  // as held: float32 keeps the order
    if constexpr (kWrite) store_chunk<kUnit>(out + c * step, stride, st);
  }
  if (!rest) return reduce_chunk<PoolT>(acc);
  // The tail, element by element into the same lanes of reduce_lanes' tree.
  float lanes[kVec], st[kVec];
  chunk_to_lanes<PoolT>(acc, lanes);
  if constexpr (kFromCarry) std::copy(carry + full * kVec, carry + full * kVec + rest, st);
  else DstateRow<kVec, kUnit, const PoolT>{in, stride}.load_tail(full, rest, st);
  for (int v = 0; v < rest; ++v) {
    const int64_t n = full * kVec + v;
    const float dA_n = kAPerN ? decay(Af[n], dtv) : dA_splat;
    st[v] = advance(st[v], dA_n, dtx, Bf[n]);
    lanes[v] = accumulate_y(lanes[v], st[v], Cf[n]);
  }
  if constexpr (kToCarry) std::copy(st, st + rest, carry + full * kVec);
  if constexpr (kWrite) DstateRow<kVec, kUnit, PoolT>{out, stride}.store_tail(full, rest, st);
  return reduce_lanes(lanes);
}

#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace cpu
}  // namespace ssd
