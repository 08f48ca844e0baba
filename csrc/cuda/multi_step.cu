// The multi-token decode step on CUDA (docs/multi_token.md): decode_step_multi(_out)
// and decode_step_varlen(_out).
//
// Two kernels, one result. multi_step_lean (the serving engines' case, the default
// wherever it applies; see its comment) and multi_step_kernel, for every other
// layout, described here.
//
// Grid: as in decode_step.cu, one block per (row t, head h, block of head-dim rows
// p), with the same mapping along N (step_row_map), the same per-element arithmetic
// and the same order of y's sum, so that with a float32 pool K tokens give the bits
// of K single steps. A thread loads its chunks of the source row once, into float32
// registers, before anything is stored, and advances them through the row's tokens;
// the state after token k is rounded once, on its store to token k's slot.
//
// Tokens go in groups of up to 32. Per group the whole block first stages what the
// tokens need into shared memory -- B and C widened, the per-channel scalars (dt,
// dt * x, the decay), each token's destination -- and finishes y of the previous
// group; with a destination table it then marks the writes that a later write to
// the same slot overrides (multi_last_writer's rule, the later writes split over
// the threads); then each thread runs through the group's tokens with no global
// load in the way of the stores. (Loads cannot be moved above the pool stores: the
// compiler must assume they may alias.) Nothing is allocated and nothing waits for
// the host.
//
// kSpill: when a row has more chunks per lane than one batch holds in registers
// (N > 1024), the state waits in shared memory between tokens.
//
// Varlen: y of tokens that no row owns is 0. A few blocks past the rows' blocks
// clear those tokens (normally none: the padded tail of the flat axis), so y needs
// no separate clearing pass.
#include <algorithm>
#include <cstdlib>

#include "common.cuh"

namespace ssd {
namespace cuda {
namespace {

constexpr int kMaxGroup = 32;               // tokens per group: one bit each in a 32-bit mask
constexpr size_t kGroupSmemBytes = 24 * 1024;  // staging budget of one group (B, C, scalars)

// What the launch decided on the host, passed by value.
struct MultiLaunch {
  RowMap map;
  int rows_per_block = 0;  // warps * rows_per_warp
  uint32_t p_blocks = 0;   // blocks per (t, h)
  uint32_t heads = 0, heads_per_group = 0;
  uint32_t row_blocks = 0;  // T * H * p_blocks; the blocks after these clear unowned varlen tokens
  int smem_n = 0;           // B / C floats per token: N rounded up to whole chunks
  int group = 1;            // tokens per group, 1..kMaxGroup
  // Shared memory, byte offsets: B and C (group x smem_n floats each) at 0, then the
  // spilled state, the group's destination slots (int64), four float scalars per
  // (token, row) -- dt, dt * x, the splat decay, y's sum -- and the group's mask of
  // overridden writes.
  uint32_t off_state = 0, off_dst = 0, off_scalars = 0, off_mask = 0;
};

// An operand view moved by `shift` elements (token k of a token-indexed operand).
__device__ __forceinline__ OperandRef shifted(const OperandRef& r, int64_t shift) {
  OperandRef v = r;
  v.data = shift_elements(r.data, shift, r.dtype);
  return v;
}

__device__ __forceinline__ int64_t y_offset(const StepParams& v, int64_t i, int64_t h, int64_t p) {
  return i * v.y_stride[0] + h * v.y_stride[1] + p * v.y_stride[2];
}

// Varlen: y = 0 for every token that no row owns. Block `cb` of `nclear`.
__device__ void clear_unowned(const MultiStepParams& m, uint32_t cb, uint32_t nclear) {
  const StepParams& s = m.step;
  const int64_t T = s.T, L = m.L, HP = s.H * s.P;
  auto zero_token = [&](int64_t tok, int64_t e) {  // element e of token tok's (H, P)
    const int64_t h = e / s.P, p = e - h * s.P;
    store_scalar(s.y, y_offset(s, tok, h, p), s.y_dtype, 0.0f);
  };
  bool disordered = false;
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x)
    if (m.cu_seqlens.slot(t, 0) > m.cu_seqlens.slot(t + 1, 0)) disordered = true;
  disordered = __syncthreads_or(disordered);
  const int64_t lo = m.cu_seqlens.slot(0, 0), hi = m.cu_seqlens.slot(T, 0);
  if (!disordered && lo >= 0 && hi <= L) {
    // Every row is in bounds and they follow each other: the rows own [lo, hi).
    const int64_t total = (lo + (L - hi)) * HP;
    const int64_t step = static_cast<int64_t>(nclear) * blockDim.x;
    for (int64_t e = static_cast<int64_t>(cb) * blockDim.x + threadIdx.x; e < total; e += step) {
      const int64_t u = e / HP;
      zero_token(u < lo ? u : hi + (u - lo), e - u * HP);
    }
    return;
  }
  // Unchecked bad cu_seqlens: rows may be out of bounds, empty or overlapping.
  // Test each token against every row.
  for (int64_t tok = cb; tok < L; tok += nclear) {
    bool owned = false;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
      const RowTokens r = multi_row_tokens(m, t);
      if (r.first <= tok && tok < r.first + r.count) owned = true;
    }
    if (__syncthreads_or(owned)) continue;
    for (int64_t e = threadIdx.x; e < HP; e += blockDim.x) zero_token(tok, e);
  }
}

template <typename PoolT, bool kUnit, bool kAPerN, bool kSpill>
__global__ void __launch_bounds__(kMaxThreads)
    multi_step_kernel(const __grid_constant__ MultiStepParams m, const MultiLaunch L) {
  static_assert(!(kUnit && kSpill), "the spilled path takes the gather layout");
  if (blockIdx.x >= L.row_blocks) {
    clear_unowned(m, blockIdx.x - L.row_blocks, gridDim.x - L.row_blocks);
    return;
  }
  constexpr int VEC = vec_of<PoolT>();
  constexpr int KB = step_chunks_per_batch<PoolT>();
  const StepParams& s = m.step;
  const RowMap& map = L.map;
  const int rpb = L.rows_per_block;

  extern __shared__ float4 smem_vec[];  // float4: 16-byte aligned chunks
  char* smem = reinterpret_cast<char*>(smem_vec);
  float* Bs = reinterpret_cast<float*>(smem);
  float* Cs = Bs + L.group * L.smem_n;
  float4* spill = reinterpret_cast<float4*>(smem + L.off_state);
  int64_t* dst_s = reinterpret_cast<int64_t*>(smem + L.off_dst);
  float* dtv_s = reinterpret_cast<float*>(smem + L.off_scalars);  // [token j][row q] at j * rpb + q
  float* dtx_s = dtv_s + L.group * rpb;
  float* dA_s = dtx_s + L.group * rpb;
  float* sum_s = dA_s + L.group * rpb;
  uint32_t* mask_s = reinterpret_cast<uint32_t*>(smem + L.off_mask);  // bit j: a later write wins over token j

  // 32-bit index arithmetic (the host checked that the grid fits).
  const uint32_t pb = blockIdx.x % L.p_blocks;
  const uint32_t th = blockIdx.x / L.p_blocks;
  const int64_t h = th % L.heads, t = th / L.heads;
  const int64_t g = static_cast<uint32_t>(h) / L.heads_per_group;

  const int li = threadIdx.x & (map.lanes - 1);  // lane within the row
  const int q = threadIdx.x >> map.lanes_log2;   // row within the block
  const int64_t p0 = static_cast<int64_t>(pb) * rpb;
  const int64_t p = p0 + q;
  const bool valid = p < s.P;
  const int64_t pc = valid ? p : 0;  // a readable p for the per-channel loads

  const RowTokens tokens = multi_row_tokens(m, t);
  const int64_t first = tokens.first, count = tokens.count;
  if (count == 0) return;  // owns no token (the whole block leaves: no barrier waits)
  const int64_t src = multi_source_slot(m, t);
  if (!slot_addressable(src, s.S, s.pad_slot_id)) {  // pad row: y = 0, the pool untouched
    for (int64_t i = threadIdx.x; i < count * rpb; i += blockDim.x) {
      const int64_t k = i / rpb, pq = p0 + (i - k * rpb);
      if (pq >= s.P) continue;
      const StepParams v = token_view(m, k);
      store_scalar(v.y, y_offset(v, first, h, pq), v.y_dtype, 0.0f);
    }
    return;
  }

  PoolT* pool = static_cast<PoolT*>(s.pool);
  const DstateRow<VEC, kUnit, const PoolT> in{pool + s.pool_offset(src, h, pc), s.pool_stride[3]};

  // Chunk j of a batch starting at k0 is chunk (k0 + j) * lanes + li of the row; a
  // batch whose chunks are all whole takes a branch-free path (as in decode_step.cu).
  auto whole_batch = [&](int k0) {
    return k0 + KB <= map.chunks_per_lane && (k0 + KB - 1) * map.lanes + li < map.nfull;
  };
  float st[KB][VEC];
  auto load_batch = [&](int k0) {
    if (whole_batch(k0)) {
#pragma unroll
      for (int j = 0; j < KB; ++j) in.load((k0 + j) * map.lanes + li, st[j]);
      return;
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = (k0 + j) * map.lanes + li;
      if (k0 + j >= map.chunks_per_lane) continue;
      if (c < map.nfull) in.load(c, st[j]);
      else if (c == map.nfull && map.rest > 0) in.load_tail(c, map.rest, st[j]);
    }
  };
  // kSpill: this thread's chunk i, part w (of VEC / 4 float4s), at float4 index
  // (i * VEC / 4 + w) * blockDim + thread: a warp's accesses are contiguous.
  auto spill_at = [&](int i, int w) { return spill + (i * (VEC / 4) + w) * blockDim.x + threadIdx.x; };
  auto save_batch = [&](int k0) {
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (k0 + j >= map.chunks_per_lane) break;
#pragma unroll
      for (int w = 0; w < VEC / 4; ++w)
        *spill_at(k0 + j, w) = make_float4(st[j][4 * w], st[j][4 * w + 1], st[j][4 * w + 2], st[j][4 * w + 3]);
    }
  };
  auto restore_batch = [&](int k0) {
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (k0 + j >= map.chunks_per_lane) break;
#pragma unroll
      for (int w = 0; w < VEC / 4; ++w) {
        const float4 f = *spill_at(k0 + j, w);
        st[j][4 * w] = f.x, st[j][4 * w + 1] = f.y, st[j][4 * w + 2] = f.z, st[j][4 * w + 3] = f.w;
      }
    }
  };
  // The whole source row, before anything is stored (a token may write to the
  // source slot itself); in flight while the first group is staged.
  if constexpr (!kSpill) {
    if (valid) load_batch(0);
  }

  // Staging of tokens [kg, kg + tg), by the whole block.
  auto stage_group = [&](int64_t kg, int tg) {
    if (threadIdx.x == 0) *mask_s = 0;
    // B and C of (token, g), widened; zero past N.
    for (int i = threadIdx.x; i < tg * L.smem_n; i += blockDim.x) {
      const int j = i / L.smem_n, n = i - j * L.smem_n;
      const int64_t k = kg + j;
      Bs[i] = n < map.n ? shifted(s.B, k * m.B_tok).at(first, g, n) : 0.0f;
      Cs[i] = n < map.n ? shifted(s.C, k * m.C_tok).at(first, g, n) : 0.0f;
    }
    // Per-channel scalars; a stride-0 A is a splat: one decay per channel.
    for (int i = threadIdx.x; i < tg * rpb; i += blockDim.x) {
      const int j = i / rpb;
      const int64_t pq = p0 + (i - j * rpb);
      if (pq >= s.P) continue;
      const StepParams v = token_view(m, kg + j);
      const float dtv = channel_dt(v, first, h, pq);
      const float xv = v.x.at(first, h, pq);
      dtv_s[i] = dtv;
      dtx_s[i] = dtv * xv;
      if constexpr (!kAPerN) dA_s[i] = map.n > 0 ? decay(s.A.at(h, pq), dtv) : 0.0f;  // N = 0: A is empty
    }
    if (threadIdx.x < tg) dst_s[threadIdx.x] = multi_dest_slot(m, t, kg + threadIdx.x, count);
  };
  // Which of the group's writes a later write to the same slot overrides
  // (multi_last_writer): each thread takes some of the later writes -- (row u >= t,
  // write column i), u - t = e / columns -- and compares each with all of the
  // group's destinations; the loads of different writes are independent.
  const int64_t columns = multi_write_columns(m);
  auto mark_overridden = [&](int64_t kg, int tg) {
    uint32_t bits = 0;
    const int64_t total = (s.T - t) * columns;
    for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
      const int64_t du = e / columns, u = t + du, i = e - du * columns;
      const int64_t n = multi_writing_tokens(m, u, t, count);
      const int64_t j = multi_column_token(m, i, n);
      if (j < 0) continue;
      const int64_t slot = multi_dest_slot(m, u, j, n);
      if (!slot_addressable(slot, s.S, s.pad_slot_id)) continue;  // writes nothing
      for (int k = 0; k < tg; ++k)
        if (dst_s[k] == slot && multi_write_after(u, j, t, kg + k)) bits |= 1u << k;
    }
    if (bits != 0) atomicOr(mask_s, bits);
  };
  // y of tokens [kg, kg + tg) from the staged sums, by the whole block.
  auto finish_group = [&](int64_t kg, int tg) {
    for (int i = threadIdx.x; i < tg * rpb; i += blockDim.x) {
      const int j = i / rpb;
      const int64_t pq = p0 + (i - j * rpb);
      if (pq >= s.P) continue;
      const StepParams v = token_view(m, kg + j);
      const float xv = v.x.at(first, h, pq);
      store_scalar(v.y, y_offset(v, first, h, pq), v.y_dtype, finish_y(v, sum_s[i], first, h, pq, xv));
    }
  };
  // Token kg + j of this thread's row: advance, accumulate y's sum, store.
  auto advance_token = [&](int64_t k, int j, uint32_t mask) {
    const int si = j * rpb + q;
    const float dtv = dtv_s[si], dtx = dtx_s[si];
    float dA_splat = 0.0f;
    if constexpr (!kAPerN) dA_splat = dA_s[si];
    const int64_t dst = dst_s[j];
    const bool write = valid && slot_addressable(dst, s.S, s.pad_slot_id) && !((mask >> j) & 1u);
    const DstateRow<VEC, kUnit, PoolT> out{pool + s.pool_offset(write ? dst : src, h, pc), s.pool_stride[3]};
    const float* Bk = Bs + j * L.smem_n;
    const float* Ck = Cs + j * L.smem_n;
    float acc = 0.0f;

    // One chunk: count = VEC for a whole chunk, map.rest for the tail. a: A of the
    // chunk (kAPerN).
    auto step_chunk = [&](int c, int n_el, bool whole, float(&r)[VEC], const float(&a)[VEC]) {
      float b[VEC], cc[VEC];
      bc_chunk(Bk, Ck, c, b, cc);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        if (!whole && v >= n_el) break;  // the tail: only its real elements
        float dA;
        if constexpr (kAPerN) dA = decay(a[v], dtv);
        else dA = dA_splat;
        r[v] = advance(r[v], dA, dtx, b[v]);
        acc = accumulate_y(acc, r[v], cc[v]);
      }
      if (write) {
        if (whole) out.store(c, r);
        else out.store_tail(c, n_el, r);
      }
    };
    auto step_batch = [&](int k0) {
      // A per element: loaded for the whole batch before the first store.
      float a[KB][VEC];
      if constexpr (kAPerN) {
#pragma unroll
        for (int jj = 0; jj < KB; ++jj) {
          const int c = (k0 + jj) * map.lanes + li;
          if (k0 + jj >= map.chunks_per_lane || c > map.nfull || (c == map.nfull && map.rest == 0)) continue;
          const int n_el = c < map.nfull ? VEC : map.rest;
#pragma unroll
          for (int v = 0; v < VEC; ++v)
            if (v < n_el) a[jj][v] = s.A.at(h, pc, static_cast<int64_t>(c) * VEC + v);
        }
      }
      if (whole_batch(k0)) {
#pragma unroll
        for (int jj = 0; jj < KB; ++jj) step_chunk((k0 + jj) * map.lanes + li, VEC, true, st[jj], a[jj]);
        return;
      }
#pragma unroll
      for (int jj = 0; jj < KB; ++jj) {
        const int c = (k0 + jj) * map.lanes + li;
        if (k0 + jj >= map.chunks_per_lane) continue;
        if (c < map.nfull) step_chunk(c, VEC, true, st[jj], a[jj]);
        else if (c == map.nfull && map.rest > 0) step_chunk(c, map.rest, false, st[jj], a[jj]);
      }
    };

    if (valid) {
      if constexpr (kSpill) {
#pragma unroll 1
        for (int k0 = 0; k0 < map.chunks_per_lane; k0 += KB) {
          if (k == 0) load_batch(k0);  // the source: each chunk read before its own stores
          else restore_batch(k0);
          step_batch(k0);
          if (k + 1 < count) save_batch(k0);
        }
      } else {
        step_batch(0);  // every chunk of the lane is in this one batch
      }
    }
    const float sum = row_sum(acc, map.lanes);  // every lane of the warp takes part
    if (li == 0 && valid) sum_s[si] = sum;
  };

  // Duplicate destinations are possible only through a destination table.
  const bool may_collide = m.write_state && m.dst.present();
  int64_t prev_kg = 0;
  int prev_tg = 0;
