"""A tiny tool-calling chat model built offline, for tests and demos.

Tests of token-exact turns, batching, trainers and agent loops need a real causal LM with a real
chat template and tokenizer, but no network and no GPU. :func:`build_tiny_model` trains a byte-level
BPE tokenizer on text generated here, creates a 2-layer Qwen2-style model with a Qwen2.5-style
chat template (tools in ``<tools>``, calls as ``<tool_call>`` JSON, results as ``<tool_response>``),
and runs a short CPU SFT warm-up on synthetic tool-use conversations so greedy decoding emits
well-formed tool calls. The result is an ordinary HF checkpoint directory.

Named settings live in :mod:`closedloop.models.tiny_presets`; :func:`ensure_tiny_model` keeps a
folder that already holds a build, or copies one from the build cache (``CLOSEDLOOP_TINY_CACHE``),
so the README, the serve script and the demo share one build per machine.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from closedloop.models.hf import HFClient

TINY_CONFIG_FILE = "closedloop_tiny.json"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Atomic markup tokens (Qwen adds these as non-special added tokens, so decoding keeps them).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>",
                 "<tools>", "</tools>"]

QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TinyConfig:
    """Everything that determines the checkpoint; saved next to it as ``closedloop_tiny.json``."""

    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192  # rotary: no cost; long enough for the τ retail policy
    train_steps: int = 500
    batch_size: int = 8
    learning_rate: float = 3e-3
    n_conversations: int = 600
    # Relative weight of goal-restatement examples (tool use weighs 9, chit-chat 2).
    goal_weight: float = 2.0
    # Share of examples in the form an agent graph sends: the react graph's default system prompt
    # and tool schemas as closedloop's @tool writes them (a description per argument). 0 keeps the
    # data (and the checkpoint) exactly as before this option existed.
    agent_format: float = 0.0
    # Label smoothing of the warm-up loss (0: plain cross-entropy). The frozen IG scorer uses it:
    # without it, tokens the training data never continues with get arbitrary, seed-dependent
    # log-probabilities far in the tail (-10 nats and below), and a log-ratio of two such tails
    # (IG of an uninformative answer) is noise of several nats; smoothing gives them a common floor.
    label_smoothing: float = 0.0
    # One thread: on a shared CPU, several OpenMP threads spin against each other (40x slower).
    torch_threads: int = 1


# --------------------------------------------------------------------------- synthetic data


def token_id(tokenizer: Any, token: str) -> int:
    """One token's id (transformers types ``convert_tokens_to_ids`` as ``int | list[int]`` whatever the input)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise ValueError(f"the tokenizer has no single id for {token!r}: {found!r}")
    return found


def _fn(name: str, description: str, props: dict[str, str], docs: dict[str, str] | None = None) -> dict[str, Any]:
    # Same shape as closedloop's @tool schemas, so demos with real tools look familiar to the model
    # (``docs``: a description per argument, as @tool takes them from the docstring's Args).
    properties = {k: ({"description": docs[k], "type": v} if docs else {"type": v}) for k, v in props.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "additionalProperties": False, "properties": properties, "required": list(props), "type": "object"}}}


def tool_schemas(rng: random.Random | None = None) -> dict[str, dict[str, Any]]:
    """The three warm-up tools; with ``rng``, descriptions and number types vary."""
    pick = (lambda xs: rng.choice(xs)) if rng else (lambda xs: xs[0])
    num = pick(["integer", "number"])
    return {
        "add": _fn("add", pick(["Add two numbers.", "Return a + b.", "Add two integers."]), {"a": num, "b": num}),
        "multiply": _fn("multiply", pick(["Multiply two numbers.", "Return a * b.", "Multiply two integers."]),
                        {"a": num, "b": num}),
        "get_weather": _fn("get_weather", pick(["Get the current weather for a city.", "Weather in a city."]),
                           {"city": "string"}),
    }


