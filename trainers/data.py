"""SFT data: chat rows and trajectories to token ids with an assistant-only loss mask, packing,
and collation.

Where the mask comes from, in order of trust:

1. Recorded tokens. A :class:`~closedloop.messages.Trajectory` whose turns carry token ids is
   trained on exactly those ids with the recorded ``loss_mask`` (``Trajectory.token_view()``):
   nothing is re-tokenised, so what the model is trained on is what it produced.
2. Rendering prefixes. For plain messages (a JSONL chat dataset, expert trajectories without ids)
   the conversation is rendered with the tokenizer's chat template, and the tokens of assistant
   message ``k`` are those the rendering of ``messages[:k+1]`` adds to the rendering of
   ``messages[:k]`` plus the generation prompt, through the first end-of-turn token (what the
   model would have generated; the template's newline after it is not; without an end-of-turn
   token, through the end of the rendering of ``messages[:k+1]``). This works for any
   template whose rendering is *prefix-stable* (rendering a longer conversation extends the
   rendering of a shorter one, token for token); that property is checked for every assistant
   message and a template that breaks it (e.g. one that drops earlier turns' reasoning) is
   refused with :class:`TemplateError` rather than trained on a wrong mask. Unlike
   ``return_assistant_tokens_mask`` it needs no ``{% generation %}`` markers in the template.

Packing (``SFTConfig.packing``): examples are packed into rows of ``max_length`` tokens by
best-fit decreasing (TRL's ``"bfd"`` strategy), each example keeping its own ``position_ids``
starting at 0. Rows are fed with ``attention_mask=None`` and those position ids; transformers then
derives a block-diagonal mask (``masking_utils.find_packed_sequence_indices``), so an example never
attends to its neighbours (this is TRL's ``padding_free`` approach; the equivalence to unpacked
training is tested). The unused tail of a row is padding that forms its own segment with loss 0.
"""

from __future__ import annotations

import inspect
import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["Example", "TemplateError", "encode_conversation", "assistant_mask", "examples_from_rows",
           "examples_from_trajectories", "load_chat_rows", "DataSchedule", "load_store_trajectories", "pack_examples",
           "collate", "Batch", "end_of_turn_ids"]


class TemplateError(ValueError):
    """The chat template cannot give an exact assistant mask for this conversation."""


@dataclass
class Example:
    """One training sequence. ``loss_mask[i] == 1``: token ``i`` is a target (written by the
    assistant). ``position_ids`` is set for packed rows (restarting at 0 per example)."""

    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int] | None = None
    n_examples: int = 1
    source: str = ""
    n_pad: int = 0  # padding at the end of a packed row

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("input_ids and loss_mask must have the same length")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_trained(self) -> int:
        """Tokens that contribute to the loss (a mask on token 0 cannot, there is no prediction)."""
        return sum(self.loss_mask[1:])


# --------------------------------------------------------------------------- templates and masks


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(i) for i in out]


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Tokens that end an assistant turn: the tokenizer's EOS and the usual chat end markers."""
    ids: set[int] = set()
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>") if t in vocab)
    return ids


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    return _ids(tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                              tokenize=True))