#pragma unroll 1
  for (int64_t kg = 0; kg < count; kg += L.group) {
    const int tg = static_cast<int>(count - kg < L.group ? count - kg : L.group);
    __syncthreads();  // the previous group is done with the staging area; its sums are visible
    stage_group(kg, tg);
    if (prev_tg > 0) finish_group(prev_kg, prev_tg);  // last: its stores come after the loads above
    __syncthreads();
    if (may_collide) {
      mark_overridden(kg, tg);
      __syncthreads();
    }
    const uint32_t mask = *mask_s;
#pragma unroll 1
    for (int j = 0; j < tg; ++j) advance_token(kg + j, j, mask);
    prev_kg = kg, prev_tg = tg;
  }
  __syncthreads();
  finish_group(prev_kg, prev_tg);
}

// ---------------------------------------------------------------------------
// The lean multi-token kernel: the serving engines' case (lean_applies in
// common.cuh: unit-stride pool rows split evenly over a row's lanes, A broadcast
// along N, x, z, dt, B, C and y of one type, bfloat16 or float32), with the
// techniques of decode_step_lean:
//   * one warp per block, grid (head, row t, group of tiles along P), no block
//     barrier: a block starts its row loads as soon as its slot index is in;
//   * B and C (pick_bc_path): kWidened, the default where a lane's share fits
//     kMaxWidePieces pieces (N <= 128, or 256 with 16-bit pools and inputs): each
//     lane loads a 32nd of token k + 2's raw B and C while token k is computed, and
//     widens it once for the whole warp into one of two float32 buffers in shared
//     memory (one warp barrier per token), so the 8 rows that read the same chunks
//     no longer widen them 8 times; and each thread takes two rows (kRows: the same
//     chunks of rows r and r + rows_per_warp), so every token's B / C reads,
//     shuffles, slot and loop work serve twice the elements. Otherwise kRegisters
//     (each lane loads its own chunks a token ahead into registers, before token
//     k's stores: a store between them would keep the compiler from hoisting the
//     loads, it must assume they alias) or kStaged (raw bytes of up to kWindow
//     tokens staged by cp.async, two stages in flight);
//   * the per-(row, token) scalars -- the channel loads, softplus, the decay, y --
//     are computed once per pair: lane l owns row l % rows_per_warp of each of the
//     thread's kRows row blocks and token l / rows_per_warp of each group of
//     `lanes` tokens, and shuffles them to the row's lanes;
//   * programmatic dependent launch on sm_90;
//   * kWidened for N = 128 (4 lanes per row, the usual state size) also compiled with the
//     lanes fixed (kLanes, kFixedLanes): the chunk offsets, the y tree and the token-group
//     arithmetic become constants, 14 % fewer instructions and 0.4-4.9 % faster on an
//     H200 (BENCHMARKS.md, seventeenth session).
// Which writes a later write to the same slot overrides (multi_last_writer's rule)
// is decided by the warp for a window of kWindow tokens at a time: each lane takes
// some of the later rows (their source check once per row) and compares their
// writes with the window's destinations; lane w of the window then holds token w's
// destination, or none, and each token takes it with one shuffle. A warp walks
// several tiles of its (head, row) (pick_multi_tiles): the first window's decision
// and the row's slots serve them all; kWidened (kNextRows, pick_next_rows) copies the
// next tile's rows into shared memory while this tile's tokens run, and keeps a short
// row's widened B / C for all of those tiles (pick_kept_bc).
// The state stays in float32 registers across the tokens and is rounded once per
// store; kWidened stores it evict-first (no access of the step reads it again; the
// step's inputs stay in L2: 1.3-6.4 % faster on an H200, BENCHMARKS.md, fifteenth
// session), its bulk copies too (0-1.7 %, sixteenth session). Mapping along N,
// per-element arithmetic and reduction order are multi_step_kernel's (and so, on
// float32 pools, K single steps'): the same bits (tests/test_multi_token.py checks it).
// Varlen: the blocks of grid row T clear y of the tokens no row owns.
// ---------------------------------------------------------------------------

