"""Admission for the ``hf:`` client: the request queue, the pause that keeps generation off the
weights, and the worker that admits queued requests into the running batch (prefill, prompt cache)
between decode steps. The steps themselves are :mod:`closedloop.models.hf_decode`'s."""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from closedloop.messages import Turn
from closedloop.models.base import ModelError
from closedloop.models.batching import settle
from closedloop.models.decode_batch import DecodeBatch
from closedloop.models.prompt_cache import PromptCache, PromptState, weights_signature
from closedloop.models.hf_requests import _live_rows, _Request, _Row, log

#: A request waiting beside a running batch joins it after at most this many decode steps, or
#: sooner once the waiting requests number at least 1/_ADMIT_WAITING_RATIO of the running rows (TGI
#: has the same two knobs: max_waiting_tokens, waiting_served_ratio). Measured on the tiny model at 8
#: and 32 in-process clients: 8 steps and a ratio of 2 gave 15-30% more requests/s than 2 and 8,
#: because each admission costs a prefill pass, about as much as a decode step of the whole batch.
#: Admitting prompt-cache hits at once instead (they cost no prefill pass) was no faster at 32
#: clients over HTTP (593 vs 614 requests/s, medians of 4 interleaved runs): each admission still
#: copies the batch's KV cache.
_ADMIT_AFTER_STEPS = 8
_ADMIT_WAITING_RATIO = 2



