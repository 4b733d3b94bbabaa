"""bench/soak.py's verdict on recorded series: a live-session plateau, memory given back, memory held, a leak.

The series are shaped like the bench's own output (idle-phase samples: seconds after the burst, live
sessions, RSS MiB), so the verdict is tested without running a gateway or waiting for one; and
bench/memstats.py's walk that names what keeps a burst's arenas, on a burst made in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.soak import Sample, verdict

ROOT = Path(__file__).resolve().parent.parent


def _series(*rows: tuple[float, int | None, float]) -> list[Sample]:
    return [Sample(t, live, rss) for t, live, rss in rows]


def test_a_run_shorter_than_the_idle_timeout_is_a_plateau_not_a_leak() -> None:
    # Was GROWING: a 26 s run against a 600 s idle timeout ends with its sessions still held.
    got = verdict(72.8, [_series((5, 250, 260.0), (10, 250, 262.0), (15, 250, 262.0))])
    assert got.label == "PLATEAU"
    assert "250 sessions still live" in got.why


def test_back_within_ten_percent_with_no_session_live_is_released() -> None:
    burst = _series((5, 980, 250.0), (10, 12, 180.0), (15, 0, 79.0), (75, 0, 79.5))
    got = verdict(74.9, [burst])
    assert got.label == "RELEASED", got


def test_just_over_ten_percent_is_not_released() -> None:
    burst = _series((5, 0, 90.0), (65, 0, 82.5))
    got = verdict(74.9, [burst])
    assert got.label == "HELD"
    assert "+10 %" in got.why and "--bursts 2" in got.why


def test_held_memory_that_rises_from_burst_to_burst_is_a_leak() -> None:
    first = _series((5, 0, 110.0), (65, 0, 90.0))
    second = _series((5, 0, 130.0), (65, 0, 105.0))
    got = verdict(74.9, [first, second])
    assert got.label == "LEAK"
    assert "90.0 -> 105.0" in got.why


def test_held_memory_that_stays_level_over_bursts_is_held() -> None:
    first = _series((5, 0, 110.0), (65, 0, 86.0))
    second = _series((5, 0, 130.0), (65, 0, 87.0))
    got = verdict(74.9, [first, second])
    assert got.label == "HELD"
    assert "from burst to burst" in got.why


def test_growing_while_no_session_is_live_is_a_leak() -> None:
    burst = _series((5, 0, 80.0), (10, 0, 84.0), (15, 0, 88.0), (20, 0, 92.0))
    assert verdict(74.9, [burst]).label == "LEAK"


def test_a_server_that_cannot_say_its_sessions_is_judged_by_its_rss() -> None:
    # LiteLLM in bench/gateway.py: no live-session count, read after a fixed wait.
    assert verdict(389.8, [_series((90, None, 400.0))]).label == "RELEASED"
    assert verdict(389.8, [_series((90, None, 435.3))]).label == "HELD"


STRAYS = """
import json, sys
sys.path.insert(0, "bench")
import memstats

class Survivor:
    pass

baseline = memstats.anon_ranges()
burst = [Survivor() for _ in range(200_000)]
kept = burst[::50_000]
del burst
print(json.dumps(memstats.strays(baseline)))
"""


def test_strays_names_what_lies_in_memory_mapped_since_the_baseline() -> None:
    # Fragmentation as after a burst: many small objects fill new arenas, all but a few die, and the
    # survivors keep their arenas. The walk must find those survivors (and not its own bookkeeping). A
    # fresh interpreter: in this one, earlier tests leave free room in old arenas for the whole burst.
    out = subprocess.run([sys.executable, "-c", STRAYS], cwd=ROOT, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    types = {name: count for name, count, _ in found["types"]}
    # 4 kept, 50,000 objects apart (> 2 MiB): at most the first can lie in room an old arena had free.
    assert types.get("Survivor") in (3, 4), found
    assert "int" not in types, found  # the walk's own id sets are not reported
    assert any(h.startswith("Survivor < list len 4") for h, _ in found["holders"]), found
