"""One τ episode with tau2's half-duplex semantics.

The agent speaks first with the fixed greeting; then each agent message is either text for the
user or tool calls for the environment. A message with both goes to the environment and its
text never reaches the user (tau2's default); with ``validate_communication=True`` it ends the
episode as ``AGENT_ERROR`` (tau2's strict mode). Only the user ends a conversation normally, by
one of the stop tokens; the agent may end it with ``###STOP###``. Every routing (agent turn, user
turn, tool execution) is one step, as in tau2, and limits are checked only when no tool result
is pending. Reasoning (``<think>`` blocks, the message's ``reasoning`` field) is stripped before
text crosses from one party to the other.

The agent is any ``async agent(messages, tools) -> AssistantMessage | Turn``: ``messages`` is
the agent's view (system prompt with the policy, then the conversation with tool results) and
``tools`` the environment's :class:`~closedloop.tool.Tool` objects, for their schemas. The
orchestrator executes tool calls itself; an agent must not call the tools directly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, Awaitable, Callable, Union

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.environment import Environment
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.evals.tau.user_messages import TauUserMessage
from closedloop.messages import AssistantMessage, SystemMessage, ToolMessage, Turn, Usage, UserMessage, _Message
from closedloop.models.base import ModelClient, ModelError, SamplingParams
from closedloop.models.chat_format import strip_reasoning
from closedloop.tool import Tool

__all__ = ["GREETING", "STOP", "TRANSFER", "OUT_OF_SCOPE", "USER_STOP_TOKENS", "AGENT_INSTRUCTION",
           "agent_system_prompt", "strip_reasoning", "UserSimulator", "Orchestrator", "run_episode", "model_agent",
           "AgentFn", "make_user", "load_user_guidelines", "UserGuidelines", "parse_message_history", "DEFAULT_USER_GUIDELINES",
           "DEFAULT_USER_TOOLS_GUIDELINES"]

GREETING = "Hi! How can I help you today?"
STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
USER_STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)

# tau2 LLMAgent's prompt, so a model sees the same instructions here as upstream.
AGENT_INSTRUCTION = """
You are a customer service agent that helps the user according to the <policy> provided below.
In each turn you can either:
- Send a message to the user.
- Make a tool call.
You cannot do both at the same time.

Try to be helpful and always follow the policy. Always make sure you generate valid JSON only.
""".strip()

_AGENT_SYSTEM = """
<instructions>
{agent_instruction}
</instructions>
<policy>
{domain_policy}
</policy>
""".strip()

# Used when no tau2 data root with data/tau2/user_simulator/simulation_guidelines.md is given;
# our own wording of the same rules (pass the upstream file for byte-exact parity).
DEFAULT_USER_GUIDELINES = """# User Simulation Guidelines
You are playing the role of a customer contacting a customer service agent.
Your goal is to simulate realistic customer interactions while following the specific scenario you are given.
<PERSONA_GUIDELINES>
## Core Principles
- Generate one message at a time, keeping it natural and short, as a real customer would write it.
- Disclose information progressively: give only what the agent asks for at each step.
- Only state facts that are in the scenario. If you are asked for something you do not know, say you do not know or do not remember.
- Never invent order ids, item ids, addresses or other details; never make up instructions.
- Paraphrase the scenario in your own words instead of copying it.
- Stay in character; you are not an assistant and must not try to solve the task yourself.

## Task Completion
- When the task in your scenario is done (or cannot be done any further), end the conversation by sending '###STOP###' on its own.
- If you are transferred to another agent, send '###TRANSFER###'.
- If the scenario does not give you the information needed to continue, send '###OUT-OF-SCOPE###'.
"""

# Our wording of tau2's extra rules for a user who has tools (simulation_guidelines_tools.md),
# used with DEFAULT_USER_GUIDELINES' rules when no tau2 data root is given.
DEFAULT_USER_TOOLS_GUIDELINES = DEFAULT_USER_GUIDELINES.replace(
    "## Task Completion", """## Your Tools
- You have tools that act on your own side (your phone, your account); the agent may ask you to use them.
- Each message is either text for the agent or tool calls, never both. The agent sees only your text.
- Call a tool only when the agent asks for that action or when you need its result to answer; one action at a time.
- Report tool results as they are; never make them up. If a call fails, correct it and try again.