struct LeanMultiLaunch {
  RowMap map;
  int rows_per_pass = 0;  // rows a warp covers: kRows * rows_per_warp
  int tiles = 0;          // tiles along P
  uint32_t heads_per_group = 1;
  int stage_log2 = 0;       // tokens per stage of B / C in shared memory: 1 << stage_log2 (<= kWindow)
  int row_pieces_log2 = 0;  // copies per B or C row: N * sizeof(InT) / piece bytes = 1 << row_pieces_log2
  bool tiles_inner = false;  // grid (tile groups, H, rows) instead of (H, rows, tile groups)
  bool bulk_stores = false;  // kWidened: states written by bulk copies from shared memory (pick_bulk_stores)
  int store_smem_offset = 0;  // bytes into the dynamic shared memory: the store buffers (two of a tile's rows)
  bool next_rows = false;     // kWidened: the kernel with kNextRows (pick_next_rows)
  int next_rows_offset = 0;   // bytes into the dynamic shared memory: those rows, each lane's chunks
  int kept_bc_tokens = 0;     // kWidened: a row of at most this many tokens keeps them all widened (pick_kept_bc)
};

constexpr int kWindow = 8;  // tokens whose overridden writes are decided together
constexpr int64_t kStageBytes = 4096;  // one stage of B / C in shared memory (two per warp)
constexpr int kMaxWidePieces = 2;      // kWidened: pieces of B / C per lane and token
constexpr int kStoreRowPad = 64;  // bulk stores: bytes between a row and the next in a store buffer (banks)

// Bytes of one copy of B / C in the lean kernels (16 or 8): the alignment the host checks,
// a chunk's bytes up to 16.
template <typename PoolT, typename InT>
constexpr int lean_piece_bytes() {
  return RawChunk<vec_of<PoolT>(), InT>::kBytes >= 16 ? 16 : 8;
}

// Copies per B or C row of row_bytes (N * sizeof(InT)) in pieces of piece_bytes: 1 << this.
// One rule for the host (LeanMultiLaunch::row_pieces_log2) and the fixed-lane kernels,
// which fold it into a constant.
constexpr int row_pieces_log2_of(int64_t row_bytes, int piece_bytes) {
  return log2_of(static_cast<int>(row_bytes / piece_bytes));
}

// The slots a window of kWindow tokens (from token kw of row t, which has `count` tokens)
// writes, decided by the whole warp (every lane calls it with the same arguments): lane w
// of each kWindow lanes gets token kw + w's slot as a 32-bit number (every addressable
// slot is below S < 2^31, host-checked), or -1 when it writes nothing or a later write to
// the same slot overrides it (multi_last_writer's rule). Each lane takes some of the later
// rows (their source check once per row) and compares their writes with the window's.
__device__ __forceinline__ int32_t warp_window_dests(const MultiStepParams& m, int64_t t, int count, int kw,
                                                     int lane) {
  const StepParams& s = m.step;
  const bool may_collide = m.write_state && m.dst.present();
  const int w = lane & (kWindow - 1);
  const int64_t d = kw + w < count ? multi_dest_slot(m, t, kw + w, count) : kNoSlot;
  const int32_t mine = slot_addressable(d, s.S, s.pad_slot_id) ? static_cast<int32_t>(d) : -1;
  if (!may_collide) return mine;
  int32_t dsts[kWindow];
#pragma unroll
  for (int v = 0; v < kWindow; ++v) dsts[v] = __shfl_sync(kFullMask, mine, v);
  const int64_t columns = multi_write_columns(m);
  uint32_t bits = 0;
  for (int64_t u = t + lane; u < s.T; u += kWarp) {  // this lane's later rows
    const int64_t n = multi_writing_tokens(m, u, t, count);
    for (int64_t i = 0; i < columns; ++i) {
      const int64_t j = multi_column_token(m, i, n);
      if (j < 0) continue;
      const int64_t slot = multi_dest_slot(m, u, j, n);
      if (!slot_addressable(slot, s.S, s.pad_slot_id)) continue;  // writes nothing
      // The window's tokens this write comes after: all of them for a later row,
      // those before token j in this row.
      const int64_t before = j - kw;
      const uint32_t after_mask =
          u > t || before >= kWindow ? (1u << kWindow) - 1 : before <= 0 ? 0u : (1u << before) - 1;
      uint32_t equal = 0;
#pragma unroll
      for (int v = 0; v < kWindow; ++v) equal |= static_cast<uint32_t>(dsts[v] == static_cast<int32_t>(slot)) << v;
      bits |= equal & after_mask;
    }
  }
  bits = __reduce_or_sync(kFullMask, bits);
  return (bits >> w) & 1u ? -1 : mine;
}

// What both lean multi-token kernels know of their warp before its tiles: its place in the
// grid, its row's tokens and source slot, and where the row's inputs start.
template <typename InT>
struct LeanWarpRow {
  LeanBlock at;     // head at.h, row at.row, tiles at.tile, + at.tiles, ...
  uint32_t g;       // the head's B / C group
  int64_t first;    // the row's token 0 on the token axis
  int count;        // its tokens (32 bits: multi_into)
  int64_t src;      // its source slot
  bool pad_row;     // src is padding: y = 0, the pool untouched
  const InT* B0;    // token 0's B row; token k's is k * m.B_tok on
  const InT* C0;    // and its C row (m.C_tok)
  // Element (token 0 of the row, head at.h, channel p) of x, dt, z or y; token k of the row
  // is k token strides on.
  __device__ __forceinline__ const InT* pair_in(const OperandRef& o, int64_t p) const {
    return static_cast<const InT*>(o.data) + (first * o.stride[0] + at.h * o.stride[1] + p * o.stride[2]);
  }
  // The same element of y.
  __device__ __forceinline__ InT* y_at(const StepParams& s, int64_t p) const {
    return static_cast<InT*>(s.y) + (first * s.y_stride[0] + at.h * s.y_stride[1] + p * s.y_stride[2]);
  }
};

// The lean kernels' start: the warp's row, after waiting for the previous grid (programmatic
// dependent launch) and letting the next one be scheduled. The varlen grid's extra row clears
// its share of the unowned slots. False where the warp has nothing more to do (that extra
// row, or a row without tokens).
template <typename InT>
__device__ __forceinline__ bool start_lean_warp(const MultiStepParams& m, const LeanMultiLaunch& L,
                                                LeanWarpRow<InT>& row) {
  const StepParams& s = m.step;
  row.at = lean_block(L.tiles_inner);
  row.g = row.at.h / L.heads_per_group;
  wait_for_prior_grid();
  allow_next_grid();
  if (row.at.row == s.T) {  // varlen: the extra grid row
    clear_unowned(m, row.at.h * row.at.tiles + row.at.tile, row.at.heads * row.at.tiles);
    return false;
  }
  const RowTokens tokens = multi_row_tokens(m, row.at.row);
  row.first = tokens.first;
  row.count = static_cast<int>(tokens.count);
  if (row.count == 0) return false;  // owns no token
  row.src = multi_source_slot(m, row.at.row);
  row.pad_row = !slot_addressable(row.src, s.S, s.pad_slot_id);
  row.B0 = static_cast<const InT*>(s.B.data) + row.first * s.B.stride[0] + row.g * s.B.stride[1];
  row.C0 = static_cast<const InT*>(s.C.data) + row.first * s.C.stride[0] + row.g * s.C.stride[1];
  return true;
}

// How the lean kernel's B and C reach the token loop (pick_bc_path).
enum class BcPath {
  kRegisters,  // each lane loads its own chunks, a token ahead, into registers and widens them
  kStaged,     // a stage of tokens' raw bytes copied into shared memory by cp.async, widened by each lane
  kWidened,    // each lane loads a 32nd of the next token's B and C and widens it once for the whole
               // warp into a float32 buffer (two buffers); every lane reads its chunks as floats
  kWindowed,   // multi_step_windowed: a window's raw B / C and per-(row, token) scalars in shared
               // memory, nothing per token in registers but the state (N = 128 only; a knob)
};

// Rows per thread (the same chunks of each) of the lean kernel on each path, and the
// resident warps per multiprocessor the host tiles for (kWidened's and kWindowed's launch
// bounds ask for exactly that; the others' are below).
constexpr int lean_rows(BcPath path) { return path == BcPath::kWidened || path == BcPath::kWindowed ? 2 : 1; }
constexpr int lean_warps_per_sm(BcPath path) { return path == BcPath::kWidened ? 12 : 16; }

