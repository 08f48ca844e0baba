// The multi-token decode step on CUDA (docs/multi_token.md): decode_step_multi(_out)
// and decode_step_varlen(_out).
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

// Warps per block: 8, fewer when P is small (no warp without a row) or when there
// are few (t, h) pairs (so that every multiprocessor gets some of the rows).
// TORCH_SSD_CUDA_MULTI_WARPS=1..8 overrides it (tuning runs).
int multi_warps(const Dims& d, const RowMap& map) {
  const char* env = std::getenv("TORCH_SSD_CUDA_MULTI_WARPS");
  const int forced = env ? std::atoi(env) : 0;
  if (forced >= 1 && forced <= kMaxThreads / kWarp) return forced;
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
    MultiLaunch L;
    L.map = step_row_map<PoolT>(d.N);
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