## Task Completion""")

_USER_SYSTEM = """
{guidelines}

<scenario>
{instructions}
</scenario>
""".strip()


def agent_system_prompt(policy: str) -> str:
    return _AGENT_SYSTEM.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=policy)


@dataclass(frozen=True)
class UserGuidelines:
    """tau2's two user-simulator guideline texts: ``plain`` for a user without tools and ``tools``
    for one with tools (dual control, e.g. telecom). tau2 picks the text by whether the simulator
    was given user tools; so does :class:`UserSimulator` with this pair."""

    plain: str = DEFAULT_USER_GUIDELINES
    tools: str = DEFAULT_USER_TOOLS_GUIDELINES

    def select(self, has_tools: bool) -> str:
        return self.tools if has_tools else self.plain


def load_user_guidelines(data_root: str | Path | None) -> UserGuidelines:
    """tau2's ``simulation_guidelines.md`` and ``simulation_guidelines_tools.md`` from
    ``<data_root>/tau2/user_simulator/`` (read as they are: byte-equal prompts); our own wording
    for a file that is not there."""
    folder = Path(data_root) / "tau2" / "user_simulator" if data_root is not None else None

    def read(name: str, default: str) -> str:
        path = folder / name if folder is not None else None
        return path.read_text() if path is not None and path.is_file() else default

    return UserGuidelines(plain=read("simulation_guidelines.md", DEFAULT_USER_GUIDELINES),
                          tools=read("simulation_guidelines_tools.md", DEFAULT_USER_TOOLS_GUIDELINES))


GuidelinesArg = Union[str, UserGuidelines, None]


AgentOutput = Union[AssistantMessage, Turn]
AgentFn = Callable[[list[_Message], list[Tool]], Awaitable[AgentOutput]]


def model_agent(client: ModelClient, params: SamplingParams | None = None) -> AgentFn:
    """The plain LLM agent: one model call per turn with the environment's tool schemas."""

    async def agent(messages: list[_Message], tools: list[Tool]) -> Turn:
        return await client.generate(messages, tools=[t.schema for t in tools] or None, params=params)

    return agent


class UserSimulator:
    """The user side: a model prompted with the guidelines and the task's scenario.

    Roles are flipped for the model: the agent's messages are its "user" turns and its own
    replies are "assistant" turns. It sees only the agent's text, never the agent's tool traffic.
    ``guidelines`` is a text used as it is, or a :class:`UserGuidelines` pair whose ``tools`` text
    is used once the simulator is given tools (:meth:`set_tools`), as tau2 does.
    """

    def __init__(self, client: ModelClient, scenario: str, *, guidelines: GuidelinesArg = None,
                 persona_guidelines: str = "", params: SamplingParams | None = None) -> None:
        self.client = client
        self.params = params or SamplingParams(temperature=0.0, max_tokens=1024, logprobs=False)
        self.guidelines: str | UserGuidelines = guidelines if guidelines is not None else UserGuidelines()
        self.scenario, self.persona_guidelines = scenario, persona_guidelines
        self.history: list[_Message] = []
        self.usage = Usage()
        self.tools: list[dict[str, Any]] | None = None  # user tool schemas (dual-control domains)
        self.system = self._system_message()

    def _system_message(self) -> SystemMessage:
        text = self.guidelines if isinstance(self.guidelines, str) else self.guidelines.select(bool(self.tools))
        persona = f"\n\n{self.persona_guidelines}\n" if self.persona_guidelines else ""
        filled = text.replace("<PERSONA_GUIDELINES>", persona)
        return SystemMessage(content=_USER_SYSTEM.format(guidelines=filled, instructions=self.scenario))

    def set_tools(self, schemas: list[dict[str, Any]] | None) -> None:
        """Give the simulator its own tools (tau2: then the tool-using guidelines apply)."""
        self.tools = list(schemas) if schemas else None
        self.system = self._system_message()

    async def act(self, agent_text: str | None) -> AssistantMessage:
        """The user's next message (its own view: an assistant message), text or, with user
        tools, tool calls on the user's side. ``agent_text`` is None after tool results."""
        if agent_text is not None:
            self.history.append(UserMessage(content=agent_text))
        turn = await self.client.generate([self.system, *self.history], tools=self.tools or None, params=self.params)
        self.usage = self.usage + turn.usage
        msg = turn.message if isinstance(turn.message, AssistantMessage) else AssistantMessage(content=turn.message.text)
        if self.tools and msg.tool_calls:
            self.history.append(AssistantMessage(content=msg.content, tool_calls=msg.tool_calls))
            return msg
        text = strip_reasoning(msg.text)
        if not text:
            raise ModelError("user simulator returned an empty message")
        self.history.append(AssistantMessage(content=text))
        return AssistantMessage(content=text)

    def add_tool_results(self, results: list[ToolMessage]) -> None:
        self.history.extend(results)

    async def respond(self, agent_text: str) -> str:
        self.history.append(UserMessage(content=agent_text))
        turn = await self.client.generate([self.system, *self.history], params=self.params)
        self.usage = self.usage + turn.usage
        text = strip_reasoning(turn.message.text)
        if not text:
            raise ModelError("user simulator returned an empty message")
        self.history.append(AssistantMessage(content=text))
        return text


