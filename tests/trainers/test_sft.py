"""SFT: assistant-only masks (rendered vs recorded), packing, learning, resume, data sources, CLI."""

from __future__ import annotations

import asyncio
import copy
import json
import signal

import pytest
import torch

from closedloop.messages import AssistantMessage, ToolMessage, Trajectory, UserMessage
from closedloop.models.base import SamplingParams
from closedloop.trainers.config import SFTConfig, load_config
from closedloop.trainers.data import (TemplateError, collate, encode_conversation,
                                      examples_from_trajectories, pack_examples)
from closedloop.trainers.losses import sft_loss

GREEDY = SamplingParams(temperature=0, max_tokens=40)
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOL_CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome!"},
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def sft_config(tiny_model_path, tmp_path, *overrides: str) -> SFTConfig:
    return load_config(SFTConfig, None, [f"model=hf:{tiny_model_path}", f"output_dir={tmp_path / 'out'}",
                                         "report_to=none", "save_steps=null", "torch_threads=1", *overrides])


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# --------------------------------------------------------------------------- masks


def test_rendered_mask_equals_recorded_mask_of_hf_turns(tiny_client):
    """The prefix-rendering mask of a conversation equals the mask hf: recorded while generating it."""
    tok = tiny_client.tokenizer
    # One plain reply.
    msgs = [UserMessage(content="Hello!")]
    turn = asyncio.run(tiny_client.generate(msgs, params=GREEDY))
    assert turn.finish_reason == "stop"
    ex = encode_conversation(tok, msgs + [turn.message])
    # The rendering goes on past the end-of-turn token (the template's newline), untrained.
    n = len(turn.loss_mask)
    assert ex.input_ids[:n] == turn.prompt_ids + turn.completion_ids and tok.decode(ex.input_ids[n:]) == "\n"
    assert ex.loss_mask == turn.loss_mask + [0]
    # Two turns around a tool call: the token view of the recorded turns vs the rendered messages.
    msgs = [UserMessage(content="What is 3 plus 4?")]
    first = asyncio.run(tiny_client.generate(msgs, tools=[ADD_TOOL], params=GREEDY))
    if first.message.tool_calls:  # what the shipped tiny model does
        call = first.message.tool_calls[0]
        msgs += [first.message, ToolMessage(tool_call_id=call.id, name=call.name, content="7")]
    else:  # a rebuilt tiny model may answer directly; the user then replies
        msgs += [first.message, UserMessage(content="Thanks!")]
    second = asyncio.run(tiny_client.generate(msgs, tools=[ADD_TOOL], params=GREEDY))
    msgs.append(second.message)
    traj = Trajectory(messages=msgs, turns=[first, second])
    (view,) = traj.token_view()
    rendered = encode_conversation(tok, msgs, [ADD_TOOL])
    n = len(view.input_ids)
    assert rendered.input_ids[:n] == view.input_ids and tok.decode(rendered.input_ids[n:]) == "\n"
    assert rendered.loss_mask == view.loss_mask + [0]
    assert sum(view.loss_mask) == len(first.completion_ids) + len(second.completion_ids)


def test_mask_is_exactly_the_assistant_text_and_gradient_flows_only_there(tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    ex = encode_conversation(tokenizer, TOOL_CONV, [ADD_TOOL])
    spans, cur = [], []
    for tid, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            cur.append(tid)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    assert spans == ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
                     "The answer is 5.<|im_end|>", "You're welcome!<|im_end|>"]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.tensor([ex.input_ids])
    logits = model(input_ids=ids).logits.detach().requires_grad_(True)
    loss, _ = sft_loss(logits, ids, torch.tensor([ex.loss_mask]))
    loss.backward()
    # Row t-1 of the logits predicts token t: its gradient is non-zero exactly where token t is trained.
    per_row = logits.grad[0, :-1].abs().sum(-1)
    trained = torch.tensor(ex.loss_mask[1:], dtype=torch.bool)
    assert torch.all(per_row[~trained] == 0)
    assert torch.all(per_row[trained] > 0)


def test_template_that_rewrites_history_is_refused(tokenizer):
    bad = copy.deepcopy(tokenizer)
    # Like templates that drop earlier turns' reasoning: the rendering of a prefix is not a prefix.
    bad.chat_template = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not prefix-stable at assistant message 1"):
        encode_conversation(bad, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


def test_template_without_end_of_turn_token_masks_the_rendered_message(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = ("{% for m in messages %}<{{ m.role }}>\n{{ m.content }}\n{% endfor %}"
                           "{% if add_generation_prompt %}<assistant>\n{% endif %}")
    ex = encode_conversation(plain, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"},
                                     {"role": "user", "content": "bye"}])
    assert plain.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m]) == "Hello there\n"


def test_prompt_completion_rows_and_full_loss(tokenizer):
    from closedloop.trainers.data import examples_from_rows

    prompt = TOOL_CONV[:2]
    completion = TOOL_CONV[2:5]
    (pc,) = examples_from_rows([{"prompt": prompt, "completion": completion, "tools": [ADD_TOOL]}], tokenizer)
    full = encode_conversation(tokenizer, TOOL_CONV[:5], [ADD_TOOL])
    assert pc.input_ids == full.input_ids and pc.loss_mask == full.loss_mask
    (everything,) = examples_from_rows([{"messages": TOOL_CONV}], tokenizer, assistant_only_loss=False)
    assert all(everything.loss_mask)


