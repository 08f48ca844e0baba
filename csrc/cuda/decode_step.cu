// The fused decode step on CUDA (DESIGN.md sections 2, 3, 5, 6).
//
// Three kernels, one result. decode_step_lean (the serving engines' case, the
// default wherever it applies): one warp per tile of rows, B and C read straight
// into registers, nothing but the step's own work per row. decode_step_kernel
// (every other layout: strided rows, a tail along N, A per element): one block per
// (row t, head h, block of head-dim rows p); each thread owns one p row -- its
// per-channel scalars (dt, x, the decay) are computed once -- and a few chunks of it
// along N (the RowMap of common.cuh), whose 16-byte loads are all issued before the
// first is used; B and C of (t, group) are widened once per block into shared
// memory. decode_step_pipelined (16-bit pools where the lean one does not apply): a
// resident grid walks the same tiles, with the next tile's rows in flight while the
// current one is computed. All share the thread mapping and the per-row sum over N
// -- each lane's chunks in turn, then a shuffle tree over the row's lanes -- with the
// scalar gather path, so every layout and every kernel give the same bits.
#include <algorithm>
#include <cstdlib>

#include "common.cuh"

namespace ssd {
namespace cuda {
namespace {

// What the launch decided on the host, passed by value.
struct StepLaunch {
  RowMap map;
  int rows_per_block = 0;  // warps * rows_per_warp
  uint32_t p_blocks = 0;   // blocks per (t, h)
  uint32_t heads = 0, heads_per_group = 0;
  int smem_n = 0;          // B / C floats in shared memory: N rounded up to whole chunks
};

// kStage (vector path only): whole chunks are staged into shared memory with
// cp.async instead of being loaded into registers; the arithmetic is the same.
template <typename PoolT, bool kUnit, bool kAPerN, bool kStage>
__global__ void __launch_bounds__(kMaxThreads)
    decode_step_kernel(const __grid_constant__ StepParams s, const StepLaunch L) {
  static_assert(kUnit || !kStage, "staging needs the vector path");
  constexpr int VEC = vec_of<PoolT>();
  constexpr int KB = step_chunks_per_batch<PoolT>();
  extern __shared__ float4 smem_vec[];  // float4: 16-byte aligned chunks
  float* Bs = reinterpret_cast<float*>(smem_vec);
  float* Cs = Bs + L.smem_n;
  // This thread's staging slots, chunk-major (slot j of thread i at j * blockDim + i:
  // a warp's 16-byte accesses are contiguous, free of bank conflicts).
  uint4* stage = reinterpret_cast<uint4*>(Cs + L.smem_n) + threadIdx.x;

  const RowMap& m = L.map;
  // 32-bit index arithmetic (the host checked that the grid fits): a 64-bit
  // division is a long software sequence on the path to the first load.
  const uint32_t pb = blockIdx.x % L.p_blocks;
  const uint32_t th = blockIdx.x / L.p_blocks;
  const int64_t h = th % L.heads, t = th / L.heads;
  const int64_t g = static_cast<uint32_t>(h) / L.heads_per_group;

  const int li = threadIdx.x & (m.lanes - 1);  // lane within the row
  const int64_t p = static_cast<int64_t>(pb) * L.rows_per_block + (threadIdx.x >> m.lanes_log2);
  const bool valid = p < s.P;
  const int64_t pc = valid ? p : 0;  // a readable p for the per-channel loads
  const int64_t y_off = t * s.y_stride[0] + h * s.y_stride[1] + pc * s.y_stride[2];

  const int64_t src = s.src.slot(t, t);
  if (!slot_addressable(src, s.S, s.pad_slot_id)) {  // pad row: y = 0, the pool untouched
    if (li == 0 && valid) store_scalar(s.y, y_off, s.y_dtype, 0.0f);
    return;  // the whole block leaves: no barrier is left waiting
  }
  const int64_t dst = s.dst.slot(t, t);
  PoolT* pool = static_cast<PoolT*>(s.pool);
  const DstateRow<VEC, kUnit, const PoolT> in{pool + s.pool_offset(src, h, pc), s.pool_stride[3]};
  const DstateRow<VEC, kUnit, PoolT> out{pool + s.pool_offset(dst, h, pc), s.pool_stride[3]};

  // Chunk j of a batch starting at k0 is chunk (k0 + j) * lanes + li of the row.
  // A batch whose chunks are all whole (every batch when N is a multiple of
  // lanes * VEC * KB) takes a branch-free path: its loads are all
  // in flight before the first use. Both paths do the same arithmetic.
  auto whole_batch = [&](int k0) {
    return k0 + KB <= m.chunks_per_lane && (k0 + KB - 1) * m.lanes + li < m.nfull;
  };
  float st[KB][VEC];
  auto load_batch = [&](int k0) {
    if (!valid) return;
    if (whole_batch(k0)) {
#pragma unroll
      for (int j = 0; j < KB; ++j) in.load((k0 + j) * m.lanes + li, st[j]);
      return;
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = (k0 + j) * m.lanes + li;
      if (k0 + j >= m.chunks_per_lane) continue;
      if (c < m.nfull) in.load(c, st[j]);
      else if (c == m.nfull && m.rest > 0) in.load_tail(c, m.rest, st[j]);
    }
  };
  // Staged: issue the whole chunks of a batch (the tail, if any, is read later).
  auto stage_batch = [&](int k0) {
    if (!valid) return;
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = (k0 + j) * m.lanes + li;
      if (k0 + j < m.chunks_per_lane && c < m.nfull)
        stage_unit_async<VEC>(in.base + static_cast<int64_t>(c) * VEC, stage + j * blockDim.x);
    }
    stage_commit();
  };
  if constexpr (kStage) stage_batch(0);  // issued before anything else is waited on
  else load_batch(0);

  // B and C of (t, g), widened once for the block; zero past N.
  for (int i = threadIdx.x; i < L.smem_n; i += blockDim.x) {
    Bs[i] = i < m.n ? s.B.at(t, g, i) : 0.0f;
    Cs[i] = i < m.n ? s.C.at(t, g, i) : 0.0f;
  }
  // Per-channel scalars; a stride-0 A is a splat: one decay per channel.
  const float dtv = channel_dt(s, t, h, pc);
  const float xv = s.x.at(t, h, pc);
  const float dtx = dtv * xv;
  float dA_splat = 0.0f;
  if constexpr (!kAPerN) {
    if (m.n > 0) dA_splat = decay(s.A.at(h, pc), dtv);  // N = 0: A is empty, y = D * x only
  }
  // Every lane of the warp takes part in the vote, whether or not its row exists.
  const bool last = warp_last_writer(s.dst, s.src, true, s.T, s.S, s.pad_slot_id, t, dst);
  const bool write = valid && last;
  __syncthreads();

