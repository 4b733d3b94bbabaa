"""A stop signal that arrives while a polar server's event loop closes (a gateway worker stopped by its
supervisor while its own start-up failed) ends the process quietly instead of printing a traceback.

asyncio's `loop.close()` closes the loop's self-pipe and only then removes the signal handlers; a signal in
between is written to the closed wakeup fd. The script below stops in that window on purpose (the pipe
closed by hand, as `close()` does first) and signals itself."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import asyncio, os, signal, sys, time
from polar.cli.common import STOP_SIGNALS, release_signals

loop = asyncio.new_event_loop()
for sig in STOP_SIGNALS:
    loop.add_signal_handler(sig, lambda: None)
if sys.argv[1] == "released":
    release_signals(loop)  # what serve_until_stopped does before asyncio.run closes its loop
loop._close_self_pipe()  # the first step of loop.close()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("the signal was swallowed")
"""


@pytest.mark.parametrize("handlers", ["kept", "released"])
def test_a_stop_signal_while_the_loop_closes(handlers: str) -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT, handlers], capture_output=True, text=True, timeout=60)
    if handlers == "kept":  # the quirk itself: a traceback on stderr, and the signal lost
        assert "signal wakeup fd" in r.stderr and "Traceback" in r.stderr
        assert "swallowed" in r.stdout
    else:
        assert r.returncode == -signal.SIGTERM and r.stderr == "" and r.stdout == ""
