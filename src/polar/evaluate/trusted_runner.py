# mypy: ignore-errors
# (Runs on the task's interpreter, any Python >= 3.8, standard library only: kept free of annotations.)
"""The test runner polar starts itself (`polar.evaluate.runner`), in the task's interpreter, as
`python -I -B -X pycache_prefix=... -c <this file> collect|run`: isolated mode (no PYTHON* variables, no
user site, no script or working directory prepended to `sys.path`), no bytecode written or read from the
tree. It needs nothing uploaded and runs in any runtime. Standard library only, Python >= 3.8.

Why each step:
- stdin carries a per-evaluation nonce, then the JSON job. Both are read, and stdin replaced by /dev/null,
  before any task or agent code is imported: the nonce never sits in argv, the environment or a file.
- The report goes to a private duplicate of stdout; fd 1 is pointed at stderr, so whatever the tested code
  prints lands in the human-readable output and never among the report's lines, which the host reads only
  between `<nonce> BEGIN` and `<nonce> END`.
- The framework (unittest or pytest) is imported, and the callables of its modules and classes (and the
  builtins) are recorded, before the working directory is put on `sys.path`: a shadowing module cannot
  stand in for it, and any later replacement of what was recorded is reported as tampering.
- A canary test that must fail runs last, through the same result machinery; a canary reported as passed
  means the tested code disabled failures.
- `os._exit` right after the report: no atexit handler or thread of the tested code runs after it.
"""

from __future__ import annotations

import os
import sys

_RANK = {"passed": 0, "skipped": 1, "xfail": 2, "xpass": 3, "failed": 4, "error": 5}


def _routine(value, callable=callable, hasattr=hasattr, type=type):
    """Whether replacing `value` changes behaviour: a callable or a descriptor (method, property). Data
    (counters, once-flags the framework sets on its classes) is left out of the comparison."""
    return callable(value) or hasattr(type(value), "__get__")


def _snapshot(prefixes, owned, vars=vars, list=list, isinstance=isinstance, type=type):
    """What `_changed` compares against: the routines of the modules named by `prefixes`, of the classes
    they define (and which routines those classes have: one added to a subclass overrides) and of the
    runner's own classes in `owned`."""
    snap = {}
    keys = {}
    classes = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name in prefixes or name.split(".")[0] in prefixes):
            continue
        for attr, value in list(vars(mod).items()):
            if _routine(value):
                snap[(mod, name, attr)] = value
            if isinstance(value, type) and getattr(value, "__module__", "") == name:
                classes.append(value)
    for cls in classes:
        keys[cls] = frozenset(k for k, v in vars(cls).items() if _routine(v))
    for cls in [*classes, *owned]:
        for attr, value in list(vars(cls).items()):
            if _routine(value):
                snap[(cls, f"{cls.__module__}.{cls.__qualname__}", attr)] = value
    return snap, keys, sys.gettrace(), sys.getprofile()


def _changed(
    state,
    vars=vars,
    sorted=sorted,
    set=set,
    frozenset=frozenset,
    routine=_routine,
    gettrace=sys.gettrace,
    getprofile=sys.getprofile,
):
    """Names of what was replaced, added or removed since `_snapshot` (builtins bound at definition: the
    tested code may have replaced the module's)."""
    snap, keys, trace, profile = state
    out = []
    for (owner, label, attr), value in snap.items():
        if vars(owner).get(attr, _RANK) is not value:
            out.append(f"{label}.{attr}")
    for cls, names in keys.items():
        for attr in sorted(frozenset(k for k, v in vars(cls).items() if routine(v)) ^ names):
            out.append(f"{cls.__module__}.{cls.__qualname__}.{attr}")
    if gettrace() is not trace:
        out.append("sys.settrace")
    if getprofile() is not profile:
        out.append("sys.setprofile")
    return sorted(set(out))


def _add_paths(job):
    """The working directory first, then the task's PYTHONPATH: what `python -m <runner>` would have
    (added only now, after the framework was imported from the interpreter's own library)."""
    extra = [os.path.abspath(p) for p in job.get("pythonpath", []) if p]
    sys.path[:0] = [os.getcwd(), *extra]


def _relative_file(path):
    if not path:
        return None
    full = os.path.realpath(path)
    root = os.path.realpath(os.getcwd())
    if full.startswith(root + os.sep):
        return os.path.relpath(full, root)
    return None


