// Metal kernels for torch.ops.ssd on MPS: the fused decode step and the loader
// verbs (load_state, load_bc, store_state). Compiled at run time by
// torch.mps.compile_shader after dstate_io.metal (see torch_ssd/mps.py).
//
// compile_shader binds every tensor at its storage offset and passes no strides,
// so each kernel takes one `constant ...Args&` block of int64 sizes, strides
// (in elements) and flags, which torch_ssd/mps.py packs field by field in the
// order declared here. Buffer i is the kernel's i-th parameter.
//
// Semantics are those of csrc/step.h and DESIGN.md sections 2 and 3: float32
// arithmetic, the state rounded once on the store, y from the unrounded state; a
// row whose source slot is the pad id or outside [0, S) reads and writes nothing
// and gets y = 0; of rows sharing a destination slot the last one writes; pool
// offsets in 64 bits. Where csrc/step.h writes a * b + c, these kernels call fma
// explicitly, so no compiler setting can change how a result rounds.

// ---------------------------------------------------------------------------
// Slots: which rows read and write which pool slot.
// ---------------------------------------------------------------------------

inline bool slot_addressable(long slot, long S, long pad_slot_id) {
  return slot != pad_slot_id && slot >= 0 && slot < S;
}

inline long read_slot(device const uchar* idx, long is_int64, long stride, long t) {
  if (is_int64) return reinterpret_cast<device const long*>(idx)[t * stride];
  return long(reinterpret_cast<device const int*>(idx)[t * stride]);
}

struct PlanArgs {
  long T;
  long S;
  long pad_slot_id;
  long has_src_idx;
  long src_is_int64;
  long src_stride;
  long has_dst_idx;
  long dst_is_int64;
  long dst_stride;
  long rows_read_state;  // 1: decode_step (a row with a pad source writes nothing)
};

// plan[2t] = row t's source slot, or -1 when it is a pad row (nothing is read and
// y is 0); plan[2t + 1] = the slot row t writes, or -1 when it writes nothing: its
// destination is not addressable, or a later row that reads state writes the same
// slot (the last writer wins: csrc/step.h last_writer). Without a source index row
// t reads slot t; without a destination index it writes its source slot.
kernel void ssd_row_plan(device const uchar* src_idx [[buffer(0)]],
                         device const uchar* dst_idx [[buffer(1)]],
                         device long* plan [[buffer(2)]],
                         constant PlanArgs& a [[buffer(3)]],
                         uint3 gid [[thread_position_in_grid]]) {
  const long t = long(gid.x);
  if (t >= a.T) return;
  const long src = a.has_src_idx ? read_slot(src_idx, a.src_is_int64, a.src_stride, t) : t;
  const bool reads = !a.rows_read_state || slot_addressable(src, a.S, a.pad_slot_id);
  const long dst = a.has_dst_idx ? read_slot(dst_idx, a.dst_is_int64, a.dst_stride, t) : src;
  bool writes = reads && slot_addressable(dst, a.S, a.pad_slot_id);
  if (writes && (a.has_src_idx || a.has_dst_idx)) {
    for (long u = t + 1; u < a.T; ++u) {
      const long u_src = a.has_src_idx ? read_slot(src_idx, a.src_is_int64, a.src_stride, u) : u;
      const long u_dst = a.has_dst_idx ? read_slot(dst_idx, a.dst_is_int64, a.dst_stride, u) : u_src;
      if (u_dst == dst && (!a.rows_read_state || slot_addressable(u_src, a.S, a.pad_slot_id))) {
        writes = false;
        break;
      }
    }
  }
  plan[2 * t] = reads ? src : -1;
  plan[2 * t + 1] = writes ? dst : -1;
}

// ---------------------------------------------------------------------------
// Per-channel float32 arithmetic (csrc/step.h).
// ---------------------------------------------------------------------------

