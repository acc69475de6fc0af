import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cpp_source = r"""
#include <torch/extension.h>
torch::Tensor relu_forward(torch::Tensor x) {
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t n = xc.numel();
    #pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) {
        o[i] = in[i] > 0.f ? in[i] : 0.f;
    }
    return out;
}
"""

relu_ext = load_inline(name="kb_relu_ok", cpp_sources=cpp_source, functions=["relu_forward"],
                       extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return relu_ext.relu_forward(x)
