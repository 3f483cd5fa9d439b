"""API process 0's engine-core process: spawned, watched and stopped (see mp_client.py).

The supervisor owns the process; the client owns what a restart means for the streams (fresh sockets,
a warm-up, telling the other API processes), and the crash-loop guard decides whether there is one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_any

from ..config import Config
from .crash_loop import CrashLoopGuard
from .process import run_engine_core
from .wire import CoreAddresses, CoreInfo

log = logging.getLogger(__name__)

JOIN_S = 10.0  # the core's own shutdown (engine close, codec stop) before it is terminated


class CoreStartError(RuntimeError):
    """The engine-core process failed to build its engine (its traceback is in the message)."""


class CoreSupervisor:
    def __init__(self, config: Config, addresses: CoreAddresses) -> None:
        self._config = config
        self._addresses = addresses
        self.process: multiprocessing.process.BaseProcess | None = None
        self.crash_loop = CrashLoopGuard()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def spawn(self, stopping: Callable[[], bool]) -> CoreInfo:
        """Start the engine-core process and wait until its engine is built (blocking; the engine build has no
        bound of its own). CoreStartError if it fails, or if `stopping()` by the time it is ready."""
        ctx = multiprocessing.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_engine_core, name="orpheus-engine-core", daemon=True,
                              args=(self._config.model_dump(mode="json"), self._addresses, sender))
        process.start()
        sender.close()
        try:
            wait_for_any([receiver, process.sentinel])
            if not receiver.poll():
                process.join()
                raise CoreStartError(f"the engine-core process exited with code {process.exitcode} before it was ready")
            try:
                status, payload = receiver.recv()
            except EOFError:
                process.join()
                raise CoreStartError(f"the engine-core process exited with code {process.exitcode} before it was ready") from None
        finally:
            receiver.close()
        if status != "ready":
            process.join(JOIN_S)
            raise CoreStartError(f"the engine core failed to start:\n{payload}")
        if stopping():  # a restart that finished after shutdown began: this core is not wanted
            process.kill()
            process.join()
            raise CoreStartError("the server stopped while the engine core was starting")
        self.process = process
        log.info("engine core running in process %d (%d slots, max_seq_len %d)", payload.pid, payload.num_slots,
                 payload.max_seq_len)
        return payload

    def watch(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[str], None],
              stopping: Callable[[], bool]) -> None:
        """Call `on_death(reason)` when the process exits (unless `stopping()` by then)."""
        assert self.process is not None
        self._loop = loop
        loop.add_reader(self.process.sentinel, self._exited, self.process, on_death, stopping)

    def _exited(self, process: multiprocessing.process.BaseProcess, on_death: Callable[[str], None],
                stopping: Callable[[], bool]) -> None:
        assert self._loop is not None
        self._loop.remove_reader(process.sentinel)
        process.join(1.0)
        if stopping():
            return
        on_death(f"the engine-core process died (exit code {process.exitcode})")
        if process.is_alive():  # lost for another reason (its output handler): make sure it is gone
            process.kill()
            process.join()

    def kill_silent(self, message: str) -> None:
        """A core that leaves a call unanswered is stuck (its input thread answers at once whatever the engine
        does): treated as dead, killed; its death then fails its streams and starts it again."""
        if self.process is not None and self.process.is_alive():
            log.error("%s; killing it (process %d)", message, self.process.pid)
            self.process.kill()

    def stop(self, ask_to_stop: Callable[[], object] | None) -> None:
        """Ask the core to stop (`ask_to_stop`, None when it cannot be asked), join it, then terminate and
        kill what does not go."""
        process = self.process
        if process is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(process.sentinel)
        if process.is_alive() and ask_to_stop is not None:
            ask_to_stop()
        process.join(JOIN_S)
        if process.is_alive():
            log.error("the engine core did not stop within %.0f s; terminating it", JOIN_S)
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