class HFAdmission:
    """The queue, pause and admission half of :class:`~closedloop.models.hf.HFClient` (whose
    ``__init__`` sets the attributes declared here)."""

    model: Any
    spec: str
    max_batch_size: int
    batch_wait_s: float
    batch_gap_s: float | None
    batch_sizes: list[int]
    decode_steps: int
    weights_lock: threading.RLock
    prompt_cache: PromptCache | None
    _queue: queue.Queue[_Request | None]
    _worker: threading.Thread | None
    _worker_lock: threading.Lock
    _pausing: int
    _pausing_lock: threading.Condition
    _warned_training: bool
    _cancel_ticks: Iterator[int]
    _cancel_stamp: int
    _pad_id: int
    _cache_kw: str

    if TYPE_CHECKING:  # the client's and the decode half's (no stubs: they would shadow them)
        def _prefill_inputs(self, rows: list[_Row], device: Any) -> dict[str, Any]: ...

        def _step(self, batch: DecodeBatch) -> DecodeBatch | None: ...

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No generation runs on the model inside this block (hold it around an optimizer step).

        Waits for the rows decoding now to finish (none joins them once a pause is waiting);
        requests submitted inside the block run after it, on the updated weights. Re-entrant (a ``threading.RLock``). Do not await a generation
        of this client inside the block: it cannot run until the block exits.
        """
        with self._pausing_lock:
            self._pausing += 1
        try:
            with self.weights_lock:
                # the weights may change in here, and not always visibly to version counters (``.data``)
                self._clear_prompt_cache()
                try:
                    yield
                finally:
                    self._clear_prompt_cache()
        finally:
            with self._pausing_lock:
                self._pausing -= 1
                self._pausing_lock.notify_all()

    def _clear_prompt_cache(self) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    def _acquire_unpaused(self) -> bool:
        """Take ``weights_lock`` for a new batch, but never ahead of a waiting :meth:`paused`;
        returns whether it had to wait.

        ``threading`` locks are not fair: a worker that just released the lock could take it
        again at once and start a new batch while a trainer waits; so it yields until no pause
        is pending.
        """
        waited = False
        while True:
            acquired = self.weights_lock.acquire(blocking=False)
            if not acquired:
                waited = True
                self.weights_lock.acquire()
            if not self._pausing:
                return waited
            waited = True
            self.weights_lock.release()
            with self._pausing_lock:
                self._pausing_lock.wait_for(lambda: not self._pausing)

    def _mark_cancelled(self, req: _Request) -> None:
        req.cancelled.set()
        # after the flag: a worker that sees the new stamp also sees the flag (each stamp is unique,
        # so no assignment, in whatever order threads make them, can equal the one last seen)
        self._cancel_stamp = next(self._cancel_ticks)

    @staticmethod
    def _resolve(req: _Request, result: Turn | None = None, error: BaseException | None = None) -> None:
        settle(req.loop, req.future, result, error)

    def _put(self, req: _Request) -> None:
        self._queue.put(req)
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="closedloop-hf-decoder", daemon=True)
                self._worker.start()

    def _gather(self, first: _Request, room: int) -> tuple[list[_Request], bool]:
        """``first`` plus what arrives within ``batch_wait_ms`` (up to ``room`` requests): requests
        sent together (a GRPO group) start together. Also returns whether the stop sentinel came."""
        more, stop = self._take(room - 1, time.perf_counter() + self.batch_wait_s)
        return [first, *more], stop

    def _drain(self, room: int) -> tuple[list[_Request], bool]:
        """What is queued now (up to ``room`` requests), without waiting."""
        return self._take(room, None)

    def _take(self, room: int, deadline: float | None) -> tuple[list[_Request], bool]:
        """Up to ``room`` queued requests, waiting until ``deadline`` (``None``: not at all; with
        ``batch_gap_s``, no longer than that between arrivals), and whether the stop sentinel came."""
        batch: list[_Request] = []
        while len(batch) < room:
            remaining = 0.0 if deadline is None else deadline - time.perf_counter()
            if self.batch_gap_s is not None:
                remaining = min(remaining, self.batch_gap_s)
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _work(self) -> None:
        """The decode worker: admit queued requests into the running batch between steps, decode
        one token for every row, hand each finished row to its caller at once.

        ``weights_lock`` is held from the first admitted row until the batch is empty, so no row
        ever decodes across a weight update; while someone waits in :meth:`paused`, no new row is
        admitted and the running ones drain.

        Prefill and decode run under ``torch.inference_mode`` rather than ``no_grad``: no tensor
        made here (KV cache, logits, masks) ever meets autograd, and skipping version counters and
        view tracking made 32-client decoding of the tiny model about 15% faster (measured). Only
        token ids and float logprobs leave the worker, so a trainer's later backward never sees them.
        """
        import torch

        active: DecodeBatch | None = None
        holding = stopping = False
        first_wait: int | None = None  # the decode step at which a queued request was first seen
        try:
            while True:
                if active is None:
                    if holding:
                        self.weights_lock.release()
                        holding = False
                    if stopping:
                        return
                    first = self._queue.get()
                    if first is None:
                        return
                    reqs, stopping = self._gather(first, self.max_batch_size)
                    if self._acquire_unpaused() and not stopping:
                        # what queued up during a pause (a trainer's next rollout) starts as one batch
                        more, stopping = self._drain(self.max_batch_size - len(reqs))
                        reqs += more
                    holding = True
                    with torch.inference_mode():
                        active = self._admit(reqs, None)
                elif not stopping and not self._pausing and active.mergeable() \
                        and (running := len(_live_rows(active))) < self.max_batch_size:
                    waiting = self._queue.qsize()
                    if waiting and first_wait is None:
                        first_wait = self.decode_steps
                    # Each admission costs a prefill pass, about one decode step: a busy batch lets
                    # newcomers gather for up to _ADMIT_AFTER_STEPS steps (or until enough wait).
                    if waiting and (waiting >= max(1, running // _ADMIT_WAITING_RATIO)
                                    or self.decode_steps - (first_wait or 0) >= _ADMIT_AFTER_STEPS):
                        first_wait = None
                        reqs, stopping = self._drain(self.max_batch_size - running)
                        if reqs:
                            with torch.inference_mode():
                                active = self._admit(reqs, active)
                if active is not None:
                    with torch.inference_mode():
                        active = self._step(active)
        finally:
            if holding:
                self.weights_lock.release()

    def _admit(self, reqs: list[_Request], active: DecodeBatch | None) -> DecodeBatch | None:
        """Prefill the requests still wanted and join them to ``active`` (or start a batch)."""
        import torch

        rows: list[_Row] = []
        for req in reqs:
            if req.future.cancelled() or req.cancelled.is_set():
                continue
            try:
                assert req.encoded is not None, "requests are encoded before they are queued"
                prompt, extras, media = req.encoded
                seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
                # torch takes seeds in [-2**63, 2**64); a negative one as its 64-bit two's complement
                generator = torch.Generator().manual_seed(seed % (1 << 64))
                rows.append(_Row(req, list(prompt), req.max_new, generator, extras=extras, media=media))
            except Exception as e:  # a bad request fails alone, not its batch-mates
                self._resolve(req, error=e)
        if not rows:
            return active
        self.batch_sizes.append(len(rows))
        if getattr(self.model, "training", False) and not self._warned_training:
            self._warned_training = True  # the caller's choice (see the module docstring); said once
            log.warning("%s: generating while the model is in train mode: dropout, if the model has any, "
                        "is active in sampling and in the recorded logprobs", self.spec)
        try:
            fresh = self._prefill(rows, next(self.model.parameters()).device)
            if active is None:
                return fresh
            live = _live_rows(active)
            if len(live) < len(active):
                active.keep(live)  # finished rows leave before the copy a merge makes anyway
            active.merge(fresh)
            return active
        except Exception as e:  # the newcomers fail; rows already decoding go on
            for row in rows:
                self._resolve(row.req, error=ModelError(f"generation failed: {type(e).__name__}: {e}"))
            return active

    def _prefill(self, rows: list[_Row], device: Any) -> DecodeBatch:
        """A batch of ``rows`` ready to sample: a prefill pass over the prompts the prompt cache does
        not hold (each distinct prompt once), the others from their cached states."""
        cache = self.prompt_cache
        if cache is None or getattr(self.model, "training", False):
            return DecodeBatch.prefill(self.model, rows, pad=self._pad_id, cache_kw=self._cache_kw, device=device,
                                       extra_inputs=self._prefill_inputs(rows, device))
        cache.validate(weights_signature(self.model))
        misses: list[_Row] = []
        first_miss: dict[tuple[int, ...], int] = {}  # prompt -> its row among the misses
        reused: list[tuple[_Row, tuple[int, ...], PromptState | None]] = []  # None: the state comes from this prefill
        for row in rows:
            if row.extras is not None or row.media:  # the state depends on more than the token ids
                misses.append(row)
                continue
            key = tuple(row.prompt_ids)
            if key in first_miss:
                cache.count_reuse()
                reused.append((row, key, None))
            elif (state := cache.get(key)) is not None:
                reused.append((row, key, state))
            else:
                first_miss[key] = len(misses)
                misses.append(row)
        batch = None
        if misses:
            batch = DecodeBatch.prefill(self.model, misses, pad=self._pad_id, cache_kw=self._cache_kw, device=device,
                                        extra_inputs=self._prefill_inputs(misses, device))
            new = {key: batch.row_state(i) for key, i in first_miss.items()}
            for key, state in new.items():
                cache.put(key, state)
        if reused:
            states = [state if state is not None else new[key] for _, key, state in reused]
            joined = DecodeBatch.from_states(self.model, [row for row, _, _ in reused], states, device=device)
            if batch is None:
                return joined
            batch.merge(joined)
        assert batch is not None
        return batch
