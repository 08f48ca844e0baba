// TORCH_LIBRARY(ssd): the operator schemas (DESIGN.md section 1), the argument
// checks every backend shares (section 4), checked mode (section 3) and the
// Autograd registration that refuses gradients.
#include "ssd.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace ssd {

namespace {

std::atomic<bool> g_checks{[] {
  const char* env = std::getenv("TORCH_SSD_CHECKS");
  return env != nullptr && std::strcmp(env, "") != 0 && std::strcmp(env, "0") != 0;
}()};

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << (sizes.size() == 1 ? ",)" : ")");
  return os.str();
}

bool is_float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

void check_float(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(is_float_dtype(t.scalar_type()), "ssd.", op, ": argument '", name,
              "' must be float32, bfloat16 or float16, got ", t.scalar_type());
}

// `dims` names the expected sizes, e.g. "(T, H, P)".
void check_shape(const char* op, const char* name, const Tensor& t, const char* dims,
                 std::vector<int64_t> expected) {
  TORCH_CHECK(t.sizes().equals(expected), "ssd.", op, ": argument '", name, "' must have shape ",
              dims, " = ", shape_str(expected), ", got ", shape_str(t.sizes()));
}

void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank, const char* dims) {
  TORCH_CHECK(t.dim() == rank, "ssd.", op, ": argument '", name, "' must be ", rank, "-D ", dims,
              ", got a ", t.dim(), "-D tensor of shape ", shape_str(t.sizes()));
}

void check_device(const char* op, const char* name, const Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.device() == device, "ssd.", op, ": argument '", name, "' must be on ", device,
              " like ssm_pool, got ", t.device());
}

void check_operand(const char* op, const char* name, const Tensor& t, const at::Device& device,
                   const char* dims, std::vector<int64_t> expected) {
  check_device(op, name, t, device);
  check_rank(op, name, t, static_cast<int64_t>(expected.size()), dims);
  check_shape(op, name, t, dims, std::move(expected));
  check_float(op, name, t);
}

void check_opt_operand(const char* op, const char* name, const OptTensor& t, const at::Device& device,
                       const char* dims, std::vector<int64_t> expected) {
  if (t.has_value()) check_operand(op, name, *t, device, dims, std::move(expected));
}

void check_index(const char* op, const char* name, const OptTensor& idx, int64_t T,
                 const at::Device& device) {
  if (!idx.has_value()) return;
  check_device(op, name, *idx, device);
  TORCH_CHECK(idx->scalar_type() == at::kInt || idx->scalar_type() == at::kLong, "ssd.", op,
              ": argument '", name, "' must be int32 or int64, got ", idx->scalar_type());
  check_rank(op, name, *idx, 1, "(T,)");
  check_shape(op, name, *idx, "(T,)", {T});
}

// Checked mode: every slot must be the pad id or a slot of the pool.
void check_slot_values(const char* op, const char* name, const OptTensor& idx, int64_t S,
                       int64_t pad_slot_id) {
  if (!idx.has_value() || !checks_enabled()) return;
  const Tensor host = idx->to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = host.data_ptr<int64_t>();
  for (int64_t t = 0; t < host.numel(); ++t) {
    TORCH_CHECK(v[t] == pad_slot_id || (v[t] >= 0 && v[t] < S), "ssd.", op, ": row ", t, ": ",
                name, "[", t, "] = ", v[t], " is not a slot of ssm_pool (which has S = ", S,
                " slots) and is not pad_slot_id = ", pad_slot_id,
                " (checked mode; torch_ssd.set_checks(False) treats it as a pad row)");
  }
}

// Checked mode: rows that write state must name distinct slots (unchecked, the
// last such row wins; see last_writer in step.h).
// `src_idx`, when given, are the rows' sources: a row reading the pad slot writes nothing.
void check_unique_slots(const char* op, const char* name, const OptTensor& idx, const OptTensor& src_idx,
                        int64_t pad_slot_id) {
  if (!idx.has_value() || !checks_enabled()) return;
  const Tensor host = idx->to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = host.data_ptr<int64_t>();
  Tensor src_host;
  if (src_idx.has_value()) src_host = src_idx->to(at::kCPU, at::kLong).contiguous();
  const int64_t* src = src_idx.has_value() ? src_host.data_ptr<int64_t>() : nullptr;
  std::unordered_map<int64_t, int64_t> first_row;
  for (int64_t t = 0; t < host.numel(); ++t) {
    if (v[t] == pad_slot_id || (src != nullptr && src[t] == pad_slot_id)) continue;
    const auto [it, fresh] = first_row.emplace(v[t], t);
    TORCH_CHECK(fresh, "ssd.", op, ": rows ", it->second, " and ", t, " both write slot ", v[t],
                " (", name, " has a duplicate destination; checked mode rejects it, unchecked the last row wins)");
  }
}

