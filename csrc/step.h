// What one decode step needs to know, as plain data that crosses the host/device
// boundary, and the per-channel float32 arithmetic every backend shares.
// DESIGN.md section 2 is the contract; torch_ssd/reference.py its executable form.
#pragma once

#include <math.h>
#include <stdint.h>

#include "dstate_io.h"

namespace ssd {

// A strided view of one operand (up to 4 dims, strides in elements). An absent
// optional operand has data == nullptr.
struct OperandRef {
  const void* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  Dtype dtype = Dtype::kFloat32;

  SSD_HD bool present() const { return data != nullptr; }
  SSD_HD float at(int64_t i0, int64_t i1, int64_t i2) const {
    return load_scalar(data, i0 * stride[0] + i1 * stride[1] + i2 * stride[2], dtype);
  }
  SSD_HD float at(int64_t i0, int64_t i1) const {
    return load_scalar(data, i0 * stride[0] + i1 * stride[1], dtype);
  }
};

// A slot-index tensor (T,), int32 or int64; data == nullptr means "row t is slot t".
struct SlotRef {
  const void* data = nullptr;
  int64_t stride = 1;
  bool is_int64 = true;

  SSD_HD int64_t slot(int64_t t, int64_t fallback) const {
    if (data == nullptr) return fallback;
    return is_int64 ? static_cast<const int64_t*>(data)[t * stride]
                    : static_cast<int64_t>(static_cast<const int32_t*>(data)[t * stride]);
  }
};

// DESIGN.md section 3: a slot that is the pad id or lies outside the pool is
// never read or written.
SSD_HD bool slot_addressable(int64_t slot, int64_t num_slots, int64_t pad_slot_id) {
  return slot != pad_slot_id && slot >= 0 && slot < num_slots;
}

struct StepParams {
  int64_t S = 0, T = 0, H = 0, P = 0, N = 0, G = 0;
  int64_t heads_per_group = 1;

  void* pool = nullptr;  // (S, H, P, N)
  int64_t pool_stride[4] = {0, 0, 0, 0};
  Dtype pool_dtype = Dtype::kFloat32;

  OperandRef x, dt, A, B, C, D, z, dt_bias;  // shapes as in DESIGN.md section 1
  void* y = nullptr;                         // (T, H, P), x's dtype
  int64_t y_stride[3] = {0, 0, 0};
  Dtype y_dtype = Dtype::kFloat32;

  SlotRef src, dst;
  int64_t pad_slot_id = -1;
  bool dt_softplus = false;

  // 64-bit element offset of pool[slot, h, p, 0] (pools beyond 2^31 elements are real).
  SSD_HD int64_t pool_offset(int64_t slot, int64_t h, int64_t p) const {
    return slot * pool_stride[0] + h * pool_stride[1] + p * pool_stride[2];
  }
};

// Whether row t writes its state to slot dst. Rows that share a destination slot
// would race; the contract is that the last such row (highest t) writes and the
// others only compute y. A row whose source is a pad writes nothing. `src` is the
// rows' source slots (store_state has none: pass an empty SlotRef and T rows).
SSD_HD bool last_writer(const SlotRef& dst_idx, const SlotRef& src_idx, bool has_src, int64_t T,
                        int64_t S, int64_t pad_slot_id, int64_t t, int64_t dst) {
  if (!slot_addressable(dst, S, pad_slot_id)) return false;
  if (dst_idx.data == nullptr) return true;  // row t -> slot t: no duplicates possible
  for (int64_t u = t + 1; u < T; ++u) {
    if (dst_idx.slot(u, u) != dst) continue;
    if (!has_src || slot_addressable(src_idx.slot(u, u), S, pad_slot_id)) return false;
  }
  return true;
}

SSD_HD bool row_writes(const StepParams& s, int64_t t, int64_t dst) {
  return last_writer(s.dst, s.src, true, s.T, s.S, s.pad_slot_id, t, dst);
}

// ---------------------------------------------------------------------------
// Per-channel float32 arithmetic (channel = (t, h, p)).
// ---------------------------------------------------------------------------

SSD_HD float softplus(float v) { return v <= 20.0f ? log1pf(expf(v)) : v; }

// dtv = dt (+ dt_bias), then softplus if asked.
SSD_HD float channel_dt(const StepParams& s, int64_t t, int64_t h, int64_t p) {
  float v = s.dt.at(t, h, p);
  if (s.dt_bias.present()) v += s.dt_bias.at(h, p);
  return s.dt_softplus ? softplus(v) : v;
}

// dA = exp(A * dtv): one function for the broadcast and the per-element case, so
// a stride-0 A gives the same bits as the same values laid out in full.
SSD_HD float decay(float a, float dtv) { return expf(a * dtv); }

// The recurrence for one element, in float32 registers.
SSD_HD float advance(float state, float dA, float dtx, float b) { return state * dA + dtx * b; }

// y = sum_n(s * C) + D * x, then * silu(z).
SSD_HD float finish_y(const StepParams& s, float sum, int64_t t, int64_t h, int64_t p, float xv) {
  float y = sum;
  if (s.D.present()) y += s.D.at(h, p) * xv;
  if (s.z.present()) {
    const float zv = s.z.at(t, h, p);
    y *= zv / (1.0f + expf(-zv));
  }
  return y;
}

}  // namespace ssd
