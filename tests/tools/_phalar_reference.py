"""Verbatim reference code from gladia-research-group/phalar (commit 4a333999d60a0abce6524521fa4892d87bcc3c3d),
files contrastive_model/complex_stuff.py, learned_spectral_pooling.py and similarity_ops.py (the
complex classes only), used by tests/tools/test_phalar.py as the cross-check. Only the imports were
adapted (torch only; the CUDA autocast decorator is dropped).

    MIT License
    
    Copyright (c) 2026 GLADIA Research Group
    
    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:
    
    The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.
    
    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
    SOFTWARE.
"""
# ruff: noqa

import torch
import torch.nn as nn

class CplxLinear(nn.Module):
    def __init__(self, in_f, out_f, bias=False):
        super().__init__()
        self.W = nn.Linear(in_f, out_f*2, bias=False)

        nn.init.kaiming_uniform_(self.W.weight, a=5**0.5)
        with torch.no_grad():
            self.W.weight.mul_(1 / 2**0.5)

        self.bias = bias
        if self.bias:
            self.br = nn.Parameter(torch.zeros(out_f))
            self.bi = nn.Parameter(torch.zeros(out_f))

    def forward(self, x):  # x: complex, real/imag in half
        rp, ip = torch.chunk(self.W(x), 2, dim=-1)

        yr = (rp[:, 0] - ip[:, 1])
        yi = (rp[:, 1] + ip[:, 0])

        if self.bias:
            yr = yr + self.br[None].to(yr.dtype)
            yi = yi + self.bi[None].to(yi.dtype)

        return torch.stack([yr, yi], dim=1)

class CplxRMSNorm(nn.Module):
    def __init__(
        self,
        channels: int
    ):
        super().__init__()

        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Input is B 2 C
        # |x|^2 = Re^2 + Im^2
        mag_sq = (x**2).sum(dim=1)  # B C

        scale = torch.sqrt(mag_sq.mean(dim=-1, keepdim=True) + 1e-6)[:, None]

        # normalization
        x_norm = x / scale

        return x_norm * self.weight.view(1, 1, -1).to(x.dtype)

class modReLU(nn.Module):
    def __init__(self, channels):
        super(modReLU, self).__init__()
        self.b = nn.Parameter(torch.Tensor(channels))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.b, -0.01)

    def forward(self, z):
        mag = ((z**2).sum(dim=1) + 1e-6) ** .5
        
        bias = self.b.view(1, -1)
        
        scale = torch.relu(mag + bias) / mag
        
        return z * scale[:, None]

class CplxSiLU(nn.Module):
    def __init__(self, channels):
        super(CplxSiLU, self).__init__()
        self.b = nn.Parameter(torch.Tensor(channels))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.b, -0.01)

    def forward(self, z):
        mag = ((z**2).sum(dim=1) + 1e-6) ** .5
        
        bias = self.b.view(1, -1)
        
        scale = (mag + bias) * torch.sigmoid(mag + bias) / mag
        
        return z * scale[:, None]

class CplxDropout(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.p = p
    
    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        # input is B 2 *

        # total magnitude is decreased to m * (1 - self.p)
        mask = (torch.rand(tuple(v for i, v in enumerate(x.shape) if i!=1), device=x.device) > self.p).to(x.dtype)
        mask = mask / (1 - self.p)

        return x * mask[:, None]


class LearnedFeaturesSpectralPooling(nn.Module):
    def __init__(self, proj, out_channels=80, output_components=8, complex_output=False, norm=None, center_padding=True):
        super().__init__()
        self.project_in = proj
        self.out_channels = out_channels
        self.output_components = output_components
        self.complex_output = complex_output
        self.norm = norm
        self.center_padding = center_padding
    
    def forward(self, x):
        # input will be of shape B, C, F, T
        x = x.transpose(1, 3) # become B, T, F, C
        x = self.project_in(x).transpose(-1, -2) # become B, d, T
        
        # Learnable temporal compression
        offset = max(0, (self.output_components+1) * 2 + 1 - x.shape[-1])
        if self.center_padding:
            l_pad = offset // 2
            r_pad = offset - l_pad
        else:
            l_pad, r_pad = 0, offset

        r = nn.functional.pad(x, (l_pad, r_pad))

        # FFT over the temporal axis
        r = torch.fft.rfftn(r, dim=(-1,), norm='ortho') # (B, N, T//2 + 1), 'ortho' norm gives invariance to input length

        assert r.shape[-1] >= (self.output_components + 1), f"Expected FFT components ({self.output_components} + 1) exceed available frequency bins ({r.shape[-1]}). Reduce output_components."
        
        r = r[..., 1:self.output_components+1]

        mag = r.abs()#**2
        match self.norm:
            case 'component_wise':
                scale = mag.mean(dim=-2, keepdim=True)
            case 'channel_wise':
                scale = mag.mean(dim=-1, keepdim=True)
            case 'global':
                scale = mag.mean(dim=(-2, -1), keepdim=True)
            case _:
                scale = 1
        scale = (scale + 1e-6) #** .5
        r = r / scale

        if self.complex_output:
            return torch.stack([r.real, r.imag], dim=1)
        else:
            return r.abs()


def complex_normalize(x: torch.Tensor) -> torch.Tensor:
    norm = ((x ** 2).sum(dim=(-2,-1), keepdim=True) + 1e-6) ** .5
    return x / norm


class CplxBilinearSimilarity(nn.Module):
    def __init__(self, dim, psd=False, hermitian=False) -> None:
        super().__init__()
        self.dim = dim
        assert not (psd and hermitian), "Cannot be both PSD and Hermitian."
        self.psd = psd
        self.hermitian = hermitian

        self.W = CplxLinear(dim, dim, bias=False)
        
        # Initialize weights to match COCOLA's scale (0.05)
        # with torch.no_grad():
        #     self.W.W.weight.normal_(0, 0.05)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """
        Computes Re(x^H W y) for all pairs in the batch.
        Output: (B, B) real-valued logits.
        """
        # 1. Normalize
        x = complex_normalize(x) # B, 2, D
        y = complex_normalize(y) # B, 2, D
        
        # 2. Project X using the complex weight matrix W
        proj_x = self.W(x) # B, 2, D
        if self.psd or self.hermitian:
            proj_y = self.W(y)
            if self.psd:
                y = proj_y

        term = torch.matmul(proj_x[..., 0, :], y[..., 0, :].t())
        term += torch.matmul(proj_x[..., 1, :], y[..., 1, :].t())
        if self.hermitian:
            term += torch.matmul(x[..., 0, :], proj_y[..., 0, :].t())
            term += torch.matmul(x[..., 1, :], proj_y[..., 1, :].t())
            term /= 2.0
        
        return term

    def pairwise(self, x: torch.Tensor, y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """
        Computes Re(x^H W y) for matched pairs.
        Output: (B,) real-valued logits.
        """
        x = complex_normalize(x)
        y = complex_normalize(y)
        
        x = self.W(x) # B, 2, D
        if self.psd:
            y = self.W(y)
        
        x_re, x_im = x[..., 0, :], x[..., 1, :]
        y_re, y_im = y[..., 0, :], y[..., 1, :]
        
        # Element-wise dot product
        term1 = (x_re * y_re).sum(dim=-1)
        term2 = (x_im * y_im).sum(dim=-1)
        
        return term1 + term2