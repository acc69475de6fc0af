"""The viewer in a real headless Chromium (Debian's, driven by Selenium).

- Acceptance on a store filled by a real ``closedloop demo --quick`` (tiny model, SFT, GRPO,
  held-out evaluations; scaled down further with ``--set``): the demo writes while the viewer is
  open on it and refreshing every 100 ms; the demo completes, nothing is lost, and the page shows
  the new runs without being reloaded. Then a trace, a token view (masked and unmasked tokens shown
  as such), an evaluation and a training curve, each saved as a screenshot (test artifacts).
- A writer process stepping a training run while the browser watches its training page: each
  step appears on the page (live refresh) before the writer goes on, and every row is there at the end.
- Hostile content stays text: no script runs, the page title is untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from ui_support import ServedUI, shot

from closedloop.store import RunStore

pytestmark = pytest.mark.slow
DEMO = dict(expert_episodes=16, sft_steps=2, grpo_steps=3, prompts_per_step=2, num_generations=2, eval_episodes=2)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def wait_for(browser, condition, what: str, timeout: float = float(os.environ.get("CLOSEDLOOP_UI_WAIT_S", 600)), proc: subprocess.Popen | None = None):
    """Poll ``condition(browser)`` until it is truthy; fail with ``what`` (and the writer's output
    if it died). A deadline only against a hang: the condition, not the clock, ends the wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition(browser)
        if value:
            return value
        if proc is not None and proc.poll() not in (None, 0):
            out, err = proc.communicate()
            pytest.fail(f"the writer failed while waiting for {what}: {out[-2000:]} {err[-4000:]}")
        if time.monotonic() > deadline:
            state = js(browser, "return {status: (document.getElementById('live-status') || {}).textContent, "
                                "data: {...document.body.dataset}, url: location.href}")
            logs = [e["message"] for e in browser.get_log("browser")][-10:]
            pytest.fail(f"timed out waiting for {what}; page: {state}; console: {logs}")
        time.sleep(0.05)


