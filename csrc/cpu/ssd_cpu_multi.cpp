// CPU kernels of the multi-token decode step (docs/multi_token.md):
// decode_step_multi(_out) and decode_step_varlen(_out). Parallel over (row, head);
// for each channel (row, h, p) the source row is read once and the row's tokens are
// stepped in turn by the single-token kernel's step_channel (cpu_common.h), the
// state carried between them in float32; the state after token k is rounded once,
// on its store. Per element the arithmetic and the reduction tree of y are those of
// the single-token CPU kernel, so a float32 pool gives the bits of K single steps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../ssd.h"
#include "cpu_common.h"

// AVX-sized vectors pass only between always-inlined helpers (see ssd_cpu.cpp).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace ssd {
namespace {

using namespace cpu;

// Per row: its tokens, its source slot, and for each token the slot its state
// goes to (kNoSlot when it writes nothing). Computed once per call, so the
// last-writer scan is not repeated per head.
struct RowPlan {
  RowTokens tokens;
  int64_t src = kNoSlot;
  bool pad = true;
};

struct Plan {
  std::vector<RowPlan> rows;
  std::vector<int64_t> dst;  // (T, max_tokens)
  int64_t max_tokens = 0;
};

Plan make_plan(const MultiStepParams& m) {
  const StepParams& s = m.step;
  Plan plan;
  plan.rows.resize(s.T);
  for (int64_t t = 0; t < s.T; ++t) {
    RowPlan& r = plan.rows[t];
    r.tokens = multi_row_tokens(m, t);
    r.src = multi_source_slot(m, t);
    r.pad = !slot_addressable(r.src, s.S, s.pad_slot_id);
    plan.max_tokens = std::max(plan.max_tokens, r.tokens.count);
  }
  const int64_t width = plan.max_tokens;
  plan.dst.assign(s.T * width, kNoSlot);
  at::parallel_for(0, s.T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const RowPlan& r = plan.rows[t];
      if (r.pad) continue;
      for (int64_t k = 0; k < r.tokens.count; ++k) {
        const int64_t slot = multi_dest_slot(m, t, k, r.tokens.count);
        if (multi_last_writer(m, t, k, r.tokens.count, slot)) plan.dst[t * width + k] = slot;
      }
    }
  });
  return plan;
}

