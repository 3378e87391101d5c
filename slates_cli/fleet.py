"""`slates fleet`: the fleet's CA, host enrollment, and the enrolled hosts.

Theory of operation: a click group of thin commands over slates.fleet
(DESIGN.md section 7):

- `fleet init DIR` makes the fleet's CA in DIR (slates.fleet.pki.init_fleet;
  never overwrites one) and prints its fingerprint;
- `fleet enroll HOST --ca DIR --out DIR --address IP...` issues HOST a key
  and certificate signed by the CA into --out (pki.enroll), the addresses
  going into its SAN, and prints the certificate's fingerprint;
- `fleet hosts [--json]` lists etcd's enrolled hosts with their lease and
  serf's verdict.  By default it asks the running fleet link on the
  runtime directory (RUNTIME/fleet.sock, slates.fleet.link's `hosts`);
  with `--config FILE` (a host's fleet config) it reads etcd and the serf
  agent named there itself, so it works where no link runs;
- `fleet owner GREEN` prints GREEN's configuration in etcd (the link's
  `owner`), and `fleet takeover GREEN --epoch E` asks the link to commit
  this host as owner at E+1 and recover GREEN (the link's `takeover`).

Errors are printed as main.py prints them (`error: <code>: <message>`,
exit 2 for the caller's faults, 1 otherwise); this module does not import
main.py (see slates_cli.commands for why).  main.py registers the group:
`main.add_command(fleet)`.
"""

from __future__ import annotations

from typing import Any, NoReturn

import click

from slates.errors import SlatesError

__all__ = ["fleet"]


def _fail(error: SlatesError) -> NoReturn:
    click.echo(f"error: {error.code}: {error.message}", err=True)
    raise SystemExit(2 if error.fault == "caller" else 1)


@click.group()
def fleet() -> None:
    """Many hosts: the fleet's CA, enrolled hosts and their liveness."""


@fleet.command("init")
@click.argument("directory", type=click.Path(file_okay=False))
def init_command(directory: str) -> None:
    """Make the fleet's certificate authority in DIRECTORY (never overwrites one)."""
    from slates.fleet.pki import init_fleet

    try:
        ca = init_fleet(directory)
    except SlatesError as exc:
        _fail(exc)
    click.echo(f"fleet CA {ca.name} in {ca.directory}")
    click.echo(f"fingerprint {ca.fingerprint}")


@fleet.command("enroll")
@click.argument("host")
@click.option("--ca", "ca_dir", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
@click.option(
    "--address",
    "addresses",
    multiple=True,
    metavar="IP",
    help="An IP address of the host (repeat for more); peers dial it.",
)
@click.option("--days", type=int, default=None, help="Validity in days (default 90).")
def enroll_command(
    host: str, ca_dir: str, out_dir: str, addresses: tuple[str, ...], days: int | None
) -> None:
    """Issue HOST a key and certificate from the fleet's CA into --out."""
    from slates.fleet.pki import DEFAULT_VALIDITY_DAYS, enroll

    try:
        creds = enroll(
            ca_dir,
            host,
            out_dir,
            list(addresses),
            validity_days=DEFAULT_VALIDITY_DAYS if days is None else days,
        )
    except SlatesError as exc:
        _fail(exc)
    click.echo(f"enrolled {creds.host_id} in {creds.directory}")
    click.echo(f"fingerprint {creds.fingerprint}")


def _hosts_direct(config_path: str) -> dict[str, Any]:
    from slates.fleet.etcd import Council
    from slates.fleet.hostconfig import load_host_config
    from slates.fleet.link_rules import host_listing
    from slates.fleet.serf import SerfClient

    config = load_host_config(config_path)
    with Council(config.etcd_endpoints) as council:
        records = council.hosts()
        alive = council.alive_hosts()
    try:
        serf = {m.name: m.status for m in SerfClient(config.serf_rpc_address).members()}
        serf_error = None
    except SlatesError as exc:
        serf, serf_error = {}, exc.message
    return {
        "host": config.host_id,
        "hosts": host_listing(records, alive, serf),
        "serf_error": serf_error,
    }


@fleet.command("hosts")
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
@click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the service and its fleet link live (default: $SLATES_RUNTIME_DIR, ...).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="A host's fleet config: read etcd and serf directly instead of asking the link.",
)
def hosts_command(as_json: bool, runtime_dir: str | None, config_path: str | None) -> None:
    """The enrolled hosts: failure domain, addresses, lease (etcd) and serf's verdict."""
    try:
        if config_path is not None:
            listing = _hosts_direct(config_path)
        else:
            from slates.fleet.link_client import call_link, link_socket
            from slates.node.runtime import Runtime

            listing = call_link(link_socket(Runtime(runtime_dir).path), {"op": "hosts"})
    except SlatesError as exc:
        _fail(exc)
    if as_json:
        import json

        click.echo(json.dumps(listing, indent=1, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fleet hosts (seen from {listing.get('host')})", title_justify="left")
    for column in ("host", "domain", "quic", "serf address", "boot", "lease", "serf"):
        table.add_column(column)
    for row in listing["hosts"]:
        table.add_row(
            row["host"],
            row["failure_domain"],
            row["quic_address"],
            row["serf_address"],
            row["boot_id"][:12],
            row["lease"],
            row["serf"],
        )
    Console().print(table)


def _link_call(runtime_dir: str | None, message: dict[str, Any]) -> Any:
    from slates.fleet.link_client import call_link, link_socket
    from slates.node.runtime import Runtime

    try:
        return call_link(link_socket(Runtime(runtime_dir).path), message, timeout=120)
    except SlatesError as exc:
        _fail(exc)


_RUNTIME = click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the service and its fleet link live (default: $SLATES_RUNTIME_DIR, ...).",
)


@fleet.command("owner")
@click.argument("green")
@_RUNTIME
def owner_command(green: str, runtime_dir: str | None) -> None:
    """GREEN's configuration in etcd (GREEN is a fleet name, <id>@<host>), as JSON."""
    import json

    click.echo(json.dumps(_link_call(runtime_dir, {"op": "owner", "green": green}), indent=1))


@fleet.command("takeover")
@click.argument("green")
@click.option("--epoch", type=int, required=True, help="The epoch etcd is expected to hold.")
@_RUNTIME
def takeover_command(green: str, epoch: int, runtime_dir: str | None) -> None:
    """Make this host GREEN's owner at EPOCH+1 and recover it from its holders.

    What a failed verdict does by itself; refused (EpochFenced) when etcd
    has moved past EPOCH, and while serf sees the owner's host alive.
    """
    message = {"op": "takeover", "green": green, "epoch": epoch}
    result = _link_call(runtime_dir, message)
    click.echo(
        f"{green}: owned here at epoch {result['epoch']} as {result['local']} "
        f"({result['versions']} versions recovered)"
    )


if __name__ == "__main__":  # `python -m slates_cli.fleet`, until main.py registers the group
    fleet(prog_name="slates fleet")