def js(browser, script: str):
    return browser.execute_script(script)


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_model_path, browser):
    """A real demo run written while the viewer (and the browser on its runs page) watches."""
    out = tmp_path_factory.mktemp("demo")
    store_path = out / "runs.duckdb"
    with ServedUI(store=str(store_path), poll_ms=100) as ui:
        browser.get(ui.url + "/?scope=all")
        cmd = [sys.executable, "-m", "closedloop", "demo", "--quick", "--model", f"hf:{tiny_model_path}", "--out", str(out),
               "--store", str(store_path)] + [a for k, v in DEMO.items() for a in ("--set", f"{k}={v}")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            wait_for(browser, lambda b: js(b, "return Number(document.body.dataset.refreshes || 0) > 0 && "
                                              "[...document.querySelectorAll('tr.run-row td:nth-child(2)')]"
                                              ".some(td => td.textContent === 'train')"),
                     "the runs page to show a training run while the demo writes", proc=proc)
            stdout, stderr = proc.communicate(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        yield ui, RunStore(store_path), browser


def test_demo_completes_under_the_viewer_and_nothing_is_lost(demo):
    _, store, _ = demo
    trains = store.list_runs(kind="train", limit=None)
    grpo = next(r for r in trains if r.metadata.get("trainer") == "grpo")
    assert grpo.status == "completed"
    assert [m["step"] for m in store.metrics(grpo.id)] == list(range(1, DEMO["grpo_steps"] + 1))
    rollouts = store.list_runs(parent_id=grpo.id, kind="rollout", limit=None)
    assert len(rollouts) == DEMO["grpo_steps"] * DEMO["prompts_per_step"] * DEMO["num_generations"]
    evals = store.list_runs(kind="eval", limit=None)
    assert len(evals) == 3 and all(r.status == "completed" for r in evals)
    assert all(len(store.list_runs(parent_id=e.id, limit=None)) == DEMO["eval_episodes"] for e in evals)
    assert len(store.list_runs(kind="expert", limit=None)) == DEMO["expert_episodes"]


def test_trace_token_view_evaluation_and_training_in_the_browser(demo):
    ui, store, b = demo
    b.get(ui.url + "/")
    assert js(b, "return document.querySelectorAll('tr.run-row').length") >= 5
    shot(b, "runs")
    grpo = next(r for r in store.list_runs(kind="train", limit=None) if r.metadata.get("trainer") == "grpo")
    rollout = next(r for r in store.list_runs(parent_id=grpo.id, limit=None) if r.completion_tokens > 0)
    b.get(f"{ui.url}/runs/{rollout.id}")
    assert js(b, "return document.querySelectorAll('li.step.turn').length") == len(store.get_run(rollout.id).turns)
    shot(b, "trace")
    b.find_element("css selector", "li.step.turn a.token-link").click()
    wait_for(b, lambda b: b.current_url.endswith("/turns/0"), "the token view to open")
    counts = js(b, """const t = [...document.querySelectorAll('#tokens .tok')];
        return {all: t.length, m1: t.filter(s => s.classList.contains('m1')).length,
                m0: t.filter(s => s.classList.contains('m0')).length,
                consistent: t.every(s => s.classList.contains('m' + s.dataset.mask)),
                hover: t.length ? t[t.length - 1].title : ''}""")
    turn = store.get_run(rollout.id).turns[0]
    assert counts["all"] == len(turn.prompt_ids) + len(turn.completion_ids)
    assert counts["m1"] == sum(turn.loss_mask) > 0 and counts["m0"] == len(turn.loss_mask) - sum(turn.loss_mask) > 0
    assert counts["consistent"] and "mask 1" in counts["hover"] and "logprob" in counts["hover"]
    # masked and unmasked tokens look different to a person, not only by class name
    bg = js(b, "return [...new Set([...document.querySelectorAll('#tokens .tok')].map("
               "s => getComputedStyle(s).backgroundColor))]")
    assert len(bg) == 2
    shot(b, "token-view")
    b.get(b.current_url.split("?")[0] + "?color=advantage")
    assert js(b, "return document.querySelectorAll('#tokens .tok[class*=\"avp\"], #tokens .tok[class*=\"avn\"], "
                 "#tokens .tok.av0').length") == sum(turn.loss_mask)
    shot(b, "token-view-advantage")
    ev = next(r for r in store.list_runs(kind="eval", limit=None) if "stage:grpo" in r.tags)
    b.get(f"{ui.url}/evals/{ev.id}")
    assert "summary.success" in b.page_source and js(b, "return document.querySelectorAll('table.episodes tbody tr')"
                                                       ".length") == DEMO["eval_episodes"]
    shot(b, "evaluation")
    b.get(f"{ui.url}/train/{grpo.id}")
    names = {k for m in store.metrics(grpo.id) for k in m if k != "step"}
    titles = set(js(b, "return [...document.querySelectorAll('svg.chart > title')].map(t => t.textContent)"))
    assert names <= titles and js(b, "return document.querySelectorAll('svg.chart polyline.line').length") > len(names)
    shot(b, "training")


WRITER = textwrap.dedent("""
    import sys, time, pathlib
    from closedloop.messages import AssistantMessage, Trajectory, Turn, UserMessage
    from closedloop.store import RunStore
    store, sig, steps = RunStore(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    rid = store.start_run(kind="train", model_spec="scripted", metadata={"trainer": "grpo"},
                          config={"scale_rewards": "group"})
    (sig / "run").write_text(rid)
    deadline = time.monotonic() + 900
    for step in range(1, steps + 1):
        answer = AssistantMessage(content="7")
        trajs = [Trajectory(messages=[UserMessage(content="3+4?"), answer], rewards={"success": float(i % 2)},
                            turns=[Turn(message=answer, prompt_ids=[1, 2, 3], completion_ids=[4], logprobs=[-0.1])],
                            metadata={"group": step, "sample": i}) for i in range(4)]
        store.record_trajectories(trajs, kind="rollout", parent_id=rid, tags=[f"step:{step}"])
        for sub in range(10):  # a burst of small commits racing the viewer's 100 ms polls
            store.log_metrics(rid, step, {"loss": 1.0 / step, "burst": float(sub)})
        (sig / f"wrote-{step}").touch()
        while not (sig / f"seen-{step}").exists():  # the test says when the page showed this step
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.01)
    store.finish_run(rid, "completed")
""")


def test_viewer_follows_a_training_run_written_by_another_process(tmp_path, browser):
    steps = 5
    store_path, sig = tmp_path / "runs.duckdb", tmp_path / "signals"
    sig.mkdir()
    with ServedUI(store=str(store_path), poll_ms=100) as ui:
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store_path), str(sig), str(steps)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            run_file = sig / "run"
            wait_for(browser, lambda b: run_file.exists() and run_file.read_text(), "the writer's run", proc=proc)
            rid = run_file.read_text()
            browser.get(f"{ui.url}/train/{rid}")
            for step in range(1, steps + 1):
                wait_for(browser, lambda b: (sig / f"wrote-{step}").exists(), f"step {step} written", proc=proc)
                wait_for(browser, lambda b: js(b, "return document.getElementById('last-step').textContent") == str(step),
                         f"the page to show step {step}", proc=proc)
                (sig / f"seen-{step}").touch()
            assert proc.wait(timeout=600) == 0, proc.stderr.read()
            wait_for(browser, lambda b: js(b, "return document.body.dataset.live") == "0", "the page to see the end")
        finally:
            if proc.poll() is None:
                proc.kill()
        assert int(js(browser, "return document.body.dataset.refreshes")) >= steps  # swapped live, never reloaded
        assert "completed" in browser.find_element("css selector", "h1").text
        store = RunStore(store_path)
        assert [m["step"] for m in store.metrics(rid)] == list(range(1, steps + 1))
        assert all(m["burst"] == 9.0 for m in store.metrics(rid))  # the last of each burst is there
        assert len(store.list_runs(parent_id=rid, limit=None)) == 4 * steps
        assert store.list_runs(kind="train", limit=1)[0].status == "completed"


def test_hostile_content_never_runs_in_the_browser(served, sample, browser):
    for url in (f"/runs/{sample.interactive}", f"/runs/{sample.interactive}/turns/1", f"/evals/{sample.tau_eval}",
                "/?scope=all"):
        browser.get(served.url + url)
        assert browser.title != "pwned" and "closedloop" in browser.title
        assert js(browser, "return document.querySelectorAll('script').length") == 1
        assert js(browser, "return document.querySelectorAll('[onerror], img[src=x]').length") == 0  # nothing injected
    browser.get(served.url + f"/runs/{sample.interactive}")
    assert '<script>document.title="pwned"</script>' in browser.find_element("id", "msg-1").text
    shot(browser, "hostile")