// Launch bounds: kWidened (two rows: 64 state floats) 12 warps per multiprocessor, 168
// registers, no spill at sm_90; the next step up is 16 warps at 128 registers (any bound of
// 13-16 gives a one-warp block 128), where it spills ~200 bytes and ran 11-12 % slower on an
// H100, 3-4 % with its registers trimmed to 66 bytes of spills (BENCHMARKS.md, thirty-fifth
// session); half rows (8 lanes of 16 elements: 16 warps with no spill) 1.9 % slower
// (thirty-seventh session); one row per thread at 16 / 20 / 24 warps 2-5 / 9 / 20-31 %
// slower (thirty-eighth session). The others (one row): 16 warps (128 registers) where the inputs
// are 16-bit (0-92 bytes spill, outside the token loop), float32 inputs take more for their
// B / C chunks; a cap of 96 registers spilled more and ran 5-30 % slower (BENCHMARKS.md,
// 2026-12-01).
template <typename PoolT, typename InT, int KB, BcPath kBc, bool kNextRows = false, int kLanes = 0>
__global__ void __launch_bounds__(kBc == BcPath::kWidened ? kWarp : kMaxThreads,
                                  kBc == BcPath::kWidened ? lean_warps_per_sm(kBc) : (sizeof(InT) == 2 ? 2 : 1))
    multi_step_lean(const __grid_constant__ MultiStepParams m, const LeanMultiLaunch L) {
  constexpr int VEC = vec_of<PoolT>();
  constexpr bool kStaged = kBc == BcPath::kStaged;
  constexpr bool kWidened = kBc == BcPath::kWidened;
  constexpr bool kRegisters = kBc == BcPath::kRegisters;
  constexpr int kRows = lean_rows(kBc);
  const StepParams& s = m.step;
  const RowMap& map = L.map;
  // kLanes: a row's lanes fixed at compile time (0: map.lanes, read at run time); the
  // chunk offsets, the y tree and the token-group arithmetic then fold into constants.
  static_assert(kLanes >= 0 && kLanes <= kWarp && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two");
  const int lanes_log2 = kLanes ? log2_of(kLanes) : map.lanes_log2;
  const int lanes = kLanes ? kLanes : map.lanes;  // (the run-time values straight from the parameters)
  const int lane = threadIdx.x & (kWarp - 1);
  const int li = lane & (lanes - 1);
  const int rpw_log2 = 5 - lanes_log2;  // rows per warp: 32 / lanes
  const int row_in_warp = lane >> lanes_log2;
  const int q_own = lane & ((1 << rpw_log2) - 1);  // the row of this lane's (row, token) pairs
  const int k_lane = lane >> rpw_log2;              // its token in each group of `lanes` tokens

  LeanWarpRow<InT> warp_row;
  if (!start_lean_warp(m, L, warp_row)) return;
  const uint32_t h = warp_row.at.h, t = warp_row.at.row;
  const uint32_t group = warp_row.at.tile, groups = warp_row.at.tiles;  // this warp's tiles: group, + groups, ...
  // Token and channel numbers in 32 bits (multi_into: tokens and P below 2^30).
  const int count = warp_row.count;
  const int P = static_cast<int>(s.P);
  PoolT* pool = static_cast<PoolT*>(s.pool);

  // Lane w (of each kWindow lanes) gets the slot token kw + w writes, or -1.
  auto window_dests = [&](int kw) { return warp_window_dests(m, t, count, kw, lane); };
  const int32_t first_window = warp_row.pad_row ? -1 : window_dests(0);

  // kStaged: B and C reach the token loop through shared memory, a stage of tokens
  // at a time: two buffers, the next stage's copies (cp.async) in flight while this
  // one is read.
  extern __shared__ __align__(16) unsigned char lean_smem[];
  InT* const staged = reinterpret_cast<InT*>(lean_smem);
  constexpr int kPieceBytes = lean_piece_bytes<PoolT, InT>();  // one copy: the chunks' alignment
  constexpr int kPieceElems = kPieceBytes / static_cast<int>(sizeof(InT));
  const int row_pieces_log2 = kLanes ? row_pieces_log2_of(kLanes * KB * VEC * sizeof(InT), kPieceBytes)
                                     : L.row_pieces_log2;
  const int n_row = lanes * KB * VEC;  // N: a lean row splits evenly over its lanes
  const int stage_tokens = 1 << L.stage_log2;
  // Token k's staged B row (its C row follows it).
  auto staged_b = [&](int k) {
    const int buf = (k >> L.stage_log2) & 1;
    return staged + (buf * stage_tokens + (k & (stage_tokens - 1))) * 2 * n_row;
  };
  // Issue stage st's copies (its tokens that exist) and close their group.
  auto issue_stage = [&](int st) {
    const int k0 = st << L.stage_log2;
    const int left = count - k0;
    const int n_tok = left <= 0 ? 0 : left < stage_tokens ? left : stage_tokens;
    const int pieces = n_tok << (row_pieces_log2 + 1);  // B and C rows of n_tok tokens
    InT* const buf = staged_b(k0);
    for (int i = lane; i < pieces; i += kWarp) {
      const int row = i >> row_pieces_log2;  // 2 * token + (0: B, 1: C)
      const int piece = i & ((1 << row_pieces_log2) - 1);
      const int k = k0 + (row >> 1);
      const InT* src = (row & 1 ? warp_row.C0 + k * m.C_tok : warp_row.B0 + k * m.B_tok) + piece * kPieceElems;
      stage_bytes_async<kPieceBytes>(src, buf + row * n_row + piece * kPieceElems);
    }
    stage_commit();
  };

  // kWidened: token k's B row, then its C row, in float32 in buffer k % 2. A token's
  // raw B and C are cut into pieces of kPieceBytes; lane l loads pieces l and l + 32
  // (those that exist; B's pieces first, then C's), a token ahead, and widens piece
  // i into the buffer's floats from i * kPieceElems on.
  // A row of at most L.kept_bc_tokens tokens (kept_bc) keeps token k in buffer k
  // instead: its warp's first tile widens them, its later tiles only read them (no
  // B / C load, no barrier per token).
  const bool kept_bc = kWidened && count <= L.kept_bc_tokens;
  auto wide_buffer = [&](int k) { return kept_bc ? k : k & 1; };
  float* const wide = reinterpret_cast<float*>(lean_smem);
  float* const wide_lane = wide + lane * kPieceElems;
  const int wide_pieces = 2 << row_pieces_log2;
  RawChunk<kPieceElems, InT> pieces[kMaxWidePieces];
  const InT* piece_at[kMaxWidePieces];  // this lane's pieces of the next token to load
  bool piece_of_c[kMaxWidePieces];
  auto first_pieces = [&]() {  // the next token to load is token 0
#pragma unroll
    for (int i = 0; i < kMaxWidePieces; ++i) {
      const int piece = lane + i * kWarp;
      piece_of_c[i] = (piece >> row_pieces_log2) != 0;
      piece_at[i] = (piece_of_c[i] ? warp_row.C0 : warp_row.B0) + (piece & ((1 << row_pieces_log2) - 1)) * kPieceElems;
    }
  };
  auto load_pieces = [&]() {  // the next token's pieces into registers
#pragma unroll
    for (int i = 0; i < kMaxWidePieces; ++i) {
      if (lane + i * kWarp >= wide_pieces) break;
      pieces[i] = load_raw_shared<kPieceElems>(piece_at[i]);
      piece_at[i] += piece_of_c[i] ? m.C_tok : m.B_tok;
    }
  };
  auto store_pieces = [&](int k) {  // the loaded pieces, widened into token k's buffer
    float* const buf = wide_lane + wide_buffer(k) * 2 * n_row;
#pragma unroll
    for (int i = 0; i < kMaxWidePieces; ++i) {
      if (lane + i * kWarp >= wide_pieces) break;
      float r[kPieceElems];
      widen_raw(pieces[i], r);
#pragma unroll
      for (int v = 0; v < kPieceElems; v += 4)
        *reinterpret_cast<float4*>(buf + i * kWarp * kPieceElems + v) = make_float4(r[v], r[v + 1], r[v + 2], r[v + 3]);
    }
  };

  const int rpw = 1 << rpw_log2;
  // Row r of a thread (and of its pairs) lies r * rpw rows after its row 0; for an
  // operand whose channels lie channel_stride apart, a missing row takes row 0's.
  const int64_t pool_half = rpw * s.pool_stride[2];
  auto half_at = [&](auto* own0, int64_t channel_stride, int r, bool row_valid) {
    return r == 0 || !row_valid ? own0 : own0 + r * rpw * channel_stride;
  };

  // kWidened with bulk stores (L.bulk_stores): two buffers of a tile's rows after the
  // B / C buffers, a row every store_pitch elements (kStoreRowPad bytes past the row: a
  // warp's 16-byte writes to neighbouring rows fall in different banks); `stores` counts
  // this warp's tile stores, whose parity picks the buffer.
  PoolT* const store_buf = reinterpret_cast<PoolT*>(lean_smem + L.store_smem_offset);
  const int store_pitch = n_row + kStoreRowPad / static_cast<int>(sizeof(PoolT));
  uint32_t stores = 0;

  // kNextRows (kWidened only): while a tile's tokens run, its warp's next tile's rows are copied
  // (cp.async) into shared memory, each lane's chunks where only it reads them, so the
  // next tile starts without a round trip to DRAM. Pool writes of this step cannot reach
  // those rows: another p of this warp's row, or another row's source (not allowed).
  uint4* const next_lane = reinterpret_cast<uint4*>(lean_smem + L.next_rows_offset) + lane;
  auto next_chunk = [&](int r, int j) -> uint4& { return next_lane[(r * KB + j) * kWarp]; };
  bool next_ready = false;  // this tile's rows are in next_chunk

#pragma unroll 1
  for (int tile = group; tile < L.tiles; tile += groups) {
    const int warp_base = tile * L.rows_per_pass;
    const int p_any = warp_base + row_in_warp;  // this thread's row 0 (its chunks along N)
    const int p = p_any < P ? p_any : 0;
    bool valid[kRows];
    const int p_own_any = warp_base + q_own;  // row 0 of its (row, token) pairs
    const int p_own = p_own_any < P ? p_own_any : 0;
    bool own_valid[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      valid[r] = p_any + r * rpw < P;
      own_valid[r] = p_own_any + r * rpw < P;
    }
    InT* const y_own = warp_row.y_at(s, p_own);
    auto y_half = [&](int r) { return half_at(y_own, s.y_stride[2], r, own_valid[r]); };
    if (warp_row.pad_row) {  // y = 0, the pool untouched
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (own_valid[r])
          for (int k = k_lane; k < count; k += lanes) y_half(r)[k * m.y_tok] = narrow<InT>(0.0f);
      continue;
    }
    const int64_t row_offset = s.pool_offset(0, h, p);  // row 0's, + slot * pool_stride[0]
    // kept_bc: every token's B / C is in its buffer from the warp's first tile on.
    const bool bc_widened = kept_bc && tile != static_cast<int>(group);
    uint4 raw[kRows][KB];
    if (kNextRows && next_ready) {
      stage_wait_all();
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < KB; ++j) raw[r][j] = valid[r] ? next_chunk(r, j) : make_uint4(0, 0, 0, 0);
    } else {
      const PoolT* row = pool + (warp_row.src * s.pool_stride[0] + row_offset);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < KB; ++j)
          raw[r][j] = valid[r] ? load_chunk_raw(row + r * pool_half + (j * lanes + li) * VEC)
                               : make_uint4(0, 0, 0, 0);
    }

    // While the rows are in flight: token 0's B and C (or their first stage), the
    // pairs' constant inputs, the first group's inputs.
    const InT* b_next = warp_row.B0;  // the next token's B and C in global memory (kRegisters)
    const InT* c_next = warp_row.C0;
    RawChunk<VEC, InT> nb[kRegisters ? KB : 1], nc[kRegisters ? KB : 1];  // their chunks (kRegisters)
    auto load_bc = [&]() {
#pragma unroll
      for (int j = 0; j < (kRegisters ? KB : 0); ++j) {
        const int c = j * lanes + li;
        nb[j] = load_raw_shared<VEC>(b_next + c * VEC);
        nc[j] = load_raw_shared<VEC>(c_next + c * VEC);
      }
    };
    if constexpr (kStaged) {
      __syncwarp();  // the previous tile's reads of the buffers are done
      issue_stage(0);
    } else if (kWidened && !bc_widened) {
      first_pieces();
      load_pieces();  // token 0 (the previous tile's reads ended at its last token's barrier)
    } else if constexpr (kRegisters) {
      load_bc();
    }
    ChannelInputs in[kRows];  // the pairs' inputs
    float a_own[kRows];
    float nx[kRows], ndt[kRows], nz[kRows];  // x, dt, z of the pairs' next token (clamped to the row)
    const InT* const x_own = warp_row.pair_in(s.x, p_own);
    const InT* const dt_own = warp_row.pair_in(s.dt, p_own);
    // Without z its loads read x's first element (an absent operand's strides and z_tok
    // are 0) and the value is dropped: no branch around them, so a group's loads go out
    // together (a load and its conversion under `if (z)` made the warp wait for it there).
    const bool has_z = s.z.present();
    const InT* const z_own = has_z ? warp_row.pair_in(s.z, p_own) : x_own;
    auto load_pair = [&](int k) {
      const int kr = k < count ? k : count - 1;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        nx[r] = widen(half_at(x_own, s.x.stride[2], r, own_valid[r])[kr * m.x_tok]);
        ndt[r] = widen(half_at(dt_own, s.dt.stride[2], r, own_valid[r])[kr * m.dt_tok]);
        const float zv = widen(half_at(z_own, s.z.stride[2], r, own_valid[r])[kr * m.z_tok]);
        nz[r] = has_z ? zv : 0.0f;
      }
    };
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int pr = own_valid[r] ? p_own + r * rpw : p_own;
      if (s.dt_bias.present()) in[r].dt_bias = s.dt_bias.at(h, pr);
      if (s.D.present()) in[r].D = s.D.at(h, pr);
      a_own[r] = s.A.at(h, pr);
    }
    load_pair(k_lane);

    float st[kRows][KB][VEC];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < KB; ++j) widen_chunk<VEC, PoolT>(raw[r][j], st[r][j]);
    // The next tile's copies go out once this tile's chunks are read out of the buffer
    // (same lane, in order: its reads are served before the copies land).
    next_ready = false;
    if (kNextRows && tile + groups < L.tiles) {
      const int p_next_any = (tile + static_cast<int>(groups)) * L.rows_per_pass + row_in_warp;
      const PoolT* row =
          pool + (warp_row.src * s.pool_stride[0] + s.pool_offset(0, h, p_next_any < P ? p_next_any : 0));
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (p_next_any + r * rpw < P)
#pragma unroll
          for (int j = 0; j < KB; ++j)
            stage_bytes_async<16>(row + r * pool_half + (j * lanes + li) * VEC, &next_chunk(r, j));
      stage_commit();
      next_ready = true;
    }
    if (kWidened && !bc_widened) {
      store_pieces(0);
      if (count > 1) load_pieces();  // token 1
      __syncwarp();  // token 0's buffer is visible to every lane
    }

    float dA_own[kRows], dtx_own[kRows], y_sum[kRows];
    auto start_group = [&]() {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        in[r].x = nx[r], in[r].dt = ndt[r], in[r].z = nz[r];
        const float dtv = channel_dt(s, in[r]);
        dtx_own[r] = dtv * in[r].x;
        dA_own[r] = decay(a_own[r], dtv);
        y_sum[r] = 0.0f;
      }
    };
    start_group();
    int32_t window = first_window;
