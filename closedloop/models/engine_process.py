"""A local model in its own process: the ``hf:`` decode engine apart from the caller's event loop.

Why a process: in one CPython process, a server's HTTP event loop and the ``hf:`` decode worker
share one GIL. Every torch op of a decode step hands the GIL back and has to win it again from a
loop busy parsing requests and writing responses, so on a small machine the server used about one
core in all, whatever the number of cores, and served well below what the decoder alone sustains
(``benchmarks/bench_serve.py --in-process``). vLLM splits its API server from its engine core for
the same reason. Here the child process owns the model (any ``hf:`` spec, text or vision, built by
:func:`closedloop.models.make_client`); the parent keeps only the tokenizer (for logprob token
texts) and forwards requests over a pipe.

:class:`EngineProcessClient` is a :class:`~closedloop.models.base.ModelClient` like the one it
wraps, with the parts ``closedloop serve`` uses:

* ``generate`` / ``stream`` (text deltas as the child decodes them) / ``batch``;
* cancellation: a cancelled ``generate`` or a closed stream cancels the child's request, so its
  row leaves the running batch (as with an in-process ``hf:`` client);
* ``batch_stats()`` (the ``/health`` record), asked of the child;
* ``load_weights(items)``: tensors go to the child through shared memory (``torch.multiprocessing``'s
  pickler, file descriptors over the pipe's Unix socket) and are copied in under the child
  client's ``paused()``, so no batch decodes across the update;
* ``aclose()``: queued and running requests finish, then the child exits. If the child dies, every
  waiting request fails with :class:`~closedloop.models.base.ModelUnavailableError` and so do later ones.

A trainer that samples from its live policy keeps using :meth:`HFClient.from_model` in its own
process: weights shared in memory are the point there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any, AsyncGenerator, Callable, Iterable

from closedloop.messages import Turn, _Message
from closedloop.models.base import (EndMarkers, ModelClient, ModelError, ModelUnavailableError, ReportsBatches,
                                    SamplingParams, StreamEvent, TextDelta, ToolChoice, TurnDone)
from closedloop.models.weights import load_weights_into

log = logging.getLogger("closedloop.models.engine_process")

#: How long ``batch_stats`` and a weight load wait for the child's answer.
_RPC_TIMEOUT_S = 600.0


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a :class:`ModelError` with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable error is reported by its text
        return ModelError(f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------- the child


def _engine_main(conn: Connection, spec: str, kwargs: dict[str, Any], torch_threads: int | None,
                 factory: Callable[..., ModelClient] | None = None, cpus: list[int] | None = None) -> None:
    """The child process: build the client, say ``ready``, then serve requests until ``close``
    or until the parent goes away."""
    if cpus:  # before torch starts its thread pool: the pool inherits the binding
        from closedloop.models.cpu_binding import bind_this_process

        bind_this_process(cpus)
    import torch
    import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor pickler

    from closedloop.models import make_client

    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        client = (factory or make_client)(spec, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", _portable(e)))
        return
    model = getattr(client, "model", None)
    info = {"name": getattr(client, "name", spec), "spec": getattr(client, "spec", spec),
            "end_markers": list((client._end_markers if isinstance(client, EndMarkers) else ()) or ()),
            "model_type": getattr(getattr(model, "config", None), "model_type", None),
            "max_batch_size": getattr(client, "max_batch_size", None)}
    conn.send(("ready", info))
    asyncio.run(_EngineServer(conn, client).run())


class _EngineServer:
    """The child's event loop: one task per request; only this loop's thread writes to the pipe."""

    def __init__(self, conn: Connection, client: ModelClient) -> None:
        self.conn = conn
        self.client = client
        self.tasks: dict[int, asyncio.Task] = {}
        self.done: asyncio.Future | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._readable)
        try:
            await self.done
        finally:
            loop.remove_reader(self.conn.fileno())
            for task in list(self.tasks.values()):
                task.cancel()
            await self.client.aclose()

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._finish()  # the parent is gone

    def _forget(self, rid: int, _task: asyncio.Task) -> None:
        self.tasks.pop(rid, None)

    def _finish(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _readable(self) -> None:
        try:
            while self.conn.poll(0):
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self._finish()  # the parent closed its end or exited

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("generate", "stream"):
            rid = msg[1]
            run = self._generate if kind == "generate" else self._stream
            task = asyncio.get_running_loop().create_task(run(rid, *msg[2:]))
            self.tasks[rid] = task
            task.add_done_callback(functools.partial(self._forget, rid))
        elif kind == "cancel":
            running = self.tasks.get(msg[1])
            if running is not None:
                running.cancel()
        elif kind == "stats":
            stats = self.client.batch_stats() if isinstance(self.client, ReportsBatches) else None
            self._send(("reply", msg[1], stats, None))
        elif kind == "weights":
            asyncio.get_running_loop().create_task(self._load_weights(msg[1], msg[2]))
        elif kind == "close":  # what runs finishes first
            asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self._finish()

    async def _generate(self, rid: int, messages, tools, params, tool_choice) -> None:
        try:
            turn = await self.client.generate(messages, tools, params, tool_choice)
        except asyncio.CancelledError:
            return  # the parent cancelled it and no longer waits
        except Exception as e:  # noqa: BLE001 - the caller's error, raised in the parent
            self._send(("error", rid, _portable(e)))
            return
        self._send(("result", rid, turn))

    async def _stream(self, rid: int, messages, tools, params, tool_choice) -> None:
        try:
            async for ev in self.client.stream(messages, tools, params, tool_choice):
                if isinstance(ev, TextDelta):
                    self._send(("delta", rid, ev.text))
                elif isinstance(ev, TurnDone):
                    self._send(("result", rid, ev.turn))
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001
            self._send(("error", rid, _portable(e)))

    async def _load_weights(self, rid: int, state: dict[str, Any]) -> None:
        try:
            count = await asyncio.to_thread(load_weights_into, self.client, state)
        except Exception as e:  # noqa: BLE001
            self._send(("reply", rid, None, _portable(e)))
            return
        self._send(("reply", rid, count, None))


# ---------------------------------------------------------------------------------- the parent


class EngineProcessClient(ModelClient):
    """A model client whose model runs in a child process (see the module docstring).

    ``spec`` is an ``hf:`` spec; ``kwargs`` go to :func:`~closedloop.models.make_client` in the
    child (``max_batch_size``, ``batch_wait_ms``, ``device``, ``dtype`` ...); ``torch_threads``
    sets the child's intra-op threads; ``cpus`` binds the child's threads to those CPUs
    (:mod:`closedloop.models.cpu_binding`). ``factory`` replaces ``make_client`` as the child's
    constructor, called as ``factory(spec, **kwargs)`` (a module-level function: it is pickled to a
    spawned process). The constructor returns once the model is loaded, and raises the child's
    error if it could not be.
    """

    def __init__(self, spec: str, *, torch_threads: int | None = None, start_timeout_s: float = 600.0,
                 factory: Callable[..., ModelClient] | None = None, cpus: Iterable[int] | None = None,
                 **kwargs: Any) -> None:
        import torch.multiprocessing  # noqa: F401 - tensors to the child through shared memory

        from closedloop.models import parse_spec

        parsed = parse_spec(spec)
        if parsed.backend != "hf":
            raise ValueError(f"an engine process runs hf: models, not {parsed.backend}:")
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold torch threads
        self._conn, child = ctx.Pipe(duplex=True)
        bound = list(cpus) if cpus is not None else None
        self._process = ctx.Process(target=_engine_main,
                                    args=(child, f"hf:{parsed.model}", kwargs, torch_threads, factory, bound),
                                    name="closedloop-engine", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise ModelUnavailableError(f"the engine process did not load {parsed} within {start_timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise ModelUnavailableError(f"the engine process exited while loading {parsed} "
                                        f"(exit code {self._process.exitcode})") from None
        if kind == "failed":
            self._process.join(5)
            raise payload
        self.name: str = payload["name"]
        self.spec: str = payload["spec"]
        self._end_markers = tuple(payload["end_markers"])
        self.model_type: str | None = payload["model_type"]
        self.max_batch_size: int | None = payload["max_batch_size"]
        self.tokenizer = self._load_tokenizer(parsed.model)
        self._send_lock = threading.Lock()
        self._pending: dict[int, Callable[[str, Any], None]] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="closedloop-engine-reader", daemon=True)
        self._reader.start()

    @staticmethod
    def _load_tokenizer(path: str) -> Any:
        """The checkpoint's tokenizer, for the token texts of logprobs (``None``: token ids instead)."""
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001 - only the logprob token texts need it
            log.warning("no tokenizer for %s in the server process; logprob tokens are named by id", path,
                        exc_info=True)
            return None

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise ModelUnavailableError(self._dead)
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise ModelUnavailableError(f"the engine process is gone: {e}") from None

    def _expect(self, on_message: Callable[[str, Any], None]) -> int:
        rid = next(self._ids)
        with self._pending_lock:
            if self._dead is not None:
                raise ModelUnavailableError(self._dead)
            self._pending[rid] = on_message
        return rid

    def _forget(self, rid: int) -> None:
        with self._pending_lock:
            self._pending.pop(rid, None)

    def _read(self) -> None:
        """The reader thread: hand each message from the child to its request's callback."""
        try:
            while True:
                msg = self._conn.recv()
                kind, rid = msg[0], msg[1]
                with self._pending_lock:
                    on_message = self._pending.get(rid)
                    if kind != "delta":
                        self._pending.pop(rid, None)
                if on_message is not None:
                    on_message(kind, msg[2:])
        except (EOFError, OSError):
            pass
        self._process.join(5)
        reason = f"the engine process exited (exit code {self._process.exitcode})"
        with self._pending_lock:
            self._dead = self._dead or reason
            waiting, self._pending = list(self._pending.values()), {}
        for on_message in waiting:
            on_message("error", (ModelUnavailableError(reason),))

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # that loop is closed; nobody is waiting

    # ------------------------------------------------------------------ ModelClient

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(future: asyncio.Future, kind: str, payload: tuple) -> None:
            if future.done():
                return
            if kind == "result":
                future.set_result(payload[0])
            else:
                future.set_exception(payload[0])

        rid = self._expect(lambda kind, payload: self._on_loop(loop, settle, fut, kind, payload))
        try:
            self._send(("generate", rid, list(messages), tools, params or SamplingParams.model_validate({}), tool_choice))
            return await fut
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        except ModelUnavailableError:
            self._forget(rid)
            raise

    async def stream(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None,
                     tool_choice: ToolChoice | None = None) -> AsyncGenerator[StreamEvent, None]:
        """Text deltas as the child decodes them, then the turn (as :meth:`HFClient.stream`)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, tuple]] = asyncio.Queue()
        rid = self._expect(lambda kind, payload: self._on_loop(loop, events.put_nowait, (kind, payload)))
        finished = False
        try:
            self._send(("stream", rid, list(messages), tools, params or SamplingParams.model_validate({}), tool_choice))
            while True:
                kind, payload = await events.get()
                if kind == "delta":
                    yield TextDelta(payload[0])
                elif kind == "result":
                    finished = True
                    yield TurnDone(payload[0])
                    return
                else:
                    finished = True
                    raise payload[0]
        finally:
            if not finished:
                self._cancel(rid)

    def _cancel(self, rid: int) -> None:
        self._forget(rid)
        try:
            self._send(("cancel", rid))
        except ModelUnavailableError:
            pass

    def _call(self, kind: str, *args: Any, timeout_s: float = _RPC_TIMEOUT_S) -> Any:
        """A blocking request to the child (``stats``, ``weights``): its reply, or its error raised."""
        reply: concurrent.futures.Future = concurrent.futures.Future()

        def on_message(_kind: str, payload: tuple) -> None:
            if _kind == "reply":
                value, error = payload
                if error is None:
                    reply.set_result(value)
                else:
                    reply.set_exception(error)
            else:
                reply.set_exception(payload[0])

        rid = self._expect(on_message)
        try:
            self._send((kind, rid, *args))
            return reply.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise ModelError(f"the engine process did not answer {kind!r} within {timeout_s:.0f} s") from None
        finally:
            self._forget(rid)

    def batch_stats(self) -> dict[str, Any] | None:
        """The child's batching record (see :meth:`HFClient.batch_stats`)."""
        return self._call("stats", timeout_s=30.0)

    def load_weights(self, items: Iterable[tuple[str, Any]]) -> int:
        """Copy these tensors into the child's model in place, between batches; returns how many.
        (What :func:`closedloop.models.weights.load_weights_into` calls.)"""
        return int(self._call("weights", dict(items)))

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    async def aclose(self) -> None:
        """Let queued and running requests finish, then stop the child."""
        if self._process.is_alive():
            try:
                self._send(("close",))
            except ModelUnavailableError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, functools.partial(self._process.join, 60.0))
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def close(self) -> None:
        """Stop the child now (running requests fail)."""
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)


__all__ = ["EngineProcessClient"]
