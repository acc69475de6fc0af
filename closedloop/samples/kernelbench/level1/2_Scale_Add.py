import torch
import torch.nn as nn


class Model(nn.Module):
    """y = a * alpha + b, with a learned-free constant alpha."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.alpha + b


N = 1024
M = 512
alpha = 0.5


def get_inputs():
    return [torch.rand(N, M), torch.rand(N, M)]


def get_init_inputs():
    return [alpha]
