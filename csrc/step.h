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

// The per-channel inputs of one step as loaded (absent operands read as 0 and
// are never used): what a kernel may fetch early, apart from the arithmetic.
struct ChannelInputs {
  float x = 0.0f, dt = 0.0f, dt_bias = 0.0f, D = 0.0f, z = 0.0f;
};

SSD_HD ChannelInputs load_channel(const StepParams& s, int64_t t, int64_t h, int64_t p) {
  ChannelInputs in;
  in.x = s.x.at(t, h, p);
  in.dt = s.dt.at(t, h, p);
  if (s.dt_bias.present()) in.dt_bias = s.dt_bias.at(h, p);
  if (s.D.present()) in.D = s.D.at(h, p);
  if (s.z.present()) in.z = s.z.at(t, h, p);
  return in;
}

// dtv = dt (+ dt_bias), then softplus if asked.
SSD_HD float channel_dt(const StepParams& s, const ChannelInputs& in) {
  float v = in.dt;
  if (s.dt_bias.present()) v += in.dt_bias;
  return s.dt_softplus ? softplus(v) : v;
}

SSD_HD float channel_dt(const StepParams& s, int64_t t, int64_t h, int64_t p) {
  ChannelInputs in;
  in.dt = s.dt.at(t, h, p);
  if (s.dt_bias.present()) in.dt_bias = s.dt_bias.at(h, p);
  return channel_dt(s, in);
}

// dA = exp(A * dtv): one function for the broadcast and the per-element case, so
// a stride-0 A gives the same bits as the same values laid out in full.
SSD_HD float decay(float a, float dtv) { return expf(a * dtv); }

// The recurrence for one element, in float32 registers. On CUDA the two
// multiply-adds are explicit fused multiply-adds (the build turns off implicit
// contraction, so every kernel and layout rounds the same way); the host keeps
// separate roundings (its build has -ffp-contract=off, and a software fma would be
// slow on CPUs without FMA).
#if defined(__CUDA_ARCH__)
SSD_HD float advance(float state, float dA, float dtx, float b) { return fmaf(state, dA, dtx * b); }
#else
SSD_HD float advance(float state, float dA, float dtx, float b) { return state * dA + dtx * b; }
#endif

// One term of the y sum over N: acc + state * c. Every kernel of a backend uses
// this (in one fixed order along N) so that all layouts give the same bits.
#if defined(__CUDA_ARCH__)
SSD_HD float accumulate_y(float acc, float state, float c) { return fmaf(state, c, acc); }
#else
SSD_HD float accumulate_y(float acc, float state, float c) { return acc + state * c; }
#endif

// silu(z) = z * sigmoid(z), the factor y takes from z.
SSD_HD float silu_gate(float z) { return z / (1.0f + expf(-z)); }

// y = sum_n(s * C) + D * x, then * silu(z).
SSD_HD float finish_y(const StepParams& s, float sum, const ChannelInputs& in) {
  float y = sum;
  if (s.D.present()) y += in.D * in.x;
  if (s.z.present()) y *= silu_gate(in.z);
  return y;
}

SSD_HD float finish_y(const StepParams& s, float sum, int64_t t, int64_t h, int64_t p, float xv) {
  ChannelInputs in;
  in.x = xv;
  if (s.D.present()) in.D = s.D.at(h, p);
  if (s.z.present()) in.z = s.z.at(t, h, p);
  return finish_y(s, sum, in);
}


// ---------------------------------------------------------------------------
// Multi-token decode step (speculative decoding): the K tokens of a row advance
// one float32 state kept in registers; the state after token k may be written
// to its own slot. Shared by every backend; docs/multi_token.md is the contract.
// ---------------------------------------------------------------------------

// "No slot": negative, so slot_addressable() is false for it whatever pad_slot_id is.
constexpr int64_t kNoSlot = -1;

// A slot table: absent (data == nullptr), (T,) or (T, W); int32 or int64.
struct SlotTable {
  const void* data = nullptr;
  int64_t row_stride = 0, col_stride = 0;
  int64_t cols = 1;        // W for a (T, W) table, 1 for a (T,) table
  bool per_token = false;  // a (T, W) table: column k belongs to token k
  bool is_int64 = true;

  SSD_HD bool present() const { return data != nullptr; }
  SSD_HD int64_t at(int64_t t, int64_t c) const {
    const int64_t i = t * row_stride + c * col_stride;
    return is_int64 ? static_cast<const int64_t*>(data)[i]
                    : static_cast<int64_t>(static_cast<const int32_t*>(data)[i]);
  }
};

struct MultiStepParams {
  // Shapes (T = rows), pool, per-channel operands. The token-indexed operands
  // (x, dt, B, C, z, y) are 3-D views at a row's token 0; token_view() moves them.
  StepParams step;
  int64_t K = 0;  // fixed form: tokens per row (0 in the varlen form)
  int64_t L = 0;  // varlen form: tokens on the flat axis
  // Element stride from one token of a row to the next, per token-indexed operand.
  int64_t x_tok = 0, dt_tok = 0, B_tok = 0, C_tok = 0, z_tok = 0, y_tok = 0;
  SlotTable src, dst;     // dst is src's table when dst_slot_idx is None
  SlotRef num_accepted;   // (T,); absent: data == nullptr
  SlotRef cu_seqlens;     // (T + 1,) in the varlen form; absent in the fixed form
  bool write_state = true;
};

