"""The product description's AsyncClient example, run as written against a real service.

Theory of operation: DESIGN.md section 8 says the example in "Combining
Changes from Multiple Agents" (spec/product.txt) must run as written.  Its
statements are copied verbatim into `run_example` (only the indentation,
which the text lost, is restored), inside `async with
slates.AsyncClient(runtime_dir) as client:` on a real anchor (the `service`
fixture).  The runtime directory is given both ways the SDK takes it: as
the argument, and through $SLATES_RUNTIME_DIR with no argument.  After the
example, the test reads the green head's files, the ledger and the work
volumes, and checks what the example printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import slates
from tests.anchor_fixture import Service, service

__all__ = ["service"]  # the fixture, re-exported for pytest


async def run_example(runtime_dir: Path | None) -> dict[str, Any]:
    """The example, verbatim; returns what it computed and what the service holds after it."""
    async with slates.AsyncClient(runtime_dir) as client:
        # -- spec/product.txt, "Combining Changes from Multiple Agents", verbatim --
        green = await client.create_green("main")
        agent1 = await client.create_work(green, "agent1")
        agent2 = await client.create_work(green, "agent2")
        base = agent1["base"]
        assert agent2["base"] == base
        await client.edit(agent1["id"], "/formats.txt", 0, 0, b"webp\n")
        await client.edit(agent2["id"], "/cache.txt", 0, 0, b"ttl=300\n")
        accepted = {}
        for name, work in (("agent1", agent1), ("agent2", agent2)):
            result = await client.submit(work["id"])
            if not result["ok"]:
                raise RuntimeError(f"{name}: {result['conflicts']}")
            accepted[name] = result["version"]
        head = await client.versions(green)
        changed = await client.changed_since(green, base)
        assert head == accepted["agent2"]
        assert accepted["agent1"] < accepted["agent2"]
        print("Accepted version:", head)
        print("Changed paths:", sorted(changed))
        # -- end of the example --
        return {
            "green": green,
            "agents": (agent1["id"], agent2["id"]),
            "base": base,
            "accepted": accepted,
            "head": head,
            "changed": changed,
            "formats": await client.read(green, "/formats.txt"),
            "cache": await client.read(green, "/cache.txt"),
            "listing": sorted(entry["name"] for entry in await client.list(green, "/")),
            "ledger": await client.ledger(green),
            "agent1_listing": [e["name"] for e in await client.list(agent1["id"], "/")],
        }


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_product_example_runs_as_written(
    service: Service, how: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if how == "environment":
        monkeypatch.setenv("SLATES_RUNTIME_DIR", str(service.runtime))
        runtime_dir = None
    else:
        monkeypatch.delenv("SLATES_RUNTIME_DIR", raising=False)
        runtime_dir = service.runtime
    done = trio.run(run_example, runtime_dir)

    # The resulting files, on the green head.
    assert done["formats"] == b"webp\n"
    assert done["cache"] == b"ttl=300\n"
    assert done["listing"] == ["cache.txt", "formats.txt"]
    # A fresh green volume: v0 is empty, the agents' submissions are v1 and v2.
    assert done["base"] == 0
    assert done["accepted"] == {"agent1": 1, "agent2": 2} and done["head"] == 2
    assert sorted(done["changed"]) == ["/cache.txt", "/formats.txt"]
    ledger = done["ledger"]
    assert ledger["green"] == done["green"] and ledger["head"] == 2
    assert [(v["version"], v["base"], v["work"], v["paths"]) for v in ledger["versions"]] == [
        (0, -1, "", []),
        (1, 0, done["agents"][0], ["/formats.txt"]),
        (2, 0, done["agents"][1], ["/cache.txt"]),
    ]
    # Each work volume still holds only its own change.
    assert done["agent1_listing"] == ["formats.txt"]

    out = capsys.readouterr().out
    assert out == "Accepted version: 2\nChanged paths: ['/cache.txt', '/formats.txt']\n"