// log1p without a log1p in the Metal library: log(u) * x / (u - 1) with u = 1 + x
// cancels the rounding of u, which is accurate to a few ulp.
inline float ssd_log1p(float v) {
  const float u = 1.0f + v;
  return u == 1.0f ? v : precise::log(u) * (v / (u - 1.0f));
}

inline float ssd_softplus(float v) { return v <= 20.0f ? ssd_log1p(precise::exp(v)) : v; }

// dA = exp(A * dtv): the one function for a broadcast A and for each lane of a
// per-element A, so both give the same bits.
inline float ssd_decay(float a, float dtv) { return precise::exp(a * dtv); }

inline float4 ssd_decay4(float4 a, float dtv) {
  return float4(ssd_decay(a.x, dtv), ssd_decay(a.y, dtv), ssd_decay(a.z, dtv), ssd_decay(a.w, dtv));
}

// ---------------------------------------------------------------------------
// decode_step
// ---------------------------------------------------------------------------

struct StepArgs {
  long S;
  long T;
  long H;
  long P;
  long N;
  long heads_per_group;
  long pool_stride[4];
  long x_stride[3];
  long dt_stride[3];
  long A_stride[3];
  long B_stride[3];
  long C_stride[3];
  long D_stride[2];
  long z_stride[3];
  long dt_bias_stride[2];
  long y_stride[3];
  long x_dtype;
  long dt_dtype;
  long A_dtype;  // read when A is broadcast along N; a per-element A has the row type
  long D_dtype;
  long z_dtype;
  long dt_bias_dtype;
  long y_dtype;
  long has_D;
  long has_z;
  long has_dt_bias;
  long dt_softplus;
  long has_plan;  // 0: no slot indices, row t reads and writes slot t
};

// Chunks advanced per pass: all their loads are issued before the arithmetic that
// needs them, so one thread keeps several loads in flight.
enum { kChunksPerPass = 4 };

// One channel (t, h, p): its rows along N and its scalars.
template <typename PoolT, typename RowT, bool kUnit, bool kAPerN>
struct ChannelStep {
  DstateReader<PoolT, kUnit> state_in;
  DstateWriter<PoolT, kUnit> state_out;
  DstateReader<RowT, kUnit> B_row;
  DstateReader<RowT, kUnit> C_row;
  DstateReader<RowT, kUnit> A_row;  // read only when kAPerN
  float dtv;
  float dtx;       // dt * x
  float dA_splat;  // exp(A * dt) when A is broadcast along N
  bool store_back;  // this row writes its state

  // Chunks [c0, c0 + U): s = s * dA + dt * x * B; acc += s * C; store s.
  template <int U>
  void pass(long c0, thread float4& acc) const {
    float4 s[U], b[U], c[U], dA[U];
    for (int u = 0; u < U; ++u) {
      s[u] = state_in.chunk(c0 + u);
      b[u] = B_row.chunk(c0 + u);
      c[u] = C_row.chunk(c0 + u);
      dA[u] = kAPerN ? ssd_decay4(A_row.chunk(c0 + u), dtv) : float4(dA_splat);
    }
    for (int u = 0; u < U; ++u) {
      s[u] = fma(s[u], dA[u], dtx * b[u]);
      acc = fma(s[u], c[u], acc);
    }
    if (store_back) {
      for (int u = 0; u < U; ++u) state_out.chunk(c0 + u, s[u]);
    }
  }

  // The last count < 4 elements. Lanes past N are zeroed after the update, so they
  // add nothing to y even where dA overflows.
  void tail(long c0, int count, thread float4& acc) const {
    float4 s = state_in.tail(c0, count);
    const float4 b = B_row.tail(c0, count);
    const float4 c = C_row.tail(c0, count);
    const float4 dA = kAPerN ? ssd_decay4(A_row.tail(c0, count), dtv) : float4(dA_splat);
    s = fma(s, dA, dtx * b);
    for (int v = count; v < 4; ++v) s[v] = 0.0f;
    acc = fma(s, c, acc);
    if (store_back) state_out.tail(c0, count, s);
  }
};

