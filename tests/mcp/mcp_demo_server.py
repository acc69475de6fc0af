"""A small MCP server written with the official SDK (MCPServer), for tests of our MCP client.

    python mcp_demo_server.py stdio
    python mcp_demo_server.py http PORT
"""

import sys
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("demo")


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("division by zero")  # a tool error the client sees (other exceptions are hidden)
    return a / b


@server.tool(name="unit.convert")
def convert(value: float, unit: Literal["km", "mi"], digits: int = 2) -> str:
    """Convert a distance to the other unit."""
    out = value * 0.621371 if unit == "km" else value / 0.621371
    return f"{round(out, digits)} {'mi' if unit == 'km' else 'km'}"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", port=int(sys.argv[2]))