# What the react graph sends by default (closedloop.runtime.context.DEFAULT_SYSTEM_PROMPT; a test
# checks they agree: models cannot import the runtime) and the arithmetic tools' schemas as @tool
# writes them: the form of `closedloop run react --tools arithmetic` and of the README's examples.
AGENT_SYSTEM_PROMPT = ("You are a helpful assistant. Use the tools when they help; "
                       "answer the user directly when you have what you need.")
GREETING = "Hi! How can I help you today?"  # τ-bench's agent opens every episode with it


def agent_tool_schemas() -> dict[str, dict[str, Any]]:
    """The three warm-up tools as closedloop's ``@tool`` describes them (``closedloop.tools.arithmetic``)."""
    return {
        "add": _fn("add", "Add two numbers.", {"a": "number", "b": "number"},
                   {"a": "The first addend.", "b": "The second addend."}),
        "multiply": _fn("multiply", "Multiply two numbers.", {"a": "number", "b": "number"},
                        {"a": "The first factor.", "b": "The second factor."}),
        "get_weather": _fn("get_weather", "Get the current weather for a city.", {"city": "string"},
                           {"city": "The city."}),
    }


CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Boston"]
WEATHER = ["sunny", "rainy", "cloudy", "windy", "snowy"]
ASK = {
    "add": ["What is {a} plus {b}?", "Add {a} and {b}.", "What is {a} + {b}?", "Please add {a} and {b}.",
            "Compute {a} plus {b}.", "What do you get if you add {a} and {b}?"],
    "multiply": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} * {b}?",
                 "Compute {a} times {b}.", "What is the product of {a} and {b}?"],
    "get_weather": ["What is the weather in {city}?", "How is the weather in {city}?",
                    "Weather in {city}?", "Is it sunny in {city}?"],
}
CHAT = [("Hello!", "Hello! How can I help you today?"), ("Hi", "Hi! How can I help you today?"),
        ("Who are you?", "I am a tiny test model."), ("Thanks!", "You're welcome!"),
        ("Thank you.", "You're welcome!"), ("How are you?", "I am fine, thank you."),
        ("Tell me a joke.", "Why did the robot cross the road? To charge its battery."),
        ("Goodbye.", "Goodbye! Have a nice day.")]
SYSTEMS = [None, None, "You are a helpful assistant.", "You are a concise assistant."]

# Goal restatement: the model learns to copy the details a user gave (possibly only after a
# clarifying question) into a one-line summary. The clarifier's frozen scorer asks exactly this
# (closedloop.agents.clarifier.scorer uses the same request and prefix), so the tiny model is a
# meaningful scorer in tests: a goal stated in the conversation becomes likely, one that was not
# stays unlikely.
GOAL_REQUEST = "Summarise what the user wants, as one line."
GOAL_PREFIX = "The user's goal: "
GOAL_ACTS = ["return", "exchange", "cancel"]
GOAL_ITEMS = ["kettle", "lamp", "keyboard", "watch", "backpack", "headphones", "mug", "jacket", "camera",
              "blender", "sofa", "bicycle"]


def goal_conversation(rng: random.Random) -> list[dict[str, Any]]:
    act, item = rng.choice(GOAL_ACTS), rng.choice(GOAL_ITEMS)
    detail = f"the {item}"
    vague = f"I want to {act} an item."
    question = rng.choice(["Which item do you mean?", "Which one do you mean?",
                           "Could you tell me which item you mean?"])
    unknown = f"{act} an item; the details are unknown."
    # Uninformative exchanges (no answer, "not sure", the request repeated) leave the goal as
    # unknown as it was before the question, so the scorer learns that they carry no information.
    style = rng.choice(["direct", "vague", "asked", "asked", "unsure", "empty", "repeat"])
    if style == "direct":
        msgs, goal = [{"role": "user", "content": f"I want to {act} {detail}."}], f"{act} {detail}."
    elif style == "vague":
        msgs, goal = [{"role": "user", "content": vague}], unknown
    else:
        answer = {"asked": f"It is {detail}.", "unsure": "I am not sure.", "empty": "", "repeat": vague}[style]
        msgs = [{"role": "user", "content": vague}, {"role": "assistant", "content": question},
                {"role": "user", "content": answer}]
        goal = f"{act} {detail}." if style == "asked" else unknown
    return msgs + [{"role": "user", "content": GOAL_REQUEST}, {"role": "assistant", "content": GOAL_PREFIX + goal}]


