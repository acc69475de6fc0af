// Hand-written CUDA kernels shipped with the GPU check (benchmarks/gpu/) for three KernelBench
// level-1 problems: 88 (minGPT's tanh GELU), 40 (LayerNorm over the last three dimensions) and
// 95 (cross-entropy, mean over rows). float32 in and out, as the problems are.
//
// Why no torch headers here: nvcc then compiles this file in seconds; the torch wrappers live in
// kernels.cpp (a C++ compiler builds those). Each launcher returns nullptr or CUDA's error text.
// Kernels run on the default stream, as KernelBench's own examples do.
#include <cuda_runtime.h>
#include <cstdint>
#include <cmath>

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

int multiprocessors() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
    if (count <= 0) count = 1;
  }
  return count;
}

const char* launch_error() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

int grid_for(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  int64_t cap = (int64_t)multiprocessors() * 8;  // a grid-stride loop does the rest
  if (blocks > cap) blocks = cap;
  return blocks < 1 ? 1 : (int)blocks;
}

// ------------------------------------------------------------------ reductions within a block
template <typename T>
__device__ T warp_sum(T v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block; the total is valid in thread 0.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kWarps ? shared[threadIdx.x] : T(0);
  if (warp == 0) v = warp_sum(v);
  __syncthreads();  // the shared slots may be reused by the caller's next reduction
  return v;
}

// ------------------------------------------------------------------ 88: tanh GELU
__device__ __forceinline__ float gelu_tanh_one(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi), as math.sqrt(2.0 / math.pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * (x * x * x))));
}

__global__ void gelu_tanh_vec4(const float4* __restrict__ x, float4* __restrict__ y, int64_t n4) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
    float4 v = x[i];
    v.x = gelu_tanh_one(v.x);
    v.y = gelu_tanh_one(v.y);
    v.z = gelu_tanh_one(v.z);
    v.w = gelu_tanh_one(v.w);
    y[i] = v;
  }
}

__global__ void gelu_tanh_scalar(const float* __restrict__ x, float* __restrict__ y, int64_t start, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = start + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = gelu_tanh_one(x[i]);
  }
}

// ------------------------------------------------------------------ 40: LayerNorm
// Pass 1: float sums of one chunk of one row (each thread adds at most chunk / kThreads values),
// combined across the block in double. Grid: (rows, chunks).
__global__ void layer_norm_partials(const float* __restrict__ x, double* __restrict__ partials, int64_t cols,
                                    int64_t chunk) {
  __shared__ double shared[kWarps];
  const int64_t row = blockIdx.x;
  const int64_t begin = (int64_t)blockIdx.y * chunk;
  const int64_t end = begin + chunk < cols ? begin + chunk : cols;
  const float* xr = x + row * cols;
  float s = 0.f, ss = 0.f;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float v = xr[j];
    s += v;
    ss += v * v;
  }
  const double total = block_sum<double>((double)s, shared);
  const double total_sq = block_sum<double>((double)ss, shared);
  if (threadIdx.x == 0) {
    double* out = partials + 2 * (row * (int64_t)gridDim.y + blockIdx.y);
    out[0] = total;
    out[1] = total_sq;
  }
}

// Pass 2: each row's mean and 1 / sqrt(var + eps) (biased variance, as torch). Grid: rows.
__global__ void layer_norm_stats(const double* __restrict__ partials, float* __restrict__ stats, int chunks,
                                 int64_t cols, double eps) {
  __shared__ double shared[kWarps];
  const int64_t row = blockIdx.x;
  double s = 0.0, ss = 0.0;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    s += partials[2 * (row * chunks + c)];
    ss += partials[2 * (row * chunks + c) + 1];
  }
  s = block_sum<double>(s, shared);
  ss = block_sum<double>(ss, shared);
  if (threadIdx.x == 0) {
    const double mean = s / (double)cols;
    double var = ss / (double)cols - mean * mean;
    if (var < 0.0) var = 0.0;
    stats[2 * row] = (float)mean;
    stats[2 * row + 1] = (float)(1.0 / sqrt(var + eps));
  }
}

// Pass 3: y = (x - mean) * rstd * w + b. Each thread owns columns and walks the rows, so the
// weight and bias are read once (made for problem 40's few, very long rows; right for any shape).
__global__ void layer_norm_apply(const float* __restrict__ x, const float* __restrict__ w,
                                 const float* __restrict__ b, const float* __restrict__ stats,
                                 float* __restrict__ y, int64_t rows, int64_t cols) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += stride) {
    const float wj = w[j], bj = b[j];
    for (int64_t r = 0; r < rows; ++r) {
      y[r * cols + j] = (x[r * cols + j] - stats[2 * r]) * stats[2 * r + 1] * wj + bj;
    }
  }
}