// A written tensor whose elements share memory (an expanded view) would be written
// by several rows or channels at once.
void check_no_internal_overlap(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "ssd.", op, ": argument '", name,
              "' is written in place but some of its elements share memory (strides ",
              shape_str(t.strides()), "); pass a tensor whose elements do not overlap");
}

// Checked mode: a row must not read a slot that another row writes in the same
// call (rows run in an unspecified order, so the read could see either state).
void check_read_write_hazard(const char* op, const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                             int64_t T, int64_t pad_slot_id) {
  if (!dst_slot_idx.has_value() || !checks_enabled()) return;
  const Tensor dst = dst_slot_idx->to(at::kCPU, at::kLong).contiguous();
  Tensor src;
  if (slot_idx.has_value()) src = slot_idx->to(at::kCPU, at::kLong).contiguous();
  auto src_of = [&](int64_t t) { return src.defined() ? src.data_ptr<int64_t>()[t] : t; };
  std::unordered_map<int64_t, int64_t> reader;  // slot -> the row reading it, -1 if several do
  for (int64_t t = 0; t < T; ++t) {
    if (src_of(t) == pad_slot_id) continue;
    const auto [it, fresh] = reader.emplace(src_of(t), t);
    if (!fresh) it->second = -1;
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t to = dst.data_ptr<int64_t>()[t];
    if (src_of(t) == pad_slot_id || to == pad_slot_id) continue;
    const auto it = reader.find(to);
    TORCH_CHECK(it == reader.end() || it->second == t, "ssd.", op, ": row ", t, " writes slot ", to,
                " (dst_slot_idx[", t, "]) which another row reads (slot_idx); rows run in no fixed "
                "order, so that row could read either state (checked mode rejects it; unchecked, "
                "the result is unspecified)");
  }
}

void check_pool(const char* op, const Tensor& ssm_pool) {
  check_rank(op, "ssm_pool", ssm_pool, 4, "(S, H, P, N)");
  check_float(op, "ssm_pool", ssm_pool);
}

void check_rows_fit(const char* op, const OptTensor& slot_idx, int64_t S, int64_t T) {
  TORCH_CHECK(slot_idx.has_value() || T <= S, "ssd.", op, ": ssm_pool has S = ", S,
              " slots, fewer than the T = ", T,
              " rows; without slot_idx row t uses slot t, so S must be >= T");
}

OperandRef operand_ref(const OptTensor& t) {
  OperandRef r;
  if (!t.has_value()) return r;
  r.data = t->data_ptr();
  r.dtype = to_dtype(*t);
  for (int64_t i = 0; i < t->dim() && i < 4; ++i) r.stride[i] = t->stride(i);
  return r;
}

}  // namespace

bool checks_enabled() { return g_checks.load(std::memory_order_relaxed); }
void set_checks(bool enabled) { g_checks.store(enabled, std::memory_order_relaxed); }

Dtype to_dtype(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kFloat16;
    case at::kFloat: return Dtype::kFloat32;
    default: TORCH_CHECK(false, "ssd: unsupported dtype ", t.scalar_type());
  }
}

SlotRef slot_ref(const OptTensor& idx) {
  SlotRef r;
  if (!idx.has_value()) return r;
  r.data = idx->data_ptr();
  r.stride = idx->stride(0);
  r.is_int64 = idx->scalar_type() == at::kLong;
  return r;
}

Dims check_load_state(const Tensor& ssm_pool, const OptTensor& slot_idx, int64_t pad_slot_id) {
  const char* op = "load_state";
  check_pool(op, ssm_pool);
  Dims d;
  d.S = ssm_pool.size(0), d.H = ssm_pool.size(1), d.P = ssm_pool.size(2), d.N = ssm_pool.size(3);
  d.T = slot_idx.has_value() && slot_idx->dim() == 1 ? slot_idx->size(0) : d.S;
  check_index(op, "slot_idx", slot_idx, d.T, ssm_pool.device());
  check_slot_values(op, "slot_idx", slot_idx, d.S, pad_slot_id);
  return d;
}

Dims check_load_bc(const Tensor& B, const Tensor& C) {
  const char* op = "load_bc";
  check_rank(op, "B", B, 3, "(T, G, N)");
  check_float(op, "B", B);
  Dims d;
  d.T = B.size(0), d.G = B.size(1), d.N = B.size(2);
  check_operand(op, "C", C, B.device(), "(T, G, N) like B", {d.T, d.G, d.N});
  return d;
}