// The multi-token step for the (row, head) pairs [begin, end).
template <typename PoolT, bool kUnit, bool kAPerN>
SSD_CPU_INLINE void multi_range(const MultiStepParams& m, const Plan& plan, int64_t begin, int64_t end) {
  const StepParams& s = m.step;
  const int64_t N = s.N, P = s.P, Kmax = plan.max_tokens;
  std::vector<float> scratch((2 * Kmax + (kAPerN ? 1 : 0)) * N + N + (5 * Kmax + 1) * P);
  float* Bf = scratch.data();      // (Kmax, N), whole chunks in PoolT's lane order
  float* Cf = Bf + Kmax * N;       // (Kmax, N), likewise
  float* carry = Cf + Kmax * N;    // (N,): one channel's state between its tokens (step_channel)
  // Per token k and channel p of the head (k * P + p), as the single-token kernel
  // keeps them: x, dt (+ dt_bias, softplus), dt * x, exp(A * dt) when A is constant
  // along N, y's sum over N and then y; then P floats of finish_y_row's scratch.
  float* xs = carry + N;
  float* dtv = xs + Kmax * P;
  float* dtx = dtv + Kmax * P;
  float* dA = dtx + Kmax * P;
  float* ys = dA + Kmax * P;
  float* tmp = ys + Kmax * P;
  float* Af = tmp + P;  // (N,) when kAPerN, in PoolT's lane order
  std::vector<StepParams> views(Kmax);
  for (int64_t k = 0; k < Kmax; ++k) views[k] = token_view(m, k);
  PoolT* pool = static_cast<PoolT*>(s.pool);
  int64_t widened_tg = -1;

  for (int64_t th = begin; th < end; ++th) {
    const int64_t t = th / s.H, h = th % s.H, g = h / s.heads_per_group;
    const RowPlan& row = plan.rows[t];
    const int64_t first = row.tokens.first, count = row.tokens.count;
    if (count == 0) continue;
    if (row.pad) {  // a pad row: y = 0 for each of its tokens, the pool untouched
      for (int64_t k = 0; k < count; ++k) {
        const StepParams& v = views[k];
        const int64_t y_row = first * v.y_stride[0] + h * v.y_stride[1];
        for (int64_t p = 0; p < P; ++p) store_scalar(v.y, y_row + p * v.y_stride[2], v.y_dtype, 0.0f);
      }
      continue;
    }
    if (P == 0) continue;
    const int64_t* dst = plan.dst.data() + t * Kmax;
    // The next pair's source rows, requested a row at a time alongside this pair's.
    const PoolT* next_in = next_pair_rows<kUnit>(s, pool, th, end, [&](int64_t row) {
      return plan.rows[row].pad ? kNoSlot : plan.rows[row].src;
    });
    if (t * s.G + g != widened_tg) {  // B and C are shared by the heads of a group
      for (int64_t k = 0; k < count; ++k) {
        const StepParams& v = views[k];
        widen_row_ordered<PoolT>(v.B, first * v.B.stride[0] + g * v.B.stride[1], v.B.stride[2], N, Bf + k * N);
        widen_row_ordered<PoolT>(v.C, first * v.C.stride[0] + g * v.C.stride[1], v.C.stride[2], N, Cf + k * N);
      }
      widened_tg = t * s.G + g;
    }

    // The per-token channel scalars of the head, as the single-token kernel computes them.
    for (int64_t k = 0; k < count; ++k)
      channel_scalars(views[k], first, h, !kAPerN && N > 0, xs + k * P, dtv + k * P, dtx + k * P, dA + k * P);

    for (int64_t p = 0; p < P; ++p) {
      if (next_in != nullptr) prefetch_row(next_in + p * s.pool_stride[2], N);
      if constexpr (kAPerN) widen_row_ordered<PoolT>(s.A, h * s.A.stride[0] + p * s.A.stride[1], s.A.stride[2], N, Af);
      const PoolT* in = pool + s.pool_offset(row.src, h, p);
      // Token by token, each as the single-token kernel steps a channel (y's sum in
      // registers across the chunks), the state carried in float32 between tokens:
      // token 0 reads the source row, a later token the carry; each token's state
      // goes to its destination row (if any) and, but for the last, to the carry.
      // Token 0 reads each chunk of the source before it stores that chunk, and
      // later tokens read only the carry, so a destination may be the source slot.
      for (int64_t k = 0; k < count; ++k) {
        PoolT* out = slot_addressable(dst[k], s.S, s.pad_slot_id) ? pool + s.pool_offset(dst[k], h, p) : nullptr;
        const int64_t kp = k * P + p;
        const float dA_kp = kAPerN || N == 0 ? 0.0f : dA[kp];
        with_flag(out != nullptr, [&](auto kWrite) SSD_CPU_INLINE_LAMBDA {
          with_flag(k > 0, [&](auto kFromCarry) SSD_CPU_INLINE_LAMBDA {
            with_flag(k + 1 < count, [&](auto kToCarry) SSD_CPU_INLINE_LAMBDA {
              ys[kp] = step_channel<PoolT, kUnit, kAPerN, decltype(kWrite)::value, decltype(kFromCarry)::value,
                                    decltype(kToCarry)::value>(in, out, s.pool_stride[3], N, Bf + k * N,
                                                               Cf + k * N, Af, dtv[kp], dA_kp, dtx[kp], carry);
            });
          });
        });
      }
    }
    for (int64_t k = 0; k < count; ++k) {
      const StepParams& v = views[k];
      finish_y_row(v, first, h, xs + k * P, tmp, ys + k * P);
      narrow_row(v.y, v.y_dtype, first * v.y_stride[0] + h * v.y_stride[1], v.y_stride[2], P, ys + k * P);
    }
  }
}

template <typename PoolT>
SSD_CPU_INLINE void multi_rows_of(const MultiStepParams& m, const Plan& plan, bool unit, bool a_per_n,
                                  int64_t begin, int64_t end) {
  with_flag(unit, [&](auto kUnit) SSD_CPU_INLINE_LAMBDA {
    with_flag(a_per_n, [&](auto kAPerN) SSD_CPU_INLINE_LAMBDA {
      multi_range<PoolT, decltype(kUnit)::value, decltype(kAPerN)::value>(m, plan, begin, end);
    });
  });
}

SSD_CPU_CLONES void multi_rows_float(const MultiStepParams& m, const Plan& plan, bool unit, bool a_per_n,
                                     int64_t begin, int64_t end) {
  multi_rows_of<float>(m, plan, unit, a_per_n, begin, end);
}

// Half-precision pools get the AVX-512 clone too, as in the single-token kernel.
SSD_CPU_CLONES_AVX512 void multi_rows_half(const MultiStepParams& m, const Plan& plan, bool unit, bool a_per_n,
                                           int64_t begin, int64_t end) {
  if (m.step.pool_dtype == Dtype::kBFloat16) multi_rows_of<c10::BFloat16>(m, plan, unit, a_per_n, begin, end);
  else multi_rows_of<c10::Half>(m, plan, unit, a_per_n, begin, end);
}

