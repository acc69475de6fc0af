"""A store holding one of everything the viewer shows, written through the store's own write API
(no training, no model): an interactive run with tool calls (one failed, one rejected), an image
and hostile text; a turn whose backend gave no token ids; a run waiting for approval; a τ-bench
evaluation with a failing episode; a KernelBench evaluation; a GRPO training run with metrics and
rollouts; a demo-style evaluation. Token ids come from a byte-level BPE tokenizer trained here in
milliseconds, saved as ``tokenizer.json`` in a model directory the runs name as their model."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from closedloop.messages import (AssistantMessage, FunctionCall, ImagePart, LogprobSpec, SystemMessage, TextPart,
                                 ToolCall, ToolMessage, Trajectory, Turn, Usage, UserMessage)
from closedloop.store import RunStore
from closedloop.tool import ToolResult

HOSTILE = ('<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'
           '<b>bold?</b> {{7*7}} &amp; </pre></textarea>')
HUGE_LEN = 300_000


def png_bytes(color: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (24, 16), color).save(buf, format="PNG")
    return buf.getvalue()


def make_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE (any text encodes), saved as ``directory/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 3 plus 4? The answer is 7.", "add(a=3, b=4) returns 7", "<|im_start|>user hello<|im_end|>",
              "You are a helpful assistant. Use the tools.", "The result of the tool call is 7."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def tokens_turn(tok, prompt: str, message: AssistantMessage, *, model: str, logprob: float = -0.3,
                latency: float = 0.25) -> Turn:
    completion_text = message.text or json.dumps([c.function.arguments for c in message.tool_calls or []])
    p = tok.encode(prompt).ids
    c = tok.encode(completion_text).ids
    lps = [logprob - 0.5 * (i % 3) for i in range(len(c))]
    return Turn(message=message, model=model, prompt_ids=p, completion_ids=c, logprobs=lps,
                loss_mask=[0] * len(p) + [1] * len(c), logprob_spec=LogprobSpec(mode="tempered", backend="hf"),
                completion_text=completion_text, finish_reason="stop",
                usage=Usage(prompt_tokens=len(p), completion_tokens=len(c)), latency_s=latency)


@dataclass
class SampleStore:
    path: Path
    model_dir: Path
    interactive: str = ""
    waiting: str = ""
    tau_eval: str = ""
    tau_failing_episode: str = ""
    kb_eval: str = ""
    train: str = ""
    rollouts: list[str] = field(default_factory=list)
    demo_eval: str = ""
    demo_eval_b: str = ""
    factguard_eval: str = ""
    image: bytes = b""
    svg_sha: str = ""


def build(path: Path, model_dir: Path) -> SampleStore:
    from tokenizers import Tokenizer

    make_tokenizer(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    spec = f"hf:{model_dir}"
    store = RunStore(path)
    out = SampleStore(path, model_dir, image=png_bytes())

    # --- an interactive react run: hostile text, an image, three tool calls (ok, failed, rejected)
    with store.run(kind="run", graph="react", model_spec=spec, tags=["demo", HOSTILE[:40]]) as run:
        out.interactive = run.id
        system = SystemMessage(content="You are a helpful assistant. Use the tools.")
        user = UserMessage(content=[TextPart(text="What is 3 plus 4? " + HOSTILE), ImagePart.from_bytes(out.image)])
        run.log_messages([system, user])
        calls = [ToolCall(id="call_ok", function=FunctionCall(name="add", arguments='{"a": 3, "b": 4}')),
                 ToolCall(id="call_bad", function=FunctionCall(name="add", arguments='{"a": "x"}')),
                 ToolCall(id="call_rej", function=FunctionCall(name="delete_everything", arguments="{}"))]
        first = AssistantMessage(content=None, tool_calls=calls)
        run.log_messages([first])
        run.log_turn(tokens_turn(tok, "What is 3 plus 4?", first, model=spec, latency=0.4))
        results = [ToolResult("add", "7", None, None, 0.01),
                   ToolResult("add", "Error: a must be a number", "a must be a number", "validation", 0.002),
                   ToolResult("delete_everything", "Error: the user rejected this call", "the user rejected this call",
                              "rejected", 0.0)]
        for c, r in zip(calls, results):
            run.log_messages([ToolMessage(tool_call_id=c.id, content=r.content, name=c.name, error=r.error)])
            run.log_tool_call(c, r, 0)
        answer = AssistantMessage(content="The answer is 7. " + HOSTILE + "x" * HUGE_LEN)
        run.log_messages([answer])
        run.log_turn(tokens_turn(tok, "What is 3 plus 4? The result of the tool call is 7.", answer, model=spec,
                                 latency=0.6))
        remote = AssistantMessage(content="A remote model answered without token ids.")
        run.log_turn(Turn(message=remote, model="openai:gpt-x", completion_text=remote.text,
                          unavailable={"token_ids": "the server does not return them: it rejected 'return_token_ids'",
                                       "logprobs": "the server ignores 'logprobs'"}, latency_s=0.3))
        run.outcome = {"answer": "7", "rewards": {"success": 1.0}}

    # --- a run interrupted on an approval nobody answered
    wid = store.start_run(kind="run", graph="react", model_spec=spec)
    ask = AssistantMessage(content=None, tool_calls=[ToolCall(id="call_w", function=FunctionCall(
        name="send_email", arguments='{"to": "boss@example.com"}'))])
    store.log_messages(wid, [UserMessage(content="email my boss"), ask])
    store.log_turn(wid, tokens_turn(tok, "email my boss", ask, model=spec))
    store.finish_run(wid, "waiting")
    out.waiting = wid

    _tau(store, out)
    _kernelbench(store, out)
    _train(store, out, tok, spec)
    out.demo_eval = _demo_eval(store, tok, spec, "base", [0.0, 1.0, 0.0, 0.0])
    out.demo_eval_b = _demo_eval(store, tok, spec, "grpo", [1.0, 1.0, 0.0, 1.0])
    out.factguard_eval = _factguard(store, spec)

    # --- media whose recorded type could carry script: must never be served as itself
    from closedloop.store.media import MediaSink, write_media

    sink = MediaSink()
    out.svg_sha = sink.add(b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>', "image/svg+xml")
    store._tx(lambda con: write_media(con, sink, [(out.interactive, out.svg_sha)], run_started()))
    store.close()
    return out


def run_started():
    from closedloop.store.records import utcnow

    return utcnow()


def _tau(store: RunStore, out: SampleStore) -> None:
    from closedloop.evals.tau.data_model import Action, RewardType
    from closedloop.evals.tau.eval_store import open_eval, record_episode
    from closedloop.evals.tau.simulation import (ActionCheck, DBCheck, NLAssertionCheck, RewardInfo, SimulationRun,
                                                 TerminationReason)

    parent = open_eval(store, "retail-sample", {"domain": "retail", "trials": 2}, graph="react", model_spec="oracle")
    out.tau_eval = parent

    def sim(task: str, trial: int, ok: bool) -> SimulationRun:
        info = RewardInfo(reward=1.0 if ok else 0.0,
                          db_check=DBCheck(db_match=ok, db_reward=1.0 if ok else 0.0),
                          action_checks=[ActionCheck(action=Action(action_id="a1", name="cancel_order",
                                                                   arguments={"order_id": "#W1"}),
                                                     action_match=ok, action_reward=1.0 if ok else 0.0)],
                          nl_assertions=[NLAssertionCheck(nl_assertion="agent apologises " + HOSTILE, met=ok,
                                                          justification="judge says so")],
                          reward_basis=[RewardType.DB, RewardType.ACTION],
                          reward_breakdown={RewardType.DB: 1.0 if ok else 0.0, RewardType.ACTION: 1.0 if ok else 0.0})
        return SimulationRun(task_id=task, domain="retail", trial=trial, termination_reason=TerminationReason.USER_STOP,
                             messages=[], reward_info=info, start_time="2026-01-01T00:00:00")

    for task, trial, ok in (("task_1", 0, True), ("task_1", 1, True), ("task_2", 0, True), ("task_2", 1, False)):
        rid = record_episode(store, parent, sim(task, trial, ok), eval_name="retail-sample", graph="react",
                             model_spec="oracle")
        if not ok:
            out.tau_failing_episode = rid
    store.finish_run(parent, "completed")


def _kernelbench(store: RunStore, out: SampleStore) -> None:
    parent = store.start_run(kind="eval", graph="kernel", model_spec="scripted", tags=["eval:kb", "benchmark:kernelbench"])
    out.kb_eval = parent
    samples = [("1_Square", 0, {"status": "correct", "speedup": 1.8, "message": "ok"}, "def ModelNew(): pass"),
               ("1_Square", 1, {"status": "compile_error", "message": "build failed",
                                "compiler_log": "error: expected ';' before '}' token\n" + HOSTILE}, "int x = }"),
               ("2_Relu", 0, {"status": "correct", "speedup": 0.6, "message": "ok"}, "relu"),
               ("2_Relu", 1, {"status": "incorrect", "message": "max diff 0.5", "max_diff": 0.5}, "wrong")]
    for problem, k, result, code in samples:
        correct = result["status"] == "correct"
        store.record_trajectory(Trajectory(metadata={"problem": problem}), kind="kernel_sample", graph="kernel",
                                parent_id=parent, tags=[f"problem:{problem}", f"sample:{k}"],
                                outcome={"problem": problem, "sample_id": k, "outcome": "graded", "code": code,
                                         "result": {"problem": problem, **result},
                                         "rewards": {"correct": float(correct),
                                                     "speedup": float(result.get("speedup", 0.0))}})
    store.finish_run(parent, "completed", {"summary": {"fast_p": {"fast_1": 0.25}, "geomean_speedup": 1.04}})


def _train(store: RunStore, out: SampleStore, tok, spec: str) -> None:
    config = {"trainer": "grpo", "model": spec, "scale_rewards": "group", "reward_weights": {}, "reward_funcs": [],
              "turn_reward_components": [], "gamma": 1.0, "turn_weight": 1.0, "turn_baseline": "group",
              "missing_turn_rewards": "zero", "constraints": []}
    tid = store.start_run(kind="train", model_spec=spec, config=config, metadata={"trainer": "grpo"})
    out.train = tid
    for step in range(1, 6):
        store.log_metrics(tid, step, {"loss": 1.0 / step, "reward": 0.1 * step, "rewards/success": 0.1 * step,
                                      "kl": 0.01 * step})
    trajs = []
    for group in (10, 11):
        for sample, success in enumerate((1.0, 0.0)):
            answer = AssistantMessage(content=f"The answer is {7 if success else 8}.")
            trajs.append(Trajectory(messages=[UserMessage(content="What is 3 plus 4?"), answer],
                                    turns=[tokens_turn(tok, "What is 3 plus 4?", answer, model=f"policy:{spec}")],
                                    rewards={"success": success},
                                    metadata={"group": group, "sample": sample, "step": 5, "turn_rewards": [{}]}))
    out.rollouts = store.record_trajectories(trajs, kind="rollout", parent_id=tid, tags=["step:5"])
    store.finish_run(tid, "completed")


def _factguard(store: RunStore, spec: str) -> str:
    """As ``evals/factguard/evaluate.py`` stores one: its metrics (the benchmark's own
    ``binary_metrics``) on the parent, a run per sample."""
    from closedloop.evals.factguard.data import binary_metrics

    predicted, labels = ["fake", "real", "fake", None], ["fake", "real", "real", "fake"]
    parent = store.start_run(kind="eval", graph="factguard", model_spec=spec,
                             config={"benchmark": "factguard", "n": 4, "vision": False}, tags=["factguard"])
    trajs = [Trajectory(messages=[UserMessage(content=f"video {i}")], rewards={"acc": float(p == y)},
                        metadata={"sample": f"v{i}", "label": y, "predicted": p})
             for i, (p, y) in enumerate(zip(predicted, labels))]
    store.record_trajectories(trajs, kind="eval-episode", graph="factguard", model_spec=spec, parent_id=parent,
                              tags=["factguard"])
    metrics = binary_metrics(predicted, labels, bootstrap=50)
    store.finish_run(parent, "completed", outcome={"metrics": metrics.model_dump(), "errors": 0, "tool_rate": 0.5})
    return parent


def _demo_eval(store: RunStore, tok, spec: str, stage: str, successes: list[float]) -> str:
    parent = store.start_run(kind="eval", graph="react", model_spec=spec, tags=["demo", f"stage:{stage}"])
    trajs = []
    for seed, s in enumerate(successes):
        answer = AssistantMessage(content="7" if s else "8")
        trajs.append(Trajectory(messages=[UserMessage(content="3+4?"), answer],
                                turns=[tokens_turn(tok, "3+4?", answer, model=spec)], rewards={"success": s},
                                metadata={"seed": 100 + seed}))
    store.record_trajectories(trajs, kind="eval-episode", graph="react", model_spec=spec, parent_id=parent,
                              tags=["demo", f"stage:{stage}"])
    store.finish_run(parent, "completed", {"rewards": {"success": sum(successes) / len(successes)},
                                           "summary": {"success": sum(successes) / len(successes), "mean_turns": 1.0}})
    return parent