#pragma unroll 1
    for (int k = 0; k < count; ++k) {
      const int jt = k & (lanes - 1);  // token within the group
      if (k > 0 && k % kWindow == 0) window = window_dests(k);
      if (kStaged && (k & (stage_tokens - 1)) == 0) {  // a new stage: the next one goes out, this one must be in
        __syncwarp();  // the buffer the next stage fills is read by no lane
        issue_stage((k >> L.stage_log2) + 1);
        stage_wait_prior<1>();
        __syncwarp();  // every lane's copies of this stage are visible to all
      }
      // kWidened: token k + 1 goes into the other buffer (its readers, at token k - 1,
      // passed the barrier that ends each token; kept_bc: its own), token k + 2's pieces go out.
      if (kWidened && !bc_widened && k + 1 < count) {
        store_pieces(k + 1);
        if (k + 2 < count) load_pieces();  // token k + 2
      }
      const float* wide_b = wide + wide_buffer(k) * 2 * n_row;  // token k's (kWidened)
      const InT* b_tok = kStaged ? staged_b(k) : nullptr;  // token k's staged B and C
      const InT* c_tok = kStaged ? b_tok + n_row : nullptr;
      const int owner = (jt << rpw_log2) | row_in_warp;  // the lane of (this row, token k)
      float dA[kRows], dtx[kRows], acc[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        dA[r] = __shfl_sync(kFullMask, dA_own[r], owner);
        dtx[r] = __shfl_sync(kFullMask, dtx_own[r], owner);
        acc[r] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int c = j * lanes + li;
        float b[VEC], cc[VEC];
        if constexpr (kStaged) {
          widen_raw(load_raw_shared<VEC, InT, true>(b_tok + c * VEC), b);
          widen_raw(load_raw_shared<VEC, InT, true>(c_tok + c * VEC), cc);
        } else if constexpr (kWidened) {
#pragma unroll
          for (int v = 0; v < VEC; v += 4) {
            const float4 bv = *reinterpret_cast<const float4*>(wide_b + c * VEC + v);
            const float4 cv = *reinterpret_cast<const float4*>(wide_b + n_row + c * VEC + v);
            b[v] = bv.x, b[v + 1] = bv.y, b[v + 2] = bv.z, b[v + 3] = bv.w;
            cc[v] = cv.x, cc[v + 1] = cv.y, cc[v + 2] = cv.z, cc[v + 3] = cv.w;
          }
        } else {
          widen_raw(nb[j], b);
          widen_raw(nc[j], cc);
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            st[r][j][v] = advance(st[r][j][v], dA[r], dtx[r], b[v]);
            acc[r] = accumulate_y(acc[r], st[r][j][v], cc[v]);
          }
      }
      // The next token's (next group's) loads go out before this token's stores. (The next
      // group's x, dt, z issued a group earlier, as this group starts, measured level on an
      // H200; issuing a tile's x, dt, z before its A / D / dt_bias, mostly slower (up to 11 %):
      // ninth session.)
      const bool group_ends = jt == lanes - 1 || k + 1 == count;
      if (k + 1 < count) {
        if constexpr (kRegisters) {
          b_next += m.B_tok, c_next += m.C_tok;
          load_bc();
        }
        if (group_ends) load_pair(k + 1 + k_lane);
      }
      const int32_t dst = __shfl_sync(kFullMask, window, k % kWindow);
      if (dst >= 0 && kWidened && L.bulk_stores) {
        // The tile's rows, rounded, into store buffer `stores % 2` (row q at q * pitch),
        // then one bulk copy per row, by lane q % 32; the buffer is written again two
        // stores later, once those copies have read it.
        PoolT* const buf = store_buf + static_cast<int>(stores & 1) * L.rows_per_pass * store_pitch;
        bulk_wait_read<1>();
        __syncwarp();  // every lane's copies from this buffer are done with it
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (valid[r])
#pragma unroll
            for (int j = 0; j < KB; ++j)
              *reinterpret_cast<uint4*>(buf + (row_in_warp + r * rpw) * store_pitch + (j * lanes + li) * VEC) =
                  narrow_chunk<VEC, PoolT>(st[r][j]);
        bulk_fence_shared();
        __syncwarp();  // the whole tile is in the buffer
        for (int q = lane; q < L.rows_per_pass && warp_base + q < P; q += kWarp)
          bulk_store(pool + (dst * s.pool_stride[0] + s.pool_offset(0, h, warp_base + q)), buf + q * store_pitch,
                     static_cast<uint32_t>(n_row * sizeof(PoolT)));
        bulk_commit();
        ++stores;
      } else if (dst >= 0) {
        PoolT* const row = pool + (dst * s.pool_stride[0] + row_offset);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (valid[r])
#pragma unroll
            for (int j = 0; j < KB; ++j) {
              PoolT* const at_chunk = row + r * pool_half + (j * lanes + li) * VEC;
              // kWidened: evict-first (with it the other paths spilled up to 112 bytes more at sm_90)
              if constexpr (kWidened) store_chunk_streaming(at_chunk, narrow_chunk<VEC, PoolT>(st[r][j]));
              else store_chunk_raw(at_chunk, narrow_chunk<VEC, PoolT>(st[r][j]));
            }
      }
      row_sums(acc, lanes);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float got = __shfl_sync(kFullMask, acc[r], q_own << lanes_log2);
        if (jt == k_lane) y_sum[r] = got;
      }
      if (group_ends) {
        const int k_own = k - jt + k_lane;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (own_valid[r] && k_own < count) y_half(r)[k_own * m.y_tok] = narrow<InT>(finish_y(s, y_sum[r], in[r]));
        if (k + 1 < count) start_group();
      }
      if (kWidened && !bc_widened) __syncwarp();  // token k + 1's buffer is written, token k's read
    }
  }
  if (kWidened && L.bulk_stores) bulk_wait_all();  // the copies read this block's shared memory
}

// ---------------------------------------------------------------------------
// multi_step_windowed (BcPath::kWindowed, TORCH_SSD_CUDA_MULTI_BC=windowed; N = 128, 4 lanes
// per row): the widened kernel's mapping -- one warp per block, two head-dim rows per
// thread, the same chunks, per-element arithmetic and order of y's sum, so the same bits --
// held to 128 registers, 16 resident warps per multiprocessor where the widened kernel
// keeps 12 (the store model found the token loop short of warps, not of instructions:
// BENCHMARKS.md, thirty-second session). Between tokens a thread keeps nothing in
// registers but its state. Per window of kWindow tokens the warp
//   * copies the tokens' raw B and C rows into shared memory (cp.async: no register while
//     in flight); a token's reader widens its chunks as it reads them;
//   * computes each (row, token) pair's scalars once -- the decay, dt * x, D * x, silu(z)
//     -- into shared memory (lane l: row l % 16 of the tile, tokens l / 16, + 2, + 4, + 6 of
//     the window); a token reads its two rows' decay and dt * x there;
//   * leaves each token's y sums there, and finishes and writes y by the pairs' lanes once
//     the window's tokens are done.
// A row of at most kWindow tokens copies its B / C once for all of its warp's tiles. Not
// here: the widened kernel's next-tile rows in shared memory and its bulk stores.
// ---------------------------------------------------------------------------
constexpr int kWindowedLanes = 4;                                           // lanes per row (N = 128)
constexpr int kWindowedTileRows = 2 * kWarp / kWindowedLanes;               // rows per tile: 16
constexpr int kWindowedPairsPerLane = kWindow * kWindowedTileRows / kWarp;  // (row, token) pairs: 4
constexpr int kWindowedPairTokenStep = kWarp / kWindowedTileRows;          // a lane's pairs: every 2nd token

