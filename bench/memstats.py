"""Where a process's memory is: for bench/soak.py's gateway, read inside it on SIGUSR1.

RSS alone cannot say which allocator holds the pages. This splits it: the kernel's view
(/proc/self/smaps_rollup: anonymous vs file-backed), glibc's (mallinfo2 over all arenas: in use, free in
the heaps, mmapped), CPython's small-object allocator (`sys._debugmallocstats`: 1 MiB arenas, bytes in
live blocks, free pools), SQLite's own allocations (sqlite3_memory_used, through the library the sqlite3
module links), and the collector's live objects by type. `install(path)` makes SIGUSR1 append one JSON line
to `path`; `render` prints two of them side by side. With POLAR_SOAK_STRAYS=1, each snapshot after a
burst also lists what lies in the memory mapped since the baseline (`strays`): what pins a burst's arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import re
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from typing import Any


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
    ] + [(name, ctypes.c_size_t) for name in ("fordblks", "keepcost")]


def smaps() -> dict[str, int]:
    """Kernel's view, KiB: Rss, Anonymous, file-backed and shared parts."""
    out: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            m = re.match(r"(\w+):\s+(\d+) kB", line)
            if m and m.group(1) in ("Rss", "Anonymous"):
                out[m.group(1)] = int(m.group(2))
    out["File"] = out["Rss"] - out["Anonymous"]
    return out


def mappings() -> dict[str, list[int]]:
    """Resident KiB per mapping kind: the brk heap, anonymous mappings by size class (pymalloc's 1 MiB
    arenas; glibc's 64 MiB thread-arena heaps; others), file-backed: [mappings, size KiB, Rss KiB]."""
    out: dict[str, list[int]] = {}
    kind = ""
    size = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size = (hi - lo) >> 10
                name = head[5] if len(head) > 5 else ""
                if name == "[heap]":
                    kind = "brk heap"
                elif name.startswith("["):
                    kind = name
                elif name:
                    kind = "file " + name.rsplit("/", 1)[-1].split(".")[0][:20]
                elif size == 1024:
                    kind = "anon 1 MiB (pymalloc arena)"
                elif size >= 8 * 1024:
                    kind = "anon >= 8 MiB (thread arenas, stacks)"
                else:
                    kind = "anon other"
                entry = out.setdefault(kind, [0, 0, 0])
                entry[0] += 1
                entry[1] += size
            elif head[0] == "Rss:":
                out[kind][2] += int(head[1])
    return out


def glibc() -> dict[str, int]:
    """mallinfo2 (glibc >= 2.33), bytes: `arena` sbrk'd + arena heaps, `uordblks` in use, `fordblks` free
    in them, `hblkhd` in mmapped chunks."""
    name = ctypes.util.find_library("c")
    if name is None:
        return {}
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {k: int(getattr(info, k)) for k in ("arena", "uordblks", "fordblks", "hblkhd", "keepcost")}


