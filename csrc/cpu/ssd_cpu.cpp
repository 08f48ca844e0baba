// CPU kernels: TORCH_LIBRARY_IMPL(ssd, CPU). Parallel over (row, head) with
// at::parallel_for; vectorised along N through the dstate I/O owner.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../ssd.h"
#include "cpu_common.h"

// The kernels pass AVX-sized vectors only between always-inlined helpers, so GCC's
// note that such vectors change the calling convention without AVX never applies.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace ssd {
namespace {

using namespace cpu;

// The fused step for the (row, head) pairs [begin, end). The per-channel work
// (x, dt, A, D, z, y) is done a head at a time over rows of P channels, so it
// vectorises and its dtype dispatch is paid once per head, not once per channel.
template <typename PoolT, bool kUnit, bool kAPerN>
SSD_CPU_INLINE void step_range(const StepParams& s, const uint8_t* writes, int64_t begin, int64_t end) {
  const int64_t N = s.N, P = s.P;
  std::vector<float> scratch((kAPerN ? 3 : 2) * N + 6 * P);
  float* Bf = scratch.data();
  float* Cf = Bf + N;
  float* xs = Cf + N;    // per channel of the head: x
  float* dtv = xs + P;   //   dt (+ dt_bias, softplus)
  float* dtx = dtv + P;  //   dt * x
  float* dA = dtx + P;   //   exp(A * dt), when A is constant along N
  float* ys = dA + P;    //   y's sum over N, then y
  float* tmp = ys + P;   //   D, then z (finish_y_row's scratch)
  float* Af = tmp + P;   // per element A of one channel
  PoolT* pool = static_cast<PoolT*>(s.pool);
  int64_t widened_tg = -1;

  for (int64_t th = begin; th < end; ++th) {
    const int64_t t = th / s.H, h = th % s.H, g = h / s.heads_per_group;
    const int64_t src = s.src.slot(t, t);
    const int64_t y_row = t * s.y_stride[0] + h * s.y_stride[1];
    if (!slot_addressable(src, s.S, s.pad_slot_id)) {
      for (int64_t p = 0; p < P; ++p) store_scalar(s.y, y_row + p * s.y_stride[2], s.y_dtype, 0.0f);
      continue;
    }
    if (P == 0) continue;
    const int64_t dst = s.dst.slot(t, t);
    const bool write = writes[t];
    if (t * s.G + g != widened_tg) {  // B and C are shared by the heads of a group
      widen_row_ordered<PoolT>(s.B, t * s.B.stride[0] + g * s.B.stride[1], s.B.stride[2], N, Bf);
      widen_row_ordered<PoolT>(s.C, t * s.C.stride[0] + g * s.C.stride[1], s.C.stride[2], N, Cf);
      widened_tg = t * s.G + g;
    }

    channel_scalars(s, t, h, !kAPerN && N > 0, xs, dtv, dtx, dA);

    const int64_t ps = s.pool_stride[2];
    const PoolT* in = pool + s.pool_offset(src, h, 0);
    PoolT* out = pool + s.pool_offset(dst, h, 0);
    // The next pair's source rows, requested a row at a time alongside this pair's.
    const PoolT* next_in =
        next_pair_rows<kUnit>(s, pool, th, end, [&](int64_t row) { return s.src.slot(row, row); });
    for (int64_t p = 0; p < P; ++p) {
      if (next_in != nullptr) prefetch_row(next_in + p * ps, N);
      if constexpr (kAPerN)
        widen_row_ordered<PoolT>(s.A, h * s.A.stride[0] + p * s.A.stride[1], s.A.stride[2], N, Af);
      const float dA_p = kAPerN || N == 0 ? 0.0f : dA[p];
      ys[p] = write ? step_channel<PoolT, kUnit, kAPerN, true>(in + p * ps, out + p * ps, s.pool_stride[3], N, Bf,
                                                               Cf, Af, dtv[p], dA_p, dtx[p])
                    : step_channel<PoolT, kUnit, kAPerN, false>(in + p * ps, out + p * ps, s.pool_stride[3], N, Bf,
                                                                Cf, Af, dtv[p], dA_p, dtx[p]);
    }
    finish_y_row(s, t, h, xs, tmp, ys);
    narrow_row(s.y, s.y_dtype, y_row, s.y_stride[2], P, ys);
  }
}

template <typename PoolT>
SSD_CPU_INLINE void step_rows_of(const StepParams& s, const uint8_t* writes, bool unit, bool a_per_n, int64_t begin,
                                 int64_t end) {
  with_flag(unit, [&](auto kUnit) SSD_CPU_INLINE_LAMBDA {
    with_flag(a_per_n, [&](auto kAPerN) SSD_CPU_INLINE_LAMBDA {
      step_range<PoolT, decltype(kUnit)::value, decltype(kAPerN)::value>(s, writes, begin, end);
    });
  });
}

SSD_CPU_CLONES void step_rows_float(const StepParams& s, const uint8_t* writes, bool unit, bool a_per_n,
                                    int64_t begin, int64_t end) {
  step_rows_of<float>(s, writes, unit, a_per_n, begin, end);
}

SSD_CPU_CLONES_AVX512 void step_rows_half(const StepParams& s, const uint8_t* writes, bool unit, bool a_per_n,
                                          int64_t begin, int64_t end) {
  if (s.pool_dtype == Dtype::kBFloat16) step_rows_of<c10::BFloat16>(s, writes, unit, a_per_n, begin, end);
  else step_rows_of<c10::Half>(s, writes, unit, a_per_n, begin, end);
}

void step_rows(const StepParams& s, const uint8_t* writes, bool unit, bool a_per_n, int64_t begin, int64_t end) {
  if (s.pool_dtype == Dtype::kFloat32) step_rows_float(s, writes, unit, a_per_n, begin, end);
  else step_rows_half(s, writes, unit, a_per_n, begin, end);
}

void run_step(const StepParams& s, bool unit, bool a_per_n) {
  // Whether each row writes its state (the last-writer rule scans the later rows):
  // decided once per row here, not once per (row, head) task.
  std::vector<uint8_t> writes(s.T);
  for (int64_t t = 0; t < s.T; ++t) writes[t] = row_writes(s, t, s.dst.slot(t, t));
  std::vector<std::pair<int64_t, int64_t>> reads, written;
  if (s.src.data != nullptr || s.dst.data != nullptr) {  // else row t reads and writes slot t only
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t src = s.src.slot(t, t);
      if (!slot_addressable(src, s.S, s.pad_slot_id)) continue;
      reads.emplace_back(src, t);
      if (writes[t]) written.emplace_back(s.dst.slot(t, t), t);
    }
  }
  if (cross_row_hazard(reads, written)) {
    step_rows(s, writes.data(), unit, a_per_n, 0, s.T * s.H);
    return;
  }
  // Each (row, head) pair is P * N elements of state: one pair is worth a task.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, s.P * s.N));
  at::parallel_for(0, s.T * s.H, grain, [&](int64_t begin, int64_t end) {
    step_rows(s, writes.data(), unit, a_per_n, begin, end);
  });
}

