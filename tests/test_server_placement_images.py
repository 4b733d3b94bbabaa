"""Image- and group-aware placement (`scheduler.place` with needs), the prefetch plan, and image references
spelled alike whichever engine listed them."""

from __future__ import annotations

from collections import Counter

import pytest

from polar.rollout.server.scheduler import Need, NodeView, place, prefetch
from polar.runtime.inventory import normalize_ref

PY = ("docker", "python:3.11")
GO = ("docker", "golang:1.22")


def node(node_id: str, capacity: int = 2, load: int = 0, **kw: object) -> NodeView:
    return NodeView(
        node_id,
        f"http://{node_id}",
        capacity,
        load,
        healthy=bool(kw.get("healthy", True)),
        draining=False,
        images=frozenset(kw.get("images", ())),  # type: ignore[arg-type]
        fetching=frozenset(kw.get("fetching", ())),  # type: ignore[arg-type]
        engines=frozenset(kw.get("engines", ("docker",))),  # type: ignore[arg-type]
    )


def test_a_session_goes_where_its_image_is_even_onto_the_busier_node() -> None:
    nodes = [node("a", capacity=4, load=3, images=[PY]), node("b", capacity=4)]
    needs = {"s1": Need(PY, "t1"), "s2": Need(GO, "t2")}
    assert place(["s1", "s2"], nodes, needs) == [("s1", "a"), ("s2", "b")]


def test_a_node_fetching_the_image_comes_before_one_that_would_start_fetching_it() -> None:
    nodes = [node("a", images=[GO]), node("b", fetching=[PY]), node("c")]
    assert place(["s1"], nodes, {"s1": Need(PY, "t1")}) == [("s1", "b")]


def test_a_full_holder_does_not_make_a_session_wait() -> None:
    nodes = [node("a", capacity=1, load=1, images=[PY]), node("b", capacity=1)]
    assert place(["s1"], nodes, {"s1": Need(PY, "t1")}) == [("s1", "b")]


def test_a_group_stays_together_while_its_node_has_room_then_spills() -> None:
    # No node holds the image: the group's first sample picks by load, its siblings follow it.
    nodes = [node("a", capacity=3), node("b", capacity=3), node("c", capacity=3)]
    queue = [f"s{i}" for i in range(5)]
    needs = {sid: Need(PY, "t1") for sid in queue}
    out = place(queue, nodes, needs)
    assert Counter(n for _, n in out) == Counter({"a": 3, "b": 2})
    # A group with samples already running on c joins them there.
    out = place(["s9"], nodes, {"s9": Need(PY, "t1")}, {"t1": Counter({"c": 1})})
    assert out == [("s9", "c")]


def test_sessions_in_no_container_spread_by_load_alone() -> None:
    nodes = [node("a", capacity=4), node("b", capacity=4)]
    needs = {f"s{i}": Need(None, "t1") for i in range(4)}
    out = place(list(needs), nodes, needs, {"t1": Counter({"a": 2})})
    assert Counter(n for _, n in out) == Counter({"a": 2, "b": 2})


def test_without_needs_placement_is_by_load_as_before() -> None:
    nodes = [node("a", capacity=4, load=2, images=[PY]), node("b", capacity=4)]
    assert place(["s1", "s2"], nodes) == [("s1", "b"), ("s2", "b")]


def test_prefetch_asks_one_node_per_missing_image_the_least_busy_first() -> None:
    nodes = [
        node("a", images=[PY], fetching=[("docker", "x:1")]),
        node("b", load=1),
        node("c", load=2, capacity=2),
    ]
    plan = prefetch([PY, GO, GO, ("docker", "x:1"), None, ("docker", "rust:1")], nodes)
    # PY is held and x:1 fetched already; GO goes to b (no fetch under way, lower load than c); one new
    # fetch per node per plan: rust goes to c.
    assert plan == {"b": [GO], "c": [("docker", "rust:1")]}


def test_prefetch_skips_nodes_that_report_no_images_or_another_engine_or_are_down() -> None:
    nodes = [
        node("a", engines=()),
        node("b", engines=("podman",)),
        node("c", healthy=False),
    ]
    assert prefetch([GO], nodes) == {}
    assert prefetch([("podman", "golang:1.22")], nodes) == {"b": [("podman", "golang:1.22")]}


@pytest.mark.parametrize(
    ("listed", "key"),
    [
        ("python:3.11", "python:3.11"),
        ("docker.io/library/python:3.11", "python:3.11"),
        ("localhost/polar-base:bookworm", "polar-base:bookworm"),
        ("python", "python:latest"),
        ("docker.io/swebench/sweb.eval.x86_64.a:latest", "swebench/sweb.eval.x86_64.a:latest"),
        ("ghcr.io/org/img", "ghcr.io/org/img:latest"),
        ("registry:5000/img", "registry:5000/img:latest"),
        ("img@sha256:abc", "img@sha256:abc"),
    ],
)
def test_image_references_are_spelled_alike(listed: str, key: str) -> None:
    assert normalize_ref(listed) == key


def test_a_session_waits_a_while_for_a_busy_node_holding_its_image_while_others_go_first() -> None:
    nodes = [node("a", capacity=2, load=2, images=[PY]), node("b", capacity=2, images=[GO])]
    needs = {"s1": Need(PY, "t1"), "s2": Need(GO, "t2"), "s3": Need(("docker", "new:1"), "t3")}
    skipped: set[str] = set()
    out = place(["s1", "s2", "s3"], nodes, needs, locality_wait_s=60, waited={}, skipped=skipped)
    # s1 is passed over (a holds its image and will free a slot); s2 runs where its image is; s3's image
    # is nowhere, so waiting would not save a fetch: it takes the other free slot.
    assert out == [("s2", "b"), ("s3", "b")] and skipped == {"s1"}
    # Once it has waited as long as a fetch costs, it takes a free slot and its node fetches the image.
    out = place(["s1"], nodes, needs, locality_wait_s=60, waited={"s1": 60.0}, skipped=skipped)
    assert out == [("s1", "b")]
    # An image on its way to a busy node counts as held there.
    fetching = [node("a", capacity=1, load=1, fetching=[PY]), node("b", capacity=1)]
    assert place(["s1"], fetching, needs, locality_wait_s=60) == []