def arenas() -> list[dict[str, int]]:
    """glibc's malloc_info per arena (heap 0 is the main one): bytes from the system, free in it (fast
    bins and the rest), and the top chunk (`top`, what trimming the heap's end would return)."""
    import xml.etree.ElementTree as ET

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        fp = libc.fopen(tmp.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        root = ET.parse(tmp.name).getroot()
    out = []
    for heap in root.findall("heap"):
        row = {"nr": int(heap.get("nr", "-1"))}
        for total in heap.findall("total"):
            row["free_" + total.get("type", "")] = int(total.get("size", "0"))
        for system in heap.findall("system"):
            row["system_" + system.get("type", "")] = int(system.get("size", "0"))
        out.append(row)
    return out


def pymalloc() -> dict[str, int]:
    """`sys._debugmallocstats` (it writes to the C stderr, so fd 2 is pointed at a file meanwhile)."""
    with tempfile.TemporaryFile("w+") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    keys = {
        "# arenas allocated current": "arenas",
        "# arenas highwater mark": "arenas_highwater",
        "# bytes in allocated blocks": "allocated",
        "# bytes in available blocks": "available",
        "free pools": "free_pools",  # "N unused pools * 16384 bytes"
    }
    out: dict[str, int] = {}
    for line in text.splitlines():
        for key, name in keys.items():
            if line.startswith(key):
                out[name] = int(line.rsplit("=", 1)[-1].strip().replace(",", ""))
        m = re.match(r"(\d+) unused pools \* (\d+) bytes", line)
        if m:
            out["unused_pools_bytes"] = int(m.group(1)) * int(m.group(2))
    return out


def sqlite_used() -> int:
    """Bytes SQLite holds through its allocator (page caches, schema, statements), every connection."""
    import _sqlite3

    try:
        lib = ctypes.CDLL(_sqlite3.__file__)
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        return int(lib.sqlite3_memory_used())
    except (OSError, AttributeError):
        return -1


def objects(top: int = 12) -> list[tuple[str, int]]:
    """The most numerous live objects the collector tracks, by type (frozen start-up objects excluded)."""
    return Counter(type(o).__name__ for o in gc.get_objects()).most_common(top)


def shapes(top: int = 10) -> list[tuple[str, int]]:
    """What the live dicts and lists are: a dict by its first keys, a list by its length and first item's type."""
    seen: Counter[str] = Counter()
    for o in gc.get_objects():
        if type(o) is dict:
            seen["dict " + ",".join(sorted(map(str, o))[:5])[:80]] += 1
        elif type(o) is list:
            seen[f"list len {min(len(o), 10)} of {type(o[0]).__name__ if o else '-'}"] += 1
    return seen.most_common(top)


def holders(keys: frozenset[str], depth: int = 8) -> list[str]:
    """For one live dict with exactly `keys`: what holds it, then what holds that, `depth` levels up
    (frames by their code's name; the first non-frame referrer is followed)."""
    gc.collect()
    mine: set[int] = set()
    found = [o for o in gc.get_objects() if type(o) is dict and set(o) == keys]
    mine.add(id(found))
    out: list[str] = []
    here: Any = found[0] if found else None
    del found
    for _ in range(depth):
        if here is None:
            break
        refs = gc.get_referrers(here)
        mine.add(id(refs))
        refs = [r for r in refs if id(r) not in mine]
        mine.add(id(refs))
        desc = []
        follow = None
        for r in refs[:6]:
            name = type(r).__name__
            if name == "frame":
                desc.append(f"frame {r.f_code.co_qualname} line {r.f_lineno}")
                continue
            if follow is None:
                follow = r
            if isinstance(r, dict):
                name += " keys " + ",".join(sorted(map(str, r))[:6])[:100]
            elif isinstance(r, (list, tuple)):
                name += f" len {len(r)} of " + ",".join(sorted({type(x).__name__ for x in r[:20]}))[:80]
            elif hasattr(r, "__qualname__"):
                name += " " + str(getattr(r, "__module__", "")) + "." + r.__qualname__
            desc.append(name)
        out.append(" | ".join(desc) or "(none tracked)")
        here = follow
    return out


def garbage() -> list[tuple[str, int]]:
    """Unreachable cycles the collector has not freed yet (collected now, so call it last): by type."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(type(o).__name__ for o in gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return found.most_common(8)


def traced(top: int = 12) -> list[str]:
    """The biggest groups of live blocks allocated since tracing began, with where they were allocated."""
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    )
    out = []
    for stat in snap.statistics("traceback")[:top]:
        frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in stat.traceback[-8:]]
        out.append(f"{stat.size / 1024:.0f} KiB in {stat.count} blocks: " + " < ".join(reversed(frames)))
    total = sum(t.size for t in snap.traces)
    out.append(f"total {total / 2**20:.2f} MiB in {len(snap.traces)} blocks")
    return out


def anon_ranges() -> list[tuple[int, int]]:
    """The process's anonymous mappings (where pymalloc's arenas are), as (start, end) addresses."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split()
            if len(head) == 5:  # no path: anonymous
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                out.append((lo, hi))
    return out


