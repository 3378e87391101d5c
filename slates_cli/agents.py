"""`slates agent add|list|remove`: the agents' credentials (DESIGN.md section 6a).

Theory of operation: the operator (the anchor's user) manages RUNTIME/agents.json
directly (slates.node.principals.Agents): `add` prints a new agent's token once,
and the file keeps only its BLAKE3; every shard rereads the file when it
changes, so an added agent can connect at once and a removed one cannot
open another connection.  An agent passes its token as SLATES_TOKEN, to
`AsyncClient(token=...)` or to `slates mcp --token-file`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from slates.errors import SlatesError

if TYPE_CHECKING:
    from slates.node.principals import Agents

from .commands import _echo_json, _fail, json_option, runtime_dir_option

__all__ = ["agent"]


def _agents(runtime_dir: str | None) -> Agents:
    from slates.node.principals import Agents
    from slates.node.runtime import Runtime

    runtime = Runtime(runtime_dir)
    if not runtime.path.is_dir():
        _fail(SlatesError("no Slates service there: start `slates anchor`", path=str(runtime.path)))
    return Agents(runtime.path)


@click.group()
def agent() -> None:
    """Agents' credentials: what an agent may do is less than the operator."""


@agent.command("add")
@click.argument("name")
@runtime_dir_option
@json_option
def agent_add(name: str, runtime_dir: str | None, as_json: bool) -> None:
    """Make agent NAME and print its token (shown once; keep it secret).

    With the token (SLATES_TOKEN, or `slates mcp --token-file`) the agent
    may create work volumes, use its own volumes, read green volumes,
    submit and request landing plans; never create or delete greens, name a
    base, use another principal's volumes, or approve a landing.
    """
    agents = _agents(runtime_dir)
    try:
        token = agents.add(name)
    except SlatesError as error:
        _fail(error)
    if as_json:
        _echo_json({"agent": name, "token": token})
    else:
        click.echo(token)


@agent.command("list")
@runtime_dir_option
@json_option
def agent_list(runtime_dir: str | None, as_json: bool) -> None:
    """The agents that have a credential, one per line."""
    agents = _agents(runtime_dir)
    names = agents.names()
    if as_json:
        _echo_json(names)
    else:
        for name in names:
            click.echo(name)


@agent.command("remove")
@click.argument("name")
@runtime_dir_option
def agent_remove(name: str, runtime_dir: str | None) -> None:
    """Take agent NAME's credential away (its open connections end with the service)."""
    agents = _agents(runtime_dir)
    try:
        agents.remove(name)
    except SlatesError as error:
        _fail(error)