// ------------------------------------------------------------------ 95: cross-entropy
// One block per row: an online log-sum-exp over the row (one pass through memory), then the
// row's loss and weight (0 for ignore_index, as torch). Targets outside [0, cols) give NaN.
__global__ void cross_entropy_rows(const float* __restrict__ logits, const int64_t* __restrict__ targets,
                                   double* __restrict__ rows_out, int64_t cols, int64_t ignore_index) {
  __shared__ float shared_max[kWarps];
  __shared__ float shared_sum[kWarps];
  const int64_t row = blockIdx.x;
  const float* xr = logits + row * cols;
  float m = -INFINITY, s = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float v = xr[j];
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  // combine the (max, sum) pairs: first within warps, then across them
  for (int off = 16; off > 0; off /= 2) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, off);
    const float s2 = __shfl_down_sync(0xffffffffu, s, off);
    const float mm = fmaxf(m, m2);
    s = (m == -INFINITY ? 0.f : s * expf(m - mm)) + (m2 == -INFINITY ? 0.f : s2 * expf(m2 - mm));
    m = mm;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    shared_max[warp] = m;
    shared_sum[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = -INFINITY, ss = 0.f;
    for (int k = 0; k < kWarps; ++k) mm = fmaxf(mm, shared_max[k]);
    for (int k = 0; k < kWarps; ++k) {
      if (shared_max[k] != -INFINITY) ss += shared_sum[k] * expf(shared_max[k] - mm);
    }
    const int64_t t = targets[row];
    double loss = 0.0, weight = 0.0;
    if (t != ignore_index) {
      weight = 1.0;
      loss = (t < 0 || t >= cols) ? (double)NAN : (double)logf(ss) + (double)mm - (double)xr[t];
    }
    rows_out[2 * row] = loss;
    rows_out[2 * row + 1] = weight;
  }
}

// The mean over the rows that count, in double, by one block.
__global__ void cross_entropy_mean(const double* __restrict__ rows_out, float* __restrict__ out, int64_t rows) {
  __shared__ double shared[kWarps];
  double loss = 0.0, weight = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    loss += rows_out[2 * r];
    weight += rows_out[2 * r + 1];
  }
  loss = block_sum<double>(loss, shared);
  weight = block_sum<double>(weight, shared);
  if (threadIdx.x == 0) out[0] = (float)(loss / weight);  // no row counted: NaN, as torch
}

}  // namespace

// ------------------------------------------------------------------ launchers (called from kernels.cpp)
const char* gelu_tanh_launch(const float* x, float* y, int64_t n) {
  if (n == 0) return nullptr;
  int64_t done = 0;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  if (aligned && n >= 4) {
    const int64_t n4 = n / 4;
    gelu_tanh_vec4<<<grid_for(n4), kThreads>>>(reinterpret_cast<const float4*>(x), reinterpret_cast<float4*>(y), n4);
    done = n4 * 4;
  }
  if (done < n) gelu_tanh_scalar<<<grid_for(n - done), kThreads>>>(x, y, done, n);
  return launch_error();
}

int64_t layer_norm_chunk(int64_t cols) {
  const int64_t chunk = 16384;  // 64 values per thread; a 4M-column row gives 256 blocks
  return cols < chunk ? (cols > 0 ? cols : 1) : chunk;
}

int64_t layer_norm_chunks(int64_t cols) {
  const int64_t chunk = layer_norm_chunk(cols);
  return (cols + chunk - 1) / chunk;
}

const char* layer_norm_launch(const float* x, const float* w, const float* b, float* y, double* partials,
                              float* stats, int64_t rows, int64_t cols, double eps) {
  if (rows == 0 || cols == 0) return nullptr;
  const int64_t chunk = layer_norm_chunk(cols);
  const int chunks = (int)layer_norm_chunks(cols);
  layer_norm_partials<<<dim3((unsigned)rows, chunks), kThreads>>>(x, partials, cols, chunk);
  layer_norm_stats<<<(unsigned)rows, kThreads>>>(partials, stats, chunks, cols, eps);
  layer_norm_apply<<<grid_for(cols), kThreads>>>(x, w, b, stats, y, rows, cols);
  return launch_error();
}

const char* cross_entropy_launch(const float* logits, const int64_t* targets, float* out, double* rows_out,
                                 int64_t rows, int64_t cols, int64_t ignore_index) {
  if (rows == 0) {
    cross_entropy_mean<<<1, kThreads>>>(rows_out, out, 0);
    return launch_error();
  }
  cross_entropy_rows<<<(unsigned)rows, kThreads>>>(logits, targets, rows_out, cols, ignore_index);
  cross_entropy_mean<<<1, kThreads>>>(rows_out, out, rows);
  return launch_error();
}