def strays(before: list[tuple[int, int]], top: int = 12, limit: int = 2_000_000) -> dict[str, Any]:
    """The live objects, and the dict, set and list tables, that lie in memory mapped since `before` (the
    baseline's anonymous mappings): what keeps the arenas a burst added from being freed, each with the
    chain of objects the walk reached it through. Every object reachable from the collector's is looked
    at (frozen ones too, through their referents); what only C code holds (a C extension's own caches)
    is missed, so an arena may show nothing."""
    import bisect

    starts = [lo for lo, _ in before]

    def old(addr: int) -> bool:
        i = bisect.bisect_right(starts, addr) - 1
        return i >= 0 and addr < before[i][1]

    current = anon_ranges()
    now = [r for r in current if not old(r[0]) or not old(r[1] - 1)]
    new_starts = [lo for lo, _ in now]

    def new(addr: int) -> bool:
        i = bisect.bisect_right(new_starts, addr) - 1
        return i >= 0 and addr < now[i][1] and not old(addr)

    seen: set[int] = set()
    stack: list[Any] = list(gc.get_objects())
    seen.update(map(id, stack))
    parent: dict[int, Any] = {}  # id -> the object the walk reached it from
    mine = {id(x) for x in (stack, seen, parent, before, current, now, starts, new_starts)}  # the walk's own
    found: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    samples: dict[str, list[str]] = {}
    holders: Counter[str] = Counter()
    by_range: Counter[int] = Counter()
    mine.update(id(x) for x in (mine, found, nbytes, samples, holders, by_range, *before))

    def describe(o: Any) -> str:
        name = type(o).__name__
        if isinstance(o, (list, tuple, dict, set)):
            name += f" len {len(o)}"
        if isinstance(o, dict) and "__name__" in o:
            name += f" of {o['__name__']}"
        elif hasattr(o, "__qualname__"):
            name += " " + str(getattr(o, "__qualname__", ""))
        return name

    def chain(o: Any, depth: int = 5) -> str:
        out = []
        for _ in range(depth):
            up = parent.get(id(o))
            if up is None:  # where the walk began (the collector's objects): ask who refers to it
                up = next((r for r in gc.get_referrers(o) if id(r) not in mine), None)
            if up is None:
                break
            out.append(describe(up))
            o = up
        return " < ".join(out)

    def buffer(o: Any) -> int:
        """Where a dict's keys table, a set's table or a list's items array is (0: none of those)."""
        kind = type(o)
        offset = 32 if issubclass(kind, dict) else 40 if issubclass(kind, (set, frozenset)) else 24
        if not issubclass(kind, (dict, set, frozenset, list)):
            return 0
        return int(ctypes.c_void_p.from_address(id(o) + offset).value or 0)

    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in mine:
            continue
        table = buffer(o)
        if table and new(table):
            name = f"table of {type(o).__name__}"
            found[name] += 1
            by_range[new_starts[bisect.bisect_right(new_starts, table) - 1]] += 1
            holders[name + " < " + chain(o, 3)] += 1
            if len(samples.setdefault(name, [])) < 3:
                samples[name].append(f"{describe(o)} < {chain(o)}")
        if new(id(o)):
            name = type(o).__name__
            found[name] += 1
            nbytes[name] += sys.getsizeof(o)
            by_range[new_starts[bisect.bisect_right(new_starts, id(o)) - 1]] += 1
            holders[name + " < " + chain(o, 3)] += 1
            if len(samples.setdefault(name, [])) < 3:
                try:
                    text = repr(o)[:60]
                except Exception:
                    text = "?"
                samples[name].append(f"{text} < {chain(o)}")
        for r in gc.get_referents(o):
            if id(r) not in seen and id(r) not in mine:
                seen.add(id(r))
                parent[id(r)] = o
                stack.append(r)
    return {
        "new_ranges_kib": [(hex(lo), (hi - lo) >> 10) for lo, hi in now],
        "objects_in_each": sorted(by_range.values(), reverse=True),
        "looked_at": len(seen),
        "types": [(n, c, nbytes[n]) for n, c in found.most_common(top)],
        "samples": {n: samples[n] for n, _ in found.most_common(top)},
        "holders": holders.most_common(top),
    }


def snapshot(label: str) -> dict[str, Any]:
    return {
        "label": label,
        "time": time.time(),
        "smaps": smaps(),
        "mappings": mappings(),
        "glibc": glibc(),
        "arenas": arenas(),
        "pymalloc": pymalloc(),
        "sqlite": sqlite_used(),
        "gc_tracked": len(gc.get_objects()),
        "objects": objects(),
        "shapes": shapes(),
        "holders": holders(frozenset({"max_tokens", "messages", "model", "tools"})),
        "garbage": garbage(),
    }


