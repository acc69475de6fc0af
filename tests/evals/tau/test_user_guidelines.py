"""The user simulator's prompt is tau2's, byte for byte: ``simulation_guidelines.md`` for a user
without tools, ``simulation_guidelines_tools.md`` for a user with tools (telecom), chosen as tau2
chooses (the task's τ³ ``user_tools`` can offer none). The two files in ``fixtures/`` are tau2's
own (MIT, see ``fixtures/LICENSE``); with ``TAU2_PYTHON`` the prompts are also compared with the
ones real tau2 builds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from closedloop.evals.tau import load_domain, run_episode
from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.orchestrator import DEFAULT_USER_GUIDELINES, UserGuidelines, load_user_guidelines

from ._support import ScriptedClient, scripted_agent

FIXTURES = Path(__file__).parent / "fixtures"
GUIDES = FIXTURES / "tau2" / "user_simulator"


def _tau2_prompt(guidelines: str, task: Task) -> str:
    # tau2 user_simulator.SYSTEM_PROMPT, with no runtime persona
    return f"{guidelines}\n\n<scenario>\n{task.user_scenario}\n</scenario>"


async def _user_prompt(domain: str, task: Task, guidelines) -> str:
    data = load_domain(domain, FIXTURES, tau2_source=False)
    user = ScriptedClient(["###STOP###"])
    await run_episode(task, scripted_agent([]), user, environment_factory=data.make_environment, guidelines=guidelines)
    return user.prompts[0][0].text


def test_files_are_read_as_they_are() -> None:
    g = load_user_guidelines(FIXTURES)
    assert g.plain == (GUIDES / "simulation_guidelines.md").read_text()
    assert g.tools == (GUIDES / "simulation_guidelines_tools.md").read_text()
    assert g.plain != g.tools
    assert load_user_guidelines(FIXTURES / "missing") == UserGuidelines()  # our wording without the files
    assert UserGuidelines().plain == DEFAULT_USER_GUIDELINES and "tool" in UserGuidelines().tools


async def test_tool_using_user_gets_the_tools_guidelines() -> None:
    g = load_user_guidelines(FIXTURES)
    telecom = load_domain("telecom", FIXTURES, tau2_source=False).load_tasks("train").tasks[0]
    retail = load_domain("retail", FIXTURES, tau2_source=False).load_tasks("train").tasks[0]
    assert await _user_prompt("telecom", telecom, g) == _tau2_prompt(g.tools, telecom)
    assert await _user_prompt("retail", retail, g) == _tau2_prompt(g.plain, retail)
    # τ³: a task that offers the user no tools gets the plain guidelines, as in tau2
    no_tools = telecom.model_copy(update={"user_tools": []})
    assert await _user_prompt("telecom", no_tools, g) == _tau2_prompt(g.plain, no_tools)
    # a single text is used as it is, tools or not
    assert await _user_prompt("telecom", telecom, "Be a user.") == _tau2_prompt("Be a user.", telecom)


TAU2_PYTHON = os.environ.get("TAU2_PYTHON")

_TAU2_SCRIPT = """
import json, sys
from tau2.data_model.tasks import Task
from tau2.registry import registry
from tau2.user.user_simulator import UserSimulator
root = sys.argv[1]
out = {}
for domain in ("telecom", "retail"):
    raw = json.load(open(f"{root}/tau2/domains/{domain}/tasks.json"))[0]
    task = Task.model_validate(raw)
    env = registry.get_env_constructor(domain)()
    try:
        tools = env.get_user_tools() or None
    except Exception:
        tools = None
    out[domain] = UserSimulator(llm="x", instructions=str(task.user_scenario), tools=tools).system_prompt
print(json.dumps(out))
"""


@pytest.mark.skipif(not TAU2_PYTHON, reason="set TAU2_PYTHON to a Python that can import tau2")
async def test_prompts_equal_real_tau2s() -> None:
    run = subprocess.run([TAU2_PYTHON, "-c", _TAU2_SCRIPT, str(FIXTURES)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TAU2_DATA_DIR": str(FIXTURES)})
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    g = load_user_guidelines(FIXTURES)
    for domain in ("telecom", "retail"):
        data = load_domain(domain, FIXTURES, tau2_source=False)
        task = data.load_tasks("base").tasks[0]
        assert await _user_prompt(domain, task, g) == theirs[domain], domain