// One thread per channel: gid = (p, h, t).
template <typename PoolT, typename RowT, bool kUnit, bool kAPerN>
kernel void ssd_decode_step(device PoolT* pool [[buffer(0)]],
                            device const uchar* x [[buffer(1)]],
                            device const uchar* dt [[buffer(2)]],
                            device const uchar* A [[buffer(3)]],
                            device const RowT* B [[buffer(4)]],
                            device const RowT* C [[buffer(5)]],
                            device const uchar* D [[buffer(6)]],
                            device const uchar* z [[buffer(7)]],
                            device const uchar* dt_bias [[buffer(8)]],
                            device const long* plan [[buffer(9)]],
                            device uchar* y [[buffer(10)]],
                            constant StepArgs& a [[buffer(11)]],
                            uint3 gid [[thread_position_in_grid]]) {
  const long p = long(gid.x), h = long(gid.y), t = long(gid.z);
  if (p >= a.P || h >= a.H || t >= a.T) return;
  const long src = a.has_plan ? plan[2 * t] : t;
  const long dst = a.has_plan ? plan[2 * t + 1] : t;
  const long y_at = t * a.y_stride[0] + h * a.y_stride[1] + p * a.y_stride[2];
  if (src < 0) {  // pad row
    store_scalar(y, y_at, int(a.y_dtype), 0.0f);
    return;
  }
  const long g = h / a.heads_per_group;

  ChannelStep<PoolT, RowT, kUnit, kAPerN> ch;
  ch.dtv = load_scalar(dt, t * a.dt_stride[0] + h * a.dt_stride[1] + p * a.dt_stride[2], int(a.dt_dtype));
  if (a.has_dt_bias) {
    ch.dtv += load_scalar(dt_bias, h * a.dt_bias_stride[0] + p * a.dt_bias_stride[1], int(a.dt_bias_dtype));
  }
  if (a.dt_softplus) ch.dtv = ssd_softplus(ch.dtv);
  const float xv = load_scalar(x, t * a.x_stride[0] + h * a.x_stride[1] + p * a.x_stride[2], int(a.x_dtype));
  ch.dtx = ch.dtv * xv;
  const long A_at = h * a.A_stride[0] + p * a.A_stride[1];
  ch.dA_splat = (!kAPerN && a.N > 0) ? ssd_decay(load_scalar(A, A_at, int(a.A_dtype)), ch.dtv) : 0.0f;

  // 64-bit element offsets of pool[slot, h, p, 0].
  const long src_at = src * a.pool_stride[0] + h * a.pool_stride[1] + p * a.pool_stride[2];
  const long dst_at = (dst >= 0 ? dst : src) * a.pool_stride[0] + h * a.pool_stride[1] + p * a.pool_stride[2];
  ch.state_in.base = pool + src_at;
  ch.state_in.stride = a.pool_stride[3];
  ch.state_out.base = pool + dst_at;
  ch.state_out.stride = a.pool_stride[3];
  ch.store_back = dst >= 0;
  ch.B_row.base = B + t * a.B_stride[0] + g * a.B_stride[1];
  ch.B_row.stride = a.B_stride[2];
  ch.C_row.base = C + t * a.C_stride[0] + g * a.C_stride[1];
  ch.C_row.stride = a.C_stride[2];
  ch.A_row.base = reinterpret_cast<device const RowT*>(A) + A_at;
  ch.A_row.stride = a.A_stride[2];

  float4 acc = float4(0.0f);
  const long full = a.N / 4;
  const int rest = int(a.N - full * 4);
  long c = 0;
  for (; c + kChunksPerPass <= full; c += kChunksPerPass) ch.template pass<kChunksPerPass>(c, acc);
  for (; c < full; ++c) ch.template pass<1>(c, acc);
  if (rest > 0) ch.tail(full, rest, acc);

  // y = sum_n s * C (a fixed tree over the four lanes) + D * x, then * silu(z).
  float yv = (acc.x + acc.y) + (acc.z + acc.w);
  if (a.has_D) yv = fma(load_scalar(D, h * a.D_stride[0] + p * a.D_stride[1], int(a.D_dtype)), xv, yv);
  if (a.has_z) {
    const float zv = load_scalar(z, t * a.z_stride[0] + h * a.z_stride[1] + p * a.z_stride[2], int(a.z_dtype));
    yv *= zv / (1.0f + precise::exp(-zv));
  }
  store_scalar(y, y_at, int(a.y_dtype), yv);
}

