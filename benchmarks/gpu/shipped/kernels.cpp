// Torch wrappers of the launchers in kernels.cu (see there): check the inputs, allocate the
// outputs and the scratch buffers, launch. load_inline's `functions=` binds these to Python.
#include <torch/extension.h>

const char* gelu_tanh_launch(const float* x, float* y, int64_t n);
int64_t layer_norm_chunks(int64_t cols);
const char* layer_norm_launch(const float* x, const float* w, const float* b, float* y, double* partials,
                              float* stats, int64_t rows, int64_t cols, double eps);
const char* cross_entropy_launch(const float* logits, const int64_t* targets, float* out, double* rows_out,
                                 int64_t rows, int64_t cols, int64_t ignore_index);

static void launched(const char* err, const char* what) {
  TORCH_CHECK(err == nullptr, what, " failed: ", err == nullptr ? "" : err);
}

static void need(const torch::Tensor& t, torch::ScalarType type, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == type, name, " has dtype ", t.scalar_type(), ", expected ", type);
}

torch::Tensor gelu_tanh(torch::Tensor x) {
  need(x, torch::kFloat, "x");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  launched(gelu_tanh_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel()), "gelu_tanh");
  return y;
}

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
  need(x, torch::kFloat, "x");
  need(weight, torch::kFloat, "weight");
  need(bias, torch::kFloat, "bias");
  const int64_t nd = weight.dim();
  TORCH_CHECK(x.dim() >= nd && x.sizes().slice(x.dim() - nd) == weight.sizes() && bias.sizes() == weight.sizes(),
              "x's trailing dimensions must be the normalized shape");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto bc = bias.contiguous();
  const int64_t cols = wc.numel();
  const int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  auto y = torch::empty_like(xc);
  auto partials = torch::empty({rows * layer_norm_chunks(cols) * 2}, xc.options().dtype(torch::kDouble));
  auto stats = torch::empty({rows * 2}, xc.options());
  launched(layer_norm_launch(xc.data_ptr<float>(), wc.data_ptr<float>(), bc.data_ptr<float>(), y.data_ptr<float>(),
                             partials.data_ptr<double>(), stats.data_ptr<float>(), rows, cols, eps),
           "layer_norm");
  return y;
}

torch::Tensor cross_entropy(torch::Tensor logits, torch::Tensor targets) {
  need(logits, torch::kFloat, "logits");
  need(targets, torch::kLong, "targets");
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "expected logits (N, C) and targets (N)");
  auto lc = logits.contiguous();
  auto tc = targets.contiguous();
  const int64_t rows = lc.size(0), cols = lc.size(1);
  auto out = torch::empty({}, lc.options());
  auto rows_out = torch::empty({rows * 2 > 0 ? rows * 2 : 1}, lc.options().dtype(torch::kDouble));
  launched(cross_entropy_launch(lc.data_ptr<float>(), tc.data_ptr<int64_t>(), out.data_ptr<float>(),
                                rows_out.data_ptr<double>(), rows, cols, -100),
           "cross_entropy");
  return out;
}
