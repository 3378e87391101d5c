"""slates.mcp: the Model Context Protocol server for agents (`slates mcp`).

See slates.mcp.server for what it offers, and what it never offers (landing
approval).
"""

from slates.mcp.server import (
    CHUNK,
    INSTRUCTIONS,
    SERVER_NAME,
    TOOL_NAMES,
    SlatesTools,
    blob,
    build_server,
    decode_data,
    error_result,
    run_stdio,
)

__all__ = [
    "CHUNK",
    "INSTRUCTIONS",
    "SERVER_NAME",
    "TOOL_NAMES",
    "SlatesTools",
    "blob",
    "build_server",
    "decode_data",
    "error_result",
    "run_stdio",
]
