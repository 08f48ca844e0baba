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

}  // namespace ssd
