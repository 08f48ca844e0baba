// A model of the widened multi-token kernel's footprint, for tools/cuda_multi_store_model.py
// (built there with torch.utils.cpp_extension.load; a developer tool, not part of the
// extension).
//
// One warp per block, a tile of 8 * kRows head-dim rows of N = 128 per block (4 lanes per
// row, kRows rows per thread, 16-byte chunks: the lean widened kernel's mapping along N), the
// row's source slot read once, then per token the state stored evict-first to the token's
// slot. What happens between the load and the stores is the model's knob:
//   kCompute = false  the loaded chunks stored as they are (the pattern with this footprint);
//   kCompute = true   the step's essential work and nothing else: per element the state's
//                     advance and y's term (fmaf(s, dA, dtx * b), fmaf(s, c, acc)), the
//                     float32 state rounded once per store, y's sum over a row's 4 lanes and
//                     y written; B, C and the per-(row, token) scalars staged in shared memory
//                     before the first store, so the token loop has no global load;
//   extra rounds      `extra` more FMAs per state element per token that change no value
//                     (fmaf(s, 1, 0)): instructions the real kernel spends on what the model
//                     leaves out, to see what each 64 per token costs.
// Occupancy is set from outside by the dynamic shared memory a block asks for.
#include <algorithm>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

