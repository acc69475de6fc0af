"""The running batch of ``hf:``'s continuous batching: rows, their KV cache and sampling state.

Why a padded batch rather than paged attention: a ``DynamicCache`` is what every transformers
causal LM accepts, on any device, with any attention implementation. Requests join a batch that
is already decoding by being prefilled on their own and then concatenated to it, left-padded to a
common width (TGI's ``CausalLMBatch.concatenate`` does the same for models without paged
attention); a finished row leaves the batch at once and its caller gets the result then, not when
the longest row of the batch ends. Padding columns are masked (``attention_mask`` 0) and every
row keeps its own ``position_ids``, so a row's logits do not depend on its batch-mates; leading
columns that no remaining row uses are cut off after rows leave.

Sampling stays per row and reproducible: each row draws its uniforms up front from its own seeded
generator, and the ``t``-th token of a row reads the row's ``t``-th uniform, whatever step of the
batch that happens at.

Caches whose layers are not plain :class:`~transformers.cache_utils.DynamicLayer` (sliding-window
or hybrid caches) cannot be padded this way; :meth:`DecodeBatch.mergeable` says so, and the client
then only starts new requests when the running batch is empty (static batching).

Two things keep a decode step cheap on small models, where a step is mostly fixed costs: the KV
cache of a mergeable batch keeps spare room (:func:`_slack_layer_class`: a step writes its key in
place instead of copying the whole cache with ``torch.cat``), and the attention mask goes to the
model already 4D for ``sdpa``/``eager`` (built from the 2D mask in one op, instead of transformers'
mask functions on every step). Both give bit-identical logits (tests/models/test_hf_continuous.py).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

#: Spare key/value columns a layer reserves when it (re)allocates: one copy of the cache then
#: serves this many decode steps.
SLACK_TOKENS = 64


@functools.cache
def _slack_layer_class() -> type:
    """A ``DynamicLayer`` whose keys/values are views into a buffer with spare columns.

    ``update`` writes new columns into the buffer when they fit; anything that replaced the
    tensors (a merge, a row selection, a cut of leading columns) is detected by the tensor no
    longer being the buffer's leading view, and the next update falls back to the plain
    concatenation and reserves a new buffer. The views handed to attention are never written
    where they can see (only columns past their end change).
    """
    from transformers.cache_utils import DynamicLayer

    class SlackLayer(DynamicLayer):
        _buf_k: Any = None
        _buf_v: Any = None

        def _is_buffer_view(self, t: Any, buf: Any) -> bool:
            return (buf is not None and t is not None and t.data_ptr() == buf.data_ptr()
                    and t.shape[:2] == buf.shape[:2] and t.stride() == buf.stride())

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            keys: Any = self.keys
            if self.is_initialized and self._is_buffer_view(keys, self._buf_k) \
                    and self._is_buffer_view(self.values, self._buf_v):
                n, m = keys.shape[-2], key_states.shape[-2]
                if n + m <= self._buf_k.shape[-2]:
                    self._buf_k[..., n:n + m, :] = key_states
                    self._buf_v[..., n:n + m, :] = value_states
                    self.keys, self.values = self._buf_k[..., :n + m, :], self._buf_v[..., :n + m, :]
                    return self.keys, self.values
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            b, h, n, d = keys.shape
            self._buf_k = keys.new_empty(b, h, n + SLACK_TOKENS, d)
            self._buf_v = values.new_empty(values.shape[0], values.shape[1], n + SLACK_TOKENS, values.shape[3])
            self._buf_k[..., :n, :] = keys
            self._buf_v[..., :n, :] = values
            self.keys, self.values = self._buf_k[..., :n, :], self._buf_v[..., :n, :]
            return self.keys, self.values

    return SlackLayer


def _plain_layers(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain (full-attention, growing) dynamic layer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) in (DynamicLayer, _slack_layer_class()) for layer in layers)


def _left_pad(t: Any, width: int, dim: int, value: float = 0) -> Any:
    """``t`` padded on the left of ``dim`` to ``width`` with ``value``."""
    import torch

    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.full(shape, value, dtype=t.dtype, device=t.device), t], dim=dim)


class DecodeBatch:
    """Row-aligned decoding state: ``rows[i]`` owns row ``i`` of every tensor and of the cache.

    ``last`` holds each row's logits for its next token; ``step[i]`` is how many tokens row ``i``
    has drawn. The tensors used for sampling live on the CPU (they are tiny), the cache, mask and
    positions on the model's device.
    """

    def __init__(self, rows: list[Any], cache: Any, attn: Any, next_pos: Any, last: Any, *, greedy: Any,
                 temps: Any, top_p: Any, uniforms: Any, max_new: Any) -> None:
        import torch

        self.rows = rows
        self.cache, self.attn, self.next_pos, self.last = cache, attn, next_pos, last
        self.greedy, self.temps, self.top_p, self.uniforms, self.max_new = greedy, temps, top_p, uniforms, max_new
        self.step = torch.zeros(len(rows), dtype=torch.long)
        self._mergeable = _plain_layers(cache)  # the cache's layer types never change

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ building

    @staticmethod
    def _new_cache(model: Any) -> Any:
        """An empty ``DynamicCache`` for ``model``, its plain layers replaced by slack layers."""
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # transformers < 4.56
            cache = DynamicCache()
        if _plain_layers(cache) and cache.layers:
            cache.layers = [_slack_layer_class()() for _ in cache.layers]
        return cache

    @classmethod
    def can_merge(cls, model: Any) -> bool:
        """Whether ``model``'s batches can take rows mid-decode (see :meth:`mergeable`)."""
        return _plain_layers(cls._new_cache(model))

    @classmethod
    def prefill(cls, model: Any, rows: list[Any], *, pad: int, cache_kw: str, device: Any,
                extra_inputs: dict[str, Any]) -> "DecodeBatch":
        """One forward pass over the rows' left-padded prompts; the batch is then ready to sample."""
        import torch

        width = max(len(r.prompt_ids) for r in rows)
        n = len(rows)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding keeps every row's last token in the last column
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids):] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = cls._new_cache(model)
        input_ids, attn, positions = input_ids.to(device), attn.to(device), positions.to(device)
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **extra_inputs, **{cache_kw: cache})
        return cls._with_sampling(rows, cache, attn, positions[:, -1:] + 1, out.logits[:, -1, :])

    @classmethod
    def from_states(cls, model: Any, rows: list[Any], states: list[Any], *, device: Any) -> "DecodeBatch":
        """A batch of rows whose prompts were prefilled before: ``states[i]`` (a
        :class:`~closedloop.models.prompt_cache.PromptState`) is row ``i``'s cached keys, values
        and next-token logits, left-padded to a common width. No forward pass."""
        import torch

        width = max(s.length for s in states)
        attn = torch.stack([_left_pad(torch.ones(s.length, dtype=torch.long, device=device), width, 0)
                            for s in states])
        cache = cls._new_cache(model)
        for layer_idx, layer in enumerate(cache.layers):
            keys = torch.stack([_left_pad(s.keys[layer_idx], width, -2) for s in states])
            values = torch.stack([_left_pad(s.values[layer_idx], width, -2) for s in states])
            layer.update(keys, values)  # the first update initialises the layer with these tensors
        next_pos = torch.tensor([[s.length] for s in states], dtype=torch.long, device=device)
        return cls._with_sampling(rows, cache, attn, next_pos, torch.stack([s.logits for s in states]))

    def row_state(self, i: int) -> Any:
        """Row ``i``'s prompt state, copied out of a batch that was just prefilled (no step yet)."""
        from closedloop.models.prompt_cache import PromptState

        n = len(self.rows[i].prompt_ids)
        return PromptState(keys=tuple(layer.keys[i, :, -n:, :].clone() for layer in self.cache.layers),
                           values=tuple(layer.values[i, :, -n:, :].clone() for layer in self.cache.layers),
                           logits=self.last[i].clone())

    @classmethod
    def _with_sampling(cls, rows: list[Any], cache: Any, attn: Any, next_pos: Any, last: Any) -> "DecodeBatch":
        """The batch with each row's sampling state (temperature, top-p, its own seeded uniforms)."""
        import torch

        params = [r.req.params for r in rows]
        steps = max(r.max_new for r in rows)
        # Greedy rows read the plain softmax (temperature 1) and draw no uniforms.
        greedy = torch.tensor([p.temperature == 0 for p in params])
        temps = torch.tensor([[1.0 if p.temperature == 0 else float(p.temperature)] for p in params])
        # float64: a top_p of 1e-300 is 0 in float32 (an empty nucleus); the draw keeps the top token
        top_p = torch.tensor([[1.0 if p.temperature == 0 else float(p.top_p)] for p in params], dtype=torch.float64)
        uniforms = torch.stack([torch.zeros(steps, dtype=torch.float64) if p.temperature == 0 else
                                torch.rand(steps, generator=r.generator, dtype=torch.float64)
                                for p, r in zip(params, rows)])
        max_new = torch.tensor([r.max_new for r in rows])
        return cls(list(rows), cache, attn, next_pos, last, greedy=greedy, temps=temps,
                   top_p=top_p, uniforms=uniforms, max_new=max_new)

    def mergeable(self) -> bool:
        """Whether rows can join this batch mid-decode (every cache layer a plain ``DynamicLayer``)."""
        return self._mergeable

    def merge(self, other: "DecodeBatch") -> None:
        """Append ``other``'s rows (freshly prefilled) to this batch, left-padding the narrower side."""
        import torch

        width = max(self.attn.shape[1], other.attn.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, -2), _left_pad(theirs.keys, width, -2)], 0)
            mine.values = torch.cat([_left_pad(mine.values, width, -2), _left_pad(theirs.values, width, -2)], 0)
        self.attn = torch.cat([_left_pad(self.attn, width, 1), _left_pad(other.attn, width, 1)], 0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos], 0)
        self.last = torch.cat([self.last, other.last], 0)
        steps = max(self.uniforms.shape[1], other.uniforms.shape[1])
        pad_cols = (lambda u: torch.cat([u, torch.zeros(u.shape[0], steps - u.shape[1], dtype=u.dtype)], 1)
                    if u.shape[1] < steps else u)
        self.uniforms = torch.cat([pad_cols(self.uniforms), pad_cols(other.uniforms)], 0)
        for name in ("greedy", "temps", "top_p", "max_new", "step"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], 0))
        self.rows = self.rows + other.rows

    # ------------------------------------------------------------------ decoding

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the rows at ``indices`` (in that order), in every tensor and in the cache, then
        cut the leading columns no remaining row attends to."""
        import torch

        idx = torch.tensor(list(indices), dtype=torch.long)
        on_device = idx.to(self.attn.device)
        self.rows = [self.rows[i] for i in indices]
        for name in ("greedy", "temps", "top_p", "uniforms", "max_new", "step"):
            setattr(self, name, getattr(self, name)[idx])
        self.attn, self.next_pos, self.last = self.attn[on_device], self.next_pos[on_device], self.last[on_device]
        self.cache.batch_select_indices(on_device)
        if not self.rows or not self.mergeable():
            return
        used = self.attn.any(0)
        first = int(used.int().argmax())
        if first > 0:
            self.attn = self.attn[:, first:]
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]

    def _step_mask(self, model: Any, mask_4d: bool) -> Any:
        """The mask of a one-token step: the 2D padding mask, or for ``sdpa``/``eager`` models with
        full attention everywhere the 4D mask they would build from it (a query of one token at
        the end sees every unpadded column, so padding is all the mask says)."""
        import torch

        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if not mask_4d or impl not in ("sdpa", "eager") or not self.mergeable():
            return self.attn
        mask = self.attn[:, None, None, :].bool()
        if impl == "sdpa":
            return mask
        dtype = next(model.parameters()).dtype  # eager adds the mask to the scores
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

    def forward(self, model: Any, tokens: Any, cache_kw: str, *, mask_4d: bool = True) -> None:
        """Feed each row's newest token; ``last`` becomes the logits of the token after it.
        ``mask_4d=False`` always passes the 2D mask (models that derive more than attention from it)."""
        import torch

        ones = torch.ones((len(self.rows), 1), dtype=self.attn.dtype, device=self.attn.device)
        self.attn = torch.cat([self.attn, ones], dim=1)
        out = model(input_ids=tokens.to(self.attn.device).unsqueeze(1), attention_mask=self._step_mask(model, mask_4d),
                    position_ids=self.next_pos, use_cache=True, **{cache_kw: self.cache})
        self.last = out.logits[:, -1, :]
        self.next_pos = self.next_pos + 1