  float acc = 0.0f;
  // One chunk: count = VEC for a whole chunk, m.rest for the tail.
  auto step_chunk = [&](int c, int count, bool whole, float(&r)[VEC]) {
    float b[VEC], cc[VEC];
    bc_chunk(Bs, Cs, c, b, cc);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if (!whole && v >= count) break;  // the tail: only its real elements
      float dA;
      if constexpr (kAPerN) dA = decay(s.A.at(h, pc, static_cast<int64_t>(c) * VEC + v), dtv);
      else dA = dA_splat;
      r[v] = advance(r[v], dA, dtx, b[v]);
      acc = accumulate_y(acc, r[v], cc[v]);
    }
    if (write) {
      if (whole) out.store(c, r);
      else out.store_tail(c, count, r);
    }
  };

#pragma unroll 1
  for (int k0 = 0; valid;) {
    if constexpr (kStage) {
      stage_wait_all();
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int c = (k0 + j) * m.lanes + li;
        if (k0 + j >= m.chunks_per_lane) break;
        float r[VEC];
        if (c < m.nfull) {
          load_staged<VEC, PoolT>(stage + j * blockDim.x, r);
          step_chunk(c, VEC, true, r);
        } else if (c == m.nfull && m.rest > 0) {
          in.load_tail(c, m.rest, r);
          step_chunk(c, m.rest, false, r);
        }
      }
      k0 += KB;
      if (k0 >= m.chunks_per_lane) break;
      stage_batch(k0);  // this thread's slots: it has read them already
      continue;
    }
    if (whole_batch(k0)) {
#pragma unroll
      for (int j = 0; j < KB; ++j) step_chunk((k0 + j) * m.lanes + li, VEC, true, st[j]);
    } else {
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int c = (k0 + j) * m.lanes + li;
        if (k0 + j >= m.chunks_per_lane) continue;
        if (c < m.nfull) step_chunk(c, VEC, true, st[j]);
        else if (c == m.nfull && m.rest > 0) step_chunk(c, m.rest, false, st[j]);
      }
    }
    k0 += KB;
    if (k0 >= m.chunks_per_lane) break;
    load_batch(k0);
  }

  const float sum = row_sum(acc, m.lanes);
  if (li == 0 && valid) store_scalar(s.y, y_off, s.y_dtype, finish_y(s, sum, t, h, pc, xv));
}

// ---------------------------------------------------------------------------
// The pipelined kernel: the common case (unit-stride rows, whole chunks split
// evenly over a row's lanes, A broadcast along N) at large and medium T.
//
// decode_step_kernel gives each block one tile and lets it exit: every block waits
// out a slot-index load, then the row loads, then computes and stores, so an SM
// holds far fewer bytes in flight on average than its resident blocks could. Here a
// grid of a few blocks per multiprocessor walks the work items (t, h, tile of rows
// along P) with a stride of gridDim.x, and while a block computes item i the pool
// rows of item i + 1 are already on their way into shared memory (cp.async), with
// that item's slot indices, B, C and per-channel inputs in registers: the memory
// system always has the next item's bytes in flight, as in a copy.
// Thread mapping along N, arithmetic and reduction order are decode_step_kernel's,
// so both kernels give the same bits.
// ---------------------------------------------------------------------------

constexpr int kMaxBCPerThread = 4;  // B and C elements a thread widens per item

struct PipeLaunch {
  RowMap map;
  int rows_per_item = 0;  // threads / lanes
  int bc_per_thread = 0;  // ceil(N / threads) <= kMaxBCPerThread
  uint32_t p_tiles = 0;   // items per (t, h)
  uint32_t heads = 0, heads_per_group = 0;
  uint32_t items = 0;
};

// Where one work item lies, as one thread sees it.
struct PipeItem {
  int64_t t = 0, h = 0, g = 0, p = 0;  // p: this thread's row, clamped to a readable one
  bool row_valid = false;
};

