import torch
import torch.nn as nn
import triton
import triton.language as tl

CHUNK = 16384  # columns summed by one program in the first pass


@triton.jit
def layer_norm_partials_kernel(x_ptr, part_ptr, cols, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    s = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * cols + offs, mask=offs < cols, other=0.0)
        s += v
        ss += v * v
    out = part_ptr + (row * n_chunks + chunk) * 2
    tl.store(out, tl.sum(s, axis=0))
    tl.store(out + 1, tl.sum(ss, axis=0))


@triton.jit
def layer_norm_stats_kernel(part_ptr, stats_ptr, cols, n_chunks, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_chunks
    s = tl.sum(tl.load(part_ptr + (row * n_chunks + offs) * 2, mask=mask, other=0.0).to(tl.float64), axis=0)
    ss = tl.sum(tl.load(part_ptr + (row * n_chunks + offs) * 2 + 1, mask=mask, other=0.0).to(tl.float64), axis=0)
    mean = s / cols
    var = tl.maximum(ss / cols - mean * mean, 0.0)  # biased variance, as torch
    tl.store(stats_ptr + row * 2, mean.to(tl.float32))
    tl.store(stats_ptr + row * 2 + 1, (1.0 / tl.sqrt(var + eps)).to(tl.float32))


@triton.jit
def layer_norm_apply_kernel(x_ptr, w_ptr, b_ptr, stats_ptr, y_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    mean = tl.load(stats_ptr + row * 2)
    rstd = tl.load(stats_ptr + row * 2 + 1)
    x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * cols + offs, (x - mean) * rstd * w + b, mask=mask)


class ModelNew(nn.Module):
    """LayerNorm over the trailing dimensions in three Triton passes: per-chunk sums spread over
    the whole GPU (the problem has 16 rows of 4M values), per-row statistics, the affine map."""

    def __init__(self, normalized_shape):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = 1e-5

    def forward(self, x):
        x = x.contiguous()
        cols = self.weight.numel()
        rows = x.numel() // cols
        n_chunks = triton.cdiv(cols, CHUNK)
        partials = torch.empty((rows, n_chunks, 2), device=x.device, dtype=torch.float32)
        stats = torch.empty((rows, 2), device=x.device, dtype=torch.float32)
        y = torch.empty_like(x)
        layer_norm_partials_kernel[(rows, n_chunks)](x, partials, cols, n_chunks, CHUNK=CHUNK, BLOCK=1024)
        layer_norm_stats_kernel[(rows,)](partials, stats, cols, n_chunks, self.eps,
                                         BLOCK=triton.next_power_of_2(n_chunks))
        layer_norm_apply_kernel[(rows, triton.cdiv(cols, 1024))](x, self.weight, self.bias, stats, y, cols, BLOCK=1024)
        return y