void step_into(const Dims& d, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
               const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
               const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
               const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor& y) {
  if (d.T == 0) return;
  const StepParams s = make_step_params(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                        dst_slot_idx, pad_slot_id, y);
  run_step(s, d.N == 1 || ssm_pool.stride(3) == 1, d.N > 1 && A.stride(2) != 0);
}

Tensor decode_step_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                       const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                       const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                       const OptTensor& dst_slot_idx, int64_t pad_slot_id) {
  const Dims d = check_decode_step("decode_step", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                   dst_slot_idx, pad_slot_id, nullptr);
  Tensor y = at::empty({d.T, d.H, d.P}, x.options());
  step_into(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, y);
  return y;
}

void decode_step_out_cpu(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                         const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                         const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                         const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor& out) {
  const Dims d = check_decode_step("decode_step_out", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                   dst_slot_idx, pad_slot_id, &out);
  step_into(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, out);
}

// ---------------------------------------------------------------------------
// The loader verbs as ops.
// ---------------------------------------------------------------------------

// The rows of a pool that load_state reads or store_state writes, and the float32
// state on the other side (load_state's contiguous result, or store_state's input).
struct PoolRows {
  void* pool = nullptr;
  int64_t pool_stride[4] = {0, 0, 0, 0};
  Dtype pool_dtype = Dtype::kFloat32;
  float* state = nullptr;
  int64_t state_stride[4] = {0, 0, 0, 0};
  SlotRef slots;
  int64_t S = 0, T = 0, H = 0, P = 0, N = 0, pad_slot_id = -1;
  bool unit = false;  // both rows have stride 1 along N
  std::vector<uint8_t> writes;  // store_state: whether row t writes its slot (last writer wins)

  PoolRows(const Tensor& ssm_pool, const Tensor& state_t, const OptTensor& slot_idx, int64_t pad)
      : pool(ssm_pool.data_ptr()), pool_dtype(to_dtype(ssm_pool)), state(state_t.data_ptr<float>()),
        slots(slot_ref(slot_idx)), S(ssm_pool.size(0)), T(state_t.size(0)), H(ssm_pool.size(1)),
        P(ssm_pool.size(2)), N(ssm_pool.size(3)), pad_slot_id(pad) {
    for (int i = 0; i < 4; ++i) pool_stride[i] = ssm_pool.stride(i), state_stride[i] = state_t.stride(i);
    unit = N == 1 || (pool_stride[3] == 1 && state_stride[3] == 1);
  }
  int64_t pool_offset(int64_t slot, int64_t h, int64_t p) const {
    return slot * pool_stride[0] + h * pool_stride[1] + p * pool_stride[2];
  }
  int64_t state_offset(int64_t t, int64_t h, int64_t p) const {
    return t * state_stride[0] + h * state_stride[1] + p * state_stride[2];
  }
};