// kStages stages of pool rows in shared memory: while item i is computed, the
// rows of the next kStages - 1 items are in flight. The schedule, per iteration
// (item i; "+k" = the item k strides ahead):
//   issue the rows of +(kStages-1) (its source slot was loaded a round earlier)
//   load the source slot of +kStages, B and C of +(kStages-1), the channel
//     inputs and destination slot of +1      -- all into registers, no waiting
//   wait for the rows of item i, compute and store it
//   decide whether +1 writes (a warp vote over later rows' slots)
//   publish B and C of +(kStages-1) to shared memory; barrier
// so no load is waited on in the iteration that issues it.
template <typename PoolT, int kStages>
__global__ void __launch_bounds__(kMaxThreads)
    decode_step_pipelined(const __grid_constant__ StepParams s, const PipeLaunch L) {
  constexpr int VEC = vec_of<PoolT>();
  constexpr int KB = step_chunks_per_batch<PoolT>();  // >= chunks per lane (make_row_map)
  const RowMap& m = L.map;
  const int cpl = m.chunks_per_lane;
  const int threads = blockDim.x;
  // Shared memory: kStages stages of 16-byte chunk slots (slot k of thread i at
  // k * threads + i: a warp's accesses are contiguous, free of bank conflicts),
  // then kStages stages of widened B and C.
  extern __shared__ float4 smem_vec[];
  uint4* chunks = reinterpret_cast<uint4*>(smem_vec);
  float* bc = reinterpret_cast<float*>(chunks + kStages * KB * threads);
  auto chunk_slot = [&](int stage, int k) { return chunks + (stage * KB + k) * threads + threadIdx.x; };
  auto b_of = [&](int stage) { return bc + stage * 2 * m.n; };

  const int li = threadIdx.x & (m.lanes - 1);
  const int row = threadIdx.x >> m.lanes_log2;
  PoolT* pool = static_cast<PoolT*>(s.pool);
  const uint32_t stride = gridDim.x;

  auto item_at = [&](uint32_t i) {
    PipeItem it;
    const uint32_t pt = i % L.p_tiles, th = i / L.p_tiles;
    const uint32_t h = th % L.heads;
    it.t = th / L.heads;
    it.h = h;
    it.g = h / L.heads_per_group;
    const int64_t p = static_cast<int64_t>(pt) * L.rows_per_item + row;
    it.row_valid = p < s.P;
    it.p = it.row_valid ? p : 0;
    return it;
  };
  // Source / destination slot of item i's row t (-1 past the last item).
  auto slot_of = [&](const SlotRef& slots, uint32_t i) {
    if (i >= L.items) return int64_t{-1};
    const int64_t t = i / L.p_tiles / L.heads;
    return slots.slot(t, t);
  };
  auto src_of = [&](uint32_t i) { return slot_of(s.src, i); };
  auto dst_of = [&](uint32_t i) { return slot_of(s.dst, i); };
  // The rows of item i into `stage` (nothing for a pad row or past the end); one
  // commit group per call, empty or not, so the wait below counts groups exactly.
  auto issue_rows = [&](uint32_t i, int64_t src, int stage) {
    if (i < L.items && slot_addressable(src, s.S, s.pad_slot_id)) {
      const PipeItem it = item_at(i);
      if (it.row_valid) {
        const PoolT* row_in = pool + s.pool_offset(src, it.h, it.p);
#pragma unroll
        for (int k = 0; k < KB; ++k)
          if (k < cpl)
            stage_unit_async<VEC>(row_in + static_cast<int64_t>(k * m.lanes + li) * VEC, chunk_slot(stage, k));
      }
    }
    stage_commit();
  };
  float bc_regs[2 * kMaxBCPerThread];
  auto load_bc = [&](uint32_t i) {
    if (i >= L.items) return;
    const PipeItem it = item_at(i);
#pragma unroll
    for (int j = 0; j < kMaxBCPerThread; ++j) {
      const int n = threadIdx.x + j * threads;
      if (j < L.bc_per_thread && n < m.n) {
        bc_regs[2 * j] = s.B.at(it.t, it.g, n);
        bc_regs[2 * j + 1] = s.C.at(it.t, it.g, n);
      }
    }
  };
  auto publish_bc = [&](int stage) {
    float* Bs = b_of(stage);
#pragma unroll
    for (int j = 0; j < kMaxBCPerThread; ++j) {
      const int n = threadIdx.x + j * threads;
      if (j < L.bc_per_thread && n < m.n) {
        Bs[n] = bc_regs[2 * j];
        Bs[m.n + n] = bc_regs[2 * j + 1];
      }
    }
  };
  // Whether this thread's row of item i (destination dst) stores its state. Every
  // lane of the warp votes, whether or not its row exists.
  auto decide_write = [&](uint32_t i, int64_t dst) {
    if (i >= L.items) return false;
    const PipeItem it = item_at(i);
    const bool last = warp_last_writer(s.dst, s.src, true, s.T, s.S, s.pad_slot_id, it.t, dst);
    return it.row_valid && last;
  };

  uint32_t i = blockIdx.x;
  if (i >= L.items) return;

  // Prologue: rows of items +0 .. +(kStages-2) in flight, B and C of those in
  // shared memory, channel inputs, destination and write decision of item +0.
  uint32_t pad_bits = 0;  // bit k: item +k has no addressable source slot
#pragma unroll
  for (int k = 0; k + 1 < kStages; ++k) {
    const uint32_t ik = i + k * stride;
    const int64_t src = src_of(ik);
    if (!slot_addressable(src, s.S, s.pad_slot_id)) pad_bits |= 1u << k;
    issue_rows(ik, src, k);
    load_bc(ik);
    publish_bc(k);
  }
  int64_t src_ahead = src_of(i + (kStages - 1) * stride);
  const PipeItem first = item_at(i);
  ChannelInputs in_cur = load_channel(s, first.t, first.h, first.p);
  int64_t dst_cur = dst_of(i);
  bool write_cur = decide_write(i, dst_cur);
  __syncthreads();

#pragma unroll 1
  for (int stage = 0;; stage = stage + 1 == kStages ? 0 : stage + 1) {
    const int far_stage = stage == 0 ? kStages - 1 : stage - 1;  // (stage + kStages - 1) % kStages
    const uint32_t far = i + (kStages - 1) * stride;
    if (!slot_addressable(src_ahead, s.S, s.pad_slot_id)) pad_bits |= 1u << (kStages - 1);
    issue_rows(far, src_ahead, far_stage);
    src_ahead = src_of(far + stride);
    load_bc(far);
    const uint32_t ni = i + stride;
    ChannelInputs in_next;
    if (ni < L.items) {
      const PipeItem nit = item_at(ni);
      in_next = load_channel(s, nit.t, nit.h, nit.p);
    }
    const int64_t dst_next = dst_of(ni);
    stage_wait_prior<kStages - 1>();  // item i's rows have landed; the later items' may not have

    // Compute item i.
    const PipeItem cur = item_at(i);
    const int64_t y_off = cur.t * s.y_stride[0] + cur.h * s.y_stride[1] + cur.p * s.y_stride[2];
    if (pad_bits & 1u) {
      if (li == 0 && cur.row_valid) store_scalar(s.y, y_off, s.y_dtype, 0.0f);
    } else {
      const float dtv = channel_dt(s, in_cur);
      const float dtx = dtv * in_cur.x;
      const float dA = decay(s.A.at(cur.h, cur.p), dtv);
      const float* Bs = b_of(stage);
      const float* Cs = Bs + m.n;
      const DstateRow<VEC, true, PoolT> out{pool + s.pool_offset(dst_cur, cur.h, cur.p), 1};
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < KB; ++k) {
        if (k >= cpl) break;
        const int c = k * m.lanes + li;
        float r[VEC];
        load_staged<VEC, PoolT>(chunk_slot(stage, k), r);
        float b[VEC], cc[VEC];
        bc_chunk(Bs, Cs, c, b, cc);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          r[v] = advance(r[v], dA, dtx, b[v]);
          acc = accumulate_y(acc, r[v], cc[v]);
        }
        if (write_cur) out.store(c, r);
      }
      const float sum = row_sum(acc, m.lanes);
      if (li == 0 && cur.row_valid) store_scalar(s.y, y_off, s.y_dtype, finish_y(s, sum, in_cur));
    }
    if (ni >= L.items) break;
    write_cur = decide_write(ni, dst_next) && !(pad_bits & 2u);
    publish_bc(far_stage);
    __syncthreads();  // B and C of `far` visible; this stage free to be refilled
    i = ni;
    pad_bits >>= 1;
    in_cur = in_next;
    dst_cur = dst_next;
  }
}

// ---------------------------------------------------------------------------
// The lean kernel: the serving engines' case -- unit-stride rows that split evenly
// over a row's lanes (4 or 8 chunks each), A broadcast along N, B and C unit-stride
// along N, and x, z, dt, B, C (and so y) of one type, bfloat16 or float32 -- with
// little but the step's own work per row. One tile of rows per block, as in
// decode_step_kernel, but:
//   * B and C chunks go straight from global memory into registers (vector loads
//     through L1, where the block's other rows find them), widened once per thread
//     where it has two or four rows; no block barrier, so a block may be a single
//     warp and start its row loads as soon as the slot index is in (four rows in a
//     one-warp block: B and C widened once by the warp into shared memory, which
//     measured faster than holding them in 64 registers);
//   * the state is held as loaded (raw 16-bit chunks take half the registers of
//     widened ones); with one or two rows per thread every row is computed before
//     anything is stored (no store between the loads lets the compiler hoist them
//     all), four are streamed (the next row's loads in flight while one is computed);
//   * the grid is (head, row t, tile along P): no index division;
//   * a thread may own kRows rows of the tile (rows_per_pass apart): more bytes in
//     flight per thread, and the per-row scalar pass serving more rows;
//   * the per-row scalars are computed by one lane per row and shuffled to the
//     row's lanes (see the kernel), and y is stored by those lanes, coalesced;
//   * programmatic dependent launch on sm_90: back-to-back steps overlap their
//     launch gaps; where the whole grid is resident at once, the state rows are
//     fetched into L2 before the wait (see the kernel);
//   * 16-bit pools at N = 128: compiled with a row's lanes fixed (kLanes, see
//     launch_lean), chunk offsets, the y tree and the row arithmetic constants.
// Mapping along N, per-element arithmetic and reduction order are
// decode_step_kernel's: the same bits (tests/test_cuda.py checks every choice).
// ---------------------------------------------------------------------------

struct LeanLaunch {
  RowMap map;
  int rows_per_pass = 0;  // rows the block covers at once: warps * rows_per_warp
  uint32_t heads_per_group = 1;
  bool prefetch = false;  // warm L2 with the state rows before the wait (pick_prefetch)
  bool tiles_inner = false;  // grid (tiles, H, T) instead of (H, T, tiles) (pick_lean_order)
  uint8_t touch_params = 0;  // read every line of the parameters first: bit 0 indexed, bit 1 operands
  uint8_t speculate = 0;  // rows loaded from the slot index read before the wait (pick_speculate): 1;
                         // 2: from the slot after it (a wrong guess: tests the reload)
};

