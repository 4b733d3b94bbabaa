"""`python -m polar.cli.node_gateway FD`: a node's gateway on several workers (`GatewayChild`).

Reads `(GatewayConfig, workers, log level, JSON logs)` pickled on stdin from the node that started it, runs
`polar.cli.workers.serve_workers` (bind, fork, supervise) and writes on descriptor FD, once every worker
serves, `ok` and a JSON object `{"data", "control", "workers"}` (the shared model API, the control listener
and each worker's own model API, as this machine reaches them), or `E` and the one line that says why it
cannot start. It gets SIGTERM when the node dies, and stops its workers then.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys

from polar.cli.common import CannotStart
from polar.cli.workers import _die_with_parent, serve_workers
from polar.gateway.forward import WorkerSet
from polar.harness.registry import classifier
from polar.logs import setup_logging
from polar.memory import tune_gc


def main() -> None:
    fd = int(sys.argv[1])
    config, workers, log_level, log_json = pickle.load(sys.stdin.buffer)
    _die_with_parent()
    setup_logging(log_level, json=log_json)

    # -1 once closed here: a worker forked later (a restart) must not close what reuses the number
    pipe = [fd]

    def worker_started() -> None:  # a worker forked while it is open must not hold the node's pipe open
        if pipe[0] >= 0:
            os.close(pipe[0])
        tune_gc()

    def ready(data: str, control: str, set_: WorkerSet) -> None:
        said = {"data": data, "control": control, "workers": list(set_.data_urls)}
        os.write(fd, b"ok" + json.dumps(said).encode())
        os.close(fd)
        pipe[0] = -1

    options = {"log_level": log_level, "proxy_headers": False}
    try:
        serve_workers(config, workers, classifier, options, on_worker_start=worker_started, on_ready=ready)
    except CannotStart as exc:
        with contextlib.suppress(OSError):
            os.write(fd, b"E" + exc.format_message().encode())
        sys.exit(2)


if __name__ == "__main__":
    main()