// Rows r = (t, h, p) in [begin, end), flattened in that order.
SSD_CPU_CLONES void load_state_rows(const PoolRows& r, int64_t begin, int64_t end) {
  with_dtype(r.pool_dtype, [&](auto tag) SSD_CPU_INLINE_LAMBDA {
    using T = decltype(tag);
    with_flag(r.unit, [&](auto unit) SSD_CPU_INLINE_LAMBDA {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / (r.H * r.P), h = (i / r.P) % r.H, p = i % r.P;
        const int64_t slot = r.slots.slot(t, t);
        float* row = r.state + r.state_offset(t, h, p);
        if (!slot_addressable(slot, r.S, r.pad_slot_id)) {
          std::fill(row, row + r.N, 0.0f);  // the result is contiguous
          continue;
        }
        load_row<kVec, decltype(unit)::value>(static_cast<const T*>(r.pool) + r.pool_offset(slot, h, p),
                                              r.pool_stride[3], r.N, row);
      }
    });
  });
}

SSD_CPU_CLONES void store_state_rows(const PoolRows& r, int64_t begin, int64_t end) {
  with_dtype(r.pool_dtype, [&](auto tag) SSD_CPU_INLINE_LAMBDA {
    using T = decltype(tag);
    with_flag(r.unit, [&](auto unit) SSD_CPU_INLINE_LAMBDA {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / (r.H * r.P), h = (i / r.P) % r.H, p = i % r.P;
        if (!r.writes[t]) continue;
        const int64_t slot = r.slots.slot(t, t);
        store_row<kVec, decltype(unit)::value>(r.state + r.state_offset(t, h, p), r.state_stride[3],
                                               static_cast<T*>(r.pool) + r.pool_offset(slot, h, p),
                                               r.pool_stride[3], r.N);
      }
    });
  });
}

SSD_CPU_CLONES void widen_rows(const OperandRef& in, int64_t G, int64_t N, float* out, int64_t begin,
                               int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    widen_row(in, (i / G) * in.stride[0] + (i % G) * in.stride[1], in.stride[2], N, out + i * N);
}

// One (t, h, p) row of N elements is a useful task; aim for ~4k elements a task.
int64_t row_grain(int64_t N) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, N)); }

Tensor load_state_cpu(const Tensor& ssm_pool, const OptTensor& slot_idx, int64_t pad_slot_id) {
  const Dims d = check_load_state(ssm_pool, slot_idx, pad_slot_id);
  Tensor out = at::empty({d.T, d.H, d.P, d.N}, ssm_pool.options().dtype(at::kFloat));
  const PoolRows rows(ssm_pool, out, slot_idx, pad_slot_id);
  at::parallel_for(0, d.T * d.H * d.P, row_grain(d.N),
                   [&](int64_t begin, int64_t end) { load_state_rows(rows, begin, end); });
  return out;
}

void store_state_cpu(const Tensor& state, const Tensor& ssm_pool, const OptTensor& slot_idx,
                     int64_t pad_slot_id) {
  const Dims d = check_store_state(state, ssm_pool, slot_idx, pad_slot_id);
  PoolRows rows(ssm_pool, state, slot_idx, pad_slot_id);
  rows.writes.resize(d.T);
  for (int64_t t = 0; t < d.T; ++t)
    rows.writes[t] = last_writer(rows.slots, SlotRef{}, false, d.T, d.S, pad_slot_id, t, rows.slots.slot(t, t));
  at::parallel_for(0, d.T * d.H * d.P, row_grain(d.N),
                   [&](int64_t begin, int64_t end) { store_state_rows(rows, begin, end); });
}

std::tuple<Tensor, Tensor> load_bc_cpu(const Tensor& B, const Tensor& C) {
  const Dims d = check_load_bc(B, C);
  Tensor Bf = at::empty({d.T, d.G, d.N}, B.options().dtype(at::kFloat));
  Tensor Cf = at::empty({d.T, d.G, d.N}, C.options().dtype(at::kFloat));
  for (const auto& [in, out] : {std::pair<const Tensor&, Tensor&>{B, Bf}, {C, Cf}}) {
    OperandRef r;
    r.data = in.data_ptr();
    r.dtype = to_dtype(in);
    for (int i = 0; i < 3; ++i) r.stride[i] = in.stride(i);
    float* o = out.data_ptr<float>();
    at::parallel_for(0, d.T * d.G, row_grain(d.N),
                     [&](int64_t begin, int64_t end) { widen_rows(r, d.G, d.N, o, begin, end); });
  }
  return {Bf, Cf};
}

}  // namespace
}  // namespace ssd

TORCH_LIBRARY_IMPL(ssd, CPU, m) {
  m.impl("load_state", &ssd::load_state_cpu);
  m.impl("load_bc", &ssd::load_bc_cpu);
  m.impl("store_state", &ssd::store_state_cpu);
  m.impl("decode_step", &ssd::decode_step_cpu);
  m.impl("decode_step_out", &ssd::decode_step_out_cpu);
}