// The lean kernel's per-channel inputs of (t, h, p) in two steps: every load issued
// (load_channel_bits: x, dt, z in the inputs' type InT, dt_bias, D and A as bits; a
// missing z reads x's element again and is dropped), the state rows' loads issued after
// them, and only then the conversions (channel_inputs). A conversion next to its load
// inside a branch (load_scalar's switch, `if (z present)`) made the warp wait for each
// load in turn, and the rows' loads went out after all of them.
template <typename InT>
struct ChannelBits {
  InT x, dt, z;
  uint32_t dt_bias, D, A;
};
template <typename InT>
__device__ __forceinline__ ChannelBits<InT> load_channel_bits(const StepParams& s, int64_t t, int64_t h, int64_t p) {
  auto at = [&](const OperandRef& o) {
    return static_cast<const InT*>(o.data) + (t * o.stride[0] + h * o.stride[1] + p * o.stride[2]);
  };
  const InT* x = at(s.x);
  const InT* z = s.z.present() ? at(s.z) : x;
  return {*x, *at(s.dt), *z, scalar_bits(s.dt_bias, h, p), scalar_bits(s.D, h, p), scalar_bits(s.A, h, p)};
}
template <typename InT>
__device__ __forceinline__ ChannelInputs channel_inputs(const StepParams& s, const ChannelBits<InT>& b, float* a) {
  ChannelInputs in;
  in.x = widen(b.x);
  in.dt = widen(b.dt);
  in.z = s.z.present() ? widen(b.z) : 0.0f;
  in.dt_bias = scalar_value(b.dt_bias, s.dt_bias.dtype);
  in.D = scalar_value(b.D, s.D.dtype);
  *a = scalar_value(b.A, s.A.dtype);
  return in;
}

// InT: the type of x, z, dt, B, C and y (one type: the host checked).
// Rows: a warp covers kRows * rows_per_warp (<= 32, host-checked) rows of its tile;
// this thread's row r is row q = r * rows_per_warp + (lane / lanes) of the warp. The
// per-row scalars (the per-channel loads, softplus, the decay, y) are computed once
// per row, by lane q of the warp, and shuffled to the row's lanes: one pass of that
// work serves up to 32 rows instead of each of a row's lanes repeating it.
// Four rows per thread are streamed (see below); fewer are held at once. Registers:
// at most 64 where a thread holds up to 32 state elements at once, else 128.
template <int kRows>
constexpr bool lean_streams() {
  return kRows > 2;
}

template <typename PoolT, int kRows, int KB>
constexpr int lean_min_blocks() {
  return !lean_streams<kRows>() && kRows * KB * vec_of<PoolT>() <= 32 ? 4 : 2;
}

// Whether a thread's B and C chunks are held widened across its rows: with more
// than one row, in a kernel of 128 registers, where they take at most 64 of them.
template <typename PoolT, int kRows, int KB>
constexpr bool lean_holds_bc() {
  return kRows > 1 && lean_min_blocks<PoolT, kRows, KB>() == 2 && KB * vec_of<PoolT>() <= 32;
}

