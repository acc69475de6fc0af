"""A frozen scorer of goals: log p_φ(g | conversation) by teacher forcing.

The conversation is rendered with the scorer's chat template, followed by a fixed request to state
the user's goal and the start of the answer; the goal string's tokens are then scored one by one
(sum of their log-probabilities). The answer is tokenised as one string, as the model writes it:
with byte-level BPE the prefix's trailing space belongs to the goal's first word (``' return'``),
so the prefix and the goal tokenised apart would score a token sequence the model never produces
(a lone ``' '`` then ``'return'``). The tokens the prefix alone and prefix + goal share are the
context; the rest, including that space, are the goal's tokens.

The scorer is a *snapshot*: its parameters are copied and frozen at construction, so a policy
update (even to the model it was copied from) cannot change the reward it computes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch

from closedloop.messages import ToolMessage, _Message

GOAL_REQUEST = "Summarise what the user wants, as one line."
GOAL_PREFIX = "The user's goal: "


class GoalScorer:
    def __init__(self, model, tokenizer, *, device: str | None = None, max_batch: int = 16) -> None:
        self.model = copy.deepcopy(model)  # a snapshot: later updates to `model` do not reach us
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = device or next(self.model.parameters()).device
        self.model.to(self.device)
        self.max_batch = max_batch

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> "GoalScorer":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        return cls(model, AutoTokenizer.from_pretrained(str(path)), **kwargs)

    def _context_text(self, messages: Sequence[_Message]) -> str:
        chat = [m.to_openai() for m in messages if not isinstance(m, ToolMessage)] + [
            {"role": "user", "content": GOAL_REQUEST}]
        for m in chat:  # scorers see text only
            if not isinstance(m.get("content"), str):
                m["content"] = "".join(p.get("text", "") for p in m.get("content") or [])
            m.pop("tool_calls", None)
        return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + GOAL_PREFIX

    def _split_ids(self, context: str, goal: str) -> tuple[list[int], list[int]]:
        """(context ids, goal ids) of ``context + goal`` tokenised as one string: the context is
        the longest token prefix it shares with ``context`` tokenised alone."""
        if not goal:
            raise ValueError("the goal string is empty")
        alone = self.tokenizer(context, add_special_tokens=False)["input_ids"]
        whole = self.tokenizer(context + goal, add_special_tokens=False)["input_ids"]
        k = 0
        while k < min(len(alone), len(whole)) and alone[k] == whole[k]:
            k += 1
        if k == 0 or k == len(whole):
            raise ValueError(f"cannot split the tokens of goal {goal!r} from its context")
        return whole[:k], whole[k:]

    @torch.no_grad()
    def logprob(self, messages: Sequence[_Message], goal: str) -> float:
        return self.logprobs([messages], [goal])[0]

    @torch.no_grad()
    def logprobs(self, conversations: Sequence[Sequence[_Message]], goals: Sequence[str]) -> list[float]:
        """Sum of log p(goal tokens | context) for each (conversation, goal) pair, batched."""
        if len(conversations) != len(goals):
            raise ValueError("one goal per conversation")
        out: list[float] = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(goals), self.max_batch):
            rows = []
            for conv, goal in zip(conversations[start:start + self.max_batch], goals[start:start + self.max_batch]):
                rows.append(self._split_ids(self._context_text(conv), goal))
            width = max(len(c) + len(t) for c, t in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, (c, t) in enumerate(rows):  # right padding: positions stay 0..n-1
                seq = torch.tensor(c + t)
                ids[i, : len(seq)] = seq
                attn[i, : len(seq)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits.float()
            logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
            for i, (c, t) in enumerate(rows):
                pos = torch.arange(len(c) - 1, len(c) + len(t) - 1)  # position predicting each goal token
                out.append(float(logp[i, pos, torch.tensor(t)].sum()))
        return out