namespace {

constexpr int kN = 128;          // state size along N (the model's only one)
constexpr int kLanesPerRow = 4;  // lanes per head-dim row: 32 elements each
constexpr int kRowsPerPass = 8;  // rows one warp covers with kRows = 1

struct Args {
  void* pool;                          // (S, H, P, N), PoolT
  const int64_t* table;                // (T, K) destination slots
  const int64_t* accepted;             // (T,) the row starts from table[t, accepted - 1]
  const __nv_bfloat16 *x, *z, *B, *C;  // x, z (T, K, H, P); B, C (T, K, G, N)
  const __nv_bfloat16* dt;             // (T, K, H)
  const float *A, *D, *dt_bias;        // (H,)
  __nv_bfloat16* y;                    // (T, K, H, P)
  int T, K, H, P, G;
  int extra;
  float one, zero;  // 1 and 0, passed so that the extra rounds are not folded away
};

__device__ __forceinline__ void widen(uint4 raw, float (&v)[8]) {  // 8 bfloat16
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void widen(uint4 raw, float (&v)[4]) {  // 4 float
  v[0] = __uint_as_float(raw.x), v[1] = __uint_as_float(raw.y);
  v[2] = __uint_as_float(raw.z), v[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ uint4 narrow(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 narrow(const float (&v)[4]) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}

template <typename PoolT, int kRows, bool kCompute>
__global__ void __launch_bounds__(32) store_model(Args a) {
  constexpr int kVec = 16 / sizeof(PoolT);           // elements per 16-byte chunk
  constexpr int kChunks = kN / kLanesPerRow / kVec;  // chunks per lane per row
  constexpr int kTileRows = kRowsPerPass * kRows;
  extern __shared__ float4 smem_raw[];
  float* const smem = reinterpret_cast<float*>(smem_raw);

  const int lane = threadIdx.x, li = lane % kLanesPerRow, rq = lane / kLanesPerRow;
  const int tiles = a.P / kTileRows;
  const int tile = blockIdx.x % tiles, h = (blockIdx.x / tiles) % a.H, t = blockIdx.x / tiles / a.H;
  const int p0 = tile * kTileRows;
  const int64_t slot_elems = static_cast<int64_t>(a.H) * a.P * kN;
  PoolT* const pool = static_cast<PoolT*>(a.pool);
  const int64_t* const slots = a.table + static_cast<int64_t>(t) * a.K;
  // Lane k holds token k's slot (K <= 32); a token takes it with one shuffle.
  const int64_t my_slot = lane < a.K ? slots[lane] : 0;
  const int64_t src = slots[a.accepted[t] - 1];
  // Element offset of this lane's chunk j of row r in a slot: + r * 8 rows + j * 4 chunks.
  const int64_t lane_off = (static_cast<int64_t>(h) * a.P + p0 + rq) * kN + li * kVec;
  auto chunk_off = [&](int r, int j) { return lane_off + r * kRowsPerPass * kN + j * kLanesPerRow * kVec; };

  uint4 raw[kRows][kChunks];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kChunks; ++j)
      raw[r][j] = *reinterpret_cast<const uint4*>(pool + src * slot_elems + chunk_off(r, j));

  if constexpr (!kCompute) {
    for (int k = 0; k < a.K; ++k) {
      const int64_t dst = __shfl_sync(0xffffffffu, my_slot, k);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < kChunks; ++j)
          __stcs(reinterpret_cast<uint4*>(pool + dst * slot_elems + chunk_off(r, j)), raw[r][j]);
    }
    return;
  } else {
    // Shared memory: B and C of every token widened ([k][2][N]), then per (token, row) dA,
    // dt * x, D * x and silu(z) ([k][row][4]).
    float* const bc = smem;
    float* const scal = smem + a.K * 2 * kN;
    const int g = h / (a.H / a.G);
    for (int i = lane; i < a.K * kN; i += 32) {
      const int k = i / kN, n = i % kN;
      const int64_t at = ((static_cast<int64_t>(t) * a.K + k) * a.G + g) * kN + n;
      bc[k * 2 * kN + n] = __bfloat162float(a.B[at]);
      bc[k * 2 * kN + kN + n] = __bfloat162float(a.C[at]);
    }
    for (int i = lane; i < a.K * kTileRows; i += 32) {
      const int k = i / kTileRows, q = i % kTileRows;
      const int64_t tk = static_cast<int64_t>(t) * a.K + k;
      const int64_t at = (tk * a.H + h) * a.P + p0 + q;
      const float xv = __bfloat162float(a.x[at]);
      float dt = __bfloat162float(a.dt[tk * a.H + h]) + a.dt_bias[h];
      dt = dt > 20.f ? dt : log1pf(expf(dt));  // softplus
      scal[4 * i + 0] = expf(dt * a.A[h]);
      scal[4 * i + 1] = dt * xv;
      scal[4 * i + 2] = a.D[h] * xv;
      const float zv = __bfloat162float(a.z[at]);
      scal[4 * i + 3] = zv / (1.f + expf(-zv));  // silu(z)
    }
    __syncwarp();

    float st[kRows][kChunks][kVec];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kChunks; ++j) widen(raw[r][j], st[r][j]);

    for (int k = 0; k < a.K; ++k) {
      float dA[kRows], dtx[kRows], acc[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 s4 = *reinterpret_cast<const float4*>(scal + 4 * (k * kTileRows + r * kRowsPerPass + rq));
        dA[r] = s4.x, dtx[r] = s4.y, acc[r] = 0.f;
      }
      const float* const bk = bc + k * 2 * kN;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        float b[kVec], c[kVec];
#pragma unroll
        for (int v = 0; v < kVec; v += 4) {
          const float4 bv = *reinterpret_cast<const float4*>(bk + (j * kLanesPerRow + li) * kVec + v);
          const float4 cv = *reinterpret_cast<const float4*>(bk + kN + (j * kLanesPerRow + li) * kVec + v);
          b[v] = bv.x, b[v + 1] = bv.y, b[v + 2] = bv.z, b[v + 3] = bv.w;
          c[v] = cv.x, c[v + 1] = cv.y, c[v + 2] = cv.z, c[v + 3] = cv.w;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int v = 0; v < kVec; ++v) {
            st[r][j][v] = fmaf(st[r][j][v], dA[r], dtx[r] * b[v]);
            acc[r] = fmaf(st[r][j][v], c[v], acc[r]);
          }
      }
#pragma unroll 1
      for (int e = 0; e < a.extra; ++e)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < kChunks; ++j)
#pragma unroll
            for (int v = 0; v < kVec; ++v) st[r][j][v] = fmaf(st[r][j][v], a.one, a.zero);
      const int64_t dst = __shfl_sync(0xffffffffu, my_slot, k);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < kChunks; ++j)
          __stcs(reinterpret_cast<uint4*>(pool + dst * slot_elems + chunk_off(r, j)), narrow(st[r][j]));
#pragma unroll
      for (int off = kLanesPerRow / 2; off > 0; off /= 2)
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
      if (li == 0)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int q = r * kRowsPerPass + rq;
          const float4 s4 = *reinterpret_cast<const float4*>(scal + 4 * (k * kTileRows + q));
          const float yv = (acc[r] + s4.z) * s4.w;
          a.y[((static_cast<int64_t>(t) * a.K + k) * a.H + h) * a.P + p0 + q] = __float2bfloat16_rn(yv);
        }
    }
  }
}

using KernelFn = void (*)(Args);

