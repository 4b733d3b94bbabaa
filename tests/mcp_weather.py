"""A stdio MCP server with two tools, built on the official `mcp` SDK (2.x): the server Codex starts in the
tool-search tests (`tests/test_cli_codex.py`). Run it with `mcp` on PYTHONPATH (`mcp_sdk()` there)."""

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


if __name__ == "__main__":
    app.run()
