"""One registry shape for every kind of code polar looks up by name (`polar.plugins.Registry`): the open
kinds a task names (harnesses, evaluators, trajectory builders) and the closed tables polar drives from
(runtimes, gateway dialects)."""

from __future__ import annotations

import pytest

from polar import plugins
from polar.evaluate.registry import EVALUATORS
from polar.gateway.app import DIALECTS, SERVED
from polar.gateway.dialects.serving import Served
from polar.harness.registry import HARNESSES
from polar.runtime.base import RuntimeEntry
from polar.runtime.factory import BACKENDS, RUNTIMES
from polar.trajectory.registry import BUILDERS

OPEN = [HARNESSES, EVALUATORS, BUILDERS]
CLOSED = [RUNTIMES, DIALECTS]


@pytest.mark.parametrize("registry", [*OPEN, *CLOSED], ids=lambda r: r.kind)
def test_every_builtin_loads(registry: plugins.Registry) -> None:
    assert registry.builtin, registry.kind
    for name in registry.builtin:
        assert registry.load(name) is not None


def test_the_closed_tables_hold_what_their_users_drive_from() -> None:
    assert all(isinstance(e, RuntimeEntry) for e in RUNTIMES.entries().values())
    assert BACKENDS == tuple(RUNTIMES.builtin) == ("bwrap", "docker", "podman", "apptainer", "local")
    assert all(isinstance(s, Served) for s in SERVED)
    assert [s.dialect.name for s in SERVED] == ["gemini", "anthropic", "responses", "chat"]  # claim order


@pytest.mark.parametrize("registry", CLOSED, ids=lambda r: r.kind)
def test_a_closed_table_takes_no_other_name(registry: plugins.Registry) -> None:
    with pytest.raises(plugins.PluginError, match=f"unknown {registry.kind} 'os:system'; known: "):
        registry.load("os:system")  # not even as an import path
    with pytest.raises(plugins.PluginError, match="polar's own"):
        registry.register("mine", object())
    assert registry.names() == registry.known() == sorted(registry.builtin)


@pytest.mark.parametrize("registry", OPEN, ids=lambda r: r.kind)
def test_an_open_kind_polices_import_paths_and_takes_registrations(registry: plugins.Registry) -> None:
    with pytest.raises(plugins.PluginError, match="import paths are not accepted from the network"):
        registry.load("os:system")
    with pytest.raises(plugins.PluginError, match=f"unknown {registry.kind} 'no-such-name'"):
        registry.load("no-such-name")
    marker = object()
    registry.register("polar-test-registry-entry", marker)
    try:
        assert registry.load("polar-test-registry-entry") is marker
        assert "polar-test-registry-entry" in registry.names()
    finally:
        del registry.registered["polar-test-registry-entry"]
