"""The decode step of the ``hf:`` client: one token for every row of the running batch, drawn
vectorised with each row's own randomness, incremental text for streaming and stop strings, and the
finished row's :class:`~closedloop.messages.Turn` (see :mod:`closedloop.models.hf` for why the loop is
hand-written)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from closedloop.messages import Turn, Usage
from closedloop.models.base import ModelError
from closedloop.models.batching import settle_many
from closedloop.models.chat_format import parse_completion
from closedloop.models.decode_batch import DecodeBatch
from closedloop.models.hf_requests import _live_rows, _Request, _Row, hf_logprob_spec


class HFDecode:
    """The decode half of :class:`~closedloop.models.hf.HFClient` (whose ``__init__`` sets the
    attributes declared here)."""

    model: Any
    name: str
    decode_steps: int
    decode_rows: int
    cancelled_rows: int
    _cancel_stamp: int
    _cancel_seen: int
    _cache_kw: str
    _eos_ids: set[int]
    _end_markers: tuple[str, ...]
    _step_mask_4d: bool

    if TYPE_CHECKING:  # the client's and the admission half's (no stubs: they would shadow them)
        def decode(self, ids: list[int]) -> str: ...

        @staticmethod
        def _resolve(req: _Request, result: Turn | None = None, error: BaseException | None = None) -> None: ...

    def _step(self, batch: DecodeBatch) -> DecodeBatch | None:
        """Draw one token for every row, finish the rows that ended, feed the rest one step."""
        import torch

        try:
            gone: list[int] = []
            if self._cancel_stamp != self._cancel_seen:
                self._cancel_seen = self._cancel_stamp
                gone = [i for i, r in enumerate(batch.rows) if r.finish is None and r.req.cancelled.is_set()]
            if gone:  # callers that went away: their rows leave the batch (and its KV cache) now
                self.cancelled_rows += len(gone)
                batch.keep([i for i in range(len(batch)) if i not in set(gone)])
                if not len(batch):
                    return None
            tokens, ended = self._sample(batch)
            if ended:
                settle_many([self._outcome(batch.rows[i]) for i in ended])
            live = _live_rows(batch)
            if not live:
                return None
            # A finished row stays in the batch (decoding into nothing) until a quarter of the batch
            # is finished or rows join: each cut copies the whole KV cache, about a decode step.
            if len(live) < len(batch) and (4 * (len(batch) - len(live)) >= len(batch) or not batch.mergeable()):
                batch.keep(live)
                tokens = tokens[torch.tensor(live, dtype=torch.long)]
            self.decode_steps += 1
            self.decode_rows += len(live)
            batch.forward(self.model, tokens, self._cache_kw, mask_4d=self._step_mask_4d)
            return batch
        except Exception as e:
            for row in batch.rows:
                self._resolve(row.req, error=ModelError(f"generation failed: {type(e).__name__}: {e}"))
            return None

    def _sample(self, batch: DecodeBatch) -> tuple[Any, list[int]]:
        """One token per row from ``batch.last``; returns the tokens and the rows that ended.

        Vectorised over the batch (one tempered ``log_softmax``, one top-p mask, one inverse-CDF
        draw); the randomness stays per row: row ``i``'s ``t``-th token reads its own ``t``-th
        uniform, so a seeded request samples the same alone or beside others. Text is decoded per
        token only for rows that stream or have stop strings; the others are decoded once, at the end.
        """
        import torch

        logits = batch.last.float().cpu()
        logp = torch.log_softmax(logits / batch.temps, dim=-1)
        broken = torch.isnan(logp).any(-1)
        if bool(broken.any()):  # a row whose logits are not finite fails alone; its batch-mates go on
            logp = torch.where(broken[:, None], torch.zeros_like(logp), logp)
        if bool(batch.greedy.all()):
            tokens = logits.argmax(-1)
        else:
            col = batch.step.clamp(max=batch.uniforms.shape[1] - 1)[:, None]
            top_p = batch.top_p if bool((batch.top_p < 1.0).any()) else None
            tokens = self._draw(logp, top_p, batch.uniforms.gather(1, col)[:, 0])
            if bool(batch.greedy.any()):
                tokens = torch.where(batch.greedy, logits.argmax(-1), tokens)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        batch.step += 1
        ended: list[int] = []
        for i, (r, token, lp, bad) in enumerate(zip(batch.rows, tokens.tolist(), chosen.tolist(), broken.tolist())):
            if r.finish is not None:  # finished at an earlier step, not yet cut out of the batch
                continue
            if bad:
                r.error = ModelError(f"the model produced non-finite logits at step {len(r.ids)} of this request")
                r.finish = "error"
                ended.append(i)
                continue
            r.ids.append(token)
            r.logprobs.append(lp)
            if token in self._eos_ids:
                r.finish = "stop"
            elif (r.req.on_delta is not None or r.req.params.stop) and self._text_step(r):
                r.finish = "stop"
            elif len(r.ids) >= r.max_new:
                r.finish = "length"
            else:
                continue
            ended.append(i)
        return tokens, ended

    def _outcome(self, row: _Row) -> tuple[asyncio.AbstractEventLoop, asyncio.Future, Turn | None,
                                           BaseException | None]:
        """What to settle the row's future with: its turn, or the error that ended it."""
        if row.error is not None:
            return row.req.loop, row.req.future, None, row.error
        try:
            return row.req.loop, row.req.future, self._finish_turn(row), None
        except Exception as e:
            return row.req.loop, row.req.future, None, e

    @staticmethod
    def _draw(logp, top_p, u):
        """One token per row from ``exp(logp)`` (optionally top-p truncated) by inverse CDF at the
        row's uniform ``u`` (float64 cumulative sums; a zero-probability token is never chosen)."""
        import torch

        probs = logp.exp().double()
        if top_p is not None:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            keep = (torch.cumsum(sorted_p, -1) - sorted_p) < top_p.double()  # smallest set reaching top_p
            keep[:, 0] = True  # the most likely token always stays (as vLLM): a tiny top_p is greedy
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
        cdf = torch.cumsum(probs, -1)
        x = u[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, x, right=True)[:, 0]
        over = tokens >= probs.shape[-1]
        if bool(over.any()):  # u * total rounded up to the total: the last token that can be drawn
            last = (probs > 0).long().cumsum(-1).argmax(-1)
            tokens = torch.where(over, last, tokens)
        return tokens

    def _text_step(self, r: _Row) -> bool:
        """Streaming / stop strings for one row after it drew a (non-end) token: emit the new
        complete text; True when a stop string has appeared."""
        delta = self._advance_text(r)
        if delta and r.req.on_delta is not None:
            r.req.on_delta(delta)
        p = r.req.params
        if p.stop and delta:
            window = r.text[-(max(len(s) for s in p.stop) + len(delta)):]
            return any(s in window for s in p.stop)
        return False

    def _advance_text(self, r: _Row) -> str:
        """Incremental detokenisation (as in TGI/vLLM): only text that is complete, never half of
        a multi-byte character, so deltas concatenate to the full decode."""
        prefix = self.decode(r.ids[r.prefix_offset:r.read_offset])
        full = self.decode(r.ids[r.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            r.prefix_offset, r.read_offset = r.read_offset, len(r.ids)
            r.text += delta
            return delta
        return ""

    def _finish_turn(self, r: _Row) -> Turn:
        text = self.decode(r.ids)
        content_text = text
        if r.finish == "stop" and r.req.params.stop and r.ids[-1] not in self._eos_ids:
            cut = min((i for i in (text.find(s) for s in r.req.params.stop) if i != -1), default=-1)
            if cut != -1:
                content_text = text[:cut]  # OpenAI semantics: the stop string is not part of the reply
        message = parse_completion(content_text, end_markers=self._end_markers)
        finish = r.finish or "length"
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Turn(message=message, model=self.name, prompt_ids=list(r.prompt_ids), completion_ids=list(r.ids),
                    logprobs=list(r.logprobs), loss_mask=[0] * len(r.prompt_ids) + [1] * len(r.ids),
                    logprob_spec=hf_logprob_spec(r.req.params), completion_text=text, finish_reason=finish,
                    media=list(r.media),
                    usage=Usage(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.ids)),
                    latency_s=time.perf_counter() - r.req.submitted)