def synthetic_conversation(rng: random.Random, goal_weight: float = 2.0,
                           agent_format: float = 0.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """One ``(messages, tools)`` example in template-dict form: a tool-use exchange or chit-chat;
    with probability ``agent_format`` in the form an agent graph sends (see :data:`AGENT_SYSTEM_PROMPT`)."""
    agent = agent_format > 0 and rng.random() < agent_format  # no draw at 0: the old data, unchanged
    system = AGENT_SYSTEM_PROMPT if agent else rng.choice(SYSTEMS)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if agent and rng.random() < 0.3:  # the agent speaks first, as in a τ-bench episode
        msgs.append({"role": "assistant", "content": GREETING})
    schemas = agent_tool_schemas() if agent else tool_schemas(rng)
    kind = rng.choices(["add", "multiply", "get_weather", "chat", "goal"], weights=[4, 3, 2, 2, goal_weight])[0]
    if kind == "goal":
        return msgs + goal_conversation(rng), None
    if kind == "chat":
        user, reply = rng.choice(CHAT)
        tools = None
        if rng.random() < 0.5:  # chit-chat with tools available: answer without calling one
            tools = rng.sample(list(schemas.values()), k=rng.randint(1, 3))
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], tools
    others = [s for n, s in schemas.items() if n != kind]
    tools = [schemas[kind]] + rng.sample(others, k=rng.randint(0, 2))
    rng.shuffle(tools)
    if kind == "get_weather":
        city, weather = rng.choice(CITIES), rng.choice(WEATHER)
        args: dict[str, Any] = {"city": city}
        question, result, answer = rng.choice(ASK[kind]).format(city=city), weather, f"It is {weather} in {city}."
    else:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        args = {"a": a, "b": b}
        value = a + b if kind == "add" else a * b
        # Tools typed with float return "7.0": the model sees both forms and copies what it got.
        shown = str(value) if rng.random() < 0.5 else f"{float(value)}"
        question, result, answer = rng.choice(ASK[kind]).format(a=a, b=b), shown, f"The answer is {shown}."
    call = {"id": "call_0", "type": "function", "function": {"name": kind, "arguments": args}}
    return msgs + [{"role": "user", "content": question},
                   {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_0", "name": kind, "content": result},
                   {"role": "assistant", "content": answer}], tools


# --------------------------------------------------------------------------- tokenizer


def _render_plain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The template rendered with plain jinja2, for BPE training text before a tokenizer exists."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=False)


def build_tokenizer(cfg: TinyConfig, texts: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline (digits one by one, so copying numbers between user text, JSON and
    # tool results is one token-level task), so the checkpoint tokenises the same whichever
    # class AutoTokenizer picks for a qwen2 model.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False, model_max_length=cfg.max_position_embeddings)
    # Markup is atomic but not special (as in Qwen), so decoding with skip_special_tokens keeps it.
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------- warm-up SFT


def _encode_example(tokenizer, messages: list[dict[str, Any]], tools) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a mask that is 1 on assistant-written tokens
    (through ``<|im_end|>``), found by rendering each assistant turn's prefix."""
    ids = list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
    mask = [0] * len(ids)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        start = len(prefix)
        if ids[:start] != list(prefix):
            raise RuntimeError("chat template tokenisation is not prefix-stable; cannot build the loss mask")
        j = start
        while j < len(ids) and ids[j] != end_id:
            j += 1
        for k in range(start, min(j + 1, len(ids))):
            mask[k] = 1
    return ids, mask


def _warm_up(model, tokenizer, cfg: TinyConfig, examples: list[tuple[list[int], list[int]]], log,
             on_step: Callable[[int, int, float], None] | None = None) -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, cfg.train_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 *
                                              (1 + math.cos(math.pi * min(1.0, s / cfg.train_steps))))
    pad = tokenizer.pad_token_id
    losses: list[float] = []
    model.train()
    for step in range(cfg.train_steps):
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in idx]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (ids, mask) in enumerate(batch):
            input_ids[r, :len(ids)] = torch.tensor(ids)
            attn[r, :len(ids)] = 1
            labels[r, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100,
                                                 label_smoothing=cfg.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, cfg.train_steps, losses[-1])
        if log and on_step is None and (step % 50 == 0 or step == cfg.train_steps - 1):
            log(f"step {step:4d} loss {loss.item():.4f}")
    model.eval()
    return losses


def _portable_tokenizer_config(path: Path) -> None:
    """Name the Qwen2 tokenizer class (whose pipeline ours copies) rather than transformers 5's
    ``TokenizersBackend``, so transformers 4.x (e.g. the one vLLM pins) loads the checkpoint too."""
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def tiny_config(*, seed: int = 0, train_steps: int = 500, **overrides: Any) -> TinyConfig:
    """The checked :class:`TinyConfig` of a build."""
    unknown = set(overrides) - set(TinyConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown tiny-model settings: {sorted(unknown)}")
    if train_steps < 0:
        raise ValueError("train_steps must be >= 0")
    cfg = TinyConfig(seed=seed, train_steps=train_steps, **overrides)
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if not 0.0 <= cfg.agent_format <= 1.0:
        raise ValueError(f"agent_format must be in [0, 1], got {cfg.agent_format}")
    return cfg


def build_tiny_model(path: str | Path, *, seed: int = 0, train_steps: int = 500, log=None,
                     on_step: Callable[[int, int, float], None] | None = None, **overrides: Any) -> Path:
    """Build the tiny tool-calling model into ``path`` (created; existing files overwritten).

    Deterministic for a given seed and thread count. ``overrides`` set other :class:`TinyConfig`
    fields (e.g. ``hidden_size``). ``log`` receives progress lines; ``on_step(step, total, loss)``
    is called after each warm-up step.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = tiny_config(seed=seed, train_steps=train_steps, **overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        rng = random.Random(cfg.seed)
        convs = [synthetic_conversation(rng, cfg.goal_weight, cfg.agent_format) for _ in range(cfg.n_conversations)]
        tokenizer = build_tokenizer(cfg, [_render_plain(m, t) for m, t in convs])
        examples = [_encode_example(tokenizer, m, t) for m, t in convs]

        torch.manual_seed(cfg.seed)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
                             intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                             num_attention_heads=cfg.num_attention_heads,
                             num_key_value_heads=cfg.num_key_value_heads,
                             max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
                             bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                             pad_token_id=tokenizer.pad_token_id,
                             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
        model = Qwen2ForCausalLM(config)
        losses = _warm_up(model, tokenizer, cfg, examples, log, on_step) if cfg.train_steps else []
        model.generation_config.eos_token_id = [config.eos_token_id,
                                                tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        _portable_tokenizer_config(path)
    finally:
        torch.set_num_threads(old_threads)
    record = {"config": asdict(cfg), "build_key": build_key(cfg), "n_parameters": sum(p.numel() for p in model.parameters()),
              "vocab_size": len(tokenizer), "final_loss": losses[-1] if losses else None,
              "initial_loss": losses[0] if losses else None, "build_seconds": round(time.perf_counter() - t0, 2),
              "mean_example_tokens": round(sum(len(i) for i, _ in examples) / len(examples), 1),
              "torch": torch.__version__}
    (path / TINY_CONFIG_FILE).write_text(json.dumps(record, indent=2))
    return path


# --------------------------------------------------------------------------- reuse of finished builds

#: Where finished builds are kept by their settings, so a second ``closedloop model tiny`` with the
#: same settings (another folder, the serve script after the README) copies instead of training
#: again. ``off`` (or empty) turns it off.
CACHE_ENV = "CLOSEDLOOP_TINY_CACHE"


def build_key(cfg: TinyConfig) -> str:
    """What determines a build: its settings, this module's code and the torch and transformers
    versions (a build with an equal key is the same checkpoint)."""
    import hashlib

    import torch
    import transformers

    text = json.dumps(asdict(cfg), sort_keys=True) + torch.__version__ + transformers.__version__
    return hashlib.sha256(Path(__file__).read_bytes() + text.encode()).hexdigest()[:16]


def _cache_root() -> Path | None:
    import os

    value = os.environ.get(CACHE_ENV)
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "closedloop" / "tiny"
    return None if value.strip().lower() in ("", "off", "0", "false", "no") else Path(value).expanduser()


def built_with(path: str | Path) -> str | None:
    """The build key recorded in a tiny checkpoint (None: not a finished tiny build)."""
    try:
        return json.loads((Path(path) / TINY_CONFIG_FILE).read_text()).get("build_key")
    except (OSError, ValueError, AttributeError):
        return None


def ensure_tiny_model(path: str | Path, *, seed: int = 0, train_steps: int = 500, log=None,
                      on_step: Callable[[int, int, float], None] | None = None,
                      **overrides: Any) -> tuple[Path, str]:
    """The tiny model with these settings in ``path``: kept when ``path`` already holds that very
    build, copied from the build cache (:data:`CACHE_ENV`) when it holds one, else built (and
    cached). Returns the path and how it got there: ``"kept"``, ``"cached"`` or ``"built"``. A
    folder holding a build with other settings is rebuilt, so changing a setting always takes."""
    import shutil
    import tempfile

    key = build_key(tiny_config(seed=seed, train_steps=train_steps, **overrides))
    path = Path(path)
    if built_with(path) == key:
        return path, "kept"
    cache = _cache_root()
    cached = cache / key if cache is not None else None
    if cached is not None and built_with(cached) == key:
        path.mkdir(parents=True, exist_ok=True)
        for f in cached.iterdir():
            if f.is_file() and f.name != TINY_CONFIG_FILE:
                shutil.copy2(f, path / f.name)
        shutil.copy2(cached / TINY_CONFIG_FILE, path / TINY_CONFIG_FILE)  # last: its presence means a whole copy
        return path, "cached"
    (path / TINY_CONFIG_FILE).unlink(missing_ok=True)  # a half-replaced folder must not look finished
    build_tiny_model(path, seed=seed, train_steps=train_steps, log=log, on_step=on_step, **overrides)
    if cache is not None and cached is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
            for f in path.iterdir():
                if f.is_file():
                    shutil.copy2(f, staging / f.name)
            try:
                staging.rename(cached)
            except OSError:  # another process cached the same build meanwhile
                shutil.rmtree(staging, ignore_errors=True)
        except OSError as e:  # a cache that cannot be written costs only the next build
            if log:
                log(f"note: could not cache the build in {cache}: {e}")
    return path, "built"


def endless_client(spec: str, **kwargs: Any) -> "HFClient":
    """An ``hf:`` client that never stops at an end-of-sequence token: it decodes to ``max_tokens``
    (vLLM's ``ignore_eos``). The tiny model's replies are a few tokens long; cancellation and load
    tests need a request that is still decoding when they act. Module-level so that it can be an
    :class:`~closedloop.models.engine_process.EngineProcessClient` ``factory``."""
    from closedloop.models import make_client
    from closedloop.models.hf import HFClient

    client = make_client(spec, **kwargs)
    if not isinstance(client, HFClient):
        raise ValueError(f"endless_client needs an hf: model (its decode loop), not {spec!r}")
    client._eos_ids = set()
    return client