def _unittest(job, emit, protect):
    import unittest
    import unittest.case
    import unittest.loader
    import unittest.main
    import unittest.result
    import unittest.runner
    import unittest.suite

    class PolarRecorder(unittest.TextTestResult):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.polar_status = {}

        def polar_mark(self, test, status):
            tid = test.id()
            old = self.polar_status.get(tid)
            if old is None or _RANK[status] > _RANK[old]:
                self.polar_status[tid] = status

        def addSuccess(self, test):
            super().addSuccess(test)
            self.polar_mark(test, "passed")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self.polar_mark(test, "failed")

        def addError(self, test, err):
            super().addError(test, err)
            self.polar_mark(test, "error")

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self.polar_mark(test, "skipped")

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self.polar_mark(test, "xfail")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self.polar_mark(test, "xpass")

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:
                failure = issubclass(err[0], test.failureException)
                self.polar_mark(test, "failed" if failure else "error")

    class PolarCanary(unittest.TestCase):
        def runTest(self):
            self.assertEqual("polar", "canary")

    state = _snapshot(("unittest", "builtins", "__main__"), (PolarRecorder, PolarCanary))
    _add_paths(job)
    loader = unittest.TestLoader()
    pattern = job.get("pattern") or "test*.py"
    if not job["tests"]:
        suites = [loader.discover(".", pattern=pattern)]
    else:
        suites = []
        for name in job["tests"]:
            if os.path.isdir(name):
                suites.append(loader.discover(name, pattern=pattern, top_level_dir="."))
            else:
                suites.append(loader.loadTestsFromName(sys.modules["unittest.main"]._convert_name(name)))

    def leaves(suite):
        for test in suite:
            if isinstance(test, unittest.TestSuite):
                yield from leaves(test)
            else:
                yield test

    tests = [t for s in suites for t in leaves(s)]
    if job["mode"] == "collect":
        for test in tests:
            if isinstance(test, unittest.loader._FailedTest):
                emit("LOADERROR", test.id(), str(test._exception)[-2000:])
                continue
            method = getattr(test, getattr(test, "_testMethodName", ""), None)
            static = ""
            if getattr(test, "__unittest_skip__", False) or getattr(method, "__unittest_skip__", False):
                static = "skip"
            elif getattr(method, "__unittest_expecting_failure__", False):
                static = "xfail"
            emit("TEST", test.id(), static)
            module = sys.modules.get(type(test).__module__)
            rel = _relative_file(getattr(module, "__file__", None))
            if rel is not None:
                protect.add(rel)
        for error in loader.errors:
            emit("LOADERROR", "", str(error)[-2000:])
        return
    expected = set(job["expected"])
    selected = [t for t in tests if t.id() in expected]
    canary = PolarCanary()
    canary_id, changed, ordered = canary.id(), _changed, sorted  # bound before the tests run
    stream = unittest.runner._WritelnDecorator(sys.__stderr__)
    result = PolarRecorder(stream, True, 2)
    unittest.TestSuite([*selected, canary]).run(result)
    result.printErrors()
    tampered = changed(state)
    status = dict(result.polar_status)
    for tid, outcome in ordered(status.items()):
        if tid != canary_id:
            emit("RESULT", tid, outcome)
    emit("CANARY", status.get(canary_id, "missing"))
    for name in tampered:
        emit("TAMPER", name)