Dims check_store_state(const Tensor& state, const Tensor& ssm_pool, const OptTensor& slot_idx,
                       int64_t pad_slot_id) {
  const char* op = "store_state";
  check_pool(op, ssm_pool);
  check_no_internal_overlap(op, "ssm_pool", ssm_pool);
  Dims d;
  d.S = ssm_pool.size(0), d.H = ssm_pool.size(1), d.P = ssm_pool.size(2), d.N = ssm_pool.size(3);
  check_device(op, "state", state, ssm_pool.device());
  check_rank(op, "state", state, 4, "(T, H, P, N)");
  d.T = state.size(0);
  check_shape(op, "state", state, "(T, H, P, N)", {d.T, d.H, d.P, d.N});
  TORCH_CHECK(state.scalar_type() == at::kFloat, "ssd.", op,
              ": argument 'state' must be float32 (the verb rounds float32 to the pool dtype), got ",
              state.scalar_type());
  check_index(op, "slot_idx", slot_idx, d.T, ssm_pool.device());
  check_rows_fit(op, slot_idx, d.S, d.T);
  check_slot_values(op, "slot_idx", slot_idx, d.S, pad_slot_id);
  check_unique_slots(op, "slot_idx", slot_idx, std::nullopt, pad_slot_id);
  return d;
}

Dims check_decode_step(const char* op, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                       const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                       const OptTensor& z, const OptTensor& dt_bias, const OptTensor& slot_idx,
                       const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor* out) {
  check_pool(op, ssm_pool);
  check_no_internal_overlap(op, "ssm_pool", ssm_pool);
  const at::Device device = ssm_pool.device();
  Dims d;
  d.S = ssm_pool.size(0), d.H = ssm_pool.size(1), d.P = ssm_pool.size(2), d.N = ssm_pool.size(3);

  check_device(op, "x", x, device);
  check_rank(op, "x", x, 3, "(T, H, P)");
  d.T = x.size(0);
  check_shape(op, "x", x, "(T, H, P)", {d.T, d.H, d.P});
  check_float(op, "x", x);

  check_device(op, "B", B, device);
  check_rank(op, "B", B, 3, "(T, G, N)");
  d.G = B.size(1);
  TORCH_CHECK(d.G > 0 && d.H % d.G == 0, "ssd.", op, ": argument 'B' has G = ", d.G,
              " groups, which must divide the H = ", d.H, " heads of ssm_pool");
  check_shape(op, "B", B, "(T, G, N)", {d.T, d.G, d.N});
  check_float(op, "B", B);
  check_operand(op, "C", C, device, "(T, G, N)", {d.T, d.G, d.N});
  check_operand(op, "dt", dt, device, "(T, H, P)", {d.T, d.H, d.P});
  check_operand(op, "A", A, device, "(H, P, N)", {d.H, d.P, d.N});
  check_opt_operand(op, "D", D, device, "(H, P)", {d.H, d.P});
  check_opt_operand(op, "z", z, device, "(T, H, P)", {d.T, d.H, d.P});
  check_opt_operand(op, "dt_bias", dt_bias, device, "(H, P)", {d.H, d.P});
  check_index(op, "slot_idx", slot_idx, d.T, device);
  check_index(op, "dst_slot_idx", dst_slot_idx, d.T, device);
  check_rows_fit(op, slot_idx, d.S, d.T);
  if (out != nullptr) {
    check_device(op, "out", *out, device);
    check_rank(op, "out", *out, 3, "(T, H, P)");
    check_shape(op, "out", *out, "(T, H, P)", {d.T, d.H, d.P});
    TORCH_CHECK(out->scalar_type() == x.scalar_type(), "ssd.", op,
                ": argument 'out' must have x's dtype ", x.scalar_type(), ", got ", out->scalar_type());
    check_no_internal_overlap(op, "out", *out);
  }
  check_slot_values(op, "slot_idx", slot_idx, d.S, pad_slot_id);
  check_slot_values(op, "dst_slot_idx", dst_slot_idx, d.S, pad_slot_id);
  if (dst_slot_idx.has_value()) check_unique_slots(op, "dst_slot_idx", dst_slot_idx, slot_idx, pad_slot_id);
  else check_unique_slots(op, "slot_idx", slot_idx, std::nullopt, pad_slot_id);
  check_read_write_hazard(op, slot_idx, dst_slot_idx, d.T, pad_slot_id);
  return d;
}

