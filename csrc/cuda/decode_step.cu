// The fused decode step on CUDA (DESIGN.md sections 2, 3, 5, 6).
//
// Grid: one block per (row t, head h, block of head-dim rows p). Each thread
// owns one p row -- its per-channel scalars (dt, x, the decay) are computed once
// -- and a few chunks of it along N (the RowMap of common.cuh), whose 16-byte
// loads are all issued before the first is used. B and C of (t, group) are
// widened once per block into shared memory. The per-row sum over N has one fixed
// order -- each lane's chunks in turn, then a shuffle tree over the row's lanes --
// shared by the vector path and the scalar gather path, so every layout gives the
// same bits.
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

// Chunks per thread in flight, per pool type (measured on an H200, BENCHMARKS.md):
// float32 rows go best 8 chunks deep, staged through shared memory; 16-bit rows,
// whose 16 bytes hold twice the elements (twice the arithmetic), 4 deep in
// registers. The mapping along N -- and so the result -- follows from this and N
// alone, the same for every layout.
template <typename PoolT>
constexpr int step_batch() {
  return sizeof(PoolT) == 4 ? 8 : 4;
}

// kStage (vector path only): whole chunks are staged into shared memory with
// cp.async instead of being loaded into registers; the arithmetic is the same.
template <typename PoolT, bool kUnit, bool kAPerN, bool kStage>
__global__ void __launch_bounds__(kMaxThreads)
    decode_step_kernel(const __grid_constant__ StepParams s, const StepLaunch L) {
  static_assert(kUnit || !kStage, "staging needs the vector path");
  constexpr int VEC = vec_of<PoolT>();
  constexpr int KB = step_batch<PoolT>();
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
  if constexpr (!kAPerN) dA_splat = decay(s.A.at(h, pc), dtv);
  // Every lane of the warp takes part in the vote, whether or not its row exists.
  const bool last = warp_last_writer(s.dst, s.src, true, s.T, s.S, s.pad_slot_id, t, dst);
  const bool write = valid && last;
  __syncthreads();

  float acc = 0.0f;
  // One chunk: count = VEC for a whole chunk, m.rest for the tail.
  auto step_chunk = [&](int c, int count, bool whole, float(&r)[VEC]) {
    float b[VEC], cc[VEC];
#pragma unroll
    for (int i = 0; i < VEC / 4; ++i) {
      const float4 bv = reinterpret_cast<const float4*>(Bs + c * VEC)[i];
      const float4 cv = reinterpret_cast<const float4*>(Cs + c * VEC)[i];
      b[4 * i] = bv.x, b[4 * i + 1] = bv.y, b[4 * i + 2] = bv.z, b[4 * i + 3] = bv.w;
      cc[4 * i] = cv.x, cc[4 * i + 1] = cv.y, cc[4 * i + 2] = cv.z, cc[4 * i + 3] = cv.w;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if (!whole && v >= count) break;  // the tail: only its real elements
      float dA;
      if constexpr (kAPerN) dA = decay(s.A.at(h, pc, static_cast<int64_t>(c) * VEC + v), dtv);
      else dA = dA_splat;
      r[v] = advance(r[v], dA, dtx, b[v]);
      acc += r[v] * cc[v];
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

// Warps per block. TORCH_SSD_CUDA_WARPS=1..8 overrides the heuristic (for tuning
// runs; read on every call so that one process can sweep it).
int pick_warps(const Dims& d, const RowMap& m, int elem_size) {
  const char* env = std::getenv("TORCH_SSD_CUDA_WARPS");
  const int forced = env ? std::atoi(env) : 0;
  if (forced >= 1 && forced <= kMaxThreads / kWarp) return forced;
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
  const char* env = std::getenv("TORCH_SSD_CUDA_STAGE");
  if (env && (env[0] == '0' || env[0] == '1')) return env[0] == '1';
  return pool_dtype == Dtype::kFloat32;
}

template <typename PoolT, bool kUnit, bool kAPerN, bool kStage>
void launch(const StepParams& s, StepLaunch L, int W, cudaStream_t stream) {
  auto kernel = decode_step_kernel<PoolT, kUnit, kAPerN, kStage>;
  const size_t smem = 2 * static_cast<size_t>(L.smem_n) * sizeof(float) +
                      (kStage ? static_cast<size_t>(W) * kWarp * step_batch<PoolT>() * 16 : 0);
  allow_smem(kernel, smem);
  const int64_t blocks = s.T * s.H * L.p_blocks;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "ssd.decode_step (CUDA): too many rows for one launch");
  kernel<<<static_cast<unsigned>(blocks), W * kWarp, smem, stream>>>(s, L);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
    StepLaunch L;
    L.map = make_row_map(d.N, vec_of<PoolT>(), step_batch<PoolT>());
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