def assistant_mask(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   *, ids: list[int] | None = None, only: Sequence[int] | None = None,
                   eot_ids: set[int] | None = None) -> list[int]:
    """1 on the tokens each assistant message contributes to ``ids`` (the full rendering), found
    by rendering prefixes (see the module docstring). ``only``: message indices to mask (default:
    every assistant message). Raises :class:`TemplateError` where the template is not prefix-stable."""
    full = ids if ids is not None else _render(tokenizer, messages, tools, False)
    eot = eot_ids if eot_ids is not None else end_of_turn_ids(tokenizer)
    mask = [0] * len(full)
    wanted = set(range(len(messages))) if only is None else set(only)
    for k, m in enumerate(messages):
        if m.get("role") != "assistant" or k not in wanted:
            continue
        before = _render(tokenizer, messages[:k], tools, True)
        start = len(before)
        # The turn ends at the first end-of-turn token after the generation prompt (what the model
        # emits to stop). Only without one is messages[:k+1] rendered to find where the message ends.
        end = next((i + 1 for i in range(start, len(full)) if full[i] in eot), None)
        upto = _render(tokenizer, messages[: k + 1], tools, False) if end is None else None
        checks = [("messages[:k] + generation prompt", before)]
        if upto is not None:
            checks.append(("messages[:k+1]", upto))
        for name, part in checks:
            if full[: len(part)] != part:
                at = next((i for i, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
                raise TemplateError(
                    f"the chat template is not prefix-stable at assistant message {k}: the rendering of {name} is "
                    f"not a prefix of the whole conversation's (first difference at token {at}: "
                    f"{tokenizer.decode(part[max(0, at - 8):at + 8])!r} vs "
                    f"{tokenizer.decode(full[max(0, at - 8):at + 8])!r}). "
                    "Templates that rewrite earlier turns (e.g. dropping reasoning) cannot give an exact mask by "
                    "rendering; train on recorded token trajectories instead, or add {% generation %} markers.")
        if upto is not None:
            if len(upto) < start:
                raise TemplateError(f"assistant message {k} renders shorter than its prompt; the template is not "
                                    "prefix-stable")
            end = len(upto)
        assert end is not None  # found an end-of-turn token, or rendered messages[:k+1]
        for i in range(start, end):
            mask[i] = 1
    return mask


def _to_template_dicts(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Typed messages or OpenAI dicts -> the dicts HF chat templates take (tool arguments as objects)."""
    from closedloop.messages import parse_messages
    from closedloop.models.chat_format import render_messages

    return render_messages(parse_messages([_normalise_row_message(m) if isinstance(m, dict) else m for m in messages]))


def _normalise_row_message(message: dict[str, Any]) -> dict[str, Any]:
    """A dataset's message dict in OpenAI form: nulls dropped, tool-call arguments as JSON text
    (datasets often store them as objects, as templates take them)."""
    message = _drop_nulls(message)
    calls = message.get("tool_calls")
    if calls:
        fixed = []
        for c in calls:
            c = dict(c)
            fn = dict(c.get("function") or {})
            if not isinstance(fn.get("arguments", ""), str):
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
            c["function"] = fn
            fixed.append(c)
        message = {**message, "tool_calls": fixed}
    return message


def _drop_nulls(value: Any) -> Any:
    """Remove ``None`` values from dicts, recursively (Arrow-backed rows fill absent keys with null)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def encode_conversation(tokenizer: Any, messages: Sequence[Any], tools: list[dict[str, Any]] | None = None, *,
                        assistant_only_loss: bool = True, prompt_len: int | None = None,
                        completion_only_loss: bool = True, eot_ids: set[int] | None = None) -> Example:
    """Tokenise one conversation with the chat template and build its loss mask.

    ``prompt_len``: for prompt/completion rows, the number of leading messages that are the prompt;
    with ``completion_only_loss`` the mask is then 0 on the prompt's tokens (and its generation prompt).
    """
    msgs = _to_template_dicts(messages)
    if not msgs:
        raise ValueError("empty conversation")
    tools = _drop_nulls(tools) if tools else None
    ids = _render(tokenizer, msgs, tools, False)
    if assistant_only_loss:
        only = None if prompt_len is None or not completion_only_loss else range(prompt_len, len(msgs))
        mask = assistant_mask(tokenizer, msgs, tools, ids=ids, only=only, eot_ids=eot_ids)
    else:
        mask = [1] * len(ids)
        if prompt_len is not None and completion_only_loss:
            before = _render(tokenizer, msgs[:prompt_len], tools, True)
            if ids[: len(before)] != before:
                raise TemplateError("the prompt's rendering is not a prefix of the conversation's; cannot mask it")
            mask[: len(before)] = [0] * len(before)
    return Example(ids, mask)


# --------------------------------------------------------------------------- sources


def load_chat_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local chat dataset: ``.jsonl``/``.json`` (read as JSON, exactly), ``.parquet``,
    ``.arrow`` or a ``datasets.save_to_disk`` directory (through ``datasets``).

    JSON is read directly rather than through ``datasets`` because Arrow unifies the schema of
    nested fields across rows: tool-call arguments and tool parameter schemas would gain every
    other row's keys as nulls, and the template would render them. Rows read through ``datasets``
    have nulls dropped for the same reason.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.is_dir():
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # a DatasetDict
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        return [_drop_nulls(r) for r in ds]
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON: {e}") from e
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "data" in data:
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows (or {{'data': [...]}})")
        return data
    if suffix in (".parquet", ".arrow", ".csv"):
        from datasets import load_dataset

        kind = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}[suffix]
        return [_drop_nulls(r) for r in load_dataset(kind, data_files=str(path), split="train")]
    raise ValueError(f"dataset {path}: unsupported file type {suffix!r}; use .jsonl, .json, .parquet, .arrow "
                     "or a datasets directory")


def examples_from_rows(rows: Iterable[dict[str, Any]], tokenizer: Any, *, assistant_only_loss: bool = True,
                       completion_only_loss: bool = True, source: str = "") -> list[Example]:
    """Chat rows (``{"messages", "tools"?}`` or ``{"prompt", "completion", "tools"?}``) -> examples."""
    eot = end_of_turn_ids(tokenizer)
    out = []
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{source or 'dataset'} row {n}: expected an object, got {type(row).__name__}")
        tools = row.get("tools")
        if isinstance(tools, str):  # some datasets store the schemas as a JSON string
            tools = json.loads(tools)
        try:
            if "messages" in row:
                ex = encode_conversation(tokenizer, row["messages"], tools, assistant_only_loss=assistant_only_loss,
                                         eot_ids=eot)
            elif "prompt" in row and "completion" in row:
                prompt, completion = row["prompt"], row["completion"]
                if isinstance(prompt, str) or isinstance(completion, str):
                    raise ValueError("prompt/completion rows must be conversational (lists of messages); plain-text "
                                     "rows are not supported")
                ex = encode_conversation(tokenizer, list(prompt) + list(completion), tools,
                                         assistant_only_loss=assistant_only_loss, prompt_len=len(prompt),
                                         completion_only_loss=completion_only_loss, eot_ids=eot)
            else:
                raise ValueError(f"expected 'messages' or 'prompt'+'completion' keys, got {sorted(row)}")
        except TemplateError:
            raise
        except Exception as e:
            raise ValueError(f"{source or 'dataset'} row {n}: {e}") from e
        ex.source = f"{source}:{n}" if source else str(n)
        out.append(ex)
    return out


def examples_from_trajectories(trajectories: Iterable[Any], tokenizer: Any, *, assistant_only_loss: bool = True,
                               ) -> list[Example]:
    """Trajectories -> examples: recorded token ids and masks when every trainable turn has them
    (one example per continuous token view), else the final messages rendered with the chat
    template (tools from ``trajectory.metadata["tools"]``)."""
    from closedloop.messages import MissingTokensError, Trajectory

    eot = end_of_turn_ids(tokenizer)
    out: list[Example] = []
    for traj in trajectories:
        if not isinstance(traj, Trajectory):
            traj = Trajectory.model_validate(traj)
        views = None
        if any(t.trainable and t.has_tokens for t in traj.turns):
            try:
                views = traj.token_view()
            except MissingTokensError as e:
                warnings.warn(f"trajectory {traj.id}: {e}; training on its re-rendered messages instead",
                              RuntimeWarning, stacklevel=2)
        if views:
            for i, v in enumerate(views):
                mask = list(v.loss_mask) if assistant_only_loss else [1] * len(v.input_ids)
                out.append(Example(list(v.input_ids), mask, source=f"{traj.id}:{i}"))
            continue
        if not traj.messages:
            continue
        tools = traj.metadata.get("tools") if isinstance(traj.metadata, dict) else None
        ex = encode_conversation(tokenizer, traj.messages, tools, assistant_only_loss=assistant_only_loss, eot_ids=eot)
        ex.source = traj.id
        out.append(ex)
    return out


def load_store_trajectories(selection: Any, store_path: str | None = None) -> list[Any]:
    """Trajectories matching a :class:`~closedloop.trainers.config.StoreSelection`, read with
    ``RunStore.iter_trajectories`` (filters it does not take are applied here)."""
    from closedloop.store import RunStore

    store = RunStore(selection.path or store_path) if (selection.path or store_path) else RunStore()
    if not hasattr(store, "iter_trajectories"):
        raise RuntimeError("this closedloop RunStore has no iter_trajectories(); store datasets need a newer store")
    params = inspect.signature(store.iter_trajectories).parameters
    wanted = {"graph": selection.graph, "tag": selection.tag, "kind": selection.kind,
              "min_reward": selection.min_reward, "limit": selection.limit, "status": selection.status}
    kwargs = {k: v for k, v in wanted.items() if v is not None and k in params}
    out = []
    for traj in store.iter_trajectories(**kwargs):
        if selection.min_reward is not None and "min_reward" not in kwargs and \
                sum(traj.rewards.values()) < selection.min_reward:
            continue
        if selection.tag is not None and "tag" not in kwargs and selection.tag not in traj.metadata.get("tags", []):
            continue
        out.append(traj)
        if selection.limit is not None and len(out) >= selection.limit:
            break
    return out


# --------------------------------------------------------------------------- truncation and packing


def truncate(examples: list[Example], max_length: int | None) -> tuple[list[Example], int]:
    """Cut examples to ``max_length`` tokens (keeping the start, as TRL); drop those left with no
    trained token. Returns the kept examples and how many were dropped."""
    kept, dropped = [], 0
    for ex in examples:
        if max_length is not None and len(ex) > max_length:
            ex = Example(ex.input_ids[:max_length], ex.loss_mask[:max_length], source=ex.source)
        if ex.n_trained == 0:
            dropped += 1
            continue
        kept.append(ex)
    return kept, dropped


def pack_examples(examples: list[Example], max_length: int, pad_id: int) -> list[Example]:
    """Best-fit-decreasing packing into rows of exactly ``max_length`` tokens (examples longer
    than that must be truncated first). Each row's ``position_ids`` restart at 0 per example;
    the tail is padding (its own position segment, loss 0). Deterministic for a given input."""
    import bisect

    if any(len(ex) > max_length for ex in examples):
        raise ValueError("pack_examples: truncate examples to max_length first")
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for i in order:
        n = len(examples[i])
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, b = free.pop(j)
        else:
            b, space = len(bins), max_length
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (space - n, b))
    rows = []
    for members in bins:
        ids: list[int] = []
        mask: list[int] = []
        pos: list[int] = []
        for i in members:
            ex = examples[i]
            ids += ex.input_ids
            # The first token of an example is never a target: its "prediction" would come from the
            # previous example.
            mask += [0] + ex.loss_mask[1:]
            pos += list(range(len(ex)))
        tail = max_length - len(ids)
        ids += [pad_id] * tail
        mask += [0] * tail
        pos += list(range(tail))
        rows.append(Example(ids, mask, position_ids=pos, n_examples=len(members), n_pad=tail))
    return rows


def split_eval(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded hold-out of ``fraction`` of the examples (at least one when fraction > 0)."""
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    n_eval = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    held = set(idx[:n_eval])
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


class DataSchedule:
    """The seeded example stream of a trainer that walks a dataset (SFT, DPO): epoch ``e`` is a
    permutation seeded by ``seed + e``, examples form one stream across epochs, and a step takes the
    next global batch of stream positions. The checkpoint records the position, so a resumed run
    sees exactly the examples the uninterrupted run would."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise ValueError("no training examples")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        import torch

        if epoch not in self._perms:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perms[epoch] = torch.randperm(self.n, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.n))
            self._perms.pop(epoch - 2, None)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> list[int]:
        """Example indices at stream positions ``[start, start + count)``."""
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + count)]