StepParams make_step_params(const Dims& d, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                            const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                            const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                            const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                            int64_t pad_slot_id, const Tensor& y) {
  StepParams s;
  s.S = d.S, s.T = d.T, s.H = d.H, s.P = d.P, s.N = d.N, s.G = d.G;
  s.heads_per_group = d.H / d.G;
  s.pool = ssm_pool.data_ptr();
  for (int i = 0; i < 4; ++i) s.pool_stride[i] = ssm_pool.stride(i);
  s.pool_dtype = to_dtype(ssm_pool);
  s.x = operand_ref(x), s.dt = operand_ref(dt), s.A = operand_ref(A);
  s.B = operand_ref(B), s.C = operand_ref(C);
  s.D = operand_ref(D), s.z = operand_ref(z), s.dt_bias = operand_ref(dt_bias);
  s.y = y.data_ptr();
  for (int i = 0; i < 3; ++i) s.y_stride[i] = y.stride(i);
  s.y_dtype = to_dtype(y);
  s.src = slot_ref(slot_idx);
  s.dst = dst_slot_idx.has_value() ? slot_ref(dst_slot_idx) : s.src;
  s.pad_slot_id = pad_slot_id;
  s.dt_softplus = dt_softplus;
  return s;
}

// ---------------------------------------------------------------------------
// Multi-token decode step: argument checks and parameters (docs/multi_token.md).
// ---------------------------------------------------------------------------

namespace {

// A slot table argument: None, (T,) or (T, W) with W >= min_cols; int32 or int64.
void check_slot_table(const char* op, const char* name, const OptTensor& idx, int64_t T,
                      int64_t min_cols, const char* cols_what, const at::Device& device) {
  if (!idx.has_value()) return;
  check_device(op, name, *idx, device);
  TORCH_CHECK(idx->scalar_type() == at::kInt || idx->scalar_type() == at::kLong, "ssd.", op,
              ": argument '", name, "' must be int32 or int64, got ", idx->scalar_type());
  TORCH_CHECK(idx->dim() == 1 || idx->dim() == 2, "ssd.", op, ": argument '", name,
              "' must be 1-D (T,) or 2-D (T, W) with T = ", T, ", got a ", idx->dim(),
              "-D tensor of shape ", shape_str(idx->sizes()));
  TORCH_CHECK(idx->size(0) == T, "ssd.", op, ": argument '", name, "' must have T = ", T,
              " rows, one per row, got shape ", shape_str(idx->sizes()));
  TORCH_CHECK(idx->dim() == 1 || idx->size(1) >= min_cols, "ssd.", op, ": argument '", name,
              "' of shape (T, W) must have W >= ", min_cols, " (", cols_what, "), got shape ",
              shape_str(idx->sizes()));
}

// The operands of both forms. `lead` is x's leading sizes: (T, K) or (L,).
Dims check_multi_operands(const char* op, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                          const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& D,
                          const OptTensor& z, const OptTensor& dt_bias, bool varlen,
                          const Tensor* out, std::vector<int64_t>& lead) {
  check_pool(op, ssm_pool);
  check_no_internal_overlap(op, "ssm_pool", ssm_pool);
  const at::Device device = ssm_pool.device();
  Dims d;
  d.S = ssm_pool.size(0), d.H = ssm_pool.size(1), d.P = ssm_pool.size(2), d.N = ssm_pool.size(3);
  const char* hp = varlen ? "(L, H, P)" : "(T, K, H, P)";
  const char* gn = varlen ? "(L, G, N)" : "(T, K, G, N)";
  const int64_t nlead = varlen ? 1 : 2;

  check_device(op, "x", x, device);
  check_rank(op, "x", x, nlead + 2, hp);
  lead.assign(x.sizes().begin(), x.sizes().begin() + nlead);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), tail);
    return v;
  };
  check_shape(op, "x", x, hp, with({d.H, d.P}));
  check_float(op, "x", x);

  check_device(op, "B", B, device);
  check_rank(op, "B", B, nlead + 2, gn);
  d.G = B.size(nlead);
  TORCH_CHECK(d.G > 0 && d.H % d.G == 0, "ssd.", op, ": argument 'B' has G = ", d.G,
              " groups, which must divide the H = ", d.H, " heads of ssm_pool");
  check_shape(op, "B", B, gn, with({d.G, d.N}));
  check_float(op, "B", B);
  check_operand(op, "C", C, device, gn, with({d.G, d.N}));
  check_operand(op, "dt", dt, device, hp, with({d.H, d.P}));
  check_operand(op, "A", A, device, "(H, P, N)", {d.H, d.P, d.N});
  check_opt_operand(op, "D", D, device, "(H, P)", {d.H, d.P});
  check_opt_operand(op, "z", z, device, hp, with({d.H, d.P}));
  check_opt_operand(op, "dt_bias", dt_bias, device, "(H, P)", {d.H, d.P});
  if (out != nullptr) {
    check_device(op, "out", *out, device);
    check_rank(op, "out", *out, nlead + 2, hp);
    check_shape(op, "out", *out, hp, with({d.H, d.P}));
    TORCH_CHECK(out->scalar_type() == x.scalar_type(), "ssd.", op,
                ": argument 'out' must have x's dtype ", x.scalar_type(), ", got ", out->scalar_type());
    check_no_internal_overlap(op, "out", *out);
  }
  return d;
}

