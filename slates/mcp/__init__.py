"""slates.mcp: the Model Context Protocol server for agents (`slates mcp`).

See slates.mcp.server for what it offers, and what it never offers (landing
approval).
"""

from slates.mcp.server import TOOL_NAMES, build_server, run_stdio

__all__ = ["TOOL_NAMES", "build_server", "run_stdio"]