KernelFn pick(bool bf16, int64_t rows, bool compute) {
  TORCH_CHECK(rows == 1 || rows == 2, "rows per thread: 1 or 2");
#define SSD_MODEL_PICK(T)                                                         \
  if (rows == 1) return compute ? store_model<T, 1, true> : store_model<T, 1, false>; \
  return compute ? store_model<T, 2, true> : store_model<T, 2, false>;
  if (bf16) {
    SSD_MODEL_PICK(__nv_bfloat16)
  } else {
    SSD_MODEL_PICK(float)
  }
#undef SSD_MODEL_PICK
}

// Shared memory the compute form needs (bytes).
int64_t needed_smem(int64_t K, int64_t rows, bool compute) {
  return compute ? K * (2 * kN + kRowsPerPass * rows * 4) * 4 : 0;
}

// Lets `fn` launch with `smem` bytes of dynamic shared memory. The limit is raised, never
// set below the 48 KB default: a lower one left by one form would refuse another form's
// larger launch of the same kernel.
constexpr int64_t kDefaultSmemLimit = 48 * 1024;

void allow_smem(KernelFn fn, int64_t smem) {
  const int limit = static_cast<int>(std::max(smem, kDefaultSmemLimit));
  C10_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
}

// {resident blocks per SM, registers per thread, local bytes per thread} for this form
// with `smem` bytes of dynamic shared memory per block.
std::vector<int64_t> occupancy(bool bf16_pool, int64_t rows, bool compute, int64_t smem) {
  const KernelFn fn = pick(bf16_pool, rows, compute);
  allow_smem(fn, smem);
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, 32, static_cast<size_t>(smem)));
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  return {blocks, attr.numRegs, static_cast<int64_t>(attr.localSizeBytes)};
}

void launch(at::Tensor pool, at::Tensor table, at::Tensor accepted, at::Tensor x, at::Tensor dt, at::Tensor z,
            at::Tensor B, at::Tensor C, at::Tensor A, at::Tensor D, at::Tensor dt_bias, at::Tensor y, int64_t rows,
            bool compute, int64_t extra, int64_t smem) {
  TORCH_CHECK(pool.dim() == 4 && pool.size(3) == kN && pool.is_contiguous(), "pool: contiguous (S, H, P, 128)");
  TORCH_CHECK(pool.scalar_type() == at::kBFloat16 || pool.scalar_type() == at::kFloat, "pool: bfloat16 or float32");
  const int64_t T = table.size(0), K = table.size(1), H = pool.size(1), P = pool.size(2), G = B.size(2);
  TORCH_CHECK(K <= 32 && P % (kRowsPerPass * rows) == 0 && H % G == 0, "K <= 32, P a multiple of the tile");
  TORCH_CHECK(smem >= needed_smem(K, rows, compute), "smem below what the form needs");
  for (const at::Tensor* t : {&table, &accepted, &x, &dt, &z, &B, &C, &A, &D, &dt_bias, &y})
    TORCH_CHECK(t->is_contiguous(), "model operands must be contiguous");
  TORCH_CHECK(table.scalar_type() == at::kLong && accepted.scalar_type() == at::kLong, "slots: int64");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16, "inputs: bfloat16");
  Args a{};
  a.pool = pool.data_ptr();
  a.table = table.data_ptr<int64_t>();
  a.accepted = accepted.data_ptr<int64_t>();
  auto bf = [](at::Tensor& t) { return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()); };
  a.x = bf(x), a.z = bf(z), a.B = bf(B), a.C = bf(C), a.dt = bf(dt);
  a.A = A.data_ptr<float>(), a.D = D.data_ptr<float>(), a.dt_bias = dt_bias.data_ptr<float>();
  a.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  a.T = T, a.K = K, a.H = H, a.P = P, a.G = G;
  a.extra = static_cast<int>(extra), a.one = 1.f, a.zero = 0.f;
  const KernelFn fn = pick(pool.scalar_type() == at::kBFloat16, rows, compute);
  if (smem > kDefaultSmemLimit) allow_smem(fn, smem);  // (no host call per timed launch below it)
  const int blocks = static_cast<int>(T * H * (P / (kRowsPerPass * rows)));
  fn<<<blocks, 32, static_cast<size_t>(smem), c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "one step of the store model");
  m.def("occupancy", &occupancy, "{blocks per SM, registers, local bytes} with this dynamic shared memory");
  m.def("needed_smem", &needed_smem, "dynamic shared memory the form needs");
}