void check_num_accepted(const char* op, const OptTensor& num_accepted_tokens, const OptTensor& slot_idx,
                        int64_t T, const at::Device& device) {
  if (!num_accepted_tokens.has_value()) return;
  check_index(op, "num_accepted_tokens", num_accepted_tokens, T, device);
  TORCH_CHECK(slot_idx.has_value() && slot_idx->dim() == 2, "ssd.", op,
              ": argument 'num_accepted_tokens' picks row t's source slot slot_idx[t, n - 1], so "
              "slot_idx must be 2-D (T, W), got ",
              slot_idx.has_value() ? "a 1-D slot_idx" : "slot_idx=None");
}

Tensor host_long(const OptTensor& t) {
  return t.has_value() ? t->to(at::kCPU, at::kLong).contiguous() : Tensor();
}

std::string entry_str(const char* name, const Tensor& table, int64_t t, int64_t c) {
  std::ostringstream os;
  os << name << "[" << t;
  if (table.dim() == 2) os << ", " << c;
  os << "]";
  return os.str();
}

// Checked mode for the multi-token ops: the varlen bounds, num_accepted_tokens,
// every slot a row reads or writes, distinct destinations, and no row reading a
// slot that another row writes (the order between rows is unspecified).
void check_multi_slots(const char* op, const MultiDims& md, const OptTensor& slot_idx,
                       const OptTensor& dst_slot_idx, const OptTensor& num_accepted_tokens,
                       const OptTensor& cu_seqlens, int64_t pad_slot_id, bool write_state) {
  if (!checks_enabled()) return;
  const int64_t T = md.d.T, S = md.d.S;
  const Tensor src = host_long(slot_idx), acc = host_long(num_accepted_tokens), cu = host_long(cu_seqlens);
  const Tensor dst = dst_slot_idx.has_value() ? host_long(dst_slot_idx) : src;
  const char* dst_name = dst_slot_idx.has_value() ? "dst_slot_idx" : "slot_idx";
  const int64_t src_cols = src.defined() && src.dim() == 2 ? src.size(1) : 1;
  const int64_t dst_cols = dst.defined() && dst.dim() == 2 ? dst.size(1) : 1;
  const bool per_token = dst.defined() && dst.dim() == 2;
  auto value = [](const Tensor& table, int64_t t, int64_t c) {
    return table.data_ptr<int64_t>()[t * (table.dim() == 2 ? table.size(1) : 1) + c];
  };
  auto check_slot = [&](const char* name, const Tensor& table, int64_t t, int64_t c, int64_t v) {
    TORCH_CHECK(v == pad_slot_id || (v >= 0 && v < S), "ssd.", op, ": row ", t, ": ",
                entry_str(name, table, t, c), " = ", v, " is not a slot of ssm_pool (which has S = ", S,
                " slots) and is not pad_slot_id = ", pad_slot_id,
                " (checked mode; torch_ssd.set_checks(False) treats it as a pad)");
  };

  if (cu.defined()) {
    const int64_t* c = cu.data_ptr<int64_t>();
    TORCH_CHECK(c[0] >= 0 && c[T] <= md.L, "ssd.", op, ": cu_seqlens[0] = ", c[0], " and cu_seqlens[",
                T, "] = ", c[T], " must lie in [0, L] with L = ", md.L,
                " tokens (checked mode; unchecked, a row out of bounds has no tokens)");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(c[t] <= c[t + 1], "ssd.", op, ": cu_seqlens must be non-decreasing, got cu_seqlens[",
                  t, "] = ", c[t], " > cu_seqlens[", t + 1, "] = ", c[t + 1],
                  " (checked mode; unchecked, such a row has no tokens)");
  }

  std::unordered_map<int64_t, std::vector<int64_t>> readers;          // slot -> rows
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> writes;  // slot, (row, token)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t count = cu.defined() ? cu.data_ptr<int64_t>()[t + 1] - cu.data_ptr<int64_t>()[t] : md.K;
    if (count == 0) continue;
    int64_t col = 0;
    if (acc.defined()) {
      const int64_t n = acc.data_ptr<int64_t>()[t];
      TORCH_CHECK(n >= 0 && n <= src_cols, "ssd.", op, ": row ", t, ": num_accepted_tokens[", t, "] = ", n,
                  " is outside [0, W] with W = ", src_cols,
                  " columns of slot_idx (checked mode; unchecked, the row is a pad row)");
      col = n > 0 ? n - 1 : 0;
    }
    const int64_t from = src.defined() ? value(src, t, col) : t;
    if (src.defined()) check_slot("slot_idx", src, t, col, from);
    if (from == pad_slot_id) continue;  // a pad row reads and writes nothing
    readers[from].push_back(t);
    if (!write_state) continue;
    if (per_token) {
      TORCH_CHECK(count <= dst_cols, "ssd.", op, ": row ", t, " has ", count, " tokens but ", dst_name,
                  " has only W = ", dst_cols,
                  " columns, one per token (checked mode; unchecked, the extra tokens write nothing)");
      for (int64_t k = 0; k < count; ++k) {
        const int64_t to = value(dst, t, k);
        check_slot(dst_name, dst, t, k, to);
        if (to != pad_slot_id) writes.push_back({to, {t, k}});
      }
    } else {
      const int64_t to = dst.defined() ? value(dst, t, 0) : t;
      if (dst.defined()) check_slot(dst_name, dst, t, 0, to);
      if (to != pad_slot_id) writes.push_back({to, {t, count - 1}});
    }
  }
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> writer;
  for (const auto& [slot, at] : writes) {
    const auto [it, fresh] = writer.emplace(slot, at);
    TORCH_CHECK(fresh, "ssd.", op, ": row ", it->second.first, " token ", it->second.second, " and row ",
                at.first, " token ", at.second, " both write slot ", slot, " (", dst_name,
                " has a duplicate destination; checked mode rejects it, unchecked the last write wins)");
    const auto r = readers.find(slot);
    if (r == readers.end()) continue;
    for (const int64_t u : r->second)
      TORCH_CHECK(u == at.first, "ssd.", op, ": row ", at.first, " writes slot ", slot, ", which row ", u,
                  " reads as its source; rows of one call must not share slots (checked mode)");
  }
}

