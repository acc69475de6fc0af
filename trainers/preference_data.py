"""Preference data: rows → (prompt, chosen, rejected) token ids → padded ``[chosen; rejected]`` batches.

Rows follow TRL's preference formats, so a dataset trains the same here and in ``DPOTrainer``:

- conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages], "tools"?}``;
  implicit prompt: ``{"chosen": [...], "rejected": [...]}`` whose shared leading messages are the prompt;
- plain text: ``{"prompt": str, "chosen": str, "rejected": str}`` (EOS appended to completions, as TRL);
- optional ``ref_chosen_logps`` / ``ref_rejected_logps``: precomputed *summed* reference log-probs
  of each completion; when every row has them no reference model is loaded.

Tokenisation is TRL's (``DPOTrainer._prepare_dataset``): the prompt is rendered with the generation
prompt, prompt+completion without; the completion is what follows their common prefix (every
token of it is trained, the template's end-of-turn markers included). The run store feeds the same
rows through :func:`closedloop.store.export.preference_pairs` (episodes of one task with different
rewards), with the tools the episodes saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from pydantic import Field

from closedloop.trainers.config import StoreSelection

__all__ = ["PreferenceStoreSelection", "PreferenceExample", "PreferenceBatch", "parse_preference_store_spec",
           "load_preference_rows", "store_preference_rows", "encode_preference_rows", "collate_pairs",
           "extract_prompt"]


class PreferenceStoreSelection(StoreSelection):
    """Trajectories from the run store, paired by task (``closedloop runs export --format pairs``)."""

    strategy: Literal["all", "best_worst"] = Field("all", description="Every pair of episodes of a task with "
                                                                      "different rewards, or only best vs worst.")
    min_margin: float = Field(0.0, ge=0, description="Pair only episodes whose rewards differ by more than this.")
    require_same_prompt: bool = Field(True, description="Pair only episodes with identical prompts (turn off for "
                                                        "sampled opening messages; the chosen prompt is used).")


def parse_preference_store_spec(text: str) -> PreferenceStoreSelection:
    """``store:graph=react,strategy=best_worst,min_margin=0.5`` -> :class:`PreferenceStoreSelection`."""
    import yaml

    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text[len("store:"):].split(","))):
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"dataset {text!r}: expected key=value pairs after 'store:', got {part!r}")
        fields[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    unknown = set(fields) - set(PreferenceStoreSelection.model_fields)
    if unknown:
        raise ValueError(f"dataset {text!r}: unknown store filter(s) {sorted(unknown)}; "
                         f"valid: {sorted(PreferenceStoreSelection.model_fields)}")
    return PreferenceStoreSelection.model_validate(fields)


@dataclass
class PreferenceExample:
    """One pair, tokenised: the shared prompt and the two completions (TRL's ``prompt_ids``,
    ``chosen_ids``, ``rejected_ids``), with precomputed summed reference log-probs if given."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen_logps: float | None = None
    ref_rejected_logps: float | None = None
    source: str = ""


# --------------------------------------------------------------------------- sources


def load_preference_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local file or ``datasets`` directory (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``)."""
    from closedloop.trainers.data import load_chat_rows

    return load_chat_rows(path)


def store_preference_rows(selection: PreferenceStoreSelection, store_path: str | None = None) -> list[dict[str, Any]]:
    """Preference rows from stored episodes: :func:`~closedloop.store.export.preference_pairs` over the
    selected trajectories, each row given the tools its chosen episode recorded."""
    from closedloop.store.export import preference_pairs
    from closedloop.trainers.data import load_store_trajectories

    trajs = load_store_trajectories(selection, store_path)
    by_id = {t.metadata.get("run_id", t.id): t for t in trajs}
    rows = []
    for row in preference_pairs(trajs, strategy=selection.strategy, min_margin=selection.min_margin,
                                require_same_prompt=selection.require_same_prompt):
        tools = by_id[row["chosen_id"]].metadata.get("tools")
        if isinstance(tools, list) and tools:
            row["tools"] = tools
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- tokenisation


def extract_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``extract_prompt``: the longest shared leading part of chosen and rejected (messages, or
    characters with a space before the first difference left to the completions) is the prompt."""
    chosen, rejected = row["chosen"], row["rejected"]
    n = min(len(chosen), len(rejected))
    for i in range(n):
        if chosen[i] != rejected[i]:
            n = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(tokenizer: Any, messages: list[Any], tools: Any, generation_prompt: bool) -> list[int]:
    from closedloop.trainers.data import _ids, _to_template_dicts

    return _ids(tokenizer.apply_chat_template(_to_template_dicts(messages), tools=tools or None, tokenize=True,
                                              add_generation_prompt=generation_prompt))