// A row's tokens: index `first` on the token axis of the 3-D views, `count` tokens.
struct RowTokens {
  int64_t first = 0;
  int64_t count = 0;
};

// Varlen rows whose bounds are not 0 <= bos <= eos <= L have no tokens (checked
// mode rejects them), so no kernel reads past the token axis.
SSD_HD RowTokens multi_row_tokens(const MultiStepParams& m, int64_t t) {
  if (m.cu_seqlens.data == nullptr) return {t, m.K};
  const int64_t bos = m.cu_seqlens.slot(t, 0), eos = m.cu_seqlens.slot(t + 1, 0);
  if (bos < 0 || bos > eos || eos > m.L) return {0, 0};
  return {bos, eos - bos};
}

// The slot row t starts from. With num_accepted_tokens n (vLLM's semantics) it is
// column n - 1 of the source table (n = 0 reads column 0); an n outside [0, W]
// makes the row a pad row.
SSD_HD int64_t multi_source_slot(const MultiStepParams& m, int64_t t) {
  if (!m.src.present()) return t;
  int64_t col = 0;
  if (m.num_accepted.data != nullptr) {
    const int64_t n = m.num_accepted.slot(t, 0);
    if (n < 0 || n > m.src.cols) return kNoSlot;
    col = n > 0 ? n - 1 : 0;
  }
  return m.src.at(t, col);
}

// Where the state after token k of row t (a row of `count` tokens) goes: its own
// column of a per-token table, or -- for a (T,) table or none -- the row's slot,
// after the last token only. kNoSlot when nothing is written.
SSD_HD int64_t multi_dest_slot(const MultiStepParams& m, int64_t t, int64_t k, int64_t count) {
  if (!m.write_state) return kNoSlot;
  if (m.dst.per_token) return k < m.dst.cols ? m.dst.at(t, k) : kNoSlot;
  if (k != count - 1) return kNoSlot;
  return m.dst.present() ? m.dst.at(t, 0) : t;
}

// The writes of a row, as columns: with a per-token table column i is token i (up
// to the table's width); otherwise there is one column, the row's last token.
SSD_HD int64_t multi_write_columns(const MultiStepParams& m) { return m.dst.per_token ? m.dst.cols : 1; }

// The token that writes through column i of a row of n tokens, or -1 (none).
SSD_HD int64_t multi_column_token(const MultiStepParams& m, int64_t i, int64_t n) {
  if (m.dst.per_token) return i < n && i < m.dst.cols ? i : -1;
  return i == 0 && n > 0 ? n - 1 : -1;
}

// Row u's tokens as they count for the writes seen from row t (a row of `count`
// tokens whose source the caller has checked): 0 for a row that writes nothing (no
// tokens, or a pad row).
SSD_HD int64_t multi_writing_tokens(const MultiStepParams& m, int64_t u, int64_t t, int64_t count) {
  if (u == t) return count;
  const RowTokens r = multi_row_tokens(m, u);
  if (r.count == 0 || !slot_addressable(multi_source_slot(m, u), m.step.S, m.step.pad_slot_id)) return 0;
  return r.count;
}

// (row u, token j) comes after (row t, token k) in (row, token) order.
SSD_HD bool multi_write_after(int64_t u, int64_t j, int64_t t, int64_t k) { return u > t || (u == t && j > k); }

// Whether the write of token k of row t to `slot` happens. Of the writes that
// share a slot the last one in (row, token) order wins; a pad row writes nothing.
// The caller has checked that row t's source slot is addressable.
SSD_HD bool multi_last_writer(const MultiStepParams& m, int64_t t, int64_t k, int64_t count,
                              int64_t slot) {
  const StepParams& s = m.step;
  if (!slot_addressable(slot, s.S, s.pad_slot_id)) return false;
  if (!m.dst.present()) return true;  // one write per row, to slot t: no duplicates
  const int64_t cols = multi_write_columns(m);
  for (int64_t u = t; u < s.T; ++u) {
    const int64_t n = multi_writing_tokens(m, u, t, count);
    for (int64_t i = 0; i < cols && i < n; ++i) {
      const int64_t j = multi_column_token(m, i, n);
      if (j >= 0 && multi_write_after(u, j, t, k) && multi_dest_slot(m, u, j, n) == slot) return false;
    }
  }
  return true;
}

SSD_HD int64_t dtype_size(Dtype d) { return d == Dtype::kFloat32 ? 4 : 2; }

SSD_HD const void* shift_elements(const void* p, int64_t n, Dtype d) {
  return p == nullptr ? p : static_cast<const char*>(p) + n * dtype_size(d);
}

// The single-token view of token k of every row: channel_dt, finish_y and
// OperandRef::at then index (row's first token, h, p) exactly as in one step.
SSD_HD StepParams token_view(const MultiStepParams& m, int64_t k) {
  StepParams s = m.step;
  s.x.data = shift_elements(s.x.data, k * m.x_tok, s.x.dtype);
  s.dt.data = shift_elements(s.dt.data, k * m.dt_tok, s.dt.dtype);
  s.B.data = shift_elements(s.B.data, k * m.B_tok, s.B.dtype);
  s.C.data = shift_elements(s.C.data, k * m.C_tok, s.C.dtype);
  s.z.data = shift_elements(s.z.data, k * m.z_tok, s.z.dtype);
  s.y = const_cast<void*>(shift_elements(s.y, k * m.y_tok, s.y_dtype));
  return s;
}

}  // namespace ssd