SlotTable slot_table(const OptTensor& idx) {
  SlotTable r;
  if (!idx.has_value()) return r;
  r.data = idx->data_ptr();
  r.row_stride = idx->stride(0);
  r.is_int64 = idx->scalar_type() == at::kLong;
  if (idx->dim() == 2) {
    r.per_token = true;
    r.cols = idx->size(1);
    r.col_stride = idx->stride(1);
  }
  return r;
}

}  // namespace

MultiDims check_decode_step_multi(const char* op, const Tensor& ssm_pool, const Tensor& x,
                                  const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                                  const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
                                  const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                  int64_t pad_slot_id, const OptTensor& num_accepted_tokens,
                                  bool write_state, const Tensor* out) {
  std::vector<int64_t> lead;
  MultiDims md;
  md.d = check_multi_operands(op, ssm_pool, x, dt, A, B, C, D, z, dt_bias, false, out, lead);
  md.d.T = lead[0], md.K = lead[1];
  const at::Device device = ssm_pool.device();
  check_slot_table(op, "slot_idx", slot_idx, md.d.T, 1, "source columns", device);
  check_slot_table(op, "dst_slot_idx", dst_slot_idx, md.d.T, md.K, "one column per token, K", device);
  // Without dst_slot_idx a 2-D slot_idx is also the per-token destination table.
  TORCH_CHECK(dst_slot_idx.has_value() || !write_state || !slot_idx.has_value() || slot_idx->dim() == 1 ||
                  slot_idx->size(1) >= md.K,
              "ssd.", op, ": argument 'slot_idx' of shape ", shape_str(slot_idx->sizes()),
              " is also the per-token destination table (dst_slot_idx is None), so it needs W >= K = ", md.K,
              " columns");
  check_num_accepted(op, num_accepted_tokens, slot_idx, md.d.T, device);
  check_rows_fit(op, slot_idx, md.d.S, md.d.T);
  check_multi_slots(op, md, slot_idx, dst_slot_idx, num_accepted_tokens, std::nullopt, pad_slot_id,
                    write_state);
  return md;
}

MultiDims check_decode_step_varlen(const char* op, const Tensor& ssm_pool, const Tensor& x,
                                   const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                                   const Tensor& cu_seqlens, const OptTensor& D, const OptTensor& z,
                                   const OptTensor& dt_bias, const OptTensor& slot_idx,
                                   const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                                   const OptTensor& num_accepted_tokens, bool write_state,
                                   const Tensor* out) {
  std::vector<int64_t> lead;
  MultiDims md;
  md.d = check_multi_operands(op, ssm_pool, x, dt, A, B, C, D, z, dt_bias, true, out, lead);
  md.L = lead[0];
  const at::Device device = ssm_pool.device();
  check_device(op, "cu_seqlens", cu_seqlens, device);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, "ssd.", op,
              ": argument 'cu_seqlens' must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_rank(op, "cu_seqlens", cu_seqlens, 1, "(T + 1,)");
  TORCH_CHECK(cu_seqlens.size(0) >= 1, "ssd.", op,
              ": argument 'cu_seqlens' must have T + 1 >= 1 entries, got shape ", shape_str(cu_seqlens.sizes()));
  md.d.T = cu_seqlens.size(0) - 1;
  check_slot_table(op, "slot_idx", slot_idx, md.d.T, 1, "source columns", device);
  check_slot_table(op, "dst_slot_idx", dst_slot_idx, md.d.T, 1, "one column per token", device);
  check_num_accepted(op, num_accepted_tokens, slot_idx, md.d.T, device);
  check_rows_fit(op, slot_idx, md.d.S, md.d.T);
  check_multi_slots(op, md, slot_idx, dst_slot_idx, num_accepted_tokens, cu_seqlens, pad_slot_id,
                    write_state);
  return md;
}

