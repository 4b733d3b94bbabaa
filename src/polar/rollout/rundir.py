"""A local run's output folder (`--out` of `polar run`, `generate` and `train`): never destroyed by accident.

A long run is often stopped (Ctrl-C, a crash, a full disk) and started again with the same command, so a
folder that holds an earlier run is *resumed*, never truncated: the rollout server's state (`server.db`)
knows which sessions finished (kept) and which did not (run again), and `results.jsonl` is only appended
to, with results it does not hold yet. Only an explicit `--overwrite` removes an earlier run's files, and
only the files polar writes there (`RUN_FILES`, `TRAIN_FILES`), never the folder itself.

One process at a time owns a folder (`locked`): two runs appending to one `results.jsonl` and driving one
`server.db` would corrupt both.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from polar.rollout.protocol import SessionResult
from polar.rollout.rewards import infrastructure_failure
from polar.store.files import private_dirs
from polar.task import Task

# What `polar run`/`generate` write under --out, and `polar train` under `out`: all --overwrite removes.
RUN_FILES = (
    "results.jsonl",
    "server.db",
    "gateway.db",
    "messages.jsonl",
    "tokens.jsonl",
    "messages.parquet",
    "tokens.parquet",
)
TRAIN_FILES = ("metrics.jsonl", "eval.jsonl", "checkpoints", "tensorboard", "sync", "server.db", "gateway.db")
_SIDECARS = ("-wal", "-shm")  # SQLite's, beside a .db file
LOCK = ".polar.lock"


class RunDirError(Exception):
    """The folder cannot be used as asked; the message says why and what to do (one line for the CLI)."""


_held: dict[Path, int] = {}  # folders this process holds -> nesting depth (a run's CLI, then its stack)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold `out` for this process (re-entrant); another process holding it is a `RunDirError`. Made 0700
    when missing: it holds the run's stores."""
    private_dirs(out)
    key = out.resolve()
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    f = open(key / LOCK, "a+")  # noqa: SIM115 - held for the whole run
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            raise RunDirError(
                f"{out} is in use by another polar process (pid {pid}); wait for it, or pick another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        f.close()  # releases the lock


def present(out: Path, names: Sequence[str]) -> list[str]:
    """Which of `names` exist under `out`."""
    return [name for name in names if (out / name).exists()]


def remove(out: Path, names: Sequence[str]) -> list[str]:
    """Delete these files or folders under `out` (with SQLite's sidecar files); returns those that existed."""
    removed = present(out, names)
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        for suffix in _SIDECARS:
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    return removed


class ResultsFile:
    """`results.jsonl`, append-only: one line per finished session, each session at most once.

    Opening it reads the session ids it holds. An unterminated last line (a process killed mid-write) is
    cut off: it is no result anyone can read, and the session it began is in `server.db` and is written
    again by the resumed run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.session_ids: set[str] = set()
        self._f: IO[bytes] | None = None
        if path.is_file():
            self._scan()

    def _scan(self) -> None:
        with open(self.path, "rb+") as f:
            good = 0
            for line in f:
                if not line.endswith(b"\n"):
                    f.truncate(good)
                    break
                good += len(line)
                with contextlib.suppress(orjson.JSONDecodeError, TypeError, KeyError):
                    self.session_ids.add(str(orjson.loads(line)["session_id"]))

    def __len__(self) -> int:
        return len(self.session_ids)

    def __enter__(self) -> ResultsFile:
        self._f = open(self.path, "ab")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def append(self, result: SessionResult) -> bool:
        """Write `result` unless the file holds its session already; flushed, so a kill loses nothing."""
        if result.session_id in self.session_ids:
            return False
        assert self._f is not None, "open the file with `with`"
        self._f.write(orjson.dumps(result.model_dump(mode="json")) + b"\n")
        self._f.flush()
        self.session_ids.add(result.session_id)
        return True


@dataclass
class RunPlan:
    """What a run into a folder starts from: `mode` new, resumed or overwritten; the finished results of the
    task file's tasks that the folder's server holds; which tasks it knows (not submitted again)."""

    mode: str
    total: int  # sessions the task file asks for
    finished: list[SessionResult] = field(default_factory=list)
    known: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)  # known tasks with sessions still to run
    removed: list[str] = field(default_factory=list)
    retried: int = 0  # sessions that ended in an infrastructure failure, queued to run again

    @property
    def to_run(self) -> int:
        return self.total - len(self.finished)

    @property
    def nothing_to_run(self) -> bool:
        return not self.active and self.to_run <= 0

    def describe(self, out: Path) -> str:
        """The line printed on start: which of new, resumed or overwritten happened, and what is left."""
        if self.mode == "resumed":
            if self.nothing_to_run:
                return f"resuming {out}: all {len(self.finished)} sessions finished earlier; nothing to run"
            retried = f" ({self.retried} after an infrastructure failure: run again)" if self.retried else ""
            return (
                f"resuming {out}: {len(self.finished)} of {self.total} sessions finished earlier (kept), "
                f"{self.to_run} to run{retried}"
            )
        if self.mode == "overwritten":
            return f"overwrote {out} (removed {', '.join(self.removed)}): new run of {self.total} sessions"
        return f"new run in {out}: {self.total} sessions"


def _differs(stored: Task, given: Task) -> list[str]:
    a, b = stored.model_dump(mode="json"), given.model_dump(mode="json")
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def plan_run(
    out: Path, tasks: Sequence[Task], *, overwrite: bool, source: Path | str = "the task file"
) -> RunPlan:
    """Decide how a `polar run`/`generate` into `out` starts (call with the folder `locked`).

    No earlier run: new. `overwrite`: the earlier run's files are removed, then new. Otherwise the earlier
    run is resumed; a task it ran must be the same task now (`RunDirError` names the fields that differ),
    sessions that ended in an infrastructure failure are queued again (`rewards.infrastructure_failure`),
    and files without a `server.db` to resume from are refused rather than replaced."""
    from polar.rollout.server.store import ServerStore

    total = sum(t.num_samples for t in tasks)
    removed = remove(out, RUN_FILES) if overwrite else []
    db = out / "server.db"
    if not db.is_file():
        leftovers = present(out, RUN_FILES)
        if leftovers:
            raise RunDirError(
                f"{out} holds {', '.join(leftovers)} but no server.db to resume from; pass --overwrite to "
                "replace them, or another --out"
            )
        return RunPlan("overwritten" if removed else "new", total, removed=removed)
    plan = RunPlan("resumed", total)
    store = ServerStore(db)
    try:
        for task in tasks:
            row = store.task(task.task_id)
            if row is None:
                continue
            changed = _differs(row.task, task)
            if changed:
                raise RunDirError(
                    f"task {task.task_id} in {source} is not the task {out} ran (it differs in "
                    f"{', '.join(changed)}); resuming needs the same task: pass --overwrite to start over, "
                    "or another --out"
                )
            plan.known.add(task.task_id)
            if row.state == "ACTIVE":
                plan.active.add(task.task_id)
        after = 0
        while page := store.results(sorted(plan.known), after):
            plan.finished += [SessionResult.model_validate_json(blob) for _, blob in page]
            after = page[-1][0]
        # A session the infrastructure failed (backend down, a runtime that did not start, the deadline)
        # says nothing about the policy: a plain re-run retries it under a new id. Its failed line stays in
        # results.jsonl; the agent's own outcomes (any reward, its budget spent, cancelled) are kept.
        failed = [r for r in plan.finished if infrastructure_failure(r.status.value, r.reason)]
        if failed:
            from polar.rollout.server.service import new_session_id

            plan.retried = store.retry([r.session_id for r in failed], new_session_id)
            again = {r.session_id for r in failed}
            plan.finished = [r for r in plan.finished if r.session_id not in again]
            plan.active |= {r.task_id for r in failed}
    finally:
        store.close()
    plan.active |= {t.task_id for t in tasks if t.task_id not in plan.known}
    return plan


def checkpoints(out: Path) -> list[Path]:
    """`out/checkpoints/step-N` folders `polar train` finished writing, by step."""
    found = [
        p
        for p in (out / "checkpoints").glob("step-*")
        if p.name[5:].isdigit() and (p / "trainer_state.json").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def metrics_steps(out: Path) -> list[int]:
    """The steps `out/metrics.jsonl` holds lines for, in file order."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    steps: list[int] = []
    with open(path, "rb") as f:
        for line in f:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError, KeyError, ValueError):
                steps.append(int(orjson.loads(line)["step"]))
    return steps
