// Torch wrappers of hostile_kit.cu, plus what an attacker does from the host side.
#include <torch/extension.h>
#include <thread>
#include <unistd.h>

const char* kit_relu(const float* x, float* y, int64_t n, long long spin, void* stream);
void* kit_new_stream();
const char* kit_scribble(float* y, int64_t n);
const char* kit_forever(int* flag);

static void launched(const char* err) { TORCH_CHECK(err == nullptr, "kit: ", err == nullptr ? "" : err); }

torch::Tensor relu(torch::Tensor x, int64_t spin) {
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  launched(kit_relu(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(), spin, nullptr));
  return y;
}

// The same ReLU, slowed down, on a stream of its own; returns before it has run.
torch::Tensor relu_unwaited(torch::Tensor x, int64_t spin) {
  static void* stream = kit_new_stream();
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  launched(kit_relu(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(), spin, stream));
  return y;
}

torch::Tensor scribble(torch::Tensor x) {
  auto y = torch::empty_like(x);
  launched(kit_scribble(y.data_ptr<float>(), y.numel()));
  return y;
}

torch::Tensor forever(torch::Tensor x) {
  auto flag = torch::empty({1}, x.options().dtype(torch::kInt));
  launched(kit_forever(flag.data_ptr<int>()));
  return x;
}

void spin_thread() {
  std::thread([] { volatile uint64_t k = 0; for (;;) k = k + 1; }).detach();
}

void exit_now(int64_t code) { _exit((int)code); }