MultiStepParams make_multi_step_params(const MultiDims& md, const Tensor& ssm_pool, const Tensor& x,
                                       const Tensor& dt, const Tensor& A, const Tensor& B,
                                       const Tensor& C, const OptTensor& cu_seqlens, const OptTensor& D,
                                       const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                                       const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                       int64_t pad_slot_id, const OptTensor& num_accepted_tokens,
                                       bool write_state, const Tensor& y) {
  const bool varlen = cu_seqlens.has_value();
  auto tok = [&](const Tensor& t) { return t.stride(varlen ? 0 : 1); };
  MultiStepParams m;
  m.step = make_step_params(md.d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, std::nullopt,
                            std::nullopt, pad_slot_id, y);
  if (!varlen) {
    // The fixed form's (T, K, ...) operands read at token 0 of each row, in the single
    // step's indexing (row, h, p): x[:, 0] without making the view (a view per operand
    // cost the host about 1 us each per call). Token 0 starts where the tensor does.
    for (OperandRef* r : {&m.step.x, &m.step.dt, &m.step.B, &m.step.C, &m.step.z}) {
      r->stride[1] = r->stride[2];
      r->stride[2] = r->stride[3];
      r->stride[3] = 0;
    }
    m.step.y_stride[1] = y.stride(2);
    m.step.y_stride[2] = y.stride(3);
  }
  m.K = md.K, m.L = md.L;
  m.x_tok = tok(x), m.dt_tok = tok(dt), m.B_tok = tok(B), m.C_tok = tok(C), m.y_tok = tok(y);
  m.z_tok = z.has_value() ? tok(*z) : 0;
  m.src = slot_table(slot_idx);
  m.dst = dst_slot_idx.has_value() ? slot_table(dst_slot_idx) : m.src;
  m.num_accepted = slot_ref(num_accepted_tokens);
  m.cu_seqlens = slot_ref(cu_seqlens);
  m.write_state = write_state;
  return m;
}

namespace {

// Autograd: these ops have no derivative. With grad mode on, an input that
// requires grad is refused here, by name, instead of returning a result that
// silently drops out of the graph. Otherwise the call goes on below autograd, and
// the version counters of the mutated arguments are bumped as an in-place op would.
void refuse_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto inputs = torch::jit::last(*stack, args.size());
  std::vector<Tensor> mutated;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!inputs[i].isTensor()) continue;
    const Tensor& t = inputs[i].toTensor();
    if (!t.defined()) continue;
    TORCH_CHECK(!(at::GradMode::is_enabled() && t.requires_grad()), "ssd.", schema.name().substr(5),
                ": argument '", args[i].name(),
                "' requires grad, but torch.ops.ssd ops have no autograd support "
                "(run under torch.no_grad() or torch.inference_mode(), or pass a detached tensor)");
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) mutated.push_back(t);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const Tensor& t : mutated)
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

}  // namespace ssd