// Shared memory of multi_step_windowed: the window's raw B / C rows (token k's B row, then
// its C row), then per (token, row) four float scalars, then per (token, row) y's sum.
template <typename InT>
constexpr size_t windowed_bc_bytes() {
  return static_cast<size_t>(kWindow) * 2 * kWindowedLanes * 32 * sizeof(InT);
}
template <typename InT>
constexpr size_t windowed_smem() {
  return windowed_bc_bytes<InT>() + static_cast<size_t>(kWindow) * kWindowedTileRows * (4 + 1) * sizeof(float);
}

template <typename PoolT, typename InT, int KB>
__global__ void __launch_bounds__(kWarp, lean_warps_per_sm(BcPath::kWindowed))  // 16 warps: 128 registers
    multi_step_windowed(const __grid_constant__ MultiStepParams m, const LeanMultiLaunch L) {
  constexpr int VEC = vec_of<PoolT>();
  constexpr int kLanes = kWindowedLanes;
  constexpr int kRows = 2;
  constexpr int kRpw = kWarp / kLanes;  // rows per warp pass: row r of a thread is r * kRpw after its row 0
  constexpr int kN = kLanes * KB * VEC;
  static_assert(kN == 128, "multi_step_windowed: N = 128");
  constexpr int kPieceBytes = lean_piece_bytes<PoolT, InT>();
  constexpr int kPieceElems = kPieceBytes / static_cast<int>(sizeof(InT));
  constexpr int kRowPieces = kN / kPieceElems;  // copies per B or C row
  const StepParams& s = m.step;
  const int lane = threadIdx.x & (kWarp - 1);
  const int li = lane & (kLanes - 1);
  const int row_in_warp = lane / kLanes;
  const int q_pair = lane % kWindowedTileRows;  // the tile row of this lane's pairs
  const int k_pair = lane / kWindowedTileRows;  // its first token of a window (then + 2, + 4, + 6)

  LeanWarpRow<InT> warp_row;
  if (!start_lean_warp(m, L, warp_row)) return;
  const uint32_t h = warp_row.at.h, t = warp_row.at.row;
  const uint32_t group = warp_row.at.tile, groups = warp_row.at.tiles;  // this warp's tiles: group, + groups, ...
  const int count = warp_row.count;
  const int P = static_cast<int>(s.P);
  PoolT* const pool = static_cast<PoolT*>(s.pool);
  const int32_t first_window = warp_row.pad_row ? -1 : warp_window_dests(m, t, count, 0, lane);

  extern __shared__ __align__(16) unsigned char lean_smem[];
  InT* const bc = reinterpret_cast<InT*>(lean_smem);
  float4* const scalars = reinterpret_cast<float4*>(lean_smem + windowed_bc_bytes<InT>());  // [token][row]
  float* const y_sums = reinterpret_cast<float*>(scalars + kWindow * kWindowedTileRows);    // [token][row]

  // The raw B / C rows of the window's n tokens from token kw: copy i by lane i % 32.
  auto copy_bc = [&](int kw, int n) {
    for (int i = lane; i < n * 2 * kRowPieces; i += kWarp) {
      const int row = i / kRowPieces;  // 2 * token + (0: B, 1: C)
      const int piece = i - row * kRowPieces;
      const int k = kw + (row >> 1);
      const InT* from = (row & 1 ? warp_row.C0 + k * m.C_tok : warp_row.B0 + k * m.B_tok) + piece * kPieceElems;
      stage_bytes_async<kPieceBytes>(from, bc + row * kN + piece * kPieceElems);
    }
    stage_commit();
  };

#pragma unroll 1
  for (int tile = group; tile < L.tiles; tile += groups) {
    const int p0 = tile * kWindowedTileRows;
    const int p_any = p0 + row_in_warp;  // this thread's row 0 (its chunks along N)
    const int p = p_any < P ? p_any : p0;
    bool valid[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) valid[r] = p_any + r * kRpw < P;
    const bool pair_valid = p0 + q_pair < P;
    const int p_pair = pair_valid ? p0 + q_pair : p0;
    InT* const y_pair = warp_row.y_at(s, p_pair);
    if (warp_row.pad_row) {  // y = 0, the pool untouched
      if (pair_valid)
        for (int k = k_pair; k < count; k += kWindowedPairTokenStep) y_pair[k * m.y_tok] = narrow<InT>(0.0f);
      continue;
    }
    const int64_t row_offset = s.pool_offset(0, h, p);  // row 0's, + slot * pool_stride[0]
    const int64_t pool_half = kRpw * s.pool_stride[2];
    uint4 raw[kRows][KB];
    {
      const PoolT* row = pool + (warp_row.src * s.pool_stride[0] + row_offset);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < KB; ++j)
          raw[r][j] = valid[r] ? load_chunk_raw(row + r * pool_half + (j * kLanes + li) * VEC) : make_uint4(0, 0, 0, 0);
    }
    // A row of at most kWindow tokens: its B / C are in the buffer from the warp's first tile on.
    const bool bc_kept = count <= kWindow && tile != static_cast<int>(group);

    // Window kw's B / C copies go out and its pairs' scalars go into shared memory; returns
    // its tokens. (Every lane is past the previous window's reads of both.)
    auto open_window = [&](int kw) {
      const int n = count - kw < kWindow ? count - kw : kWindow;
      if (!bc_kept) copy_bc(kw, n);
      const InT* const x_p = warp_row.pair_in(s.x, p_pair);
      const InT* const dt_p = warp_row.pair_in(s.dt, p_pair);
      const bool has_z = s.z.present();
      const InT* const z_p = has_z ? warp_row.pair_in(s.z, p_pair) : x_p;  // (no branch around the loads)
      float xv[kWindowedPairsPerLane], dtv[kWindowedPairsPerLane], zv[kWindowedPairsPerLane];
#pragma unroll
      for (int u = 0; u < kWindowedPairsPerLane; ++u) {
        const int kk = k_pair + u * kWindowedPairTokenStep;
        const int k = kw + (kk < n ? kk : n - 1);
        xv[u] = widen(x_p[k * m.x_tok]);
        dtv[u] = widen(dt_p[k * m.dt_tok]);
        zv[u] = widen(z_p[k * m.z_tok]);
      }
      ChannelInputs in;
      if (s.dt_bias.present()) in.dt_bias = s.dt_bias.at(h, p_pair);
      if (s.D.present()) in.D = s.D.at(h, p_pair);
      const float a = s.A.at(h, p_pair);
#pragma unroll
      for (int u = 0; u < kWindowedPairsPerLane; ++u) {
        const int kk = k_pair + u * kWindowedPairTokenStep;
        in.x = xv[u], in.dt = dtv[u], in.z = has_z ? zv[u] : 0.0f;
        const float dtc = channel_dt(s, in);
        scalars[kk * kWindowedTileRows + q_pair] =
            make_float4(decay(a, dtc), dtc * in.x, in.D * in.x, has_z ? silu_gate(in.z) : 1.0f);
      }
      return n;
    };
    // y of window kw's n tokens, finished by the pairs' lanes.
    auto finish_window = [&](int kw, int n) {
#pragma unroll
      for (int u = 0; u < kWindowedPairsPerLane; ++u) {
        const int kk = k_pair + u * kWindowedPairTokenStep;
        if (!pair_valid || kk >= n) continue;
        const float4 sc = scalars[kk * kWindowedTileRows + q_pair];
        // finish_y's arithmetic, on the staged D * x and silu(z)
        float y = y_sums[kk * kWindowedTileRows + q_pair];
        if (s.D.present()) y += sc.z;
        if (s.z.present()) y *= sc.w;
        y_pair[(kw + kk) * m.y_tok] = narrow<InT>(y);
      }
    };

    int n = open_window(0);
    float st[kRows][KB][VEC];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < KB; ++j) widen_chunk<VEC, PoolT>(raw[r][j], st[r][j]);
#pragma unroll 1
    for (int kw = 0;;) {
      const int32_t window = kw == 0 ? first_window : warp_window_dests(m, t, count, kw, lane);
      stage_wait_all();
      __syncwarp();  // the window's B / C and scalars are visible to every lane
#pragma unroll 1
      for (int kk = 0; kk < n; ++kk) {
        const InT* const b_tok = bc + kk * 2 * kN;
        float dA[kRows], dtx[kRows], acc[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float4 sc = scalars[kk * kWindowedTileRows + row_in_warp + r * kRpw];
          dA[r] = sc.x, dtx[r] = sc.y, acc[r] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < KB; ++j) {
          const int c = j * kLanes + li;
          float b[VEC], cc[VEC];
          widen_raw(load_raw_shared<VEC, InT, true>(b_tok + c * VEC), b);
          widen_raw(load_raw_shared<VEC, InT, true>(b_tok + kN + c * VEC), cc);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              st[r][j][v] = advance(st[r][j][v], dA[r], dtx[r], b[v]);
              acc[r] = accumulate_y(acc[r], st[r][j][v], cc[v]);
            }
        }
        const int32_t dst = __shfl_sync(kFullMask, window, kk);
        if (dst >= 0) {
          PoolT* const row = pool + (dst * s.pool_stride[0] + row_offset);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (valid[r])
#pragma unroll
              for (int j = 0; j < KB; ++j)
                store_chunk_streaming(row + r * pool_half + (j * kLanes + li) * VEC, narrow_chunk<VEC, PoolT>(st[r][j]));
        }
        row_sums(acc, kLanes);  // every lane of a row holds its sum; lane r of the row leaves row r's
        if (li < kRows) y_sums[kk * kWindowedTileRows + row_in_warp + li * kRpw] = li == 0 ? acc[0] : acc[1];
      }
      __syncwarp();  // the window's y sums are in; no lane reads its B / C any more
      finish_window(kw, n);
      kw += kWindow;
      if (kw >= count) break;
      n = open_window(kw);  // (each lane rewrites only the scalars it has just read)
    }
  }
}