// kSharedBC (one warp per block): B and C widened once by the warp into shared
// memory instead of held in registers (lean_holds_bc); 128 registers either way.
// (Bounded for 20 or 24 resident blocks per multiprocessor instead of 16: 96 / 80
// registers, 56-72 bytes spilled, 7-10 points of copy bandwidth lost on an H200 at
// T >= 64; BENCHMARKS.md, eighth session.)
// kLanes: a row's lanes fixed at compile time (kFixedLanes; 0: map.lanes at run time).
template <typename PoolT, typename InT, int kRows, int KB, bool kSharedBC = false, int kLanes = 0>
__global__ void __launch_bounds__(kSharedBC ? kWarp : kMaxThreads,
                                  kSharedBC ? 16 : lean_min_blocks<PoolT, kRows, KB>())
    decode_step_lean(const __grid_constant__ StepParams s, const LeanLaunch L) {
  constexpr int VEC = vec_of<PoolT>();
  constexpr bool kStream = lean_streams<kRows>();
  constexpr bool kHoldBC = lean_holds_bc<PoolT, kRows, KB>() && !kSharedBC;
  // KB: the chunks per lane of the row map (host-checked), a compile-time count.
  const RowMap& m = L.map;
  static_assert(kLanes >= 0 && kLanes <= kWarp && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two");
  const int lanes = kLanes ? kLanes : m.lanes;
  const int lanes_log2 = kLanes ? log2_of(kLanes) : m.lanes_log2;
  const LeanBlock at = lean_block(L.tiles_inner);
  const uint32_t h = at.h, t = at.row, tile = at.tile;
  const uint32_t g = h / L.heads_per_group;
  const int lane = threadIdx.x & (kWarp - 1);
  const int li = lane & (lanes - 1);
  const int rpw_log2 = 5 - lanes_log2;  // rows per warp and pass: 32 / lanes
  const int warp_rows = kRows << rpw_log2;
  const int64_t warp_base = static_cast<int64_t>(tile) * (kRows * L.rows_per_pass) +
                            (static_cast<int64_t>(threadIdx.x >> 5) << rpw_log2);
  auto p_of = [&](int q) {  // row q of this warp
    return warp_base + static_cast<int64_t>(q >> rpw_log2) * L.rows_per_pass + (q & ((1 << rpw_log2) - 1));
  };
  auto y_at = [&](int64_t p) {
    return static_cast<InT*>(s.y) + (t * s.y_stride[0] + h * s.y_stride[1] + p * s.y_stride[2]);
  };

  // Which rows this thread computes, and which row's scalars this lane owns (lanes
  // past the warp's rows repeat some).
  const int q_own = lane & (warp_rows - 1);
  const int64_t p_own_any = p_of(q_own);
  const bool own_valid = lane < warp_rows && p_own_any < s.P;
  const int64_t p_own = p_own_any < s.P ? p_own_any : 0;  // a readable row for the loads
  // This thread's rows: p_first, then rows_per_pass apart (p_of); row r of slot
  // `slot` starts r row steps after row p_first (addressed only where it exists).
  const int64_t p_first = p_of(lane >> lanes_log2);
  bool valid[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) valid[r] = p_first + static_cast<int64_t>(r) * L.rows_per_pass < s.P;
  const int64_t row_step = static_cast<int64_t>(L.rows_per_pass) * s.pool_stride[2];
  PoolT* pool = static_cast<PoolT*>(s.pool);
  const InT* b_row = static_cast<const InT*>(s.B.data) + t * s.B.stride[0] + g * s.B.stride[1];
  const InT* c_row = static_cast<const InT*>(s.C.data) + t * s.C.stride[0] + g * s.C.stride[1];

  // While the previous kernel finishes, the rows of the pool this warp will read
  // are fetched into L2 from the slot index as it reads now (one bulk prefetch per
  // row, by the row's owner lane); after the wait the real loads find them there.
  // At T = 1 a step is one chain of dependent latencies (slot index, state rows, the
  // previous step's end); this takes the state's DRAM latency out of it. Only when
  // the whole grid is resident at once (L.prefetch): in a larger grid most blocks
  // start after the previous kernel has ended, and the prefetches only add requests
  // (measured 1-5 points of copy bandwidth lost at T = 16 and 64 on an H200).
  // (Prefetching the inputs' lines as well measured level: +-0.3 us at T = 1.)
  // The parameters' lines read before the wait, overlapping the previous kernel's end,
  // instead of one constant-cache miss at a time along the chain after it (T = 1 on an
  // H200: 0.03-0.20 us less per step; an all-pad step 0.1-0.45 us more: BENCHMARKS.md,
  // eleventh session).
  if (L.touch_params & 1) touch_param_lines_indexed(s);
  if (L.touch_params & 2) touch_param_lines_operands(s);
  int64_t guess = L.prefetch || L.speculate ? peek_slot(s.src, t) : kNoSlot;
  if (L.speculate == 2) guess = guess + 1 < s.S ? guess + 1 : 0;
  const bool guess_addressable = slot_addressable(guess, s.S, s.pad_slot_id);
  if (L.prefetch && own_valid && guess_addressable)
    prefetch_l2_bytes(pool + s.pool_offset(guess, h, p_own), static_cast<uint32_t>(s.N * sizeof(PoolT)));

  // This lane's first chunk of row p_first in a slot; row r starts r row steps on.
  auto row0_of = [&](int64_t slot) { return pool + s.pool_offset(slot, h, p_first) + li * VEC; };
  auto load_row_from = [&](const PoolT* row0, int r, uint4 (&st)[KB]) {
    const PoolT* row = row0 + r * row_step;
#pragma unroll
    for (int j = 0; j < KB; ++j)
      if (valid[r]) st[j] = load_chunk_raw(row + j * lanes * VEC);
  };
  uint4 st[kStream ? 1 : kRows][KB];  // state chunks as stored: widened one at a time, when used
  // kStream: one row in flight ahead of the one computed (then stored); else every
  // row loaded up front.
  auto load_first_rows = [&](const PoolT* row0) {
#pragma unroll
    for (int r = 0; r < (kStream ? 1 : kRows); ++r) load_row_from(row0, r, st[r]);
  };

  wait_for_prior_grid();
  allow_next_grid();
  // L.speculate: the rows' loads go out from the slot index read before the wait, beside
  // the real read instead of after it (one L2 round trip less in a T = 1 step's chain);
  // they come after the wait, so they see the previous kernel's writes. A slot that
  // changed across the wait is loaded again. (H200, T = 1 under graph replay: 0.26 us less
  // on (80,64,128,1) float32, the other benchmark cases level: BENCHMARKS.md, twelfth
  // session.)
  const bool speculated = L.speculate && guess_addressable;
  if (speculated) load_first_rows(row0_of(guess));
  const int64_t src = s.src.slot(t, t);

  // What does not depend on the slot is fetched while the slot index is in flight.
  const ChannelBits<InT> bits = load_channel_bits<InT>(s, t, h, p_own);
  if (!slot_addressable(src, s.S, s.pad_slot_id)) {  // pad row: y = 0, the pool untouched
    if (own_valid) *y_at(p_own) = narrow<InT>(0.0f);
    return;  // the whole block leaves (src is the block's): no shuffle is left waiting
  }
  const PoolT* src_row0 = row0_of(src);
  auto load_row = [&](int r, uint4 (&st)[KB]) { load_row_from(src_row0, r, st); };
  if (!speculated || src != guess) load_first_rows(src_row0);
  // Held 16-bit B and C chunks (kHoldBC, below) are loaded here, beside the rows, as
  // raw bits: loaded where they are widened, they went out only after the destination
  // slot's load had come back (the last-writer check branches on it), one more L2 round
  // trip in a T = 1 step's chain. (float32 B / C would hold twice the registers across
  // that wait: 120 bytes of spills in the float32-pool, float32-input kernel.)
  constexpr bool kEarlyBC = kHoldBC && sizeof(InT) == 2;
  RawChunk<VEC, InT> b_raw[kEarlyBC ? KB : 1], c_raw[kEarlyBC ? KB : 1];
  if constexpr (kEarlyBC) {
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = j * lanes + li;
      b_raw[j] = load_raw_shared<VEC>(b_row + c * VEC);
      c_raw[j] = load_raw_shared<VEC>(c_row + c * VEC);
    }
  }

  const int64_t dst = s.dst.slot(t, t);
  // Every lane of the warp takes part in the vote, whether or not its rows exist.
  const bool last = warp_last_writer(s.dst, s.src, true, s.T, s.S, s.pad_slot_id, t, dst);
  PoolT* dst_row0 = pool + s.pool_offset(dst, h, p_first) + li * VEC;
  float a_own;
  const ChannelInputs in = channel_inputs(s, bits, &a_own);
  const float dtv_own = channel_dt(s, in);
  const float dtx_own = dtv_own * in.x;
  const float dA_own = decay(a_own, dtv_own);
  float dA[kRows], dtx[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int owner = (r << rpw_log2) + (lane >> lanes_log2);
    dA[r] = __shfl_sync(kFullMask, dA_own, owner);
    dtx[r] = __shfl_sync(kFullMask, dtx_own, owner);
  }
  // This lane's B and C chunks are the same for every row it computes: with more
  // than one row they are loaded and widened once, into registers, where they fit
  // (kHoldBC); else loaded (from L1) and widened per row.
  // kSharedBC: the block's one warp widens B and C into shared memory (B's N floats,
  // then C's), each lane a 32nd of the chunks; every lane then reads its chunks there.
  // (Loading each lane's first chunk beside the rows, as kEarlyBC does, measured 1-3 %
  // slower at T = 64 and 256 on an H200: BENCHMARKS.md, tenth session.)
  extern __shared__ __align__(16) float lean_bc[];
  if constexpr (kSharedBC) {
    const int chunks = kLanes ? kLanes * KB : static_cast<int>(s.N) / VEC;  // a lean row: lanes * KB chunks
    for (int i = lane; i < 2 * chunks; i += kWarp) {
      const bool is_c = i >= chunks;
      const int c = is_c ? i - chunks : i;
      float v[VEC];
      load_unit_shared<VEC>((is_c ? c_row : b_row) + c * VEC, v);
      float4* out = reinterpret_cast<float4*>(lean_bc + (is_c ? s.N : 0) + c * VEC);
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) out[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
    __syncwarp();
  }
  float b_held[kHoldBC ? KB : 1][VEC], c_held[kHoldBC ? KB : 1][VEC];
  if constexpr (kEarlyBC) {
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      widen_raw(b_raw[j], b_held[j]);
      widen_raw(c_raw[j], c_held[j]);
    }
  } else if constexpr (kHoldBC) {
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = j * lanes + li;
      load_unit_shared<VEC>(b_row + c * VEC, b_held[j]);
      load_unit_shared<VEC>(c_row + c * VEC, c_held[j]);
    }
  }
  // Row r's step on its chunks; returns this lane's part of the row's y sum.
  auto advance_row = [&](int r, uint4 (&chunks)[KB]) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = j * lanes + li;
      float b[VEC], cc[VEC], x[VEC];
      if constexpr (kHoldBC) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) b[v] = b_held[j][v], cc[v] = c_held[j][v];
      } else if constexpr (kSharedBC) {
        bc_chunk<VEC>(lean_bc, lean_bc + s.N, c, b, cc);
      } else {
        load_unit_shared<VEC>(b_row + c * VEC, b);
        load_unit_shared<VEC>(c_row + c * VEC, cc);
      }
      widen_chunk<VEC, PoolT>(chunks[j], x);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        x[v] = advance(x[v], dA[r], dtx[r], b[v]);
        acc = accumulate_y(acc, x[v], cc[v]);
      }
      chunks[j] = narrow_chunk<VEC, PoolT>(x);
    }
    return acc;
  };
  // 16-bit pools: the written rows are evict-first in L2 (this kernel never reads them
  // again; the rows still to be read stay). On an H200 the four-row kernel gained 1.7-3.1
  // points of copy bandwidth at T = 64 (T = 256 level), 0.1-0.65 us per step at T = 1 and
  // 16; float32 pools took 0.5-3.6 % longer at T >= 16, so they keep plain stores
  // (BENCHMARKS.md, twenty-second session).
  constexpr bool kEvictFirst = sizeof(PoolT) == 2;
  auto store_row = [&](int r, const uint4 (&chunks)[KB]) {
    if (!(valid[r] && last)) return;
    PoolT* row = dst_row0 + r * row_step;
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if constexpr (kStream) store_chunk_v4<kEvictFirst>(row + j * lanes * VEC, chunks[j]);
      else if constexpr (kEvictFirst) store_chunk_streaming(row + j * lanes * VEC, chunks[j]);
      else store_chunk_raw(row + j * lanes * VEC, chunks[j]);
    }
  };
  float own_sum = 0.0f;  // the y sum of row q_own, from the lanes that computed it
  auto collect = [&](int r, float acc) {
    const float sum = row_sum(acc, lanes);
    const float got = __shfl_sync(kFullMask, sum, (q_own & ((1 << rpw_log2) - 1)) << lanes_log2);
    if ((q_own >> rpw_log2) == r) own_sum = got;
  };
  if constexpr (kStream) {
    // Row r + 1's loads are issued before row r is computed and stored; a store
    // may alias a later row, so the compiler keeps this order: two rows live, in
    // two named arrays taking turns.
    static_assert(kRows % 2 == 0, "rows taken in pairs");
    uint4 (&even)[KB] = st[0];
    uint4 odd[KB];
#pragma unroll
    for (int r = 0; r < kRows; r += 2) {
      load_row(r + 1, odd);
      const float acc_even = advance_row(r, even);
      store_row(r, even);
      collect(r, acc_even);
      if (r + 2 < kRows) load_row(r + 2, even);
      const float acc_odd = advance_row(r + 1, odd);
      store_row(r + 1, odd);
      collect(r + 1, acc_odd);
    }
  } else {
    // Every row is computed before anything is stored, so that the compiler may
    // hoist the loads above the arithmetic (a store in between could alias them).
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = advance_row(r, st[r]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      store_row(r, st[r]);
      collect(r, acc[r]);
    }
  }
  if (own_valid) *y_at(p_own) = narrow<InT>(finish_y(s, own_sum, in));
}

