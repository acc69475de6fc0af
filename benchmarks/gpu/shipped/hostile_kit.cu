// The hostile candidates' CUDA kit (benchmarks/gpu/shipped/hostile.py): a correct ReLU, a
// deliberately slow one, one launched on a stream of its own that nobody waits for, a write far
// out of bounds and a kernel that never ends. The judge must contain every one of them.
#include <cuda_runtime.h>
#include <cstdint>

namespace {

__global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n, long long spin) {
  if (spin > 0) {  // a slow kernel that is still right: the only hope of a speedup is an attack
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = x[i] > 0.f ? x[i] : 0.f;
}

__global__ void scribble_kernel(float* y, int64_t n) {
  if (threadIdx.x == 0) y[n + ((int64_t)1 << 40)] = 1.f;  // a terabyte past the end
}

__global__ void forever_kernel(volatile int* flag) {
  while (*flag == 0) {  // nobody ever writes it
  }
}

const char* status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* kit_relu(const float* x, float* y, int64_t n, long long spin, void* stream) {
  const int blocks = (int)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024);
  relu_kernel<<<blocks < 1 ? 1 : blocks, 256, 0, (cudaStream_t)stream>>>(x, y, n, spin);
  return status();
}

void* kit_new_stream() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  return (void*)s;
}

const char* kit_scribble(float* y, int64_t n) {
  scribble_kernel<<<1, 32>>>(y, n);
  cudaDeviceSynchronize();
  return status();
}

const char* kit_forever(int* flag) {
  cudaMemset(flag, 0, sizeof(int));
  forever_kernel<<<1, 1>>>(flag);
  cudaDeviceSynchronize();
  return status();
}