class _Role(str, Enum):
    AGENT = "agent"
    USER = "user"
    ENV = "env"


_INFRA_ERRORS = (ModelError, OSError, asyncio.TimeoutError, ConnectionError)
_OVERFLOW_CODE = "context_length_exceeded"


def is_context_overflow(exc: BaseException) -> bool:
    """The core's :class:`ContextLengthExceededError`, or (until every client maps it) an
    OpenAI-style 400 whose code is ``context_length_exceeded``, anywhere in the cause chain."""
    from closedloop.models import ContextLengthExceededError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ContextLengthExceededError):
            return True
        code = getattr(e, "code", None)
        body = getattr(e, "body", None)
        if code == _OVERFLOW_CODE or (isinstance(body, dict) and (body.get("code") == _OVERFLOW_CODE or
                                      (body.get("error") or {}).get("code") == _OVERFLOW_CODE)):
            return True
        if _OVERFLOW_CODE in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class Orchestrator:
    """The episode as a state machine that pauses whenever it is the agent's turn.

    :func:`run_episode` drives it with an agent callable; :class:`~closedloop.evals.tau.gym.TauGymEnv`
    drives it one agent message per ``step``.
    """

    def __init__(self, task: Task, environment: Environment, user: UserSimulator, *, domain: str = "",
                 system_prompt: str | None = None, max_steps: int = 200, max_errors: int = 10,
                 timeout_s: float | None = None, validate_communication: bool = False, seed: int | None = None,
                 trial: int | None = None) -> None:
        if max_steps < 1 or max_errors < 1:
            raise ValueError("max_steps and max_errors must be at least 1")
        self.task, self.env, self.user = task, environment, user
        self._user_call_ids: set[str] = set()
        self.domain = domain or environment.domain.name
        self.system = SystemMessage(content=system_prompt if system_prompt is not None
                                    else agent_system_prompt(environment.policy))
        self.max_steps, self.max_errors, self.timeout_s = max_steps, max_errors, timeout_s
        self.validate_communication = validate_communication
        self.seed, self.trial = seed, trial
        self.trajectory: list[_Message] = []
        self.agent_turns: list[Turn] = []
        self.agent_usage = Usage()
        self.steps = 0
        self.num_errors = 0
        self.done = False
        self.termination: TerminationReason | None = None
        self.stop_token: str | None = None
        self.error: str | None = None
        self._to: _Role = _Role.USER
        self._pending: AssistantMessage | None = None
        self._user_resumes = False  # the user's next turn follows its own tool results
        self._start_perf = 0.0
        self._start_time = ""

    # ------------------------------------------------------------------ views

    @property
    def tools(self) -> list[Tool]:
        return self.env.tool_list

    def agent_messages(self) -> list[_Message]:
        """What the agent sees: its system prompt, then every message so far, except the user's
        own tool calls and their results (tau2: hidden from the agent)."""
        if not self._user_call_ids:
            return [self.system, *self.trajectory]
        seen: list[_Message] = [self.system]
        for m in self.trajectory:
            if isinstance(m, ToolMessage) and m.tool_call_id in self._user_call_ids:
                continue
            if isinstance(m, TauUserMessage):
                if m.content:
                    seen.append(UserMessage(content=m.content))
                continue
            seen.append(m)
        return seen

    # ------------------------------------------------------------------ driving

    async def start(self) -> None:
        self._start_perf, self._start_time = time.perf_counter(), _now()
        self.env.apply_initial_state(self.task.initial_state)
        if self.env.user_tools is not None:  # tau2: only the task's user_tools when it names them
            names = self.task.user_tools
            self.user.set_tools([t.schema for t in self.env.user_tools if names is None or t.name in names])
        history = self.task.initial_state.message_history if self.task.initial_state is not None else None
        if history:
            self._start_from_history(history)
            await self._advance()
            return
        greeting = AssistantMessage(content=GREETING)
        self.trajectory.append(greeting)
        self._pending, self._to = greeting, _Role.USER
        await self._advance()

    def _start_from_history(self, raw: list[dict[str, Any]]) -> None:
        """tau2 ``initialize`` with a task's pre-filled ``message_history``: the history is
        checked, its state-changing tool calls are replayed into the environment (a replayed
        output that differs from the recorded one is an error, tau2's strict ``set_state``), it
        becomes the start of the trajectory (no greeting), each side is given its own view of it,
        and the last message decides who acts next."""
        from closedloop.evals.tau.evaluator.db_check import replay_trajectory

        history = parse_message_history(raw, self.task.id)
        mismatches = replay_trajectory(self.env, history, strict=True)
        if mismatches:
            first = mismatches[0]
            raise ValueError(f"task {self.task.id}: replaying message_history call {first['name']} "
                             f"({first['tool_call_id']}) returned {first['replayed']!r}, the history records "
                             f"{first['recorded']!r}")
        self.trajectory = list(history)
        user_calls = {c.id for m in history if isinstance(m, TauUserMessage) for c in m.tool_calls or []}
        self._user_call_ids |= user_calls
        last = history[-1]
        # the user's view: the agent's text, its own messages and its own tool results, roles flipped
        user_view = history if isinstance(last, (UserMessage, ToolMessage)) else history[:-1]
        for m in user_view:
            if isinstance(m, AssistantMessage) and not m.tool_calls:
                self.user.history.append(UserMessage(content=strip_reasoning(m.text)))
            elif isinstance(m, TauUserMessage) and m.tool_calls:
                self.user.history.append(AssistantMessage(content=m.content, tool_calls=m.tool_calls))
            elif isinstance(m, UserMessage):
                self.user.history.append(AssistantMessage(content=m.text))
            elif isinstance(m, ToolMessage) and m.tool_call_id in user_calls:
                self.user.history.append(m)
        # every call has its result (parse_message_history), so the last message is text or a result
        if isinstance(last, AssistantMessage):
            if STOP in strip_reasoning(last.text):
                self.stop_token = STOP
                self._finish(TerminationReason.AGENT_STOP)
            self._pending, self._to = last, _Role.USER
        elif isinstance(last, UserMessage):
            token = next((t for t in USER_STOP_TOKENS if t in last.text), None)
            if token is not None:
                self.stop_token = token
                self._finish(TerminationReason.USER_STOP)
            self._to = _Role.AGENT
        else:  # a tool result: back to whoever called
            assert isinstance(last, ToolMessage)
            user_result = last.tool_call_id in user_calls
            self._to, self._user_resumes = (_Role.USER, True) if user_result else (_Role.AGENT, False)

    def _run_user_tools(self, msg: TauUserMessage) -> list[ToolMessage]:
        results = []
        for call in msg.tool_calls or []:
            self._user_call_ids.add(call.id)
            result = self.env.run_tool_call(call, "user")
            if result.error:
                self.num_errors += 1
            self.trajectory.append(result)
            results.append(result)
        self.user.add_tool_results(results)
        return results

    async def submit(self, output: AgentOutput) -> None:
        """Take the agent's message and run the episode until the agent's next turn or the end."""
        if self.done:
            raise RuntimeError("the episode is over")
        if self._to != _Role.AGENT:
            raise RuntimeError("it is not the agent's turn")
        if isinstance(output, Turn):
            self.agent_turns.append(output)
            self.agent_usage = self.agent_usage + output.usage
            output = output.message
        if not isinstance(output, AssistantMessage):
            self._finish(TerminationReason.AGENT_ERROR, f"agent returned {type(output).__name__}, not an AssistantMessage")
            return
        self.steps += 1
        self.trajectory.append(output)
        text = strip_reasoning(output.text)
        if STOP in text:
            self._finish(TerminationReason.AGENT_STOP)
            self.stop_token = STOP
            return
        if not text and not output.tool_calls:
            self._finish(TerminationReason.AGENT_ERROR, "agent sent an empty message")
            return
        if text and output.tool_calls and self.validate_communication:
            self._finish(TerminationReason.AGENT_ERROR, "agent sent both text content and tool calls")
            return
        self._pending = output
        self._to = _Role.ENV if output.tool_calls else _Role.USER
        self._check_limits()
        await self._advance()

    def fail_agent(self, exc: BaseException) -> None:
        """Record an exception raised by the agent callable and end the episode.

        A prompt that outgrew the agent's context window is the agent's own limit, not the
        infrastructure's: tau2's ``context_window_exceeded`` termination, scored 0 and counted in
        pass^k (an infrastructure error would be dropped from the metrics and re-run on resume)."""
        if is_context_overflow(exc):
            reason = TerminationReason.CONTEXT_WINDOW_EXCEEDED
        elif isinstance(exc, _INFRA_ERRORS):
            reason = TerminationReason.INFRASTRUCTURE_ERROR
        else:
            reason = TerminationReason.AGENT_ERROR
        self._finish(reason, f"{type(exc).__name__}: {exc}")

    async def _advance(self) -> None:
        while not self.done and self._to != _Role.AGENT:
            if self._to == _Role.ENV:
                self._run_tools()
            else:
                await self._user_turn()
            self._check_limits()

    def _run_tools(self) -> None:
        assert self._pending is not None and self._pending.tool_calls
        for call in self._pending.tool_calls:
            result = self.env.run_tool_call(call)
            if result.error:
                self.num_errors += 1
            self.trajectory.append(result)
        self.steps += 1
        self._to = _Role.AGENT

    async def _user_turn(self) -> None:
        visible: str | None = None
        if self._user_resumes:
            self._user_resumes = False
        else:
            assert self._pending is not None
            visible = strip_reasoning(self._pending.text)
        while True:
            try:
                msg = await self.user.act(visible)
            except Exception as e:  # the simulator is infrastructure: its failures are not the agent's
                self._finish(TerminationReason.INFRASTRUCTURE_ERROR, f"user simulator: {type(e).__name__}: {e}")
                return
            visible = None
            self.steps += 1
            if not msg.tool_calls:
                break
            # dual control: the user's own tool calls run on the user's side, unseen by the agent
            user_msg = TauUserMessage(content=msg.content, tool_calls=msg.tool_calls)
            self.trajectory.append(user_msg)
            self._run_user_tools(user_msg)
            self.steps += 1
            self._check_limits()
            if self.done:
                return
        reply = msg.text
        self.trajectory.append(UserMessage(content=reply))
        token = next((t for t in USER_STOP_TOKENS if t in reply), None)
        if token is not None:
            self.stop_token = token
            self._finish(TerminationReason.USER_STOP)
            return
        self._to = _Role.AGENT

    def _check_limits(self) -> None:
        if self.done or self._to == _Role.ENV:  # a pending tool result is always delivered first
            return
        if self.steps >= self.max_steps:
            self._finish(TerminationReason.MAX_STEPS)
        elif self.num_errors >= self.max_errors:
            self._finish(TerminationReason.TOO_MANY_ERRORS)
        elif self.timeout_s is not None and time.perf_counter() - self._start_perf >= self.timeout_s:
            self._finish(TerminationReason.TIMEOUT)

    def _finish(self, reason: TerminationReason, error: str | None = None) -> None:
        self.done = True
        self.termination = reason
        self.error = error

    # ------------------------------------------------------------------ result

    def result(self) -> SimulationRun:
        if not self.done or self.termination is None:
            raise RuntimeError("the episode has not ended")
        return SimulationRun(
            task_id=self.task.id, domain=self.domain, trial=self.trial, seed=self.seed,
            start_time=self._start_time, end_time=_now(), duration=time.perf_counter() - self._start_perf,
            termination_reason=self.termination, stop_token=self.stop_token, error=self.error, steps=self.steps,
            num_tool_errors=self.num_errors, agent_cost=self.agent_usage.cost_usd, user_cost=self.user.usage.cost_usd,
            agent_usage=self.agent_usage, user_usage=self.user.usage, messages=list(self.trajectory),
            agent_turns=list(self.agent_turns), task_file_sha256=self.task.source_sha256)


