// Metal kernels for torch.ops.ssd on MPS: the fused decode step, the multi-token
// decode step (decode_step_multi / decode_step_varlen and their _out forms) and the
// loader verbs (load_state, load_bc, store_state). Compiled at run time by
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

// dtv = dt (+ dt_bias), then softplus if asked. `bias` is read only when has_bias.
inline float ssd_channel_dt(float dt, bool has_bias, float bias, bool softplus) {
  float v = dt;
  if (has_bias) v += bias;
  return softplus ? ssd_softplus(v) : v;
}

// The recurrence on one 4-chunk: s * dA + dt * x * B.
inline float4 ssd_advance4(float4 s, float4 dA, float dtx, float4 b) { return fma(s, dA, dtx * b); }

// One chunk's term of the y sum. Every kernel adds the chunks of a row in order
// along N, so all kernels and layouts give the same bits.
inline float4 ssd_accumulate_y4(float4 acc, float4 s, float4 c) { return fma(s, c, acc); }

// The lanes of a tail chunk past N are zeroed after each update, so they add
// nothing to y even where dA overflows (0 * inf would be NaN).
inline float4 ssd_zero_past(float4 s, int count) {
  for (int v = count; v < 4; ++v) s[v] = 0.0f;
  return s;
}

// y = sum_n s * C (a fixed tree over the four lanes of acc) + D * x, then * silu(z).
// Dv and zv are read only when has_D / has_z.
inline float ssd_finish_y(float4 acc, float xv, bool has_D, float Dv, bool has_z, float zv) {
  float yv = (acc.x + acc.y) + (acc.z + acc.w);
  if (has_D) yv = fma(Dv, xv, yv);
  if (has_z) yv *= zv / (1.0f + precise::exp(-zv));
  return yv;
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
      s[u] = ssd_advance4(s[u], dA[u], dtx, b[u]);
      acc = ssd_accumulate_y4(acc, s[u], c[u]);
    }
    if (store_back) {
      for (int u = 0; u < U; ++u) state_out.chunk(c0 + u, s[u]);
    }
  }

  // The last count < 4 elements.
  void tail(long c0, int count, thread float4& acc) const {
    float4 s = state_in.tail(c0, count);
    const float4 b = B_row.tail(c0, count);
    const float4 c = C_row.tail(c0, count);
    const float4 dA = kAPerN ? ssd_decay4(A_row.tail(c0, count), dtv) : float4(dA_splat);
    s = ssd_zero_past(ssd_advance4(s, dA, dtx, b), count);
    acc = ssd_accumulate_y4(acc, s, c);
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
  const float bias =
      a.has_dt_bias ? load_scalar(dt_bias, h * a.dt_bias_stride[0] + p * a.dt_bias_stride[1], int(a.dt_bias_dtype))
                    : 0.0f;
  ch.dtv = ssd_channel_dt(load_scalar(dt, t * a.dt_stride[0] + h * a.dt_stride[1] + p * a.dt_stride[2],
                                      int(a.dt_dtype)),
                          a.has_dt_bias != 0, bias, a.dt_softplus != 0);
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

  const float Dv = a.has_D ? load_scalar(D, h * a.D_stride[0] + p * a.D_stride[1], int(a.D_dtype)) : 0.0f;
  const float zv =
      a.has_z ? load_scalar(z, t * a.z_stride[0] + h * a.z_stride[1] + p * a.z_stride[2], int(a.z_dtype)) : 0.0f;
  store_scalar(y, y_at, int(a.y_dtype), ssd_finish_y(acc, xv, a.has_D != 0, Dv, a.has_z != 0, zv));
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
// Multi-token decode step (docs/multi_token.md): decode_step_multi(_out), K tokens
// per row, and decode_step_varlen(_out), rows of cu_seqlens over a flat token axis.
// The slot rules mirror csrc/step.h (multi_row_tokens, multi_source_slot,
// multi_dest_slot, multi_last_writer) line for line.
// ---------------------------------------------------------------------------

// "No slot": negative, so slot_addressable() is false for it whatever pad_slot_id is.
constant long kNoSlot = -1;

// A row's plan record: [first token, token count, source slot or kNoSlot] followed
// by plan_dst_cols written slots (see ssd_multi_plan).
enum { kPlanHead = 3 };

struct MultiPlanArgs {
  long T;
  long S;
  long pad_slot_id;
  long K;  // fixed form: tokens per row
  long L;  // varlen form: tokens on the flat axis
  long has_cu_seqlens;  // 1: the varlen form
  long cu_is_int64;
  long cu_stride;
  long has_src;
  long src_is_int64;
  long src_row_stride;
  long src_col_stride;
  long src_cols;  // W of a (T, W) slot_idx, 1 for (T,)
  long has_dst;   // the destination table: dst_slot_idx, or slot_idx when that is None
  long dst_is_int64;
  long dst_row_stride;
  long dst_col_stride;
  long dst_cols;
  long dst_per_token;  // a (T, W) table: column k belongs to token k
  long has_accepted;
  long accepted_is_int64;
  long accepted_stride;
  long write_state;
  long plan_dst_cols;  // dst_cols when per token, else 1
};

// The index tensors of one call, as bound.
struct MultiSlotTables {
  device const uchar* cu_seqlens;
  device const uchar* src;
  device const uchar* dst;
  device const uchar* accepted;
};

struct RowTokens {
  long first;
  long count;
};

inline long table_at(device const uchar* table, long is_int64, long row_stride, long col_stride, long t, long c) {
  return read_slot(table, is_int64, 1, t * row_stride + c * col_stride);
}

// Varlen rows whose bounds are not 0 <= bos <= eos <= L have no tokens.
inline RowTokens multi_row_tokens(constant MultiPlanArgs& a, MultiSlotTables m, long t) {
  if (!a.has_cu_seqlens) return RowTokens{t, a.K};
  const long bos = read_slot(m.cu_seqlens, a.cu_is_int64, a.cu_stride, t);
  const long eos = read_slot(m.cu_seqlens, a.cu_is_int64, a.cu_stride, t + 1);
  if (bos < 0 || bos > eos || eos > a.L) return RowTokens{0, 0};
  return RowTokens{bos, eos - bos};
}

// Column n - 1 of the source table with n = num_accepted_tokens[t] (n = 0 reads
// column 0); an n outside [0, W] makes the row a pad row.
inline long multi_source_slot(constant MultiPlanArgs& a, MultiSlotTables m, long t) {
  if (!a.has_src) return t;
  long col = 0;
  if (a.has_accepted) {
    const long n = read_slot(m.accepted, a.accepted_is_int64, a.accepted_stride, t);
    if (n < 0 || n > a.src_cols) return kNoSlot;
    col = n > 0 ? n - 1 : 0;
  }
  return table_at(m.src, a.src_is_int64, a.src_row_stride, a.src_col_stride, t, col);
}

// Where the state after token k of row t (of `count` tokens) goes: its own column
// of a per-token table, or the row's slot after the last token only.
inline long multi_dest_slot(constant MultiPlanArgs& a, MultiSlotTables m, long t, long k, long count) {
  if (!a.write_state) return kNoSlot;
  if (a.dst_per_token) {
    return k < a.dst_cols ? table_at(m.dst, a.dst_is_int64, a.dst_row_stride, a.dst_col_stride, t, k) : kNoSlot;
  }
  if (k != count - 1) return kNoSlot;
  return a.has_dst ? table_at(m.dst, a.dst_is_int64, a.dst_row_stride, a.dst_col_stride, t, 0) : t;
}

// Whether the write of token k of row t to `slot` happens: of the writes that share
// a slot the last one in (row, token) order wins; a pad row writes nothing. The
// caller has checked that row t's source slot is addressable.
inline bool multi_last_writer(constant MultiPlanArgs& a, MultiSlotTables m, long t, long k, long count, long slot) {
  if (!slot_addressable(slot, a.S, a.pad_slot_id)) return false;
  if (!a.has_dst) return true;  // one write per row, to slot t: no duplicates
  for (long u = t; u < a.T; ++u) {
    const RowTokens r = u == t ? RowTokens{0, count} : multi_row_tokens(a, m, u);
    if (r.count == 0) continue;
    if (u != t && !slot_addressable(multi_source_slot(a, m, u), a.S, a.pad_slot_id)) continue;
    const long begin = u == t ? k + 1 : (a.dst_per_token ? 0 : r.count - 1);
    const long end = a.dst_per_token && r.count > a.dst_cols ? a.dst_cols : r.count;
    for (long j = begin; j < end; ++j) {
      if (multi_dest_slot(a, m, u, j, r.count) == slot) return false;
    }
  }
  return true;
}

// One thread per row t writes its plan record: its tokens, its source slot
// (kNoSlot for a pad row or a row without tokens) and, per column j, the slot
// written -- token j's in per-token mode, the last token's (j = 0) otherwise -- or
// kNoSlot (no write: write_state off, a pad or out-of-pool destination, a later
// write to the same slot, or a token past the table).
kernel void ssd_multi_plan(device const uchar* cu_seqlens [[buffer(0)]],
                           device const uchar* src_idx [[buffer(1)]],
                           device const uchar* dst_idx [[buffer(2)]],
                           device const uchar* accepted [[buffer(3)]],
                           device long* plan [[buffer(4)]],
                           constant MultiPlanArgs& a [[buffer(5)]],
                           uint3 gid [[thread_position_in_grid]]) {
  const long t = long(gid.x);
  if (t >= a.T) return;
  MultiSlotTables m;
  m.cu_seqlens = cu_seqlens;
  m.src = src_idx;
  m.dst = dst_idx;
  m.accepted = accepted;
  const RowTokens r = multi_row_tokens(a, m, t);
  const long src = multi_source_slot(a, m, t);
  const bool live = r.count > 0 && slot_addressable(src, a.S, a.pad_slot_id);
  device long* record = plan + t * (kPlanHead + a.plan_dst_cols);
  record[0] = r.first;
  record[1] = r.count;
  record[2] = live ? src : kNoSlot;
  for (long j = 0; j < a.plan_dst_cols; ++j) {
    const long k = a.dst_per_token ? j : r.count - 1;
    long slot = kNoSlot;
    if (live && k < r.count) {
      slot = multi_dest_slot(a, m, t, k, r.count);
      if (!multi_last_writer(a, m, t, k, r.count, slot)) slot = kNoSlot;
    }
    record[kPlanHead + j] = slot;
  }
}

// Token-indexed operands (x, dt, z, B, C, y) are described by their strides at a
// row's token 0 -- (row, h, p) or (row, g, n), the single-step indexing -- plus one
// stride from a token to the next (*_tok): token k of a row whose first token is f
// sits at f * stride[0] + k * tok. The fixed form passes the (T, K, ...) tensors'
// strides without the K dim; the varlen form a row index on the flat axis.
struct MultiStepArgs {
  long S;
  long T;
  long H;
  long P;
  long N;
  long heads_per_group;
  long plan_dst_cols;
  long dst_per_token;
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
  long x_tok;
  long dt_tok;
  long B_tok;
  long C_tok;
  long z_tok;
  long y_tok;
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
};

// Tokens whose y sums a thread keeps in registers at once. A row with more tokens
// is done in blocks of this many; each block replays the earlier tokens from the
// source (the same arithmetic, so the same bits) instead of keeping all N of the
// state in registers.
enum { kTokensPerBlock = 8 };

// The channel scalars of one token (the single step's dtv, dt * x and broadcast dA).
struct TokenScalars {
  float dtv;
  float dtx;
  float dA_splat;
};

// The slot token k of a row writes (from its plan record), or kNoSlot.
inline long multi_planned_slot(constant MultiStepArgs& a, device const long* record, long k, long count) {
  if (a.dst_per_token) return k < a.plan_dst_cols ? record[kPlanHead + k] : kNoSlot;
  return k == count - 1 ? record[kPlanHead] : kNoSlot;
}

// A whole 4-chunk (kTail = false) or the tail chunk of the last rest < 4 elements.
template <bool kTail, typename T, bool kUnit>
inline float4 load_chunk(DstateReader<T, kUnit> r, long c, int rest) {
  return kTail ? r.tail(c, rest) : r.chunk(c);
}

template <bool kTail, typename T, bool kUnit>
inline void store_chunk(DstateWriter<T, kUnit> w, long c, int rest, float4 v) {
  if (kTail) {
    w.tail(c, rest, v);
  } else {
    w.chunk(c, v);
  }
}

// The tokens [k0, k0 + count) of a row whose y sums are kept in registers.
struct TokenBlock {
  long k0;
  int count;
  bool last;  // the row's last block
  TokenScalars scalars[kTokensPerBlock];
  long slot[kTokensPerBlock];  // where token k0 + k stores its state, or kNoSlot
  float4 acc[kTokensPerBlock];
};

// One channel (t, h, p) of a row: its source row, its token-indexed operands and
// per-channel scalars.
template <typename PoolT, typename RowT, bool kUnit, bool kAPerN>
struct MultiChannel {
  device PoolT* pool_hp;  // pool[0, h, p, 0]: slot s's row starts slot_stride * s later
  long slot_stride;
  long n_stride;
  long src;
  long writes_source;  // the token that writes the source slot, or kNoSlot
  DstateReader<PoolT, kUnit> state_in;
  DstateReader<RowT, kUnit> A_row;  // read only when kAPerN
  device const RowT* B_row0;  // B and C at the row's token 0, group g
  device const RowT* C_row0;
  device const uchar* x;
  device const uchar* dt;
  long first, h, p;
  float bias;     // dt_bias[h, p] when present
  bool splat;     // A broadcast along N (and N > 0): dA is one scalar per token
  float a_splat;  // A[h, p, 0] then
  int rest;       // N % 4

  TokenScalars scalars(constant MultiStepArgs& a, long k) const {
    TokenScalars s;
    const float dt_raw = load_scalar(
        dt, first * a.dt_stride[0] + k * a.dt_tok + h * a.dt_stride[1] + p * a.dt_stride[2], int(a.dt_dtype));
    s.dtv = ssd_channel_dt(dt_raw, a.has_dt_bias != 0, bias, a.dt_softplus != 0);
    const float xv =
        load_scalar(x, first * a.x_stride[0] + k * a.x_tok + h * a.x_stride[1] + p * a.x_stride[2], int(a.x_dtype));
    s.dtx = s.dtv * xv;
    s.dA_splat = splat ? ssd_decay(a_splat, s.dtv) : 0.0f;
    return s;
  }

  DstateReader<RowT, kUnit> token_row(device const RowT* row0, long tok, long stride, long k) const {
    DstateReader<RowT, kUnit> r;
    r.base = row0 + k * tok;
    r.stride = stride;
    return r;
  }

  DstateWriter<PoolT, kUnit> slot_row(long slot) const {
    DstateWriter<PoolT, kUnit> w;
    w.base = pool_hp + slot * slot_stride;
    w.stride = n_stride;
    return w;
  }

  // Chunk c through the tokens [0, blk.k0 + blk.count): the source chunk is loaded
  // first; the earlier blocks' tokens are replayed (advance only), the block's own
  // tokens add to their y sums and store.
  template <bool kTail>
  void chunk(constant MultiStepArgs& a, long c, thread TokenBlock& blk) const {
    float4 s = load_chunk<kTail>(state_in, c, rest);
    const float4 a_n = kAPerN ? load_chunk<kTail>(A_row, c, rest) : float4(0.0f);
    for (long j = 0; j < blk.k0; ++j) {
      const TokenScalars r = scalars(a, j);
      const float4 dA = kAPerN ? ssd_decay4(a_n, r.dtv) : float4(r.dA_splat);
      s = ssd_advance4(s, dA, r.dtx, load_chunk<kTail>(token_row(B_row0, a.B_tok, a.B_stride[2], j), c, rest));
      if (kTail) s = ssd_zero_past(s, rest);
      if (blk.last && j == writes_source) store_chunk<kTail>(slot_row(src), c, rest, s);
    }
    for (int k = 0; k < kTokensPerBlock; ++k) {
      if (k >= blk.count) break;
      const long tk = blk.k0 + k;
      const TokenScalars r = blk.scalars[k];
      const float4 dA = kAPerN ? ssd_decay4(a_n, r.dtv) : float4(r.dA_splat);
      s = ssd_advance4(s, dA, r.dtx, load_chunk<kTail>(token_row(B_row0, a.B_tok, a.B_stride[2], tk), c, rest));
      if (kTail) s = ssd_zero_past(s, rest);
      blk.acc[k] = ssd_accumulate_y4(blk.acc[k], s,
                                     load_chunk<kTail>(token_row(C_row0, a.C_tok, a.C_stride[2], tk), c, rest));
      if (blk.slot[k] >= 0) store_chunk<kTail>(slot_row(blk.slot[k]), c, rest, s);
    }
  }
};

// One thread per channel (t, h, p) of a row, gid = (p, h, t), as in ssd_decode_step:
// the same walk along N in 4-chunks and the same per-chunk arithmetic and y order, so
// on a float32 pool one call gives the bits of K single steps. Chunk-outer,
// token-inner: each source chunk is loaded once, advanced through the row's tokens in
// float32 registers, and each token's state is rounded once, on its store. A
// destination may be the row's own source slot (vLLM's tables): every chunk is loaded
// before any token stores to it, and in a row of several blocks the write to the
// source slot waits for the last block, whose replay passes that token again.
template <typename PoolT, typename RowT, bool kUnit, bool kAPerN>
kernel void ssd_decode_step_multi(device PoolT* pool [[buffer(0)]],
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
                                  constant MultiStepArgs& a [[buffer(11)]],
                                  uint3 gid [[thread_position_in_grid]]) {
  const long p = long(gid.x), h = long(gid.y), t = long(gid.z);
  if (p >= a.P || h >= a.H || t >= a.T) return;
  device const long* record = plan + t * (kPlanHead + a.plan_dst_cols);
  const long first = record[0], count = record[1], src = record[2];
  const long y_row = first * a.y_stride[0] + h * a.y_stride[1] + p * a.y_stride[2];
  if (src < 0) {  // a pad row (or a row without tokens): y = 0 for each of its tokens
    for (long k = 0; k < count; ++k) store_scalar(y, y_row + k * a.y_tok, int(a.y_dtype), 0.0f);
    return;
  }
  const long g = h / a.heads_per_group;

  MultiChannel<PoolT, RowT, kUnit, kAPerN> ch;
  ch.pool_hp = pool + h * a.pool_stride[1] + p * a.pool_stride[2];
  ch.slot_stride = a.pool_stride[0];
  ch.n_stride = a.pool_stride[3];
  ch.src = src;
  ch.state_in.base = ch.pool_hp + src * a.pool_stride[0];
  ch.state_in.stride = a.pool_stride[3];
  const long A_at = h * a.A_stride[0] + p * a.A_stride[1];
  ch.A_row.base = reinterpret_cast<device const RowT*>(A) + A_at;
  ch.A_row.stride = a.A_stride[2];
  ch.B_row0 = B + first * a.B_stride[0] + g * a.B_stride[1];
  ch.C_row0 = C + first * a.C_stride[0] + g * a.C_stride[1];
  ch.x = x;
  ch.dt = dt;
  ch.first = first;
  ch.h = h;
  ch.p = p;
  ch.bias = a.has_dt_bias
                ? load_scalar(dt_bias, h * a.dt_bias_stride[0] + p * a.dt_bias_stride[1], int(a.dt_bias_dtype))
                : 0.0f;
  ch.splat = !kAPerN && a.N > 0;
  ch.a_splat = ch.splat ? load_scalar(A, A_at, int(a.A_dtype)) : 0.0f;
  const long full = a.N / 4;
  ch.rest = int(a.N - full * 4);
  // The last-writer rule leaves at most one token writing the source slot. Only a
  // row of several blocks has to hold that write back.
  ch.writes_source = kNoSlot;
  if (count > kTokensPerBlock) {
    for (long k = 0; k < count; ++k) {
      if (multi_planned_slot(a, record, k, count) == src) ch.writes_source = k;
    }
  }
  const float Dv = a.has_D ? load_scalar(D, h * a.D_stride[0] + p * a.D_stride[1], int(a.D_dtype)) : 0.0f;

  TokenBlock blk;
  for (blk.k0 = 0; blk.k0 < count; blk.k0 += kTokensPerBlock) {
    const long remaining = count - blk.k0;
    blk.count = int(remaining < long(kTokensPerBlock) ? remaining : long(kTokensPerBlock));
    blk.last = blk.k0 + blk.count == count;
    for (int k = 0; k < blk.count; ++k) {
      const long tk = blk.k0 + k;
      blk.scalars[k] = ch.scalars(a, tk);
      blk.slot[k] = blk.last || tk != ch.writes_source ? multi_planned_slot(a, record, tk, count) : kNoSlot;
      blk.acc[k] = float4(0.0f);
    }
    for (long c = 0; c < full; ++c) ch.template chunk<false>(a, c, blk);
    if (ch.rest > 0) ch.template chunk<true>(a, full, blk);

    for (int k = 0; k < blk.count; ++k) {
      const long tk = blk.k0 + k;
      const float xv =
          load_scalar(x, first * a.x_stride[0] + tk * a.x_tok + h * a.x_stride[1] + p * a.x_stride[2], int(a.x_dtype));
      const float zv =
          a.has_z ? load_scalar(z, first * a.z_stride[0] + tk * a.z_tok + h * a.z_stride[1] + p * a.z_stride[2],
                                int(a.z_dtype))
                  : 0.0f;
      store_scalar(y, y_row + tk * a.y_tok, int(a.y_dtype),
                   ssd_finish_y(blk.acc[k], xv, a.has_D != 0, Dv, a.has_z != 0, zv));
    }
  }
}

// ---------------------------------------------------------------------------
// Instantiations: one per dtype combination and layout path. Name parts of
// ssd_decode_step[_multi]_<pool>_<row>_<layout>_<A>:
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

SSD_KERNEL("ssd_decode_step_multi_f32_f32_vec_an", ssd_decode_step_multi<float, float, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_f32_vec_a1", ssd_decode_step_multi<float, float, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f32_f32_strided_an", ssd_decode_step_multi<float, float, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_f32_strided_a1", ssd_decode_step_multi<float, float, false, false>)
SSD_KERNEL("ssd_decode_step_multi_f32_bf16_vec_an", ssd_decode_step_multi<float, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_bf16_vec_a1", ssd_decode_step_multi<float, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f32_bf16_strided_an", ssd_decode_step_multi<float, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_bf16_strided_a1", ssd_decode_step_multi<float, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_multi_f32_f16_vec_an", ssd_decode_step_multi<float, half, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_f16_vec_a1", ssd_decode_step_multi<float, half, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f32_f16_strided_an", ssd_decode_step_multi<float, half, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f32_f16_strided_a1", ssd_decode_step_multi<float, half, false, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f32_vec_an", ssd_decode_step_multi<bf16_t, float, true, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f32_vec_a1", ssd_decode_step_multi<bf16_t, float, true, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f32_strided_an", ssd_decode_step_multi<bf16_t, float, false, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f32_strided_a1", ssd_decode_step_multi<bf16_t, float, false, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_bf16_vec_an", ssd_decode_step_multi<bf16_t, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_bf16_vec_a1", ssd_decode_step_multi<bf16_t, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_bf16_strided_an", ssd_decode_step_multi<bf16_t, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_bf16_strided_a1", ssd_decode_step_multi<bf16_t, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f16_vec_an", ssd_decode_step_multi<bf16_t, half, true, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f16_vec_a1", ssd_decode_step_multi<bf16_t, half, true, false>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f16_strided_an", ssd_decode_step_multi<bf16_t, half, false, true>)
SSD_KERNEL("ssd_decode_step_multi_bf16_f16_strided_a1", ssd_decode_step_multi<bf16_t, half, false, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_f32_vec_an", ssd_decode_step_multi<half, float, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_f32_vec_a1", ssd_decode_step_multi<half, float, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_f32_strided_an", ssd_decode_step_multi<half, float, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_f32_strided_a1", ssd_decode_step_multi<half, float, false, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_bf16_vec_an", ssd_decode_step_multi<half, bf16_t, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_bf16_vec_a1", ssd_decode_step_multi<half, bf16_t, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_bf16_strided_an", ssd_decode_step_multi<half, bf16_t, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_bf16_strided_a1", ssd_decode_step_multi<half, bf16_t, false, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_f16_vec_an", ssd_decode_step_multi<half, half, true, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_f16_vec_a1", ssd_decode_step_multi<half, half, true, false>)
SSD_KERNEL("ssd_decode_step_multi_f16_f16_strided_an", ssd_decode_step_multi<half, half, false, true>)
SSD_KERNEL("ssd_decode_step_multi_f16_f16_strided_a1", ssd_decode_step_multi<half, half, false, false>)

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