// Warps per block. TORCH_SSD_CUDA_WARPS=1..8 overrides the heuristic (for tuning
// runs; read on every call so that one process can sweep it).
int pick_warps(const Dims& d, const RowMap& m, int elem_size) {
  if (const auto forced = env_int("TORCH_SSD_CUDA_WARPS", 1, kMaxThreads / kWarp)) return *forced;
  // Large steps: big blocks. Small ones (few (t, h) pairs, e.g. T = 1): smaller
  // blocks, so that every multiprocessor gets some of the rows.
  const int rpw = m.rows_per_warp();
  const int64_t want = 2 * static_cast<int64_t>(num_sms());
  // 16-bit pools (register path): 4 warps measured 4-5 points of copy bandwidth
  // better than 8 at T = 64 on an H200; float32 pools (staged): 8.
  int w = elem_size == 4 ? kMaxThreads / kWarp : 4;
  while (w > 1 && (w / 2) * rpw >= d.P) w /= 2;  // no warp without a row
  while (w > 2 && d.T * d.H * ((d.P + w * rpw - 1) / (w * rpw)) < want) w /= 2;
  return w;
}

// Whether the common case stages its rows through shared memory (cp.async,
// sm_80+): by default for float32 pools (measured faster there, slower for 16-bit
// pools). TORCH_SSD_CUDA_STAGE=1 / =0 forces it on / off for every pool type (for
// comparisons; the results are the same).
bool use_staging(Dtype pool_dtype) {
  return env_switch("TORCH_SSD_CUDA_STAGE", pool_dtype == Dtype::kFloat32);
}

