"""``hf:``'s prompt cache: the KV cache and next-token logits of recent prompts, by exact token ids.

Why: a prefill pass costs about as much as a decode step of the whole batch on a small model, so
each admission of newcomers into a running batch slows every row; and the prompts a framework like
this sends repeat exactly (the ``n`` samples of a GRPO group, retries, evaluation reruns, clients
that send the same system prompt and question). A prompt seen before joins the batch from its
cached state with no forward pass at all, and copies of one prompt admitted together are prefilled
once. This is vLLM's automatic prefix caching restricted to whole prompts, which is what a padded
``DynamicCache`` batch can reuse without a second kernel path: a partial hit would need the
remainder prefilled against a per-row past, which transformers' padded prefill cannot take.
On a 2-core machine, ``closedloop serve`` with the tiny model at 32 clients cycling through six
prompts served 614 requests/s with the cache and 461 without (medians of 4 interleaved runs of
``benchmarks/bench_serve.py --peer none --concurrency 32``, with and without
``--prompt-cache-tokens 0``).

Stale states are never served: the cache remembers a signature of the weights (each parameter's
storage and in-place version counter, which ``optimizer.step``, ``load_state_dict`` and
``copy_`` all bump) and empties itself when it changes, and :meth:`HFClient.paused` empties it
too (an update through ``.data`` bypasses version counters). Models in train mode, multimodal
prompts and caches that cannot be merged (sliding-window layers) are never cached.

A state is a row's keys and values per layer (``(heads, prompt_len, head_dim)``, copied out of the
batch) and its logits for the first new token; the budget is a number of prompt tokens, oldest
entries leave first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable


@dataclass(frozen=True)
class PromptState:
    """One prompt's state after prefill: per-layer keys and values, and its next-token logits."""

    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    logits: Any

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0


#: ``closedloop serve``'s default budget (``--prompt-cache-tokens``); ``HFClient`` defaults to no cache.
SERVE_PROMPT_CACHE_TOKENS = 8192


def weights_signature(model: Any) -> tuple[tuple[int, int], ...]:
    """What changes whenever a parameter's values may have changed: its storage and version."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class PromptCache:
    """Least-recently-used :class:`PromptState`s, at most ``max_tokens`` prompt tokens in all."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[Hashable, PromptState] = OrderedDict()
        self._tokens = 0
        self._signature: Any = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def validate(self, signature: Any) -> None:
        """Empty the cache if the weights' signature is not the one its states were made with."""
        if signature != self._signature:
            self.clear()
            self._signature = signature

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` is cached (no effect on recency or the hit counts)."""
        return key in self._entries

    def get(self, key: Hashable) -> PromptState | None:
        state = self._entries.get(key)
        if state is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return state

    def count_reuse(self) -> None:
        """A copy of a prompt prefilled in the same pass: served without a prefill of its own (a hit)."""
        self.hits += 1

    def put(self, key: Hashable, state: PromptState) -> None:
        """Keep ``state`` (a prompt longer than the whole budget is not kept)."""
        if state.length > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= old.length
        self._entries[key] = state
        self._tokens += state.length
        while self._tokens > self.max_tokens:
            _, gone = self._entries.popitem(last=False)
            self._tokens -= gone.length

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._entries), "tokens": self._tokens}