// ---------------------------------------------------------------------------
// load_state: pool rows widened to a contiguous float32 (T, H, P, N); pad rows 0.
// ---------------------------------------------------------------------------

struct LoadStateArgs {
  long S;
  long T;
  long H;
  long P;
  long N;
  long pool_stride[4];
  long pad_slot_id;
  long has_idx;
  long idx_is_int64;
  long idx_stride;
};

template <typename PoolT, bool kUnit>
kernel void ssd_load_state(device const PoolT* pool [[buffer(0)]],
                           device const uchar* slot_idx [[buffer(1)]],
                           device float* out [[buffer(2)]],
                           constant LoadStateArgs& a [[buffer(3)]],
                           uint3 gid [[thread_position_in_grid]]) {
  const long p = long(gid.x), h = long(gid.y), t = long(gid.z);
  if (p >= a.P || h >= a.H || t >= a.T) return;
  const long slot = a.has_idx ? read_slot(slot_idx, a.idx_is_int64, a.idx_stride, t) : t;
  DstateWriter<float, true> row_out;
  row_out.base = out + ((t * a.H + h) * a.P + p) * a.N;
  row_out.stride = 1;
  const long full = a.N / 4;
  const int rest = int(a.N - full * 4);
  if (!slot_addressable(slot, a.S, a.pad_slot_id)) {
    for (long c = 0; c < full; ++c) row_out.chunk(c, float4(0.0f));
    if (rest > 0) row_out.tail(full, rest, float4(0.0f));
    return;
  }
  DstateReader<PoolT, kUnit> row_in;
  row_in.base = pool + slot * a.pool_stride[0] + h * a.pool_stride[1] + p * a.pool_stride[2];
  row_in.stride = a.pool_stride[3];
  for (long c = 0; c < full; ++c) row_out.chunk(c, row_in.chunk(c));
  if (rest > 0) row_out.tail(full, rest, row_in.tail(full, rest));
}

// ---------------------------------------------------------------------------
// load_bc: one (T, G, N) operand widened to a contiguous float32 copy. The host
// launches it once for B and once for C. One thread per row: gid = (g, t).
// ---------------------------------------------------------------------------

struct WidenRowsArgs {
  long T;
  long G;
  long N;
  long src_stride[3];
};

