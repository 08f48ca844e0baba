// The CUDA runtime's host time per kernel launch against the size of the kernel's
// parameter block, the launch call (<<<>>> or cudaLaunchKernelEx) and the
// programmatic-dependent-launch attribute: what of the decode step's launch cost
// (its StepParams + LeanLaunch block is about 630 bytes) comes from the block's size.
//
//   nvcc -O2 -arch=sm_90 tools/cuda_launch_cost.cu -o launch_cost && ./launch_cost
//   (or: bash tools/device_run.sh launch-cost)
//
// Each case launches an empty kernel `kLaunches` times back to back (fewer than the
// launch queue holds, so the host never waits for the GPU) and prints the host's time
// per launch, the least of kRounds.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

template <int kBytes>
struct Block {
  unsigned char bytes[kBytes];
};

template <int kBytes>
__global__ void empty_kernel(const __grid_constant__ Block<kBytes> b) {
  if (b.bytes[0] == 1 && threadIdx.x == 1024) asm volatile("trap;");  // never: keeps the parameter
}

constexpr int kLaunches = 500;
constexpr int kRounds = 15;

template <typename Launch>
double least_us(Launch launch) {
  for (int i = 0; i < 50; ++i) launch();
  cudaDeviceSynchronize();
  double best = 1e30;
  for (int r = 0; r < kRounds; ++r) {
    cudaDeviceSynchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kLaunches; ++i) launch();
    const auto t1 = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / kLaunches;
    if (us < best) best = us;
  }
  cudaDeviceSynchronize();
  return best;
}

template <int kBytes>
void measure(cudaStream_t stream) {
  Block<kBytes> b = {};
  const double plain = least_us([&] { empty_kernel<kBytes><<<132, 32, 0, stream>>>(b); });
  auto ex = [&](bool pdl) {
    // The configuration csrc/cuda/common.cuh's launch_kernel builds, written out here so
    // that this file builds with nvcc alone (common.cuh needs torch's headers).
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(132);
    config.blockDim = dim3(32);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = pdl ? 1 : 0;
    return least_us([&] { cudaLaunchKernelEx(&config, empty_kernel<kBytes>, b); });
  };
  const double ex_plain = ex(false), ex_pdl = ex(true);
  std::printf("%8d %10.2f %10.2f %10.2f\n", kBytes, plain, ex_plain, ex_pdl);
}

int main() {
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::printf("cuda_launch_cost: no CUDA device\n");
    return 2;
  }
  std::printf("host us per launch (least of %d rounds of %d launches)\n", kRounds, kLaunches);
  std::printf("%8s %10s %10s %10s\n", "bytes", "<<<>>>", "Ex", "Ex+PDL");
  measure<8>(stream);
  measure<128>(stream);
  measure<320>(stream);
  measure<640>(stream);
  measure<1024>(stream);
  measure<2048>(stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) std::printf("error: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
