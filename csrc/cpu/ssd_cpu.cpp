// CPU kernels: TORCH_LIBRARY_IMPL(ssd, CPU). Parallel over (row, head) with
// at::parallel_for; vectorised along N through the dstate I/O owner.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../dstate_io.h"
#include "../ssd.h"
#include "../step.h"

namespace ssd {
namespace {

// Floats per chunk on CPU: four SSE or two AVX registers, enough independent work
// per chunk for the compiler to keep both load ports busy.
constexpr int kVec = 16;

template <typename Fn>
void with_pool_type(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::kBFloat16: fn(c10::BFloat16{}); break;
    case Dtype::kFloat16: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

template <typename Fn>
void with_layout(bool unit, Fn&& fn) {
  if (unit) fn(std::true_type{});
  else fn(std::false_type{});
}

// Widen one row whose dtype is known only at run time (B, C, a per-element A)
// into contiguous float32 scratch.
void widen_row(const OperandRef& r, int64_t offset, int64_t stride, int64_t n, float* out) {
  with_pool_type(r.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(r.data) + offset;
    with_layout(stride == 1, [&](auto unit) { load_row<kVec, decltype(unit)::value>(p, stride, n, out); });
  });
}

// The fused step for the (row, head) pairs [begin, end).
template <typename PoolT, bool kUnit, bool kAPerN>
void step_range(const StepParams& s, int64_t begin, int64_t end) {
  const int64_t N = s.N, full = N / kVec;
  const int rest = static_cast<int>(N - full * kVec);
  std::vector<float> scratch((kAPerN ? 3 : 2) * N);
  float* Bf = scratch.data();
  float* Cf = Bf + N;
  float* Af = Cf + N;
  PoolT* pool = static_cast<PoolT*>(s.pool);
  int64_t widened_tg = -1;

  for (int64_t th = begin; th < end; ++th) {
    const int64_t t = th / s.H, h = th % s.H, g = h / s.heads_per_group;
    const int64_t src = s.src.slot(t, t);
    const int64_t y_row = t * s.y_stride[0] + h * s.y_stride[1];
    if (!slot_addressable(src, s.S, s.pad_slot_id)) {
      for (int64_t p = 0; p < s.P; ++p) store_scalar(s.y, y_row + p * s.y_stride[2], s.y_dtype, 0.0f);
      continue;
    }
    const int64_t dst = s.dst.slot(t, t);
    const bool write = row_writes(s, t, dst);
    if (t * s.G + g != widened_tg) {  // B and C are shared by the heads of a group
      widen_row(s.B, t * s.B.stride[0] + g * s.B.stride[1], s.B.stride[2], N, Bf);
      widen_row(s.C, t * s.C.stride[0] + g * s.C.stride[1], s.C.stride[2], N, Cf);
      widened_tg = t * s.G + g;
    }

    for (int64_t p = 0; p < s.P; ++p) {
      const float dtv = channel_dt(s, t, h, p);
      const float xv = s.x.at(t, h, p);
      const float dtx = dtv * xv;
      float dA_splat = 0.0f;
      if constexpr (kAPerN) widen_row(s.A, h * s.A.stride[0] + p * s.A.stride[1], s.A.stride[2], N, Af);
      else dA_splat = decay(load_scalar(s.A.data, h * s.A.stride[0] + p * s.A.stride[1], s.A.dtype), dtv);

      const DstateRow<kVec, kUnit, const PoolT> in{pool + s.pool_offset(src, h, p), s.pool_stride[3]};
      const DstateRow<kVec, kUnit, PoolT> out{pool + s.pool_offset(dst, h, p), s.pool_stride[3]};
      float acc[kVec] = {};
      float st[kVec];
      for (int64_t c = 0; c < full; ++c) {
        in.load(c, st);
        const float* b = Bf + c * kVec;
        const float* cc = Cf + c * kVec;
        for (int v = 0; v < kVec; ++v) {
          const float dA = kAPerN ? decay(Af[c * kVec + v], dtv) : dA_splat;
          st[v] = advance(st[v], dA, dtx, b[v]);
          acc[v] += st[v] * cc[v];
        }
        if (write) out.store(c, st);
      }
      if (rest) {
        in.load_tail(full, rest, st);
        for (int v = 0; v < rest; ++v) {
          const int64_t n = full * kVec + v;
          const float dA = kAPerN ? decay(Af[n], dtv) : dA_splat;
          st[v] = advance(st[v], dA, dtx, Bf[n]);
          acc[v] += st[v] * Cf[n];
        }
        if (write) out.store_tail(full, rest, st);
      }
      for (int w = kVec / 2; w > 0; w /= 2)  // fixed tree: same order for every layout
        for (int v = 0; v < w; ++v) acc[v] += acc[v + w];
      store_scalar(s.y, y_row + p * s.y_stride[2], s.y_dtype, finish_y(s, acc[0], t, h, p, xv));
    }
  }
}

void run_step(const StepParams& s, bool unit, bool a_per_n) {
  // Each (row, head) pair is P * N elements of state: one pair is worth a task.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, s.P * s.N));
  with_pool_type(s.pool_dtype, [&](auto tag) {
    using PoolT = decltype(tag);
    with_layout(unit, [&](auto kUnit) {
      with_layout(a_per_n, [&](auto kAPerN) {
        at::parallel_for(0, s.T * s.H, grain, [&](int64_t begin, int64_t end) {
          step_range<PoolT, decltype(kUnit)::value, decltype(kAPerN)::value>(s, begin, end);
        });
      });
    });
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

Tensor load_state_cpu(const Tensor& ssm_pool, const OptTensor& slot_idx, int64_t pad_slot_id) {
  const Dims d = check_load_state(ssm_pool, slot_idx, pad_slot_id);
  Tensor out = at::empty({d.T, d.H, d.P, d.N}, ssm_pool.options().dtype(at::kFloat));
  const SlotRef slots = slot_ref(slot_idx);
  const int64_t rows_per_slot = d.H * d.P;
  const int64_t sn = ssm_pool.stride(3);
  float* dst = out.data_ptr<float>();
  with_pool_type(to_dtype(ssm_pool), [&](auto tag) {
    using T = decltype(tag);
    const T* pool = static_cast<const T*>(ssm_pool.data_ptr());
    with_layout(d.N == 1 || sn == 1, [&](auto unit) {
      at::parallel_for(0, d.T * rows_per_slot, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.N)),
                       [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t t = r / rows_per_slot, h = (r / d.P) % d.H, p = r % d.P;
          const int64_t slot = slots.slot(t, t);
          float* row = dst + r * d.N;
          if (!slot_addressable(slot, d.S, pad_slot_id)) {
            std::fill(row, row + d.N, 0.0f);
            continue;
          }
          const T* in = pool + slot * ssm_pool.stride(0) + h * ssm_pool.stride(1) + p * ssm_pool.stride(2);
          load_row<kVec, decltype(unit)::value>(in, sn, d.N, row);
        }
      });
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> load_bc_cpu(const Tensor& B, const Tensor& C) {
  const Dims d = check_load_bc(B, C);
  Tensor Bf = at::empty({d.T, d.G, d.N}, B.options().dtype(at::kFloat));
  Tensor Cf = at::empty({d.T, d.G, d.N}, C.options().dtype(at::kFloat));
  for (const auto& [in, out] : {std::pair<const Tensor&, Tensor&>{B, Bf}, {C, Cf}}) {
    OperandRef r;
    r.data = in.data_ptr();
    r.dtype = to_dtype(in);
    float* o = out.data_ptr<float>();
    at::parallel_for(0, d.T * d.G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / d.G, g = i % d.G;
        widen_row(r, t * in.stride(0) + g * in.stride(1), in.stride(2), d.N, o + i * d.N);
      }
    });
  }
  return {Bf, Cf};
}

void store_state_cpu(const Tensor& state, const Tensor& ssm_pool, const OptTensor& slot_idx,
                     int64_t pad_slot_id) {
  const Dims d = check_store_state(state, ssm_pool, slot_idx, pad_slot_id);
  const SlotRef slots = slot_ref(slot_idx);
  const int64_t rows_per_slot = d.H * d.P;
  const int64_t sn = ssm_pool.stride(3), in_sn = state.stride(3);
  const float* in = state.data_ptr<float>();
  with_pool_type(to_dtype(ssm_pool), [&](auto tag) {
    using T = decltype(tag);
    T* pool = static_cast<T*>(ssm_pool.data_ptr());
    with_layout(d.N == 1 || (sn == 1 && in_sn == 1), [&](auto unit) {
      at::parallel_for(0, d.T * rows_per_slot, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, d.N)),
                       [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t t = r / rows_per_slot, h = (r / d.P) % d.H, p = r % d.P;
          const int64_t slot = slots.slot(t, t);
          if (!last_writer(slots, SlotRef{}, false, d.T, d.S, pad_slot_id, t, slot)) continue;
          const float* src = in + t * state.stride(0) + h * state.stride(1) + p * state.stride(2);
          T* row = pool + slot * ssm_pool.stride(0) + h * ssm_pool.stride(1) + p * ssm_pool.stride(2);
          store_row<kVec, decltype(unit)::value>(src, in_sn, row, sn, d.N);
        }
      });
    });
  });
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
