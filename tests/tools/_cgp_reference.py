"""Verbatim reference: class ``CGP`` (its patch_cls / patch_avg forwards) from
houtan-ghaffari/BAT_ICML2026 models/heads.py at commit cc922820b43788ade469ba75c37569741555c18a,
renamed OfficialCGP; the frame-wise forward and the type annotations are dropped. Used by
tests/tools/test_cgp_probe.py and benchmarks/bench_cgp_probe.py as the cross-check.

MIT License, Copyright (c) 2026 Houtan Ghaffari. Permission is hereby granted, free of charge, to any
person obtaining a copy of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights to use, copy, modify,
merge, publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons to
whom the Software is furnished to do so, subject to the following conditions: The above copyright
notice and this permission notice shall be included in all copies or substantial portions of the
Software. THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.
"""

import torch
import torch.nn.functional as F
from torch import nn


class OfficialCGP(nn.Module):
    """``CGP`` (patch_cls / patch_avg forwards) copied verbatim from houtan-ghaffari/BAT_ICML2026
    models/heads.py at cc922820 (MIT License, Copyright (c) 2026 Houtan Ghaffari), for cross-checking."""

    def __init__(self, num_classes=None, dim=768, num_prototypes=10000, num_layers=12, use_cls=True, dropout=0.2):
        super().__init__()
        self.num_layers = num_layers
        self.num_prototypes = num_prototypes
        self.prototype_vectors = nn.Parameter(torch.randn(self.num_prototypes, dim, 1, 1) * 0.02)
        self.block_attention = nn.Parameter(torch.ones(num_layers))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(self.num_prototypes * 3, num_classes)
        self.forward_fn = self.patch_cls_forward if use_cls else self.patch_avg_forward

    def patch_cls_forward(self, feat_cache):
        x_patch = feat_cache['patch_tokens']  # L, B, D, T, F
        x_cls = feat_cache['cls_tokens']  # L, B, D
        num_layers, batch_size, feat_dim, time_patch, freq_patch = x_patch.shape
        assert num_layers == self.num_layers, x_patch.shape
        x_patch = F.normalize(x_patch, dim=2)
        x_cls = F.normalize(x_cls, dim=2)
        p = F.normalize(self.prototype_vectors, dim=1)
        a = torch.softmax(self.block_attention, dim=0)
        a_patch = a.reshape(num_layers, 1, 1, 1, 1)
        x_patch = (a_patch * x_patch).sum(dim=0)
        a_cls = a.reshape(num_layers, 1, 1)
        x_cls = (a_cls * x_cls).sum(dim=0)
        act_patch = F.conv2d(x_patch, p)
        act_patch = act_patch.reshape(batch_size, self.num_prototypes, -1)
        act_patch_min = act_patch.min(dim=-1).values
        act_patch_max = act_patch.max(dim=-1).values
        p = p.squeeze()
        act_cls = x_cls @ p.T
        similarity_features = torch.stack([act_patch_min, act_cls, act_patch_max], dim=-1)
        similarity_features = similarity_features.reshape(batch_size, 3 * self.num_prototypes)
        return self.fc(self.dropout(similarity_features))

    def patch_avg_forward(self, feat_cache):
        x_patch = feat_cache['patch_tokens']
        num_layers, batch_size, feat_dim, time_patch, freq_patch = x_patch.shape
        x_patch = F.normalize(x_patch, dim=2)
        p = F.normalize(self.prototype_vectors, dim=1)
        a = torch.softmax(self.block_attention, dim=0)
        a_patch = a.reshape(num_layers, 1, 1, 1, 1)
        x_patch = (a_patch * x_patch).sum(dim=0)
        act_patch = F.conv2d(x_patch, p)
        act_patch = act_patch.reshape(batch_size, self.num_prototypes, -1)
        act_patch_min = act_patch.min(dim=-1).values
        act_patch_max = act_patch.max(dim=-1).values
        act_patch_mu = act_patch.mean(dim=-1)
        similarity_features = torch.stack([act_patch_min, act_patch_mu, act_patch_max], dim=-1)
        similarity_features = similarity_features.reshape(batch_size, 3 * self.num_prototypes)
        return self.fc(self.dropout(similarity_features))

    def forward(self, feat_cache):
        return self.forward_fn(feat_cache)