# --------------------------------------------------------------------------- collation


@dataclass
class Batch:
    """Tensors for one forward pass. ``attention_mask`` is None for packed rows (position ids carry
    the example boundaries)."""

    input_ids: Any
    loss_mask: Any
    attention_mask: Any = None
    position_ids: Any = None
    n_tokens: int = 0  # non-padding tokens
    n_trained: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to(self, device: Any) -> "Batch":
        move = (lambda t: None if t is None else t.to(device))
        return Batch(move(self.input_ids), move(self.loss_mask), move(self.attention_mask), move(self.position_ids),
                     self.n_tokens, self.n_trained, self.extra)

    def model_inputs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"input_ids": self.input_ids, "use_cache": False}
        if self.attention_mask is not None:
            kw["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            kw["position_ids"] = self.position_ids
        return kw


def collate(examples: Sequence[Example], pad_id: int, pad_to_multiple_of: int | None = None) -> Batch:
    """Right-pad unpacked examples to the longest (with an attention mask); stack packed rows
    (with position ids, no attention mask)."""
    import torch

    if not examples:
        raise ValueError("collate: empty batch")
    packed = examples[0].position_ids is not None
    width = max(len(e) for e in examples)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    filled = torch.zeros((len(examples), width), dtype=torch.long)  # position ids (packed), else the attention mask
    n_tokens = 0
    for r, e in enumerate(examples):
        n = len(e)
        ids[r, :n] = torch.tensor(e.input_ids)
        mask[r, :n] = torch.tensor(e.loss_mask)
        if packed:
            if e.position_ids is None:
                raise ValueError("collate: cannot mix packed and unpacked examples")
            filled[r, :n] = torch.tensor(e.position_ids)
            if width > n:
                filled[r, n:] = torch.arange(width - n)
            n_tokens += n - e.n_pad
        else:
            filled[r, :n] = 1
            n_tokens += n
    return Batch(ids, mask, None if packed else filled, filled if packed else None, n_tokens=n_tokens,
                 n_trained=int(mask[:, 1:].sum()))

