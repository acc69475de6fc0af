"""One writer process and several reader processes on one store file: every read consistent, nothing lost.

The writer does a fixed amount of work (``--ops``), every kind of write the store has: a run's
synchronous turns and tool calls, queued steps made durable by ``flush``, bulk episodes (one
transaction, checkpointed at commit), metrics, finishing runs. After each commit it prints an
acknowledgement. Readers loop until the writer is done (then read once more), checking each read:

- a live run's turns are a prefix of what the writer writes (contents exact, indices dense), and
  the run's token totals equal the sum over its turns (they commit together);
- a run's turn count never goes down from one read to the next (no read sees an older state);
- a bulk batch is all there (every episode, every turn) or not at all;
- no read raises (``IO Error: Could not read enough bytes`` was the failure this guards against).

Overlap is forced, not hoped for: twice during its run the writer waits until every reader has
finished a read that started after that point. No step waits on a clock; the only timeouts are
generous safety nets. The test (``test_concurrency.py``) runs a small version; for a long one::

    python tests/store/stress.py --ops 3000 --readers 6 /tmp/stress.duckdb
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BULK_RUNS, BULK_TURNS = 3, 4


def _turn(i: int, *, tokens: int = 24) -> Any:
    from closedloop.messages import AssistantMessage, Turn, Usage

    return Turn(message=AssistantMessage(content=f"t{i} " + "x" * (i % 50)), model="stress",
                prompt_ids=list(range(i, i + tokens)), completion_ids=[i, i + 1],
                usage=Usage(prompt_tokens=tokens, completion_tokens=2))


def _expected_turn_ok(turn: Any, i: int) -> bool:
    return (turn.message.text.startswith(f"t{i} ") and turn.completion_ids == [i, i + 1]
            and turn.prompt_ids == list(range(i, i + len(turn.prompt_ids))))


def _wait_for_readers(progress: list[Path], timeout: float = 600.0) -> None:
    """Block until each reader has finished a read that began after this call (a handshake, not a sleep)."""
    start = [_count(p) for p in progress]
    deadline = time.monotonic() + timeout  # a safety net against a dead reader, never the subject
    while any(_count(p) < s + 2 for p, s in zip(progress, start)):  # +2: one read may have been under way
        if time.monotonic() > deadline:
            raise TimeoutError("readers made no progress")
        time.sleep(0.005)


def _count(path: Path) -> int:
    try:
        return len(path.read_bytes())  # one byte appended per finished read
    except FileNotFoundError:
        return 0


def writer(path: str, ops: int, work: Path, n_readers: int) -> None:
    from closedloop.messages import AssistantMessage, ToolCall, Trajectory, UserMessage
    from closedloop.store import RunStore
    from closedloop.tool import ToolResult

    store = RunStore(path, flush_interval_s=0.01)
    progress = [work / f"progress-{k}" for k in range(n_readers)]
    rid, turns, batch = None, 0, 0

    def ack(**what: Any) -> None:
        print(json.dumps(what), flush=True)

    for i in range(ops):
        if i in (ops // 3, 2 * ops // 3):
            _wait_for_readers(progress)
        op = i % 6
        if rid is None or op == 0:
            if rid is not None:
                store.finish_run(rid, outcome={"turns": turns})
                ack(finished=rid, turns=turns)
            rid, turns = store.start_run(kind="stress", graph="stress"), 0
            ack(run=rid, turns=0)
        elif op in (1, 4):  # a synchronous turn and its tool call
            t = _turn(turns)
            store.log_turn(rid, t)
            store.log_tool_call(rid, ToolCall.make("add", {"a": turns}), ToolResult("add", str(turns)), turns)
            turns += 1
            ack(run=rid, turns=turns)
        elif op == 2:  # queued steps, then the explicit ack point
            for _ in range(2):
                t = _turn(turns)
                store.log_step(rid, [UserMessage(content=f"u{turns}")], [t])
                turns += 1
            store.flush()
            ack(run=rid, turns=turns)
        elif op == 3:  # a bulk batch: checkpointed at its commit
            episodes = [Trajectory(id=f"bulk-{batch}-{k}", messages=[UserMessage(content=f"b{batch}")],
                                   turns=[_turn(j, tokens=200) for j in range(BULK_TURNS)]) for k in range(BULK_RUNS)]
            store.record_trajectories(episodes, kind="bulk", tags=[f"batch:{batch}"])
            ack(bulk=batch)
            batch += 1
        else:
            store.log_metrics(rid, i, {"loss": float(i)})
            ack(metric=rid, step=i)
    store.finish_run(rid, outcome={"turns": turns})
    ack(finished=rid, turns=turns)
    store.close()
    (work / "done").write_text("done")
    _ = AssistantMessage  # imported for the turn builder's types


def reader(path: str, work: Path, k: int) -> None:
    from closedloop.store import RunStore

    store = RunStore(path)
    progress = work / f"progress-{k}"
    seen: dict[str, int] = {}
    bulk_seen = 0
    errors: list[str] = []
    reads = mid_run_reads = 0
    last = False
    while not last:
        last = (work / "done").exists()  # read once more after the writer finished
        try:
            runs = store.list_runs(limit=None, kind="stress")
            live = [r for r in runs if r.status == "running"]
            for summary in runs[:1]:
                rec = store.get_run(summary.id)
                n = len(rec.turns)
                if n < seen.get(rec.id, 0):
                    errors.append(f"run {rec.id}: {n} turns after {seen[rec.id]}")
                seen[rec.id] = n
                if not all(_expected_turn_ok(t, i) for i, t in enumerate(rec.turns)):
                    errors.append(f"run {rec.id}: turns are not the prefix the writer wrote")
                if rec.prompt_tokens != sum(t.usage.prompt_tokens for t in rec.turns):
                    errors.append(f"run {rec.id}: totals {rec.prompt_tokens} do not match its turns")
                if [c.idx for c in rec.tool_calls] != list(range(len(rec.tool_calls))):
                    errors.append(f"run {rec.id}: tool call indices have holes")
                if rec.status == "running" and 0 < n:
                    mid_run_reads += 1
            batches: dict[str, list[Any]] = {}
            for traj in store.iter_trajectories(kind="bulk", status="completed"):
                batches.setdefault(traj.metadata["tags"][0], []).append(traj)
            for tag, trajs in batches.items():
                if len(trajs) != BULK_RUNS or any(len(t.turns) != BULK_TURNS or
                                                  not all(_expected_turn_ok(x, j) for j, x in enumerate(t.turns))
                                                  for t in trajs):
                    errors.append(f"bulk {tag}: partially visible")
            n_bulk = sum(len(v) for v in batches.values())
            if n_bulk < bulk_seen:
                errors.append(f"bulk runs went from {bulk_seen} to {n_bulk}")
            bulk_seen = n_bulk
            _ = live
        except Exception:  # noqa: BLE001 - every failure is reported, none may happen
            errors.append(traceback.format_exc(limit=3))
        reads += 1
        with progress.open("ab") as f:
            f.write(b".")
    print(json.dumps({"reads": reads, "mid_run_reads": mid_run_reads, "errors": errors[:20]}), flush=True)


def run_stress(path: Path, *, ops: int, readers: int, timeout: float = 1800.0) -> dict[str, Any]:
    """Start the writer and the readers; returns the readers' reports, the writer's acks and the final store."""
    from closedloop.store import RunStore

    RunStore(path).close()  # the schema exists before the race starts
    env = {**os.environ, "CLOSEDLOOP_STORE_LOCK_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        me = [sys.executable, str(Path(__file__).resolve())]
        procs = [subprocess.Popen([*me, "reader", str(path), str(work), str(k)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(readers)]
        w = subprocess.Popen([*me, "writer", str(path), str(work), str(ops), str(readers)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            w_out, w_err = w.communicate(timeout=timeout)
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in [w, *procs]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if w.returncode != 0:
        raise RuntimeError(f"writer failed ({w.returncode}): {w_err[-3000:]}")
    reports = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"reader failed ({p.returncode}): {err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return {"acks": [json.loads(line) for line in w_out.splitlines() if line.startswith("{")], "readers": reports}


def lost(path: Path, acks: list[dict[str, Any]]) -> list[str]:
    """What the writer acknowledged and the store does not hold (exactly) afterwards."""
    from closedloop.store import RunStore

    store = RunStore(path)
    missing = []
    turns: dict[str, int] = {}
    finished: dict[str, int] = {}
    for a in acks:
        if "run" in a:
            turns[a["run"]] = a["turns"]
        elif "finished" in a:
            finished[a["finished"]] = a["turns"]
    for rid, n in turns.items():
        rec = store.get_run(rid)
        if len(rec.turns) < n or not all(_expected_turn_ok(t, i) for i, t in enumerate(rec.turns)):
            missing.append(f"run {rid}: {len(rec.turns)} of {n} acknowledged turns")
        if rid in finished and (rec.status != "completed" or rec.outcome != {"turns": finished[rid]}):
            missing.append(f"run {rid}: {rec.status} {rec.outcome}, acknowledged finished")
    bulk = {t.id for t in store.iter_trajectories(kind="bulk")}
    for a in acks:
        if "bulk" in a and any(f"bulk-{a['bulk']}-{k}" not in bulk for k in range(BULK_RUNS)):
            missing.append(f"bulk batch {a['bulk']}")
        if "metric" in a and not any(m["step"] == a["step"] for m in store.metrics(a["metric"])):
            missing.append(f"metric step {a['step']} of {a['metric']}")
    return missing


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "writer":
        writer(sys.argv[2], int(sys.argv[4]), Path(sys.argv[3]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "reader":
        reader(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--readers", type=int, default=6)
    args = parser.parse_args()
    t0, c0 = time.monotonic(), os.times()
    result = run_stress(args.path, ops=args.ops, readers=args.readers)
    c1 = os.times()
    missing = lost(args.path, result["acks"])
    print(json.dumps({"ops": args.ops, "readers": result["readers"], "lost": missing,
                      "wall_s": round(time.monotonic() - t0, 1),
                      "children_cpu_s": round(c1.children_user + c1.children_system - c0.children_user
                                              - c0.children_system, 1),
                      "load": os.getloadavg()}, indent=1))
    if missing or any(r["errors"] for r in result["readers"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
