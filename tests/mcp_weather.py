"""A stdio MCP server with two tools, on the official `mcp` SDK (2.x): the server every preset with an MCP
client starts as a task's `agent.mcp_servers` in its CLI test (`tests/extension_support.py`), the one Codex
starts in the tool-search test (`tests/test_cli_codex.py`) and bench/harnesses.py's discovery scenario, and
the Codex `config` setting that gives it to Codex with its tools deferred behind `tool_search`.

Run as a script by any Python that has polar: it puts the SDK, installed once into polar's tool cache, on its
own path. Codex starts MCP servers with the session's HOME, so the config names the cache (POLAR_HOME)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from polar.harness.install import pip_prefix, tools_home

MCP_VERSION = "2.3.0"
# Codex 0.171.0 offers `tool_search` only to a model its catalog marks `supports_search_tool` (gpt-5.5 is
# one); the gateway serves whatever model the node runs under any name asked.
SEARCHING_MODEL = "gpt-5.5"


def install() -> Path:
    """The SDK's folder (installed on first use: minutes; do it before Codex waits for the server)."""
    return pip_prefix("mcp", MCP_VERSION)


def codex_config() -> dict[str, Any]:
    """The codex preset's `config` setting: this server, tool search on, MCP tools deferred."""
    server = {
        "command": sys.executable,
        "args": [str(Path(__file__).resolve())],
        "env": {"POLAR_HOME": str(tools_home().parent)},
        "startup_timeout_sec": 120,
    }
    return {
        "model": SEARCHING_MODEL,
        "features": {"tool_search": True, "tool_search_always_defer_mcp_tools": True},
        "mcp_servers": {"weather": server},
    }


def server() -> Any:
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("weather")

    @app.tool()
    def forecast(city: str) -> str:
        """The weather forecast for a city."""
        return f"sunny in {city}"

    @app.tool()
    def tides(port: str, day: int = 0) -> str:
        """High and low tide times for a harbour."""
        return f"high water at {port} on day {day}: 06:12"

    return app


if __name__ == "__main__":
    sys.path.insert(0, str(install()))
    server().run()