def parse_message_history(raw: list[dict[str, Any]], task_id: str = "") -> list[_Message]:
    """A task's ``message_history`` (tau2 message dicts) as our messages, checked as tau2's
    ``validate_message_history`` checks it: only assistant, user and tool messages; each
    assistant or user message has text or tool calls; n tool calls are followed by exactly n
    tool messages, in order, with the caller's ids and requestor, including the last call (tau2's
    ``set_state`` refuses a call without its result). A bad history is a ValueError."""
    from closedloop.evals.tau.results import from_tau2_message

    where = f"task {task_id}: message_history" if task_id else "message_history"
    messages: list[_Message] = []
    expected: list[tuple[str, str]] = []  # (call id, requestor) still owed a tool message
    for i, item in enumerate(raw):
        role = item.get("role") if isinstance(item, dict) else None
        if role not in ("assistant", "user", "tool"):
            raise ValueError(f"{where}[{i}]: role {role!r}; only assistant, user and tool messages are allowed")
        msg = from_tau2_message(item)
        if role == "tool":
            if not expected:
                raise ValueError(f"{where}[{i}]: a tool message that no tool call asked for")
            call_id, requestor = expected.pop(0)
            if item.get("id") != call_id or item.get("requestor", "assistant") != requestor:
                raise ValueError(f"{where}[{i}]: tool message for {item.get('id')!r} "
                                 f"(requestor {item.get('requestor', 'assistant')!r}); expected {call_id!r} ({requestor!r})")
        else:
            if expected:
                raise ValueError(f"{where}[{i}]: {len(expected)} tool message(s) missing before this {role} message")
            calls = getattr(msg, "tool_calls", None) or []
            content = item.get("content")
            if not calls and not (isinstance(content, str) and content.strip()):
                raise ValueError(f"{where}[{i}]: a {role} message needs text or tool calls")
            expected = [(c.id, role) for c in calls]
        messages.append(msg)
    if expected:
        raise ValueError(f"{where}: {len(expected)} tool message(s) missing at the end")
    return messages


