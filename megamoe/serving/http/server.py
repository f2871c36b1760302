"""Run the OpenAI-compatible app with uvicorn over an engine: :class:`OpenAIServer`.

The listening socket is bound when the server is built (``port=0``: any free port, then ``server.port``), so a
port in use is an error before the model is needed, and the address printed is the one clients reach.
:meth:`OpenAIServer.run` serves until SIGINT / SIGTERM (in the main thread) or :meth:`OpenAIServer.shutdown`,
and raises the engine's error if the engine failed (the server shuts down by itself then: it cannot serve).

Bounds: at most ``max_in_flight`` requests are submitted and unfinished (more get a 429), and uvicorn serves at
most ``2 * max_in_flight + 16`` concurrent connections (more get its 503), so a flood costs bounded memory.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading

from megamoe.serving.http.app import build_app
from megamoe.serving.http.engine_loop import EngineLoop
from megamoe.serving.http.tokenizer import ServingTokenizer

__all__ = ["OpenAIServer", "bind_socket"]

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0           # open streams get this long to end when the server stops


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(2048)
    return sock


def _uvicorn_server_class():
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn's server, but a SIGINT / SIGTERM only shuts it down gracefully: uvicorn raises the signal again
        afterwards (KeyboardInterrupt, or death by SIGTERM), and a server asked to stop has done nothing wrong."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)
    return Uvicorn


class OpenAIServer:
    """``engine`` (a :class:`megamoe.serving.Engine`) served over HTTP on ``sock`` (a listening socket), else on
    (host, port). ``context_length``: the most positions of a request (None: the model declares none).
    ``heartbeat_s``: under torchrun, step the idle engine this often (see :mod:`.engine_loop`)."""

    def __init__(self, engine, tokenizer: ServingTokenizer, *, model_name: str, vocab_size: int,
                 context_length: int | None, max_in_flight: int, host: str = "127.0.0.1", port: int = 0,
                 sock: socket.socket | None = None, heartbeat_s: float | None = None, log_level: str = "warning"):
        import uvicorn
        self.socket = sock if sock is not None else bind_socket(host, port)
        self.host, self.port = self.socket.getsockname()[:2]
        self.loop = EngineLoop(engine, max_in_flight=max_in_flight, heartbeat_s=heartbeat_s,
                               on_failure=self._engine_failed)
        self.app = build_app(self.loop, tokenizer, model_name=model_name, vocab_size=vocab_size,
                             context_length=context_length)
        self._uvicorn = _uvicorn_server_class()(uvicorn.Config(
            self.app, log_level=log_level, access_log=False, limit_concurrency=2 * max_in_flight + 16,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off"))
        self.started = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until stopped; raises the engine's error if it failed."""
        self.loop.start()
        watcher = threading.Thread(target=self._signal_started, daemon=True)
        watcher.start()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.loop.stop(timeout=GRACEFUL_SHUTDOWN_S)
            self.socket.close()
        if self.loop.error is not None:
            raise self.loop.error

    def shutdown(self) -> None:
        """Stop serving (from any thread): :meth:`run` returns."""
        self._uvicorn.should_exit = True

    def _engine_failed(self, error: BaseException) -> None:
        logger.error("shutting the server down: the engine failed")
        self.shutdown()

    def _signal_started(self) -> None:
        while not (self._uvicorn.started or self._uvicorn.should_exit):
            threading.Event().wait(0.01)
        self.started.set()