template <typename ElemT, bool kUnit>
kernel void ssd_widen_rows(device const ElemT* src [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           constant WidenRowsArgs& a [[buffer(2)]],
                           uint3 gid [[thread_position_in_grid]]) {
  const long g = long(gid.x), t = long(gid.y);
  if (g >= a.G || t >= a.T) return;
  DstateReader<ElemT, kUnit> row_in;
  row_in.base = src + t * a.src_stride[0] + g * a.src_stride[1];
  row_in.stride = a.src_stride[2];
  DstateWriter<float, true> row_out;
  row_out.base = out + (t * a.G + g) * a.N;
  row_out.stride = 1;
  const long full = a.N / 4;
  const int rest = int(a.N - full * 4);
  for (long c = 0; c < full; ++c) row_out.chunk(c, row_in.chunk(c));
  if (rest > 0) row_out.tail(full, rest, row_in.tail(full, rest));
}

// ---------------------------------------------------------------------------
// store_state: float32 (T, H, P, N) rounded once into pool[slot]; rows that
// write nothing (pad, outside the pool, overwritten by a later row) are skipped.
// ---------------------------------------------------------------------------

struct StoreStateArgs {
  long S;
  long T;
  long H;
  long P;
  long N;
  long pool_stride[4];
  long state_stride[4];
  long has_plan;  // 0: no slot_idx, row t writes slot t
};

template <typename PoolT, bool kUnit>
kernel void ssd_store_state(device const float* state [[buffer(0)]],
                            device PoolT* pool [[buffer(1)]],
                            device const long* plan [[buffer(2)]],
                            constant StoreStateArgs& a [[buffer(3)]],
                            uint3 gid [[thread_position_in_grid]]) {
  const long p = long(gid.x), h = long(gid.y), t = long(gid.z);
  if (p >= a.P || h >= a.H || t >= a.T) return;
  const long slot = a.has_plan ? plan[2 * t + 1] : t;
  if (slot < 0) return;
  DstateReader<float, kUnit> row_in;
  row_in.base = state + t * a.state_stride[0] + h * a.state_stride[1] + p * a.state_stride[2];
  row_in.stride = a.state_stride[3];
  DstateWriter<PoolT, kUnit> row_out;
  row_out.base = pool + slot * a.pool_stride[0] + h * a.pool_stride[1] + p * a.pool_stride[2];
  row_out.stride = a.pool_stride[3];
  const long full = a.N / 4;
  const int rest = int(a.N - full * 4);
  for (long c = 0; c < full; ++c) row_out.chunk(c, row_in.chunk(c));
  if (rest > 0) row_out.tail(full, rest, row_in.tail(full, rest));
}

// ---------------------------------------------------------------------------
// Instantiations: one per dtype combination and layout path. Name parts:
//   pool / row dtype  f32 | bf16 | f16   (row = B, C and a per-element A)
//   layout            vec (unit stride along N) | strided
//   A                 an (per element along N) | a1 (broadcast along N)
// torch_ssd/mps.py builds these names; tests check that every name it can build
// is instantiated here.
// ---------------------------------------------------------------------------

#define SSD_KERNEL(NAME, ...) template [[host_name(NAME)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;

SSD_KERNEL("ssd_decode_step_f32_f32_vec_an", ssd_decode_step<float, float, true, true>)
SSD_KERNEL("ssd_decode_step_f32_f32_vec_a1", ssd_decode_step<float, float, true, false>)
SSD_KERNEL("ssd_decode_step_f32_f32_strided_an", ssd_decode_step<float, float, false, true>)
SSD_KERNEL("ssd_decode_step_f32_f32_strided_a1", ssd_decode_step<float, float, false, false>)
SSD_KERNEL("ssd_decode_step_f32_bf16_vec_an", ssd_decode_step<float, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_f32_bf16_vec_a1", ssd_decode_step<float, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_f32_bf16_strided_an", ssd_decode_step<float, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_f32_bf16_strided_a1", ssd_decode_step<float, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_f32_f16_vec_an", ssd_decode_step<float, half, true, true>)
SSD_KERNEL("ssd_decode_step_f32_f16_vec_a1", ssd_decode_step<float, half, true, false>)
SSD_KERNEL("ssd_decode_step_f32_f16_strided_an", ssd_decode_step<float, half, false, true>)
SSD_KERNEL("ssd_decode_step_f32_f16_strided_a1", ssd_decode_step<float, half, false, false>)
SSD_KERNEL("ssd_decode_step_bf16_f32_vec_an", ssd_decode_step<bf16_t, float, true, true>)
SSD_KERNEL("ssd_decode_step_bf16_f32_vec_a1", ssd_decode_step<bf16_t, float, true, false>)
SSD_KERNEL("ssd_decode_step_bf16_f32_strided_an", ssd_decode_step<bf16_t, float, false, true>)
SSD_KERNEL("ssd_decode_step_bf16_f32_strided_a1", ssd_decode_step<bf16_t, float, false, false>)
SSD_KERNEL("ssd_decode_step_bf16_bf16_vec_an", ssd_decode_step<bf16_t, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_bf16_bf16_vec_a1", ssd_decode_step<bf16_t, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_bf16_bf16_strided_an", ssd_decode_step<bf16_t, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_bf16_bf16_strided_a1", ssd_decode_step<bf16_t, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_bf16_f16_vec_an", ssd_decode_step<bf16_t, half, true, true>)
SSD_KERNEL("ssd_decode_step_bf16_f16_vec_a1", ssd_decode_step<bf16_t, half, true, false>)
SSD_KERNEL("ssd_decode_step_bf16_f16_strided_an", ssd_decode_step<bf16_t, half, false, true>)
SSD_KERNEL("ssd_decode_step_bf16_f16_strided_a1", ssd_decode_step<bf16_t, half, false, false>)
SSD_KERNEL("ssd_decode_step_f16_f32_vec_an", ssd_decode_step<half, float, true, true>)
SSD_KERNEL("ssd_decode_step_f16_f32_vec_a1", ssd_decode_step<half, float, true, false>)
SSD_KERNEL("ssd_decode_step_f16_f32_strided_an", ssd_decode_step<half, float, false, true>)
SSD_KERNEL("ssd_decode_step_f16_f32_strided_a1", ssd_decode_step<half, float, false, false>)
SSD_KERNEL("ssd_decode_step_f16_bf16_vec_an", ssd_decode_step<half, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_f16_bf16_vec_a1", ssd_decode_step<half, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_f16_bf16_strided_an", ssd_decode_step<half, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_f16_bf16_strided_a1", ssd_decode_step<half, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_f16_f16_vec_an", ssd_decode_step<half, half, true, true>)
SSD_KERNEL("ssd_decode_step_f16_f16_vec_a1", ssd_decode_step<half, half, true, false>)
SSD_KERNEL("ssd_decode_step_f16_f16_strided_an", ssd_decode_step<half, half, false, true>)
SSD_KERNEL("ssd_decode_step_f16_f16_strided_a1", ssd_decode_step<half, half, false, false>)

SSD_KERNEL("ssd_load_state_f32_vec", ssd_load_state<float, true>)
SSD_KERNEL("ssd_load_state_f32_strided", ssd_load_state<float, false>)
SSD_KERNEL("ssd_load_state_bf16_vec", ssd_load_state<bf16_t, true>)
SSD_KERNEL("ssd_load_state_bf16_strided", ssd_load_state<bf16_t, false>)
SSD_KERNEL("ssd_load_state_f16_vec", ssd_load_state<half, true>)
SSD_KERNEL("ssd_load_state_f16_strided", ssd_load_state<half, false>)

SSD_KERNEL("ssd_widen_rows_f32_vec", ssd_widen_rows<float, true>)
SSD_KERNEL("ssd_widen_rows_f32_strided", ssd_widen_rows<float, false>)
SSD_KERNEL("ssd_widen_rows_bf16_vec", ssd_widen_rows<bf16_t, true>)
SSD_KERNEL("ssd_widen_rows_bf16_strided", ssd_widen_rows<bf16_t, false>)
SSD_KERNEL("ssd_widen_rows_f16_vec", ssd_widen_rows<half, true>)
SSD_KERNEL("ssd_widen_rows_f16_strided", ssd_widen_rows<half, false>)

SSD_KERNEL("ssd_store_state_f32_vec", ssd_store_state<float, true>)
SSD_KERNEL("ssd_store_state_f32_strided", ssd_store_state<float, false>)
SSD_KERNEL("ssd_store_state_bf16_vec", ssd_store_state<bf16_t, true>)
SSD_KERNEL("ssd_store_state_bf16_strided", ssd_store_state<bf16_t, false>)
SSD_KERNEL("ssd_store_state_f16_vec", ssd_store_state<half, true>)
SSD_KERNEL("ssd_store_state_f16_strided", ssd_store_state<half, false>)