def make_user(task: Task, user_client: ModelClient, *, guidelines: GuidelinesArg = None,
              params: SamplingParams | None = None, seed: int | None = None) -> UserSimulator:
    """The user simulator for a task (tau2 defaults: temperature 0; the trial's seed, if any)."""
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=1024, logprobs=False, seed=seed)
    return UserSimulator(user_client, str(task.user_scenario), guidelines=guidelines or None, params=params)


async def run_episode(task: Task, agent: AgentFn, user_client: ModelClient, *,
                      environment: Environment | None = None,
                      environment_factory: Callable[[], Environment] | None = None,
                      guidelines: GuidelinesArg = None, user_params: SamplingParams | None = None,
                      system_prompt: str | None = None, max_steps: int = 200, max_errors: int = 10,
                      timeout_s: float | None = None, validate_communication: bool = False,
                      seed: int | None = None, trial: int | None = None) -> SimulationRun:
    """Run one episode to its end. Give a fresh ``environment`` or an ``environment_factory``."""
    if environment is not None and environment_factory is None:
        env = environment
    elif environment is None and environment_factory is not None:
        env = environment_factory()
    else:
        raise ValueError("give exactly one of environment or environment_factory")
    orch = Orchestrator(task, env, make_user(task, user_client, guidelines=guidelines, params=user_params, seed=seed),
                        system_prompt=system_prompt, max_steps=max_steps, max_errors=max_errors, timeout_s=timeout_s,
                        validate_communication=validate_communication, seed=seed, trial=trial)
    await orch.start()
    while not orch.done:
        try:
            output = await agent(orch.agent_messages(), orch.tools)
        except Exception as e:
            orch.fail_agent(e)
            break
        await orch.submit(output)
    return orch.result()