// Warps per block: 8, fewer when P is small (no warp without a row) or when there
// are few (t, h) pairs (so that every multiprocessor gets some of the rows).
// TORCH_SSD_CUDA_MULTI_WARPS=1..8 overrides it (tuning runs).
int multi_warps(const Dims& d, const RowMap& map) {
  if (const auto forced = env_int("TORCH_SSD_CUDA_MULTI_WARPS", 1, kMaxThreads / kWarp)) return *forced;
  const int rpw = map.rows_per_warp();
  const int64_t want = 2 * static_cast<int64_t>(num_sms());
  int w = kMaxThreads / kWarp;
  while (w > 1 && (w / 2) * rpw >= d.P) w /= 2;
  while (w > 2 && d.T * d.H * ((d.P + w * rpw - 1) / (w * rpw)) < want) w /= 2;
  return w;
}

// The shared memory of a launch with W warps and `group` tokens per group; fills
// L's offsets.
template <typename PoolT>
size_t layout_smem(MultiLaunch& L, int W, bool spill) {
  const size_t threads = static_cast<size_t>(W) * kWarp;
  const size_t bc = 2 * static_cast<size_t>(L.group) * L.smem_n * sizeof(float);
  const size_t state =
      spill ? threads * static_cast<size_t>(L.map.chunks_per_lane) * vec_of<PoolT>() * sizeof(float) : 0;
  L.off_state = static_cast<uint32_t>(bc);
  L.off_dst = static_cast<uint32_t>(bc + state);  // a multiple of 16 bytes
  L.off_scalars = L.off_dst + static_cast<uint32_t>(L.group * sizeof(int64_t));
  L.off_mask = L.off_scalars + static_cast<uint32_t>(4 * L.group * L.rows_per_block * sizeof(float));
  return L.off_mask + sizeof(uint32_t);
}