void multi_rows(const MultiStepParams& m, const Plan& plan, bool unit, bool a_per_n, int64_t begin, int64_t end) {
  if (m.step.pool_dtype == Dtype::kFloat32) multi_rows_float(m, plan, unit, a_per_n, begin, end);
  else multi_rows_half(m, plan, unit, a_per_n, begin, end);
}

void run_multi(const MultiStepParams& m, bool unit, bool a_per_n) {
  const Plan plan = make_plan(m);
  if (plan.max_tokens == 0) return;
  const StepParams& s = m.step;
  std::vector<std::pair<int64_t, int64_t>> reads, written;
  for (int64_t t = 0; t < s.T; ++t) {
    const RowPlan& r = plan.rows[t];
    if (r.pad || r.tokens.count == 0) continue;
    reads.emplace_back(r.src, t);
    for (int64_t k = 0; k < r.tokens.count; ++k)
      if (plan.dst[t * plan.max_tokens + k] != kNoSlot) written.emplace_back(plan.dst[t * plan.max_tokens + k], t);
  }
  if (cross_row_hazard(reads, written)) {
    multi_rows(m, plan, unit, a_per_n, 0, s.T * s.H);
    return;
  }
  // Each (row, head) pair is up to K * P * N element updates.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, plan.max_tokens * s.P * s.N));
  at::parallel_for(0, s.T * s.H, grain,
                   [&](int64_t begin, int64_t end) { multi_rows(m, plan, unit, a_per_n, begin, end); });
}

void multi_into(const MultiDims& md, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& cu_seqlens,
                const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                const OptTensor& slot_idx, const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                const OptTensor& num_accepted_tokens, bool write_state, const Tensor& y) {
  if (md.d.T == 0 || (!cu_seqlens.has_value() && md.K == 0)) return;
  const MultiStepParams m =
      make_multi_step_params(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                             dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, y);
  run_multi(m, md.d.N == 1 || ssm_pool.stride(3) == 1, md.d.N > 1 && A.stride(2) != 0);
}

Tensor decode_step_multi_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                             const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                             const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                             const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                             const OptTensor& num_accepted_tokens, bool write_state) {
  const MultiDims md = check_decode_step_multi("decode_step_multi", ssm_pool, x, dt, A, B, C, D, z, dt_bias,
                                               slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                                               write_state, nullptr);
  Tensor y = at::empty(x.sizes(), x.options());
  multi_into(md, ssm_pool, x, dt, A, B, C, std::nullopt, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, y);
  return y;
}

void decode_step_multi_out_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                               const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                               const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                               const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                               const OptTensor& num_accepted_tokens, bool write_state, const Tensor& out) {
  const MultiDims md = check_decode_step_multi("decode_step_multi_out", ssm_pool, x, dt, A, B, C, D, z,
                                               dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
                                               num_accepted_tokens, write_state, &out);
  multi_into(md, ssm_pool, x, dt, A, B, C, std::nullopt, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, out);
}

// Varlen: tokens outside every row (e.g. a padded tail of the flat axis) get y = 0,
// so y is cleared first; rows then overwrite their own tokens.
Tensor decode_step_varlen_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                              const Tensor& B, const Tensor& C, const Tensor& cu_seqlens, const OptTensor& D,
                              const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                              const OptTensor& slot_idx, const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                              const OptTensor& num_accepted_tokens, bool write_state) {
  const MultiDims md = check_decode_step_varlen("decode_step_varlen", ssm_pool, x, dt, A, B, C, cu_seqlens, D,
                                                z, dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
                                                num_accepted_tokens, write_state, nullptr);
  Tensor y = at::zeros(x.sizes(), x.options());
  multi_into(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, y);
  return y;
}

void decode_step_varlen_out_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                                const Tensor& B, const Tensor& C, const Tensor& cu_seqlens,
                                const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
                                bool dt_softplus, const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                int64_t pad_slot_id, const OptTensor& num_accepted_tokens, bool write_state,
                                const Tensor& out) {
  const MultiDims md = check_decode_step_varlen("decode_step_varlen_out", ssm_pool, x, dt, A, B, C,
                                                cu_seqlens, D, z, dt_bias, slot_idx, dst_slot_idx,
                                                pad_slot_id, num_accepted_tokens, write_state, &out);
  out.zero_();
  multi_into(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, out);
}

}  // namespace
}  // namespace ssd

TORCH_LIBRARY_IMPL(ssd, CPU, m) {
  m.impl("decode_step_multi", &ssd::decode_step_multi_cpu);
  m.impl("decode_step_multi_out", &ssd::decode_step_multi_out_cpu);
  m.impl("decode_step_varlen", &ssd::decode_step_varlen_cpu);
  m.impl("decode_step_varlen_out", &ssd::decode_step_varlen_out_cpu);
}