def install(path: str) -> None:
    """On SIGUSR1, append a snapshot to `path` as one JSON line (the label: how many were taken before)."""
    taken = [0]

    trace = bool(os.environ.get("POLAR_SOAK_TRACEMALLOC"))

    ranges: list[list[tuple[int, int]]] = []

    def handler(signum: int, frame: Any) -> None:
        snap = snapshot(f"#{taken[0]}")
        if os.environ.get("POLAR_SOAK_STRAYS"):
            if ranges and taken[0] % 2 == 0:  # after each burst (#2, #4, ...): the walk allocates
                snap["strays"] = strays(ranges[0])
            else:
                ranges.append(anon_ranges())
        if trace and tracemalloc.is_tracing():
            snap["traces"] = traced()
        with open(path, "a") as f:
            f.write(json.dumps(snap) + "\n")
        if trace and taken[0] == 0:
            tracemalloc.start(16)  # from the baseline on: what is live later was allocated after it
        taken[0] += 1

    signal.signal(signal.SIGUSR1, handler)


def render(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """A table of MiB figures, one column per labelled snapshot."""
    mib = 1 / 2**20

    def line(name: str, get: Any) -> str:
        cells = []
        for _, s in rows:
            try:
                cells.append(f"{get(s):>10.1f}")
            except (KeyError, TypeError):
                cells.append(f"{'-':>10}")
        return f"{name:<40}" + "".join(cells)

    head = f"{'MiB':<40}" + "".join(f"{label:>10}" for label, _ in rows)
    lines = [
        head,
        line("RSS (smaps)", lambda s: s["smaps"]["Rss"] / 1024),
        line("  anonymous", lambda s: s["smaps"]["Anonymous"] / 1024),
        line("  file-backed and shared", lambda s: s["smaps"]["File"] / 1024),
        line("glibc heaps (arena)", lambda s: s["glibc"]["arena"] * mib),
        line("  in use (uordblks)", lambda s: s["glibc"]["uordblks"] * mib),
        line("  free in heaps (fordblks)", lambda s: s["glibc"]["fordblks"] * mib),
        line("glibc mmapped chunks (hblkhd)", lambda s: s["glibc"]["hblkhd"] * mib),
        line("pymalloc arenas (1 MiB each)", lambda s: float(s["pymalloc"]["arenas"])),
        line("  bytes in live blocks", lambda s: s["pymalloc"]["allocated"] * mib),
        line("  free blocks in used pools", lambda s: s["pymalloc"]["available"] * mib),
        line("  unused pools", lambda s: s["pymalloc"]["unused_pools_bytes"] * mib),
        line("SQLite (sqlite3_memory_used)", lambda s: s["sqlite"] * mib),
        line("objects tracked by gc (thousands)", lambda s: s["gc_tracked"] / 1000),
    ]
    kinds = sorted({k for _, s in rows for k in s.get("mappings", {})})
    for k in kinds:
        if not k.startswith(("file ", "[v")):
            lines.append(line(f"Rss of {k}", lambda s, k=k: s["mappings"][k][2] / 1024))
    lines.append(
        line(
            "Rss of files",
            lambda s: sum(v[2] for k, v in s["mappings"].items() if k.startswith("file ")) / 1024,
        )
    )
    for label, s in rows:
        lines.append(f"{label} glibc arenas: {s.get('arenas')}")
    for label, s in rows:
        lines.append(f"{label} top types: " + ", ".join(f"{n} {c}" for n, c in s["objects"][:8]))
    for label, s in rows:
        lines.append(f"{label} shapes: " + "; ".join(f"{n} x{c}" for n, c in s.get("shapes", [])))
    for label, s in rows:
        lines.append(f"{label} holders: " + " <- ".join(s.get("holders", [])))
    for label, s in rows:
        lines.append(f"{label} uncollected garbage: {s.get('garbage')}")
    for label, s in rows:
        if "strays" in s:
            lines.append(f"{label} strays: " + json.dumps(s["strays"]))
    for label, s in rows:
        for t in s.get("traces", []):
            lines.append(f"{label} traced: {t}")
    return "\n".join(lines)