def encode_preference_rows(rows: Iterable[dict[str, Any]], tokenizer: Any, *, source: str = "") -> list[PreferenceExample]:
    """Rows (module docstring) -> :class:`PreferenceExample` list; a malformed row is a ``ValueError``
    naming it. Rows with precomputed reference log-probs must have both."""
    from closedloop.trainers.data import _ids

    out = []
    for n, row in enumerate(rows):
        where = f"{source or 'preference data'} row {n}"
        if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
            raise ValueError(f"{where}: expected an object with 'chosen' and 'rejected' (and 'prompt'), got "
                             f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
        if "prompt" not in row:
            row = extract_prompt(row)
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        if not chosen or not rejected:
            raise ValueError(f"{where}: empty chosen or rejected completion")
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        try:
            if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
                eos = tokenizer.eos_token or ""
                chosen = chosen if chosen.endswith(eos) else chosen + eos
                rejected = rejected if rejected.endswith(eos) else rejected + eos
                p = _ids(tokenizer(text=prompt))
                pc, pr = _ids(tokenizer(text=prompt + chosen)), _ids(tokenizer(text=prompt + rejected))
            elif isinstance(chosen, list) and isinstance(rejected, list) and isinstance(prompt, list):
                p = _render(tokenizer, prompt, tools, True)
                pc = _render(tokenizer, list(prompt) + list(chosen), tools, False)
                pr = _render(tokenizer, list(prompt) + list(rejected), tools, False)
            else:
                raise ValueError("prompt, chosen and rejected must all be text or all be message lists")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        k = min(_common_prefix(p, pc), _common_prefix(p, pr))
        refs = (row.get("ref_chosen_logps"), row.get("ref_rejected_logps"))
        if (refs[0] is None) != (refs[1] is None):
            raise ValueError(f"{where}: give both ref_chosen_logps and ref_rejected_logps, or neither")
        out.append(PreferenceExample(p[:k], pc[k:], pr[k:], None if refs[0] is None else float(refs[0]),
                                     None if refs[1] is None else float(refs[1]),
                                     source=f"{source}:{n}" if source else str(n)))
    return out


# --------------------------------------------------------------------------- collation


@dataclass
class PreferenceBatch:
    """``input_ids``/``attention_mask``/``completion_mask`` are ``[2B, T]``: chosen rows, then rejected
    rows (TRL's layout: one forward pass for both). ``ref_logps`` ``[2B]`` when precomputed.
    ``position_ids`` is set for left-padded batches (positions count real tokens only)."""

    input_ids: Any
    attention_mask: Any
    completion_mask: Any
    ref_logps: Any = None
    n_pairs: int = 0
    n_tokens: int = 0
    position_ids: Any = None

    def to(self, device: Any) -> "PreferenceBatch":
        move = (lambda t: None if t is None else t.to(device))
        return PreferenceBatch(self.input_ids.to(device), self.attention_mask.to(device),
                               self.completion_mask.to(device), move(self.ref_logps), self.n_pairs, self.n_tokens,
                               move(self.position_ids))


def collate_pairs(examples: Sequence[PreferenceExample], pad_id: int, max_length: int | None = None, *,
                  padding_side: Literal["right", "left"] = "right") -> PreferenceBatch:
    """TRL's ``DataCollatorForPreference``: prompt+chosen and prompt+rejected rows, truncated to
    ``max_length`` keeping the start, padded; ``completion_mask`` marks completion tokens.

    ``padding_side="left"`` (what the trainer uses) ends every row at the last column, so all
    completions lie in the last columns and the LM head need only run there; ``position_ids``
    then restart at 0 on each row's first real token, so the model computes exactly what it
    computes on the right-padded batch (tested against TRL's right-padded forward).
    """
    import torch

    if not examples:
        raise ValueError("collate_pairs: empty batch")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    seqs, masks = [], []
    for side in ("chosen_ids", "rejected_ids"):
        for e in examples:
            comp = getattr(e, side)
            ids, mask = e.prompt_ids + comp, [0] * len(e.prompt_ids) + [1] * len(comp)
            if max_length is not None:
                ids, mask = ids[:max_length], mask[:max_length]
            seqs.append(ids)
            masks.append(mask)
    width = max(len(s) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    comp = torch.zeros((n, width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        sl = slice(width - len(s), width) if padding_side == "left" else slice(0, len(s))
        input_ids[i, sl] = torch.tensor(s, dtype=torch.long)
        attn[i, sl] = 1
        comp[i, sl] = torch.tensor(m, dtype=torch.long)
    ref = None
    if all(e.ref_chosen_logps is not None for e in examples):
        ref = torch.tensor([e.ref_chosen_logps for e in examples] + [e.ref_rejected_logps for e in examples],
                           dtype=torch.float32)
    pos = (attn.cumsum(-1) - 1).clamp(min=0) if padding_side == "left" else None
    return PreferenceBatch(input_ids, attn, comp, ref, n_pairs=len(examples), n_tokens=int(attn.sum()),
                           position_ids=pos)