template <typename PoolT, bool kUnit, bool kAPerN, bool kStage>
void launch(const StepParams& s, StepLaunch L, int W, cudaStream_t stream) {
  auto kernel = decode_step_kernel<PoolT, kUnit, kAPerN, kStage>;
  const size_t smem = 2 * static_cast<size_t>(L.smem_n) * sizeof(float) +
                      (kStage ? static_cast<size_t>(W) * kWarp * step_chunks_per_batch<PoolT>() * 16 : 0);
  allow_smem(kernel, smem);
  const int64_t blocks = s.T * s.H * L.p_blocks;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "ssd.decode_step (CUDA): too many rows for one launch");
  kernel<<<static_cast<unsigned>(blocks), W * kWarp, smem, stream>>>(s, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Which kernel: the lean one wherever it applies (12-22 points of copy bandwidth
// above the others at T >= 16 on an H200, BENCHMARKS.md). Elsewhere the pipelined
// one for 16-bit pools, the block kernel for float32 pools.
// TORCH_SSD_CUDA_KERNEL=block / =pipe forces one (for comparisons; the pipelined one
// only where it applies).
bool want_pipelined(Dtype pool_dtype) {
  if (env_is("TORCH_SSD_CUDA_KERNEL", "block")) return false;
  if (env_is("TORCH_SSD_CUDA_KERNEL", "pipe")) return true;
  return pool_dtype != Dtype::kFloat32;
}

// Warps per block of the pipelined kernel (TORCH_SSD_CUDA_PIPE_WARPS=1..8 overrides).
int pick_pipe_warps(const Dims& d, const RowMap& m) {
  if (const auto forced = env_int("TORCH_SSD_CUDA_PIPE_WARPS", 1, kMaxThreads / kWarp)) return *forced;
  int w = 4;
  while (w > 1 && (w / 2) * m.rows_per_warp() >= d.P) w /= 2;  // no warp without a row
  return w;
}

template <typename PoolT>
size_t pipe_smem_bytes(int stages, int threads, int n) {
  return static_cast<size_t>(stages) * (static_cast<size_t>(step_chunks_per_batch<PoolT>()) * threads * 16 +
                                        2 * static_cast<size_t>(n) * sizeof(float));
}

// Stages of the pipelined kernel: TORCH_SSD_CUDA_PIPE_STAGES=2..3 overrides. Two
// by default: three measured 1-4 points of copy bandwidth slower on an H200
// (fewer resident blocks; BENCHMARKS.md).
int pick_pipe_stages() {
  return env_int("TORCH_SSD_CUDA_PIPE_STAGES", 2, 3).value_or(2);
}

// Whether the pipelined kernel covers this call (see its comment).
template <typename PoolT>
bool pipelined_applies(const Dims& d, const RowMap& m, bool unit, bool a_per_n, int stages, int threads) {
  return unit && !a_per_n && d.N > 0 && m.rest == 0 && m.nfull == m.lanes * m.chunks_per_lane &&
         m.chunks_per_lane <= step_chunks_per_batch<PoolT>() && d.N <= static_cast<int64_t>(kMaxBCPerThread) * threads &&
         pipe_smem_bytes<PoolT>(stages, threads, static_cast<int>(d.N)) <= 227 * 1024;
}

template <typename PoolT, int kStages>
void launch_pipelined(const Dims& d, const StepParams& s, const RowMap& map, int W, cudaStream_t stream) {
  auto kernel = decode_step_pipelined<PoolT, kStages>;
  const int threads = W * kWarp;
  PipeLaunch L;
  L.map = map;
  L.rows_per_item = threads >> map.lanes_log2;
  L.bc_per_thread = static_cast<int>((d.N + threads - 1) / threads);
  L.p_tiles = static_cast<uint32_t>((d.P + L.rows_per_item - 1) / L.rows_per_item);
  L.heads = static_cast<uint32_t>(d.H);
  L.heads_per_group = static_cast<uint32_t>(d.H / d.G);
  const int64_t items = d.T * d.H * static_cast<int64_t>(L.p_tiles);
  TORCH_CHECK(items < (int64_t{1} << 31), "ssd.decode_step (CUDA): too many rows for one launch");
  L.items = static_cast<uint32_t>(items);
  const size_t smem = pipe_smem_bytes<PoolT>(kStages, threads, static_cast<int>(d.N));
  allow_smem(kernel, smem);
  // Resident blocks per multiprocessor (an occupancy query, not a stream
  // operation: safe under graph capture). TORCH_SSD_CUDA_BPSM caps it.
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  if (const auto cap = env_int("TORCH_SSD_CUDA_BPSM", 1, per_sm)) per_sm = *cap;
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * num_sms();
  // As many blocks as fit at once, each with a near-equal share of the items.
  const int64_t rounds = (items + resident - 1) / resident;
  const int64_t blocks = (items + rounds - 1) / rounds;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(s, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows of the lean kernel per thread: TORCH_SSD_CUDA_LEAN_ROWS=1, 2 or 4 forces it
// (fewer where a warp's rows would outnumber its lanes, 2 at most with 8 chunks per
// lane; 4 are streamed). By default, measured on an H200 (BENCHMARKS.md, "2026-12-01,
// fourth session"):
//   16-bit pools, from the rows per multiprocessor (T * H * P / SMs): 2 up to 800
//   (T = 1 and 16 on (80,64,128,1): 3-4 points of copy bandwidth above 1, 3.2-3.4 above 4
//   at T = 16; at T = 1 0.2-1.0 us less per step than 1 or 4), 4 beyond (T = 16 on
//   (128,64,128,8), 993 rows: 1.4 points above 2 since the lanes are fixed, nineteenth
//   session; T = 64: 1.8-2.5 points above 1, T = 256: 9-12 above 1, 6 above 2);
//   float32 pools 2 (T = 1 under graph replay 0.4-1.1 us less per step than 1; level
//   with 4 elsewhere, and 1 was 4-6 points behind at T = 256).
int pick_lean_rows(const Dims& d, int elem_size) {
  const int forced = env_int("TORCH_SSD_CUDA_LEAN_ROWS", 1, 4).value_or(0);
  if (forced == 1 || forced == 2 || forced == 4) return forced;
  if (elem_size == 4) return 2;
  return lean_rows_per_sm(d) > 800 ? 4 : 2;
}

// Warps per block of the lean kernel (TORCH_SSD_CUDA_WARPS=1..8 overrides): one, but
// two for float32 pools with more than 2000 rows per multiprocessor. Its blocks share
// nothing, and the smallest ones measured best (a block's slot is refilled as soon as
// its one warp is done): on an H200 at T = 16 and 64, 1 warp per block measured 1-7
// points of copy bandwidth above 2, and 2 warps 1-4 above 4 (BENCHMARKS.md). Float32
// pools at T = 256 ("2026-12-01, sixth session"): 2 warps 1.4-1.6 points above 1 (T = 64:
// 0.0-1.5 above; T = 16, under 1000 rows per multiprocessor: 1.0-1.9 below).
int pick_lean_warps(const Dims& d, int elem_size) {
  if (const auto forced = env_int("TORCH_SSD_CUDA_WARPS", 1, kMaxThreads / kWarp)) return *forced;
  return elem_size == 4 && lean_rows_per_sm(d) > 2000 ? 2 : 1;
}

// Block order of the lean kernel: whether a head's tiles are side by side in the grid
// ((tiles, H, T): consecutive blocks on consecutive bytes of a slot) rather than the
// heads ((H, T, tiles)). Tiles side by side above 1200 rows per multiprocessor (T >= 64
// on the benchmark's shapes), where an H200 measured them -0.1..+2.3 points of copy
// bandwidth against the heads' order (14 of 16 A/B pairs ahead, two level); at T = 16
// they were 1-4 points behind on three of four cases
// (BENCHMARKS.md, "2026-12-01, seventh session"). TORCH_SSD_CUDA_LEAN_ORDER=1 / =0
// forces either; H above 65535 (the grid's y limit) keeps the heads' order.
bool pick_lean_order(const Dims& d) {
  return lean_tiles_inner("TORCH_SSD_CUDA_LEAN_ORDER", lean_rows_per_sm(d) > 1200, d.H);
}

// Whether the lean kernel warms L2 with its state rows before waiting on the
// previous kernel: with programmatic dependent launch (without it there is no wait
// to overlap), where its whole grid is resident at once (T = 1 and the like).
// TORCH_SSD_CUDA_PREFETCH=0 / =1 forces it off / on. `per_sm`: the kernel's
// resident blocks per multiprocessor.
bool pick_prefetch(int64_t blocks, int per_sm) {
  return env_switch("TORCH_SSD_CUDA_PREFETCH", use_pdl() && blocks <= static_cast<int64_t>(per_sm) * num_sms());
}

// How the lean kernel reads its whole parameter block first (LeanLaunch::touch_params;
// touch_param_lines_*): where its grid is resident at once (`whole_grid`, as for
// pick_prefetch) every block starts on cold constant caches. TORCH_SSD_CUDA_TOUCH_PARAMS
// = 0..3 forces the bits (1 indexed, 2 operands). Operands by default: the one form
// faster on every T = 1 benchmark case (the indexed one and both: one case level or
// slower).
uint8_t pick_touch_params(bool whole_grid) {
  return static_cast<uint8_t>(env_int("TORCH_SSD_CUDA_TOUCH_PARAMS", 0, 3).value_or(whole_grid ? 2 : 0));
}

// Whether the lean kernel issues its first rows' loads from the slot index read before
// the wait (LeanLaunch::speculate), where its whole grid is resident at once (as
// pick_prefetch): there every block waits on the previous kernel. Forced on at T = 16
// and 64 (blocks that start after the previous kernel) it measured 1-9 points of copy
// bandwidth lost. TORCH_SSD_CUDA_SPECULATE=0 / 1 forces it off / on; 2 guesses the wrong
// slot on purpose (tests of the reload).
uint8_t pick_speculate(bool whole_grid) {
  return static_cast<uint8_t>(env_int("TORCH_SSD_CUDA_SPECULATE", 0, 2).value_or(whole_grid ? 1 : 0));
}

template <typename PoolT, typename InT, int kRows, int KB, bool kSharedBC = false>
void launch_lean(const Dims& d, const StepParams& s, const RowMap& map, int W, cudaStream_t stream) {
  // N = 128 (4 lanes per row) with a 16-bit pool: the kernel with the lanes fixed
  // (use_fixed_lanes; on an H200 bfloat16 pools 1.8-3.6 points of copy bandwidth above the
  // run-time form at T >= 16, float16 1.8-5.2, both 0.10-0.19 us less per step at T = 1).
  // Float32 pools keep the run-time form: fixed, it measured 0.6-2.6 points lower at T = 16
  // and 64 and 0.15-0.20 us slower at T = 1 (BENCHMARKS.md, eighteenth session).
  constexpr bool kFixable = sizeof(PoolT) == 2;
  const bool fixed = kFixable && use_fixed_lanes(map, "TORCH_SSD_CUDA_LEAN_FIXED_LANES");
  auto kernel = decode_step_lean<PoolT, InT, kRows, KB, kSharedBC>;
  if constexpr (kFixable) {
    if (fixed) kernel = decode_step_lean<PoolT, InT, kRows, KB, kSharedBC, kFixedLanes>;
  }
  // Resident blocks per multiprocessor: an occupancy query (safe under graph
  // capture), once per kernel and block size.
  static int per_sm[2][kMaxThreads / kWarp + 1] = {};
  int& resident = per_sm[fixed][W];
  if (resident == 0) C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, W * kWarp, 0));
  LeanLaunch L;
  L.map = map;
  L.rows_per_pass = W * map.rows_per_warp();
  L.heads_per_group = static_cast<uint32_t>(d.H / d.G);
  const int64_t tiles = (d.P + kRows * L.rows_per_pass - 1) / (kRows * L.rows_per_pass);
  L.prefetch = pick_prefetch(d.H * d.T * tiles, resident);
  L.tiles_inner = pick_lean_order(d);
  L.touch_params = pick_touch_params(L.prefetch);
  L.speculate = pick_speculate(L.prefetch);
  const dim3 grid = lean_grid(L.tiles_inner, d.H, d.T, tiles);
  const size_t smem = kSharedBC ? 2 * static_cast<size_t>(d.N) * sizeof(float) : 0;
  if constexpr (kSharedBC) allow_smem(kernel, smem);
  launch_kernel(kernel, grid, dim3(W * kWarp), smem, stream, use_pdl(), s, L);
}

void step_into(const Dims& d, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
               const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
               const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
               const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor& y) {
  if (d.T == 0 || d.H == 0 || d.P == 0) return;
  const StepParams s = make_step_params(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                        dst_slot_idx, pad_slot_id, y);
  const cudaStream_t stream = current_stream();
  const bool unit = rows_vectorizable(ssm_pool);
  const bool a_per_n = d.N > 1 && A.stride(2) != 0;

  with_elem_type(s.pool_dtype, [&](auto tag) {
    using PoolT = decltype(tag);
    const RowMap map = step_row_map<PoolT>(d.N);
    if (want_lean() && lean_applies<PoolT>(d, map, unit, a_per_n, d.T, x, dt, B, C, z, y)) {
      const int W = pick_lean_warps(d, static_cast<int>(sizeof(PoolT)));
      int rows = pick_lean_rows(d, static_cast<int>(sizeof(PoolT)));
      while (rows > 1 && rows * map.rows_per_warp() > kWarp) rows /= 2;  // a warp's rows fit its lanes
      auto with_in_type = [&](auto fn) {
        if (s.B.dtype == Dtype::kBFloat16) fn(c10::BFloat16{});
        else fn(float{});
      };
      with_in_type([&](auto in_tag) {
        using InT = decltype(in_tag);
        if (map.chunks_per_lane == 8) {
          if (rows >= 2) launch_lean<PoolT, InT, 2, 8>(d, s, map, W, stream);
          else launch_lean<PoolT, InT, 1, 8>(d, s, map, W, stream);
        } else {
          // Four rows in a one-warp block: B / C in shared memory (H200, "2026-12-01,
          // fourth session": 2.0-2.8 points of copy bandwidth above holding them in
          // registers at T = 64 and 256).
          if (rows == 4 && W == 1) launch_lean<PoolT, InT, 4, 4, true>(d, s, map, W, stream);
          else if (rows == 4) launch_lean<PoolT, InT, 4, 4>(d, s, map, W, stream);
          else if (rows == 2) launch_lean<PoolT, InT, 2, 4>(d, s, map, W, stream);
          else launch_lean<PoolT, InT, 1, 4>(d, s, map, W, stream);
        }
      });
      return;
    }
    if (want_pipelined(s.pool_dtype)) {
      const int W = pick_pipe_warps(d, map);
      const int stages = pick_pipe_stages();
      if (pipelined_applies<PoolT>(d, map, unit, a_per_n, stages, W * kWarp)) {
        if (stages == 2) launch_pipelined<PoolT, 2>(d, s, map, W, stream);
        else launch_pipelined<PoolT, 3>(d, s, map, W, stream);
        return;
      }
    }
    StepLaunch L;
    L.map = map;
    L.smem_n = L.map.chunks() * vec_of<PoolT>();
    const int W = pick_warps(d, L.map, static_cast<int>(sizeof(PoolT)));
    L.rows_per_block = W * L.map.rows_per_warp();
    L.p_blocks = static_cast<uint32_t>((d.P + L.rows_per_block - 1) / L.rows_per_block);
    L.heads = static_cast<uint32_t>(d.H);
    L.heads_per_group = static_cast<uint32_t>(d.H / d.G);
    if (unit && !a_per_n && use_staging(s.pool_dtype)) {
      launch<PoolT, true, false, true>(s, L, W, stream);
      return;
    }
    with_bool(unit, [&](auto kUnit) {
      with_bool(a_per_n, [&](auto kAPerN) {
        launch<PoolT, decltype(kUnit)::value, decltype(kAPerN)::value, false>(s, L, W, stream);
      });
    });
  });
}

Tensor decode_step_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                        const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                        const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                        const OptTensor& dst_slot_idx, int64_t pad_slot_id) {
  const Dims d = check_decode_step("decode_step", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                   dst_slot_idx, pad_slot_id, nullptr);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  Tensor y = at::empty({d.T, d.H, d.P}, x.options());
  step_into(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, y);
  return y;
}

void decode_step_out_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                          const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                          const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                          const OptTensor& dst_slot_idx, int64_t pad_slot_id, const Tensor& out) {
  const Dims d = check_decode_step("decode_step_out", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                   dst_slot_idx, pad_slot_id, &out);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  step_into(d, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, out);
}

}  // namespace
}  // namespace cuda
}  // namespace ssd

TORCH_LIBRARY_IMPL(ssd, CUDA, m) {
  m.impl("decode_step", &ssd::cuda::decode_step_cuda);
  m.impl("decode_step_out", &ssd::cuda::decode_step_out_cuda);
}
