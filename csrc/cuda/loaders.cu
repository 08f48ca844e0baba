// The loader verbs on CUDA: load_state, load_bc, store_state (DESIGN.md section 1).
//
// All three copy rows along N from one tensor to another, converting the element
// type on the way (widening exactly, or rounding to nearest even once on the
// store). One kernel serves them: a block covers a run of rows of one index t
// (so the slot, and for store_state whether row t is the last writer of its slot,
// is the same for the whole block), with the RowMap of common.cuh along N.
#include "common.cuh"

namespace ssd {
namespace cuda {
namespace {

enum class Verb { kLoadState, kStoreState, kLoadBC };

// Rows are indexed (t, a, b): a run of A * Bn rows per t.
struct CopyParams {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t src_stride[4] = {0, 0, 0, 0};  // (t or slot, a, b, n)
  int64_t dst_stride[4] = {0, 0, 0, 0};
  int64_t T = 0, A = 0, Bn = 1;
  int64_t S = 0, pad_slot_id = -1;
  SlotRef slots;
  RowMap map;
  int rows_per_block = 0;
  uint32_t row_blocks = 0;  // blocks per t
};

template <typename SrcT, typename DstT, bool kUnit, Verb V>
__global__ void __launch_bounds__(kMaxThreads) copy_rows_kernel(const __grid_constant__ CopyParams q) {
  constexpr int VEC = vec_of<SrcT>() > vec_of<DstT>() ? vec_of<SrcT>() : vec_of<DstT>();
  const RowMap& m = q.map;
  const int64_t t = blockIdx.x / q.row_blocks;  // 32-bit division: the grid fits in 2^31
  const int64_t rb = blockIdx.x % q.row_blocks;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int li = lane & (m.lanes - 1);
  const int64_t row = rb * q.rows_per_block + static_cast<int64_t>(warp) * m.rows_per_warp() +
                      (lane >> m.lanes_log2);
  const bool valid = row < q.A * q.Bn;
  const uint32_t row32 = valid ? static_cast<uint32_t>(row) : 0u, bn = static_cast<uint32_t>(q.Bn);
  const int64_t a = row32 / bn, b = row32 % bn;

  // Which slot, and whether this t reads / writes it.
  int64_t src_outer = t, dst_outer = t;
  bool read = true, write = true;
  if constexpr (V == Verb::kLoadState) {
    src_outer = q.slots.slot(t, t);
    read = slot_addressable(src_outer, q.S, q.pad_slot_id);  // else: a zero row
  } else if constexpr (V == Verb::kStoreState) {
    dst_outer = q.slots.slot(t, t);
    write = warp_last_writer(q.slots, SlotRef{}, false, q.T, q.S, q.pad_slot_id, t, dst_outer);
  }
  if (!valid || !write) return;  // no barrier in this kernel

  const DstateRow<VEC, kUnit, const SrcT> in{
      static_cast<const SrcT*>(q.src) + src_outer * q.src_stride[0] + a * q.src_stride[1] + b * q.src_stride[2],
      q.src_stride[3]};
  const DstateRow<VEC, kUnit, DstT> out{
      static_cast<DstT*>(q.dst) + dst_outer * q.dst_stride[0] + a * q.dst_stride[1] + b * q.dst_stride[2],
      q.dst_stride[3]};
  // A batch of chunks: every load in flight before the first store.
  constexpr int KB = kChunksPerBatch;
  for (int k0 = 0; k0 < m.chunks_per_lane; k0 += KB) {
    float r[KB][VEC];
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = (k0 + j) * m.lanes + li;
      if (k0 + j >= m.chunks_per_lane) continue;
      if (!read) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) r[j][v] = 0.0f;
      } else if (c < m.nfull) {
        in.load(c, r[j]);
      } else if (c == m.nfull && m.rest > 0) {
        in.load_tail(c, m.rest, r[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      const int c = (k0 + j) * m.lanes + li;
      if (k0 + j >= m.chunks_per_lane) continue;
      if (c < m.nfull) out.store(c, r[j]);
      else if (c == m.nfull && m.rest > 0) out.store_tail(c, m.rest, r[j]);
    }
  }
}

template <typename SrcT, typename DstT, Verb V>
void launch_copy(CopyParams q, bool unit) {
  if (q.T == 0 || q.A * q.Bn == 0 || q.map.n == 0) return;
  constexpr int VEC = vec_of<SrcT>() > vec_of<DstT>() ? vec_of<SrcT>() : vec_of<DstT>();
  q.map = make_row_map(q.map.n, VEC);
  constexpr int kWarps = kMaxThreads / kWarp;
  q.rows_per_block = kWarps * q.map.rows_per_warp();
  q.row_blocks = static_cast<uint32_t>((q.A * q.Bn + q.rows_per_block - 1) / q.rows_per_block);
  const int64_t blocks = q.T * q.row_blocks;
  TORCH_CHECK(blocks < (int64_t{1} << 31) && q.A * q.Bn < (int64_t{1} << 31),
              "ssd (CUDA): too many rows for one launch");
  const cudaStream_t stream = current_stream();
  with_bool(unit, [&](auto kUnit) {
    copy_rows_kernel<SrcT, DstT, decltype(kUnit)::value, V>
        <<<static_cast<unsigned>(blocks), kMaxThreads, 0, stream>>>(q);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void set_strides(int64_t (&dst)[4], const Tensor& t) {
  for (int64_t i = 0; i < 4; ++i) dst[i] = 0;
  const int64_t d = t.dim();
  // Right-align: the last dim is n; a 3-D (T, G, N) tensor has no b dim.
  if (d == 4) {
    for (int64_t i = 0; i < 4; ++i) dst[i] = t.stride(i);
  } else {
    dst[0] = t.stride(0), dst[1] = t.stride(1), dst[2] = 0, dst[3] = t.stride(2);
  }
}

Tensor load_state_cuda(const Tensor& ssm_pool, const OptTensor& slot_idx, int64_t pad_slot_id) {
  const Dims d = check_load_state(ssm_pool, slot_idx, pad_slot_id);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  Tensor out = at::empty({d.T, d.H, d.P, d.N}, ssm_pool.options().dtype(at::kFloat));
  CopyParams q;
  q.src = ssm_pool.data_ptr();
  q.dst = out.data_ptr();
  set_strides(q.src_stride, ssm_pool);
  set_strides(q.dst_stride, out);
  q.T = d.T, q.A = d.H, q.Bn = d.P, q.S = d.S, q.pad_slot_id = pad_slot_id;
  q.slots = slot_ref(slot_idx);
  q.map.n = static_cast<int>(d.N);
  const bool unit = rows_vectorizable(ssm_pool) && rows_vectorizable(out);
  with_elem_type(to_dtype(ssm_pool), [&](auto tag) {
    launch_copy<decltype(tag), float, Verb::kLoadState>(q, unit);
  });
  return out;
}

void store_state_cuda(const Tensor& state, const Tensor& ssm_pool, const OptTensor& slot_idx,
                      int64_t pad_slot_id) {
  const Dims d = check_store_state(state, ssm_pool, slot_idx, pad_slot_id);
  const c10::cuda::CUDAGuard guard(ssm_pool.device());
  CopyParams q;
  q.src = state.data_ptr();
  q.dst = ssm_pool.data_ptr();
  set_strides(q.src_stride, state);
  set_strides(q.dst_stride, ssm_pool);
  q.T = d.T, q.A = d.H, q.Bn = d.P, q.S = d.S, q.pad_slot_id = pad_slot_id;
  q.slots = slot_ref(slot_idx);
  q.map.n = static_cast<int>(d.N);
  const bool unit = rows_vectorizable(state) && rows_vectorizable(ssm_pool);
  with_elem_type(to_dtype(ssm_pool), [&](auto tag) {
    launch_copy<float, decltype(tag), Verb::kStoreState>(q, unit);
  });
}

std::tuple<Tensor, Tensor> load_bc_cuda(const Tensor& B, const Tensor& C) {
  const Dims d = check_load_bc(B, C);
  const c10::cuda::CUDAGuard guard(B.device());
  Tensor Bf = at::empty({d.T, d.G, d.N}, B.options().dtype(at::kFloat));
  Tensor Cf = at::empty({d.T, d.G, d.N}, C.options().dtype(at::kFloat));
  for (const auto& [in, out] : {std::pair<const Tensor&, const Tensor&>{B, Bf}, {C, Cf}}) {
    CopyParams q;
    q.src = in.data_ptr();
    q.dst = out.data_ptr();
    set_strides(q.src_stride, in);
    set_strides(q.dst_stride, out);
    q.T = d.T, q.A = d.G, q.Bn = 1;
    q.map.n = static_cast<int>(d.N);
    const bool unit = rows_vectorizable(in) && rows_vectorizable(out);
    with_elem_type(to_dtype(in), [&](auto tag) {
      launch_copy<decltype(tag), float, Verb::kLoadBC>(q, unit);
    });
  }
  return {Bf, Cf};
}

}  // namespace
}  // namespace cuda
}  // namespace ssd

TORCH_LIBRARY_IMPL(ssd, CUDA, m) {
  m.impl("load_state", &ssd::cuda::load_state_cuda);
  m.impl("load_bc", &ssd::cuda::load_bc_cuda);
  m.impl("store_state", &ssd::cuda::store_state_cuda);
}