# --------------------------------------------------------------------------- packing


def test_packing_is_best_fit_and_attention_stays_within_examples(tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    a = encode_conversation(tokenizer, TOOL_CONV, [ADD_TOOL])
    b = encode_conversation(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    c = encode_conversation(tokenizer, TOOL_CONV[:5])
    width = len(a) + len(b) + 3
    rows = pack_examples([b, a, c], width, tokenizer.pad_token_id)
    assert all(len(r) == width for r in rows)
    assert sum(r.n_examples for r in rows) == 3 and len(rows) == 2  # a+b share a row, c alone
    row = next(r for r in rows if r.n_examples == 2)
    assert row.input_ids[:len(a)] == a.input_ids and row.position_ids[len(a)] == 0  # longest first, positions restart

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        packed = model(**collate([row], tokenizer.pad_token_id).model_inputs()).logits[0]
        alone_a = model(input_ids=torch.tensor([a.input_ids])).logits[0]
        alone_b = model(input_ids=torch.tensor([b.input_ids])).logits[0]
    torch.testing.assert_close(packed[:len(a)], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[len(a):len(a) + len(b)], alone_b, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- training


def test_sft_learns_a_conversation_and_records_the_run(tiny_model_path, tmp_path):
    from closedloop.models.hf import HFClient
    from closedloop.store import RunStore
    from closedloop.trainers.sft import train_sft

    data = write_jsonl(tmp_path / "one.jsonl", [{"messages": [{"role": "user", "content": "Who built the lighthouse?"},
                                                             {"role": "assistant", "content": "Mira built it in 1907."}]}])
    store_path = tmp_path / "runs.duckdb"
    cfg = sft_config(tiny_model_path, tmp_path, f"dataset={data}", "max_steps=40", "learning_rate=5e-3",
                     "lr_scheduler=constant", "per_device_batch_size=1", "logging_steps=5", "report_to=store",
                     f"store={store_path}")
    client = HFClient.from_pretrained(tiny_model_path)
    question = [UserMessage(content="Who built the lighthouse?")]
    before = asyncio.run(client.generate(question, params=GREEDY)).message.content
    assert before != "Mira built it in 1907."

    result = train_sft(cfg)
    losses = [m["loss"] for _, m in result.history]
    assert len(losses) == 8 and losses[-1] < 0.2 * losses[0]
    after = asyncio.run(HFClient.from_pretrained(result.model_dir).generate(question, params=GREEDY))
    assert after.message.content == "Mira built it in 1907."

    store = RunStore(store_path)
    run = store.get_run(result.run_id)
    assert run.status == "completed" and run.kind == "train"
    logged = store.metrics(result.run_id)
    assert [m["step"] for m in logged] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mean_token_accuracy"} <= set(logged[-1])


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_ctrl_c_saves_and_resume_matches_an_uninterrupted_run(tiny_model_path, tmp_path):
    from closedloop.trainers.sft import train_sft

    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                          {"role": "assistant", "content": f"It is {2 * i + 1}."}]} for i in range(7)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = [f"dataset={data}", "max_steps=6", "learning_rate=2e-3", "lr_scheduler=cosine", "warmup_steps=2",
              "per_device_batch_size=2", "gradient_accumulation_steps=2", "weight_decay=0.1", "logging_steps=2"]
    straight = train_sft(sft_config(tiny_model_path, tmp_path / "a", *common))

    def press_ctrl_c(step, metrics):
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    from closedloop.store import RunStore

    store_path = tmp_path / "runs.duckdb"
    cfg_b = sft_config(tiny_model_path, tmp_path / "b", *common, "resume=auto", "report_to=store",
                       f"store={store_path}")
    stopped = train_sft(cfg_b, on_step=press_ctrl_c)
    assert stopped.interrupted and stopped.step == 3 and stopped.checkpoint.name == "checkpoint-3"
    assert not (stopped.output_dir / "model.safetensors").exists()  # no final model for a stopped run
    assert RunStore(store_path).get_run(stopped.run_id).status == "interrupted"
    resumed = train_sft(cfg_b)
    assert not resumed.interrupted and resumed.step == 6
    assert [step for step, _ in resumed.history] == [4, 6]  # it continued from step 3, not from scratch
    # The same run continues in the store.
    assert resumed.run_id == stopped.run_id
    assert RunStore(store_path).get_run(resumed.run_id).status == "completed"
    assert [m["step"] for m in RunStore(store_path).metrics(resumed.run_id)] == [2, 4, 6]

    want, got = _weights(straight.model_dir), _weights(resumed.model_dir)
    assert want.keys() == got.keys()
    initial = _weights(tiny_model_path)
    assert any(not torch.equal(want[k], initial[k]) for k in want)  # training moved the weights
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_trajectories_from_python_and_from_the_store(tiny_client, tiny_model_path, tmp_path):
    from closedloop.store import RunStore
    from closedloop.trainers.sft import train_sft

    tok = tiny_client.tokenizer
    msgs = [UserMessage(content="Hello!")]
    turn = asyncio.run(tiny_client.generate(msgs, params=GREEDY))
    recorded = Trajectory(messages=msgs + [turn.message], turns=[turn], rewards={"success": 1.0})
    expert = Trajectory(messages=[UserMessage(content="What is 2 plus 3?"),
                                  AssistantMessage(content="The answer is 5.")],
                        rewards={"success": 1.0}, metadata={"tools": [ADD_TOOL]})
    failed = Trajectory(messages=[UserMessage(content="What is 2 plus 3?"), AssistantMessage(content="Six.")],
                        rewards={"success": 0.0})
    ex_rec, ex_exp = examples_from_trajectories([recorded, expert], tok)
    assert ex_rec.input_ids == turn.prompt_ids + turn.completion_ids and ex_rec.loss_mask == turn.loss_mask
    rendered = encode_conversation(tok, expert.messages, [ADD_TOOL])  # tools from the trajectory's metadata
    assert (ex_exp.input_ids, ex_exp.loss_mask) == (rendered.input_ids, rendered.loss_mask)

    result = train_sft(sft_config(tiny_model_path, tmp_path / "py", "max_steps=1"), [recorded, expert, failed])
    assert result.n_train == 3 and result.step == 1

    store = RunStore(tmp_path / "runs.duckdb")
    for t in (recorded, expert, failed):
        store.record_trajectory(t, kind="eval", graph="react", tags=["expert"])
    cfg = sft_config(tiny_model_path, tmp_path / "st", "max_steps=1", f"store={tmp_path / 'runs.duckdb'}",
                     "dataset=store:graph=react,tag=expert,min_reward=1")
    assert train_sft(cfg).n_train == 2
    none = sft_config(tiny_model_path, tmp_path / "st2", "max_steps=1", f"store={tmp_path / 'runs.duckdb'}",
                      "dataset=store:graph=clarifier")
    with pytest.raises(ValueError, match="holds no trajectories"):
        train_sft(none)


def test_lora_sft_saves_merged_model_and_adapter(tiny_model_path, tmp_path):
    from closedloop.models.hf import HFClient
    from closedloop.trainers.sft import train_sft

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": TOOL_CONV, "tools": [ADD_TOOL]}])
    cfg = sft_config(tiny_model_path, tmp_path, f"dataset={data}", "max_steps=3", "learning_rate=1e-2",
                     "lora.r=4", "lora.alpha=8", "packing=true", "max_length=512", "per_device_batch_size=1",
                     "gradient_checkpointing=true")
    result = train_sft(cfg)
    assert (result.model_dir / "adapter" / "adapter_config.json").is_file()
    trained, base = _weights(result.model_dir), _weights(tiny_model_path)
    changed = [k for k in base if not torch.equal(trained[k], base[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # only adapted linears moved
    assert HFClient.from_pretrained(result.model_dir).model is not None


def test_bf16_mixed_precision_trains(tiny_model_path, tmp_path):
    from closedloop.trainers.sft import train_sft

    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": TOOL_CONV, "tools": [ADD_TOOL]}])
    result = train_sft(sft_config(tiny_model_path, tmp_path, f"dataset={data}", "max_steps=2", "logging_steps=1",
                                  "mixed_precision=bf16", "learning_rate=1e-3"))
    losses = [m["loss"] for _, m in result.history]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


def test_cli_end_to_end_with_yaml(tiny_model_path, tmp_path, capsys):
    import yaml

    from closedloop.cli import main
    from closedloop.models.hf import HFClient
    from closedloop.store import RunStore

    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TOOL_CONV, "tools": [ADD_TOOL]},
                                                {"messages": TOOL_CONV[:2] + [{"role": "assistant", "content": "Five."}]}])
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump({"model": f"hf:{tiny_model_path}", "output_dir": str(tmp_path / "out"),
                                   "dataset": str(data), "per_device_batch_size": 2, "logging_steps": 1,
                                   "report_to": ["store"], "store": str(tmp_path / "runs.duckdb"), "save_steps": 2,
                                   "save_total_limit": 1, "torch_threads": 1}))
    assert main(["train", "sft", "--config", str(cfg), "--set", "max_steps=3", "--set", "learning_rate=1e-3",
                 "--set", "eval_fraction=0.5"]) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "eval_loss=" in out
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3"]  # limit 1
    HFClient.from_pretrained(tmp_path / "out")
    (run,) = RunStore(tmp_path / "runs.duckdb").list_runs(kind="train")
    assert run.status == "completed"
    logged = RunStore(tmp_path / "runs.duckdb").metrics(run.id)
    assert [m["step"] for m in logged] == [1, 2, 3] and "eval_loss" in logged[-1]
    # Bad data is a usage error, exit 2.
    assert main(["train", "sft", "--config", str(cfg), "--set", f"dataset={tmp_path / 'missing.jsonl'}"]) == 2
