// Host-side pieces every backend shares: argument checks (DESIGN.md section 4),
// checked mode (section 3) and the translation of tensors into StepParams.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "step.h"

namespace ssd {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Checked mode: validate slot indices on the host (may synchronise the device).
bool checks_enabled();
void set_checks(bool enabled);

Dtype to_dtype(const Tensor& t);

struct Dims {
  int64_t S = 0, T = 0, H = 0, P = 0, N = 0, G = 0;
};

// Each check raises a RuntimeError naming the op and the argument, and returns the
// problem's dimensions. When checked mode is on it also validates the slot indices.
Dims check_load_state(const Tensor& ssm_pool, const OptTensor& slot_idx, int64_t pad_slot_id);
Dims check_load_bc(const Tensor& B, const Tensor& C);
Dims check_store_state(const Tensor& state, const Tensor& ssm_pool, const OptTensor& slot_idx,
                       int64_t pad_slot_id);
Dims check_decode_step(const char* op, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                       const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                       const OptTensor& z, const OptTensor& dt_bias, const OptTensor& slot_idx,
                       const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor* out);

SlotRef slot_ref(const OptTensor& idx);

// Everything a kernel needs for one decode step; y is the (T, H, P) output.
StepParams make_step_params(const Dims& d, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                            const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                            const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                            const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                            int64_t pad_slot_id, const Tensor& y);


// ---------------------------------------------------------------------------
// Multi-token decode step (docs/multi_token.md): decode_step_multi(_out), the
// fixed form with K tokens per row, and decode_step_varlen(_out), the form with
// cu_seqlens over a flat token axis.
// ---------------------------------------------------------------------------

struct MultiDims {
  Dims d;          // d.T rows; S, H, P, N, G as for decode_step
  int64_t K = 0;   // fixed form: tokens per row
  int64_t L = 0;   // varlen form: tokens on the flat axis
};

// x, dt, z (T, K, H, P); B, C (T, K, G, N); out (T, K, H, P) or nullptr.
MultiDims check_decode_step_multi(const char* op, const Tensor& ssm_pool, const Tensor& x,
                                  const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                                  const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
                                  const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                  int64_t pad_slot_id, const OptTensor& num_accepted_tokens,
                                  bool write_state, const Tensor* out);

// x, dt, z (L, H, P); B, C (L, G, N); cu_seqlens (T + 1,); out (L, H, P) or nullptr.
MultiDims check_decode_step_varlen(const char* op, const Tensor& ssm_pool, const Tensor& x,
                                   const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                                   const Tensor& cu_seqlens, const OptTensor& D, const OptTensor& z,
                                   const OptTensor& dt_bias, const OptTensor& slot_idx,
                                   const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                                   const OptTensor& num_accepted_tokens, bool write_state,
                                   const Tensor* out);

// Everything a kernel needs; y has x's shape. cu_seqlens selects the varlen form.
// Call only when there is work (T > 0 and, in the fixed form, K > 0).
MultiStepParams make_multi_step_params(const MultiDims& md, const Tensor& ssm_pool, const Tensor& x,
                                       const Tensor& dt, const Tensor& A, const Tensor& B,
                                       const Tensor& C, const OptTensor& cu_seqlens, const OptTensor& D,
                                       const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                                       const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                       int64_t pad_slot_id, const OptTensor& num_accepted_tokens,
                                       bool write_state, const Tensor& y);

}  // namespace ssd