TORCH_LIBRARY(ssd, m) {
  m.def("load_state(Tensor ssm_pool, Tensor? slot_idx=None, int pad_slot_id=-1) -> Tensor");
  m.def("load_bc(Tensor B, Tensor C) -> (Tensor, Tensor)");
  m.def(
      "store_state(Tensor state, Tensor(a!) ssm_pool, Tensor? slot_idx=None, int pad_slot_id=-1) -> ()");
  m.def(
      "decode_step(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, "
      "Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1) -> Tensor");
  m.def(
      "decode_step_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, "
      "Tensor? dst_slot_idx, int pad_slot_id, Tensor(b!) out) -> ()");
  // Multi-token decode step (docs/multi_token.md): K tokens per row (x (T, K, H, P)),
  // or rows of cu_seqlens over a flat token axis (x (L, H, P)).
  m.def(
      "decode_step_multi(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, "
      "Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1, "
      "Tensor? num_accepted_tokens=None, bool write_state=True) -> Tensor");
  m.def(
      "decode_step_multi_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, "
      "Tensor? dst_slot_idx, int pad_slot_id, Tensor? num_accepted_tokens, bool write_state, "
      "Tensor(b!) out) -> ()");
  m.def(
      "decode_step_varlen(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor cu_seqlens, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, "
      "Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1, "
      "Tensor? num_accepted_tokens=None, bool write_state=True) -> Tensor");
  m.def(
      "decode_step_varlen_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor cu_seqlens, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, "
      "Tensor? dst_slot_idx, int pad_slot_id, Tensor? num_accepted_tokens, bool write_state, "
      "Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ssd, Autograd, m) {
  for (const char* name : {"load_state", "load_bc", "store_state", "decode_step", "decode_step_out",
                           "decode_step_multi", "decode_step_multi_out", "decode_step_varlen",
                           "decode_step_varlen_out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&ssd::refuse_autograd>());
}

// Python-side helpers: checked mode, and the shared checks for the MPS path
// (whose kernels are launched from Python).
PYBIND11_MODULE(_C, mod) {
  mod.def("set_checks", &ssd::set_checks, "Turn checked mode on or off.");
  mod.def("checks_enabled", &ssd::checks_enabled, "Whether checked mode is on.");
  mod.def(
      "check_decode_step",
      [](const char* op, const at::Tensor& pool, const at::Tensor& x, const at::Tensor& dt,
         const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const ssd::OptTensor& D,
         const ssd::OptTensor& z, const ssd::OptTensor& dt_bias, const ssd::OptTensor& slot_idx,
         const ssd::OptTensor& dst_slot_idx, int64_t pad_slot_id, const ssd::OptTensor& out) {
        const auto d = ssd::check_decode_step(op, pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                              dst_slot_idx, pad_slot_id, out ? &*out : nullptr);
        return std::vector<int64_t>{d.S, d.T, d.H, d.P, d.N, d.G};
      },
      "The decode step's argument checks; returns (S, T, H, P, N, G).");
  mod.def(
      "check_load_state",
      [](const at::Tensor& pool, const ssd::OptTensor& slot_idx, int64_t pad_slot_id) {
        const auto d = ssd::check_load_state(pool, slot_idx, pad_slot_id);
        return std::vector<int64_t>{d.S, d.T, d.H, d.P, d.N};
      });
  mod.def("check_load_bc", [](const at::Tensor& B, const at::Tensor& C) {
    const auto d = ssd::check_load_bc(B, C);
    return std::vector<int64_t>{d.T, d.G, d.N};
  });
  mod.def("check_store_state", [](const at::Tensor& state, const at::Tensor& pool,
                                  const ssd::OptTensor& slot_idx, int64_t pad_slot_id) {
    const auto d = ssd::check_store_state(state, pool, slot_idx, pad_slot_id);
    return std::vector<int64_t>{d.S, d.T, d.H, d.P, d.N};
  });
  mod.def(
      "check_decode_step_multi",
      [](const char* op, const at::Tensor& pool, const at::Tensor& x, const at::Tensor& dt,
         const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const ssd::OptTensor& D,
         const ssd::OptTensor& z, const ssd::OptTensor& dt_bias, const ssd::OptTensor& slot_idx,
         const ssd::OptTensor& dst_slot_idx, int64_t pad_slot_id,
         const ssd::OptTensor& num_accepted_tokens, bool write_state, const ssd::OptTensor& out) {
        const auto md = ssd::check_decode_step_multi(op, pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                                     dst_slot_idx, pad_slot_id, num_accepted_tokens,
                                                     write_state, out ? &*out : nullptr);
        const auto& d = md.d;
        return std::vector<int64_t>{d.S, d.T, md.K, d.H, d.P, d.N, d.G};
      },
      "The fixed-form multi-token step's argument checks; returns (S, T, K, H, P, N, G).");
  mod.def(
      "check_decode_step_varlen",
      [](const char* op, const at::Tensor& pool, const at::Tensor& x, const at::Tensor& dt,
         const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, const at::Tensor& cu_seqlens,
         const ssd::OptTensor& D, const ssd::OptTensor& z, const ssd::OptTensor& dt_bias,
         const ssd::OptTensor& slot_idx, const ssd::OptTensor& dst_slot_idx, int64_t pad_slot_id,
         const ssd::OptTensor& num_accepted_tokens, bool write_state, const ssd::OptTensor& out) {
        const auto md = ssd::check_decode_step_varlen(op, pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias,
                                                      slot_idx, dst_slot_idx, pad_slot_id,
                                                      num_accepted_tokens, write_state,
                                                      out ? &*out : nullptr);
        const auto& d = md.d;
        return std::vector<int64_t>{d.S, d.T, md.L, d.H, d.P, d.N, d.G};
      },
      "The varlen multi-token step's argument checks; returns (S, T, L, H, P, N, G).");
}
