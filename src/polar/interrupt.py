"""Ctrl-C for commands that do long work (`polar run`, `generate`, `train`): once stops cleanly, twice too.

The first Ctrl-C stops the work: the running coroutine is cancelled, so its cleanup runs (sessions
cancelled, sandboxes removed, stores closed) and the command then says what it kept. That cleanup takes a
few seconds, and impatient people press again: with asyncio's own handler a second press raises
KeyboardInterrupt wherever the cleanup happens to be (about 190 lines of traceback through the node, the
runtime and asyncio, and whatever that cleanup had not done yet is left undone). Here a second press prints
one line and the cleanup goes on; a third quits at once (exit 130), leaving what was not cleaned up.

SIGTERM is a press too: a batch system or a service manager (SLURM at a job's time limit, Kubernetes, systemd)
asks a command to stop with it, then kills it after a grace period. It used to kill the run at once: its
containers were left running until the next node start on that machine, and nothing said what was kept. The
exit status is then 143 (128 + SIGTERM), 130 after a Ctrl-C (`exit_status`).

`guard()` installs the handler for the rest of the command; `run(coro)` is `asyncio.run` under it (and plain
`asyncio.run` where no guard is installed, as for a library caller).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

SECOND_PRESS = b"polar: stopping (cancelling what runs, keeping what finished); Ctrl-C again quits at once\n"
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Guard:
    def __init__(self) -> None:
        self.presses = 0
        self.first = signal.SIGINT  # the signal of the first press
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses == 1:
            self.first = signal.Signals(signum)
            if self.loop is not None and self.task is not None and not self.task.done():
                self.loop.call_soon_threadsafe(self.task.cancel)
                return
            raise KeyboardInterrupt
        if self.presses == 2:
            os.write(2, SECOND_PRESS)
            return
        os._exit(exit_status())


_guard: _Guard | None = None


def guard() -> None:
    """From now on in this process, Ctrl-C behaves as the module says (call at a command's start)."""
    global _guard
    _guard = _Guard()
    for sig in SIGNALS:
        signal.signal(sig, _guard.on_signal)
    atexit.register(_ignore_once_interrupted, _guard)


def exit_status() -> int:
    """The status of a command stopped by its guard: 128 + the first signal (130 Ctrl-C, 143 SIGTERM)."""
    return 128 + (_guard.first if _guard is not None else signal.SIGINT)


def _ignore_once_interrupted(g: _Guard) -> None:
    # At exit the interpreter puts a Python-level handler back to the default (death by SIGINT, status -2
    # to a parent) but leaves an ignored signal ignored: a press while an interrupted command exits is moot.
    if g.presses:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a new event loop; under `guard()` the first Ctrl-C cancels it and, once
    its cleanup has run, raises KeyboardInterrupt here."""
    g = _guard
    if g is None or signal.getsignal(signal.SIGINT) != g.on_signal:
        return asyncio.run(main)
    loop = asyncio.new_event_loop()
    task = loop.create_task(main)
    g.loop, g.task = loop, task
    try:
        try:
            result = loop.run_until_complete(task)
        except asyncio.CancelledError:
            if g.presses:
                raise KeyboardInterrupt from None
            raise
        if g.presses:  # the work caught its cancellation and finished anyway: the user still asked to stop
            raise KeyboardInterrupt
        return result
    finally:
        g.loop = g.task = None
        _close(loop)


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """What `asyncio.run` does on its way out: cancel what is left, finish async generators and the
    default executor, close the loop."""
    try:
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in left:
            t.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
