"""The thread that owns the engine: HTTP handlers (on the asyncio loop) submit requests and aborts through a
thread-safe queue, and this thread adds them to the engine, steps it while any request is unfinished, and hands
each request's outputs back to the handler awaiting them (``loop.call_soon_threadsafe``).

Under torchrun the other ranks wait in ``Engine.follow()`` for rank 0's next step, and a collective waits at
most ``--comm-timeout``: an idle server steps its empty engine every ``heartbeat_s`` (a broadcast and no model
call), so that followers never time out while no request comes, and a rank that died is found while idle too.

The engine is never touched by another thread: its methods need no lock, and under torchrun the rank-0 engine
thread is the one that runs every step's collectives. An exception of the engine (a rank that died, a
collective that timed out) ends the thread: every request waiting gets :class:`EngineFailed`, and
``on_failure`` is called (the server then shuts down, and the command exits with the error).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import torch

from megamoe.serving import QueueFullError
from megamoe.serving.http.metrics import ServingStats

__all__ = ["EngineFailed", "EngineLoop", "ServerBusy", "RequestStream"]

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.05        # how often an idle loop looks at the stop flag


class EngineFailed(RuntimeError):
    """The engine stopped on an error: no request can be served any more."""


class ServerBusy(RuntimeError):
    """As many requests are in flight as the engine may hold (running + waiting): retry later."""


_ACCEPTED = object()


class RequestStream:
    """One request's outputs, read on the asyncio side: first :meth:`accepted`, then :meth:`next` until an
    output is ``finished``. Written by the engine thread only."""

    def __init__(self, request_id: int, prompt_ids: list[int], params, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.generated = 0
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:           # the event loop has closed (the server is gone): nobody waits
            pass

    async def accepted(self) -> None:
        """Returns once the engine took the request; raises what add_request raised (ValueError,
        QueueFullError) or EngineFailed."""
        item = await self._queue.get()
        if item is not _ACCEPTED:
            raise item

    async def next(self):
        """The next RequestOutput; raises EngineFailed."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class EngineLoop:
    """Owns ``engine`` on a daemon thread. ``max_in_flight``: requests submitted and not finished at most
    (beyond it :meth:`submit` raises :class:`ServerBusy`), so the command queue is bounded too.
    ``heartbeat_s``: step the idle engine this often (None: never; see the module docstring)."""

    def __init__(self, engine, *, max_in_flight: int, heartbeat_s: float | None = None,
                 stats: ServingStats | None = None, on_failure: Callable[[BaseException], None] | None = None):
        if max_in_flight < 1:
            raise ValueError(f"EngineLoop.max_in_flight must be >= 1, got {max_in_flight}")
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ValueError(f"EngineLoop.heartbeat_s must be > 0 seconds or None, got {heartbeat_s}")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.heartbeat_s = heartbeat_s
        self.stats = stats or ServingStats()
        self.on_failure = on_failure
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}          # engine thread only
        self._in_flight = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._metrics = engine.metrics()
        self._thread = threading.Thread(target=self._run, name="megamoe-engine", daemon=True)

    # --- any thread ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping.is_set()

    def metrics(self):
        """The engine's metrics after its latest step (a snapshot the engine thread took)."""
        return self._metrics

    def submit(self, prompt_ids: list[int], params) -> RequestStream:
        """Queue a request (from the asyncio loop): await its stream's ``accepted()``."""
        if self.error is not None:
            raise EngineFailed(f"the engine stopped: {self.error}")
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                raise ServerBusy(f"{self._in_flight} requests are in flight, as many as the server holds "
                                 "(--max-num-seqs + --max-waiting): retry later")
            self._in_flight += 1
        stream = RequestStream(next(self._ids), prompt_ids, params, asyncio.get_running_loop())
        self._commands.put(("add", stream))
        if self.error is not None:           # the engine failed meanwhile, perhaps after draining the queue
            stream._put(EngineFailed(f"the engine failed: {self.error}"))
        return stream

    def abort(self, request_id: int) -> None:
        """Abort a request (its client went away): the engine frees its blocks before its next step."""
        self._commands.put(("abort", request_id))

    # --- the engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            last_step = time.monotonic()
            with torch.no_grad():
                while not self._stopping.is_set():
                    self._take_commands(wait=not self.engine.has_unfinished())
                    if self._stopping.is_set():
                        break
                    idle = time.monotonic() - last_step
                    if self.engine.has_unfinished() or (self.heartbeat_s is not None and idle >= self.heartbeat_s):
                        self._deliver(self.engine.step())
                        last_step = time.monotonic()
                    self._metrics = self.engine.metrics()
        except BaseException as error:           # noqa: BLE001 - every request must learn that the engine is gone
            self.error = error
            logger.error("the engine failed: %s", error)
            failed = EngineFailed(f"the engine failed: {error}")
            failed.__cause__ = error
            for stream in self._streams.values():
                stream._put(failed)
            while True:                          # requests submitted but not yet added
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None and command[0] == "add":
                    command[1]._put(failed)
            if self.on_failure is not None:
                self.on_failure(error)

    def _take_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if command[0] == "add":
                self._add(command[1])
            else:
                self._abort(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, stream: RequestStream) -> None:
        try:
            self.engine.add_request(stream.request_id, stream.prompt_ids, stream.params)
        except (ValueError, QueueFullError) as error:      # a request the engine refuses (too long, queue full)
            self._done(stream)
            stream._put(error)
            return
        self._streams[stream.request_id] = stream
        stream._put(_ACCEPTED)

    def _abort(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:                    # finished already
            return
        self.engine.abort(request_id)
        self._done(stream)
        self.stats.finish("abort", 0.0, 0)

    def _done(self, stream: RequestStream) -> None:
        with self._lock:
            self._in_flight -= 1

    def _deliver(self, outputs) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:                # aborted while this step ran
                continue
            if output.new_token_ids:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                    self.stats.first_token(now - stream.arrival)
                stream.generated += len(output.new_token_ids)
                self.stats.tokens(len(output.new_token_ids))
            if output.finished:
                del self._streams[output.request_id]
                self._done(stream)
                self.stats.finish(output.finish_reason or "stop", now - (stream.first_token_at or now),
                                  stream.generated)
            stream._put(output)