template <typename PoolT, bool kUnit, bool kAPerN, bool kSpill>
void launch(const MultiStepParams& m, const MultiLaunch& L, int W, size_t smem, uint32_t blocks,
            cudaStream_t stream) {
  auto kernel = multi_step_kernel<PoolT, kUnit, kAPerN, kSpill>;
  allow_smem(kernel, smem);
  kernel<<<blocks, W * kWarp, smem, stream>>>(m, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tiles along P per warp of the lean kernel (TORCH_SSD_CUDA_MULTI_TILES=1..64
// overrides): as many as keep at least kMinWaves waves of warps at warps_per_sm
// (what the kernel's registers allow), so that the first window's decision and the row's slots serve
// several tiles without leaving multiprocessors idle at the end. More, smaller groups (at
// least 6 or 12 waves: a fuller last wave) measured level or up to 11 % slower on an H200
// (BENCHMARKS.md, ninth session). With `at_least_two` (16-bit pools, kWidened) two
// wherever one tile per warp fills kMinWaves waves: with the next tile's rows copied
// during this one (pick_next_rows), 5-14 % faster at T = 16 on an H200 (1.6 and 2.6 waves
// of two tiles against 3.2 and 5.2 of one; BENCHMARKS.md, thirteenth session); float32
// pools measured up to 4 % slower; four at T = 16 (bfloat16, an H100) 6-12 % slower
// (thirty-seventh session).
int pick_multi_tiles(int64_t warps_one_tile_each, int64_t tiles, int warps_per_sm, bool at_least_two) {
  if (const auto forced = env_int("TORCH_SSD_CUDA_MULTI_TILES", 1, 64))
    return static_cast<int>(std::min<int64_t>(*forced, tiles));
  constexpr int64_t kMinWaves = 3;
  const int64_t slots = warps_per_sm * static_cast<int64_t>(num_sms());
  int per = 1;
  while (per * 2 <= tiles && warps_one_tile_each / (per * 2) >= kMinWaves * slots) per *= 2;
  if (at_least_two && per == 1 && tiles >= 2 && warps_one_tile_each >= kMinWaves * slots) per = 2;
  return per;
}

// How the lean kernel reads B / C (TORCH_SSD_CUDA_MULTI_BC=registers / staged / widened
// overrides): widened wherever a lane's share of a token fits kMaxWidePieces pieces,
// else staged for rows of kWindow tokens or more on average, registers below.
// Measured on the H200 (BENCHMARKS.md, 2026-12-01, second session): widened (two rows
// per thread) against the former choice (registers below K = 8, staged at 8) -16..+4 %
// in time, 19 of 24 benchmark rows faster; staging every row was up to 13 % slower
// than registers at K = 2 and 4 (a row's one or two stages leave their fixed cost
// unpaid by the tokens).
// `windowed` (multi_step_windowed, rows of N = 128 only: `windowed_fits`) is a knob: 2-4 % slower
// than widened on an H100 (BENCHMARKS.md, thirty-third session).
BcPath pick_bc_path(int64_t tokens, int64_t rows, int64_t pieces, bool windowed_fits) {
  const bool widened_fits = pieces <= kWarp * kMaxWidePieces;
  constexpr const char* kKnob = "TORCH_SSD_CUDA_MULTI_BC";
  if (env_is(kKnob, "registers")) return BcPath::kRegisters;
  if (env_is(kKnob, "staged")) return BcPath::kStaged;
  if (env_is(kKnob, "widened") && widened_fits) return BcPath::kWidened;
  if (env_is(kKnob, "windowed") && windowed_fits) return BcPath::kWindowed;
  if (widened_fits) return BcPath::kWidened;
  return tokens >= kWindow * rows ? BcPath::kStaged : BcPath::kRegisters;
}

// Whether the lean kernel (kWidened) writes its states by bulk copies from shared
// memory (bulk_store) instead of 16-byte stores from registers; sm_90 only.
// TORCH_SSD_CUDA_MULTI_BULK=1 / =0 forces it on / off. By default for float32 pools
// with 4 tokens or more per row and more than 1200 rows per multiprocessor (T >= 32 on
// the benchmark's shapes), where an H200 measured it 0.4-8.9 % faster in two runs (12
// of 12 cells); it was 7-18 % slower for bfloat16 pools, and -0.3..+18 % at K = 2 or
// T = 16 (BENCHMARKS.md, eighth session).
bool pick_bulk_stores(const Dims& d, int64_t tokens, int elem_size) {
  if (!device_is_sm90()) return false;
  return env_switch("TORCH_SSD_CUDA_MULTI_BULK", elem_size == 4 && tokens >= 4 * d.T && lean_rows_per_sm(d) > 1200);
}

// Whether the lean kernel (kWidened) copies a warp's next tile's rows into shared memory
// during this tile (kNextRows; TORCH_SSD_CUDA_MULTI_NEXT_ROWS=1 / =0 forces it on / off).
// By default wherever a warp walks several tiles and the shared memory is not taken by
// the bulk stores' buffers (with them: 28 KB per warp, fewer warps per multiprocessor,
// 4-10 % slower on an H200). Measured on an H200 (BENCHMARKS.md, thirteenth session).
bool pick_next_rows(int tiles_per_warp, bool bulk_stores) {
  return env_switch("TORCH_SSD_CUDA_MULTI_NEXT_ROWS", tiles_per_warp > 1 && !bulk_stores);
}

// Tokens of a row whose widened B / C the lean kernel (kWidened) keeps for all of its
// warp's tiles (LeanMultiLaunch::kept_bc_tokens; 0: none, two alternating buffers).
// TORCH_SSD_CUDA_MULTI_KEPT_BC=1 / =0 forces it on / off. By default wherever a warp walks
// several tiles and the bulk stores' buffers do not take the shared memory: the tokens
// that kKeptBcBytes per warp hold (`token_bytes` each), if every row of the fixed form fits,
// and no more than the varlen form's tokens. On an H200 (BENCHMARKS.md, eighteenth session)
// the bfloat16 cells 0.7 % faster on average (-2.3..+1.5 % in time over 24 timings, 19
// faster), less than the 2-5 % predicted: the B / C loads were not what the tiles wait on.
constexpr int64_t kKeptBcBytes = 8192;
int pick_kept_bc(const MultiStepParams& m, int tiles_per_warp, bool bulk_stores, int64_t token_bytes) {
  if (!env_switch("TORCH_SSD_CUDA_MULTI_KEPT_BC", tiles_per_warp > 1 && !bulk_stores)) return 0;
  const int64_t fits = kKeptBcBytes / token_bytes;
  const bool varlen = m.cu_seqlens.data != nullptr;
  if (!varlen && m.K > fits) return 0;  // no row of the fixed form fits
  return static_cast<int>(std::min(fits, varlen ? m.L : m.K));
}

template <typename PoolT, typename InT, int KB>
void launch_lean(const Dims& d, const MultiStepParams& m, const RowMap& map, int64_t grid_rows, int64_t tokens,
                 cudaStream_t stream) {
  LeanMultiLaunch L;
  L.map = map;
  L.heads_per_group = static_cast<uint32_t>(d.H / d.G);
  const int64_t token_bytes = 2 * d.N * static_cast<int64_t>(sizeof(InT));
  L.row_pieces_log2 = row_pieces_log2_of(d.N * static_cast<int64_t>(sizeof(InT)), lean_piece_bytes<PoolT, InT>());
  const BcPath path = pick_bc_path(tokens, d.T, int64_t{2} << L.row_pieces_log2, map.lanes == kWindowedLanes);
  L.rows_per_pass = lean_rows(path) * map.rows_per_warp();
  const int64_t tiles = (d.P + L.rows_per_pass - 1) / L.rows_per_pass;
  L.tiles = static_cast<int>(tiles);
  const int per = pick_multi_tiles(d.H * d.T * tiles, tiles, lean_warps_per_sm(path),
                                   path == BcPath::kWidened && sizeof(PoolT) == 2);
  const unsigned groups = static_cast<unsigned>((tiles + per - 1) / per);
  // TORCH_SSD_CUDA_MULTI_ORDER=1: a head's tile groups side by side in the grid, as the
  // single-token lean kernel orders its tiles at large T (pick_lean_order). A tuning
  // knob, off by default: on an H200 level at T = 64 and mixed at T = 16 (-8.8..+6.4 % in
  // time over two runs; BENCHMARKS.md, eighth session).
  L.tiles_inner = lean_tiles_inner("TORCH_SSD_CUDA_MULTI_ORDER", false, d.H);
  const dim3 grid = lean_grid(L.tiles_inner, d.H, grid_rows, groups);
  switch (path) {
    case BcPath::kStaged: {  // stages of up to kWindow tokens, one buffer at most kStageBytes
      while ((int64_t{2} << L.stage_log2) <= kWindow && (token_bytes << (L.stage_log2 + 1)) <= kStageBytes)
        ++L.stage_log2;
      const size_t smem = static_cast<size_t>(2 * token_bytes) << L.stage_log2;
      launch_kernel(multi_step_lean<PoolT, InT, KB, BcPath::kStaged>, grid, dim3(kWarp), smem, stream,
                    use_pdl(), m, L);
      break;
    }
    case BcPath::kWidened: {  // two buffers (or kept_bc_tokens) of a token's B and C rows in float32 (+ the store buffers)
      L.bulk_stores = pick_bulk_stores(d, tokens, static_cast<int>(sizeof(PoolT)));
      const int64_t wide_token_bytes = 2 * d.N * static_cast<int64_t>(sizeof(float));
      L.kept_bc_tokens = pick_kept_bc(m, per, L.bulk_stores, wide_token_bytes);
      const size_t bc_bytes = static_cast<size_t>(std::max(2, L.kept_bc_tokens) * wide_token_bytes);
      L.store_smem_offset = static_cast<int>(bc_bytes);
      const size_t store_row_bytes = d.N * sizeof(PoolT) + kStoreRowPad;  // the kernel's store_pitch
      size_t smem = bc_bytes + (L.bulk_stores ? 2 * static_cast<size_t>(L.rows_per_pass) * store_row_bytes : 0);
      L.next_rows = pick_next_rows(per, L.bulk_stores);
      L.next_rows_offset = static_cast<int>(smem);
      if (L.next_rows) smem += static_cast<size_t>(lean_rows(path)) * KB * kWarp * 16;
      const bool fixed = use_fixed_lanes(map, "TORCH_SSD_CUDA_MULTI_FIXED_LANES");
      auto widened = L.next_rows ? (fixed ? multi_step_lean<PoolT, InT, KB, BcPath::kWidened, true, kFixedLanes>
                                          : multi_step_lean<PoolT, InT, KB, BcPath::kWidened, true>)
                                 : (fixed ? multi_step_lean<PoolT, InT, KB, BcPath::kWidened, false, kFixedLanes>
                                          : multi_step_lean<PoolT, InT, KB, BcPath::kWidened, false>);
      allow_smem(widened, smem);
      launch_kernel(widened, grid, dim3(kWarp), smem, stream, use_pdl(), m, L);
      break;
    }
    case BcPath::kWindowed:
      launch_kernel(multi_step_windowed<PoolT, InT, KB>, grid, dim3(kWarp), windowed_smem<InT>(), stream, use_pdl(),
                    m, L);
      break;
    default:
      launch_kernel(multi_step_lean<PoolT, InT, KB, BcPath::kRegisters>, grid, dim3(kWarp), 0, stream,
                    use_pdl(), m, L);
  }
}

void multi_into(const MultiDims& md, const Tensor& ssm_pool, const Tensor& x, const Tensor& dt,
                const Tensor& A, const Tensor& B, const Tensor& C, const OptTensor& cu_seqlens,
                const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                const OptTensor& slot_idx, const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                const OptTensor& num_accepted_tokens, bool write_state, const Tensor& y) {
  const Dims& d = md.d;
  const bool varlen = cu_seqlens.has_value();
  if (d.H == 0 || d.P == 0) return;  // y is empty and no pool row has an element
  if (varlen ? md.L == 0 : (d.T == 0 || md.K == 0)) return;
  const MultiStepParams m =
      make_multi_step_params(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                             dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, y);
  const cudaStream_t stream = current_stream();
  const bool unit = rows_vectorizable(ssm_pool);
  const bool a_per_n = d.N > 1 && A.stride(2) != 0;

  with_elem_type(m.step.pool_dtype, [&](auto tag) {
    using PoolT = decltype(tag);
    const RowMap map = step_row_map<PoolT>(d.N);
    const int64_t grid_rows = d.T + (varlen ? 1 : 0);  // varlen: a row of blocks that clear unowned tokens
    // The lean kernel keeps a lane's whole row in 32 float32 registers (KB * VEC), and
    // counts slots, tokens and channels in 32 bits (tokens and channels with room for a
    // tile or a few tokens past the end).
    constexpr int64_t k32 = int64_t{1} << 31;
    const bool lean = want_lean() && map.chunks_per_lane * vec_of<PoolT>() == 32 && d.S < k32 &&
                      d.T * multi_write_columns(m) < k32 && (varlen ? md.L : d.T * md.K) < k32 / 2 &&
                      d.P < k32 / 2 &&
                      lean_applies<PoolT>(d, map, unit, a_per_n, grid_rows, x, dt, B, C, z, y);
    if (lean) {
      auto with_in_type = [&](auto fn) {
        if (x.scalar_type() == at::kBFloat16) fn(c10::BFloat16{});
        else fn(float{});
      };
      with_in_type([&](auto in_tag) {
        using InT = decltype(in_tag);
        launch_lean<PoolT, InT, 32 / vec_of<PoolT>()>(d, m, map, grid_rows, varlen ? md.L : d.T * md.K, stream);
      });
      return;
    }
    MultiLaunch L;
    L.map = map;
    L.smem_n = L.map.chunks() * vec_of<PoolT>();
    const bool spill = L.map.chunks_per_lane > step_chunks_per_batch<PoolT>();
    int W = multi_warps(d, L.map);
    // Tokens per group: what fits the staging budget, at most the longest row.
    auto group_for = [&](int w) {
      const size_t rows = static_cast<size_t>(w) * L.map.rows_per_warp();
      const size_t per_token = 2 * L.smem_n * sizeof(float) + sizeof(int64_t) + 4 * rows * sizeof(float);
      int64_t gsize = static_cast<int64_t>(kGroupSmemBytes / per_token);
      gsize = std::max<int64_t>(1, std::min<int64_t>({gsize, kMaxGroup, varlen ? md.L : md.K}));
      return static_cast<int>(gsize);
    };
    auto setup = [&](int w) {
      L.rows_per_block = w * L.map.rows_per_warp();
      L.group = group_for(w);
      return layout_smem<PoolT>(L, w, spill);
    };
    size_t smem = setup(W);
    // A spilled state takes shared memory per thread: fewer warps until it fits.
    constexpr size_t kSmemCap = 200 * 1024;
    while (W > 1 && smem > kSmemCap) smem = setup(W /= 2);
    L.p_blocks = static_cast<uint32_t>((d.P + L.rows_per_block - 1) / L.rows_per_block);
    L.heads = static_cast<uint32_t>(d.H);
    L.heads_per_group = static_cast<uint32_t>(d.H / d.G);
    const int64_t row_blocks = d.T * d.H * L.p_blocks;
    // Varlen: blocks that clear y of the tokens no row owns (a grid-stride loop).
    const int64_t threads = static_cast<int64_t>(W) * kWarp;
    const int64_t clear_blocks =
        varlen ? std::min<int64_t>((md.L * d.H * d.P + 8 * threads - 1) / (8 * threads), num_sms()) : 0;
    const int64_t blocks = row_blocks + clear_blocks;
    TORCH_CHECK(blocks < (int64_t{1} << 31), "ssd (CUDA): too many rows for one launch");
    if (blocks == 0) return;
    L.row_blocks = static_cast<uint32_t>(row_blocks);
    const uint32_t grid = static_cast<uint32_t>(blocks);
    with_bool(a_per_n, [&](auto kAPerN) {
      constexpr bool a = decltype(kAPerN)::value;
      if (spill) launch<PoolT, false, a, true>(m, L, W, smem, grid, stream);
      else if (unit) launch<PoolT, true, a, false>(m, L, W, smem, grid, stream);
      else launch<PoolT, false, a, false>(m, L, W, smem, grid, stream);
    });
  });
}

Tensor decode_step_multi_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                              const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                              const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                              const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                              const OptTensor& num_accepted_tokens, bool write_state) {
  const MultiDims md = check_decode_step_multi("decode_step_multi", ssm_pool, x, dt, A, B, C, D, z, dt_bias,
                                               slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                                               write_state, nullptr);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  Tensor y = at::empty(x.sizes(), x.options());  // every token is written: its row's y, or 0 for a pad row
  multi_into(md, ssm_pool, x, dt, A, B, C, std::nullopt, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, y);
  return y;
}

void decode_step_multi_out_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                                const Tensor& B, const Tensor& C, const OptTensor& D, const OptTensor& z,
                                const OptTensor& dt_bias, bool dt_softplus, const OptTensor& slot_idx,
                                const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                                const OptTensor& num_accepted_tokens, bool write_state, const Tensor& out) {
  const MultiDims md = check_decode_step_multi("decode_step_multi_out", ssm_pool, x, dt, A, B, C, D, z,
                                               dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
                                               num_accepted_tokens, write_state, &out);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  multi_into(md, ssm_pool, x, dt, A, B, C, std::nullopt, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, out);
}

// Varlen: the kernel writes every token of y -- its row's y, or 0 for tokens of pad
// rows and tokens no row owns -- so y is not cleared first.
Tensor decode_step_varlen_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                               const Tensor& B, const Tensor& C, const Tensor& cu_seqlens, const OptTensor& D,
                               const OptTensor& z, const OptTensor& dt_bias, bool dt_softplus,
                               const OptTensor& slot_idx, const OptTensor& dst_slot_idx, int64_t pad_slot_id,
                               const OptTensor& num_accepted_tokens, bool write_state) {
  const MultiDims md = check_decode_step_varlen("decode_step_varlen", ssm_pool, x, dt, A, B, C, cu_seqlens, D,
                                                z, dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
                                                num_accepted_tokens, write_state, nullptr);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  Tensor y = at::empty(x.sizes(), x.options());
  multi_into(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, y);
  return y;
}

void decode_step_varlen_out_cuda(const Tensor& ssm_pool, const Tensor& x, const Tensor& dt, const Tensor& A,
                                 const Tensor& B, const Tensor& C, const Tensor& cu_seqlens,
                                 const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
                                 bool dt_softplus, const OptTensor& slot_idx, const OptTensor& dst_slot_idx,
                                 int64_t pad_slot_id, const OptTensor& num_accepted_tokens, bool write_state,
                                 const Tensor& out) {
  const MultiDims md = check_decode_step_varlen("decode_step_varlen_out", ssm_pool, x, dt, A, B, C,
                                                cu_seqlens, D, z, dt_bias, slot_idx, dst_slot_idx,
                                                pad_slot_id, num_accepted_tokens, write_state, &out);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  multi_into(md, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
             pad_slot_id, num_accepted_tokens, write_state, out);
}

}  // namespace
}  // namespace cuda
}  // namespace ssd

TORCH_LIBRARY_IMPL(ssd, CUDA, m) {
  m.impl("decode_step_multi", &ssd::cuda::decode_step_multi_cuda);
  m.impl("decode_step_multi_out", &ssd::cuda::decode_step_multi_out_cuda);
  m.impl("decode_step_varlen", &ssd::cuda::decode_step_varlen_cuda);
  m.impl("decode_step_varlen_out", &ssd::cuda::decode_step_varlen_out_cuda);
}