def _pytest(job, emit, protect):
    import importlib

    import _pytest.config
    import pytest

    for name in _pytest.config.default_plugins:
        try:
            importlib.import_module("_pytest." + name)
        except ImportError:  # a plugin this pytest version does not have
            pass
    if not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        # Installed plugins load before the snapshot (some patch pytest when imported, as hypothesis does);
        # they are the interpreter's, not the agent's.
        try:
            import importlib.metadata as metadata

            found = metadata.entry_points()
            group = found.select(group="pytest11") if hasattr(found, "select") else found.get("pytest11", [])
            for entry in group:
                try:
                    importlib.import_module(entry.value.split(":")[0])
                except Exception:  # pytest reports a broken plugin itself
                    continue
        except Exception:  # no metadata: pytest loads what it finds
            pass
    canary_name = "polar_canary_" + job["canary"]
    expected = set(job.get("expected", ()))

    def polar_canary():
        assert "polar" == "canary"  # the canary must fail

    class PolarPlugin:
        def __init__(self):
            self.status = {}
            self.canary = None

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, session, config, items):
            if job["mode"] == "collect":
                from _pytest.skipping import evaluate_skip_marks, evaluate_xfail_marks

                for item in items:
                    static = ""
                    try:
                        if evaluate_skip_marks(item) is not None:
                            static = "skip"
                        elif evaluate_xfail_marks(item) is not None:
                            static = "xfail"
                    except Exception:  # a condition that cannot be evaluated at collection: counted
                        static = ""
                    emit("TEST", item.nodeid, static)
                    rel = _relative_file(str(getattr(item, "path", "") or getattr(item, "fspath", "")))
                    if rel is not None:
                        protect.add(rel)
                return
            keep = [i for i in items if i.nodeid in expected]
            dropped = [i for i in items if i.nodeid not in expected]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep
            module = keep[-1] if keep else None
            while module is not None and not isinstance(module, pytest.Module):
                module = module.parent
            if module is not None:
                self.canary = pytest.Function.from_parent(module, name=canary_name, callobj=polar_canary)
                items.append(self.canary)

        def pytest_collectreport(self, report):
            if report.failed and job["mode"] == "collect":
                emit("LOADERROR", report.nodeid, str(report.longrepr)[-2000:])

        def pytest_runtest_logreport(self, report):
            xfail = hasattr(report, "wasxfail")
            if report.when == "call":
                if report.passed:
                    status = "xpass" if xfail else "passed"
                elif report.failed:
                    status = "failed"
                else:
                    status = "xfail" if xfail else "skipped"
            elif report.failed:
                status = "error"
            elif report.skipped:
                status = "xfail" if xfail else "skipped"
            else:
                return
            old = self.status.get(report.nodeid)
            if old is None or _RANK[status] > _RANK[old]:
                self.status[report.nodeid] = status

    plugin = PolarPlugin()
    state = _snapshot(("pytest", "_pytest", "pluggy", "unittest", "builtins", "__main__"), (PolarPlugin,))
    _add_paths(job)
    args = ["-p", "no:cacheprovider", *job["tests"]]
    if job["mode"] == "collect":
        args += ["--collect-only", "-q"]
    changed, ordered = _changed, sorted  # bound before the tests run
    code = pytest.main(args, plugins=[plugin])
    if job["mode"] == "collect":
        if int(code) not in (0, 5):  # 5: no tests collected, which the host reports itself
            emit("LOADERROR", "", f"pytest --collect-only exited {int(code)}")
        return
    tampered = changed(state)
    canary_id = plugin.canary.nodeid if plugin.canary is not None else None
    status = dict(plugin.status)
    for nodeid, outcome in ordered(status.items()):
        if nodeid != canary_id:
            emit("RESULT", nodeid, outcome)
    emit("CANARY", status.get(canary_id, "missing") if canary_id else "missing")
    for name in tampered:
        emit("TAMPER", name)


def _main():
    import json

    raw = sys.stdin.buffer.read()
    head, _, body = raw.partition(b"\n")
    nonce = head.decode("ascii").strip()
    job = json.loads(body.decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    report = os.dup(1)  # not inheritable: no child process of the tests holds it
    os.dup2(2, 1)
    lines = [nonce + " BEGIN"]
    write, flush, ascii_, join, ordered = os.write, sys.stdout.flush, ascii, ", ".join, sorted
    protect = set()

    def emit(kind, *values):
        lines.append(f"{nonce} {kind} " + join([ascii_(v) for v in values]))

    try:
        (_unittest if job["runner"] == "unittest" else _pytest)(job, emit, protect)
    except BaseException as exc:  # whatever the tests raised ends in the report
        emit("ERROR", f"{type(exc).__name__}: {exc}"[-2000:])
    for path in ordered(protect):
        emit("FILE", path)
    lines.append(nonce + " END")
    data = ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")
    try:
        flush()
        sys.__stderr__.flush()
    except Exception:  # the report matters, not the tests streams
        pass
    while data:
        data = data[write(report, data) :]
    os._exit(0)


if __name__ == "__main__":
    _main()
