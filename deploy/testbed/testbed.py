"""The fleet testbed: N Slates hosts on one machine, as network namespaces.

Theory of operation.  `up N` makes hosts h1..hN.  Each host is a network
namespace `{name}-hI` (name: $SLATES_TESTBED_NAME, default "slates") with
loopback and one interface, eth0, carrying 10.250.0.(10+I)/24.  Its veth peer,
`veth-hI`, sits in one more namespace, `{name}-tb`, on the bridge
`slates-br0`: the root namespace gets no interface, address, route or rule,
so the testbed's addresses cannot collide with anything on the machine, and
two testbeds with different names can run side by side.  Traffic goes only to
addresses of these namespaces (and loopback).

Each host runs, inside its namespace (`nsenter --net`, which enters the
network namespace only: unlike `ip netns exec` it keeps the machine's mount
namespace, so a volume mounted on a host is visible to every shell, as on one
machine), three daemons whose pids are recorded:

- an etcd member (h1..h3 only: a static initial cluster over their addresses;
  client port 2379 on the host's address and on 127.0.0.1, peers on 2380);
  every host uses the members' client URLs as its endpoints;
- a serf agent, node name hI, gossiping on ADDRESS:7946, RPC on 127.0.0.1:7373
  inside the namespace, retrying to join every other host until one answers;
- a Slates anchor (one shard, $SLATES_TESTBED_CAPACITY, default 256MiB) with
  its own runtime dir, passed `--fleet FILE` (the host's fleet.json: host id,
  failure domain, etcd endpoints, serf and QUIC addresses, cert dir) only
  when `slates anchor --help` offers --fleet.  When slates.fleet.pki exists,
  `up` makes a fleet CA in the state directory and enrolls every host into
  its cert dir.

`up` returns once every etcd member reports healthy, every serf agent sees N
alive members and every anchor answers `slates status`; if anything fails on
the way it tears down what it made and reports the failing daemon's log.

The state directory ($SLATES_TESTBED_DIR, default /run/slates-testbed) holds
state.json (the `Testbed` record: hosts, addresses, pids, partitions, slowed
links) and a directory per host (etcd data, the anchor's runtime dir,
logs, fleet.json, certs).  Commands that change the testbed hold a lock on
the state directory.

Faults: `kill HOST` SIGKILLs every process in the host's namespace at once
(what `ip netns pids` lists, plus the recorded pids), repeating until none is
left (bounded): a host loss.  `start HOST` boots it again: etcd data and
certs are kept (a disk), the anchor's runtime dir starts empty (RAM).
`partition HOST...` cuts the named hosts off from the others: each cut is a
side, and an nft table in every host's namespace drops arriving packets from
each host across any cut (`blocked_peers`, `nft_script`, pure); `heal`
removes every cut.  `slow HOST DELAY LOSS` gives both directions of the
host's link DELAY and LOSS: tc netem on both ends (eth0 and veth-hI) where
the kernel has netem, else delay_relay.py (user space, next to this file)
put between veth-hI and the bridge; $SLATES_TESTBED_SLOW=netem|relay picks
one.  `slow HOST off` restores the link.  `down` kills every process of
every namespace of the testbed, lazily unmounts whatever is mounted under
the state directory, deletes the namespaces (their veths and the bridge go
with them) and removes the state directory; it works from whatever is left,
so it is idempotent and cleans up after a failed `up`.

Layout of the program: testbed_plan.py holds the records and the pure
planning (command lines, fleet configs, cuts, nft rules, host transitions),
testbed_system.py the thin I/O (state file, processes, namespaces, probes),
delay_relay.py the user-space netem; this file builds, breaks and removes.
Called by the wrappers next to this file (up, run, kill, ...), by people,
and by tests/test_testbed.py.  Root only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from testbed_plan import (
    BRIDGE,
    HOST_IFACE,
    SUBNET,
    Cut,
    Host,
    Slow,
    Testbed,
    blocked_peers,
    bridge_netns,
    delay_seconds,
    etcd_argv,
    etcd_endpoints,
    fleet_config,
    host_transition,
    link_ends,
    loss_fraction,
    nft_script,
    parse_host_id,
    plan_hosts,
    relay_devices,
    serf_argv,
)
from testbed_system import (
    LOG_TAIL,
    Layout,
    alive,
    anchor_ready,
    anchor_takes_fleet,
    etcd_healthy,
    host_environment,
    in_netns,
    kill_all,
    link_exists,
    load,
    locked,
    log_tail,
    netns_list,
    netns_pids,
    save,
    serf_members,
    sh,
    spawn,
    wait_until,
)

from slates.errors import AlreadyExists, InvalidArgument, NotFound, NotSupported, SlatesError

UP_TIMEOUT = 120.0


# -- building and tearing down ------------------------------------------------------------


def make_network(name: str, hosts: Sequence[Host]) -> None:
    bridge_ns = bridge_netns(name)
    sh(["ip", "netns", "add", bridge_ns])
    sh(["ip", "-n", bridge_ns, "link", "set", "lo", "up"])
    sh(["ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
    sh(["ip", "-n", bridge_ns, "link", "set", BRIDGE, "up"])
    for host in hosts:
        veth = f"veth-{host.id}"
        sh(["ip", "netns", "add", host.netns])
        sh(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        sh(["ip", "-n", bridge_ns, "link", "add", veth, "type", "veth",
            "peer", "name", HOST_IFACE, "netns", host.netns])  # fmt: skip
        sh(["ip", "-n", bridge_ns, "link", "set", veth, "master", BRIDGE, "up"])
        cidr = f"{host.address}/{SUBNET.prefixlen}"
        sh(["ip", "-n", host.netns, "addr", "add", cidr, "dev", HOST_IFACE])
        sh(["ip", "-n", host.netns, "link", "set", HOST_IFACE, "up"])


def enroll_hosts(layout: Layout, hosts: Sequence[Host]) -> bool:
    """Make the fleet's CA and each host's credentials (slates.fleet.pki), if Slates has it."""
    if importlib.util.find_spec("slates.fleet.pki") is None:
        return False
    pki = importlib.import_module("slates.fleet.pki")  # newer than some checkouts
    pki.init_fleet(layout.root / "ca")
    for host in hosts:
        pki.enroll(layout.root / "ca", host.id, layout.host_dir(host.id) / "certs", [host.address])
    return True


def start_services(layout: Layout, testbed: Testbed, host: Host, fleet: bool) -> dict[str, int]:
    """Start the host's etcd member, serf agent and anchor; their pids (not yet ready)."""
    base = layout.host_dir(host.id)
    for sub in ("etcd", "logs", "certs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    runtime = layout.runtime_dir(host.id)
    shutil.rmtree(runtime, ignore_errors=True)  # the anchor's RAM: empty at every boot
    runtime.mkdir(mode=0o700)
    config = base / "fleet.json"
    config.write_text(json.dumps(fleet_config(host, testbed.hosts, base / "certs"), indent=1))
    pids: dict[str, int] = {}
    if host.etcd_member:
        argv = etcd_argv(host, testbed.hosts, testbed.name, base / "etcd")
        pids["etcd"] = spawn(layout, host, "etcd", argv)
    pids["serf"] = spawn(layout, host, "serf", serf_argv(host, testbed.hosts))
    capacity = os.environ.get("SLATES_TESTBED_CAPACITY", "256MiB")
    anchor = [sys.executable, "-m", "slates_cli.main", "anchor", "--runtime-dir", str(runtime),
              "--shards", "1", "--capacity", capacity]  # fmt: skip
    if fleet:
        anchor += ["--fleet", str(config)]
    pids["anchor"] = spawn(layout, host, "anchor", anchor)
    return pids


def wait_ready(layout: Layout, testbed: Testbed, hosts: Sequence[Host], timeout: float) -> None:
    """Block until each of `hosts` has healthy etcd (if a member), N serf members, an anchor."""
    alive_hosts = [h for h in testbed.hosts if testbed.pids.get(h.id)]
    for host in hosts:
        pids = testbed.pids[host.id]
        watched = {f"{d} on {host.id}": (p, layout.log(host.id, d)) for d, p in pids.items()}
        if host.etcd_member:
            wait_until(
                f"etcd on {host.id}",
                functools.partial(etcd_healthy, host.netns, host.address),
                watched,
                timeout,
            )
        wait_until(
            f"serf on {host.id} to see {len(alive_hosts)} alive members",
            functools.partial(serf_sees_alive, host.netns, len(alive_hosts)),
            watched,
            timeout,
        )
        wait_until(
            f"the anchor on {host.id}",
            functools.partial(anchor_ready, layout, host),
            watched,
            timeout,
        )


def serf_sees_alive(netns: str, count: int) -> bool:
    return sum(status == "alive" for status in serf_members(netns).values()) >= count


def mounts_under(root: Path) -> list[str]:
    found = []
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 2:
                continue
            path = fields[1]
            for code in ("\\040", "\\011", "\\012", "\\134"):
                path = path.replace(code, chr(int(code[1:], 8)))
            if path == str(root) or path.startswith(str(root) + "/"):
                found.append(path)
    return sorted(found, key=len, reverse=True)


def unmount_under(root: Path) -> None:
    for path in mounts_under(root):
        sh(["umount", "-l", path], check=False)


def teardown(layout: Layout) -> None:
    """Remove every trace of the testbed that is left, whatever state it is in."""
    recorded: dict[str, list[int]] = {}
    with contextlib.suppress(NotFound, InvalidArgument, json.JSONDecodeError, KeyError):
        testbed = load(layout)
        recorded = {testbed.host(h).netns: list(p.values()) for h, p in testbed.pids.items()}
        relays = [s.relay_pid for s in testbed.slowed.values() if s.relay_pid]
        recorded[bridge_netns(layout.name)] = relays
    prefix = re.compile(rf"^{re.escape(layout.name)}-(h[0-9]+|tb)$")
    ours = [ns for ns in netns_list() if prefix.match(ns)]
    for netns in sorted(set(ours) | set(recorded)):
        kill_all(netns, recorded.get(netns, ()))
    unmount_under(layout.root)
    for netns in ours:
        sh(["ip", "netns", "del", netns])
    shutil.rmtree(layout.root, ignore_errors=True)


# -- commands ----------------------------------------------------------------------------


def command_up(layout: Layout, count: int) -> None:
    hosts = plan_hosts(layout.name, count)
    fleet = anchor_takes_fleet()
    with locked(layout):
        if layout.state_file.exists() or bridge_netns(layout.name) in netns_list():
            raise AlreadyExists(
                "a testbed is already up: run down first", state_dir=str(layout.root)
            )
        try:
            testbed = Testbed(layout.name, hosts, {}, {h.id: 0 for h in hosts}, (), {})
            save(layout, testbed)
            make_network(layout.name, hosts)
            enroll_hosts(layout, hosts)
            for host in hosts:
                pids = start_services(layout, testbed, host, fleet)
                testbed = dataclasses.replace(
                    testbed,
                    pids={**testbed.pids, host.id: pids},
                    boots={**testbed.boots, host.id: 1},
                )
                save(layout, testbed)
            wait_ready(layout, testbed, hosts, UP_TIMEOUT)
        except BaseException:
            teardown(layout)
            raise
    print(json.dumps(summary(layout, testbed), indent=1))


def command_start(layout: Layout, host_id: str) -> None:
    with locked(layout):
        testbed = load(layout)
        host = testbed.host(host_id)
        host_transition(host_id, host_id in testbed.pids, "start")
        if netns_pids(host.netns):
            raise AlreadyExists(f"processes are left in {host.netns}", pids=netns_pids(host.netns))
        unmount_under(layout.host_dir(host_id))
        pids = start_services(layout, testbed, host, anchor_takes_fleet())
        testbed = dataclasses.replace(
            testbed,
            pids={**testbed.pids, host_id: pids},
            boots={**testbed.boots, host_id: testbed.boots.get(host_id, 0) + 1},
        )
        save(layout, testbed)
        wait_ready(layout, testbed, [host], UP_TIMEOUT)


def command_run(layout: Layout, host_id: str, argv: Sequence[str]) -> None:
    host = load(layout).host(host_id)
    if not argv:
        raise InvalidArgument("run HOST CMD...: no command given")
    os.execvpe("nsenter", in_netns(host.netns, argv), host_environment(layout, host))


def command_kill(layout: Layout, host_id: str) -> None:
    with locked(layout):
        testbed = load(layout)
        host = testbed.host(host_id)
        host_transition(host_id, host_id in testbed.pids, "kill")
        kill_all(host.netns, testbed.pids[host_id].values())
        pids = {h: p for h, p in testbed.pids.items() if h != host_id}
        save(layout, dataclasses.replace(testbed, pids=pids))


def apply_cuts(testbed: Testbed) -> None:
    blocked = blocked_peers((h.id for h in testbed.hosts), testbed.cuts)
    for host in testbed.hosts:
        addresses = [testbed.host(peer).address for peer in blocked[host.id]]
        sh(in_netns(host.netns, ["nft", "-f", "-"]), stdin=nft_script(addresses))


def command_partition(layout: Layout, host_ids: Sequence[str]) -> None:
    with locked(layout):
        testbed = load(layout)
        side = frozenset(testbed.host(h).id for h in host_ids)
        if not side or len(side) == len(testbed.hosts):
            raise InvalidArgument("a partition names some hosts but not all", hosts=sorted(side))
        testbed = dataclasses.replace(testbed, cuts=(*testbed.cuts, Cut(side)))
        apply_cuts(testbed)
        save(layout, testbed)


def command_heal(layout: Layout) -> None:
    with locked(layout):
        testbed = dataclasses.replace(load(layout), cuts=())
        apply_cuts(testbed)
        save(layout, testbed)


# -- slow links ----------------------------------------------------------------------------


def kernel_has_netem(netns: str) -> bool:
    """Whether tc can make a netem qdisc (tried on the namespace's loopback, then removed)."""
    add = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
    done = subprocess.run(in_netns(netns, add), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if "unknown" in done.stderr.lower():
            return False
        raise SlatesError("tc failed", output=done.stderr[-LOG_TAIL:])
    sh(in_netns(netns, ["tc", "qdisc", "del", "dev", "lo", "root"]))
    return True


def slow_method(name: str) -> str:
    """$SLATES_TESTBED_SLOW: netem, relay, or auto (default: netem if the kernel has it)."""
    chosen = os.environ.get("SLATES_TESTBED_SLOW", "auto")
    match chosen:
        case "netem" | "relay":
            return chosen
        case "auto":
            return "netem" if kernel_has_netem(bridge_netns(name)) else "relay"
        case _:
            raise InvalidArgument("SLATES_TESTBED_SLOW is netem, relay or auto", value=chosen)


def install_netem(netns: str, device: str, delay: str, loss: str) -> None:
    netem = ["tc", "qdisc", "replace", "dev", device, "root", "netem", "delay", delay, "loss", loss]
    done = subprocess.run(in_netns(netns, netem), capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return
    if "unknown" in done.stderr.lower():
        raise NotSupported("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)")
    raise SlatesError("tc netem failed", device=device, output=done.stderr[-LOG_TAIL:])


def start_relay(layout: Layout, name: str, host: Host, delay: str, loss: str) -> Slow:
    """Put delay_relay.py between the host's link end and the bridge."""
    bridge_ns = bridge_netns(name)
    link_end, relay_end, bridge_end = relay_devices(host)
    seed = int.from_bytes(os.urandom(4), "little")
    ip = ["ip", "-n", bridge_ns, "link"]
    sh([*ip, "add", relay_end, "type", "veth", "peer", "name", bridge_end])
    sh([*ip, "set", relay_end, "up"])
    log_path = layout.log(host.id, "relay")
    program = str(Path(__file__).with_name("delay_relay.py"))
    argv = [sys.executable, program, link_end, relay_end,
            repr(delay_seconds(delay)), repr(loss_fraction(loss)), str(seed)]  # fmt: skip
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            in_netns(bridge_ns, argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    slow = Slow(delay, loss, "relay", process.pid, seed)
    try:
        wait_until(
            f"the delay relay of {host.id}",
            functools.partial(relay_listening, log_path, seed),
            {"the delay relay": (process.pid, log_path)},
            30.0,
        )
        # Only now: while both were on the bridge, the relay would make a loop.
        sh([*ip, "set", link_end, "nomaster"])
        sh([*ip, "set", bridge_end, "master", BRIDGE, "up"])
    except BaseException:
        stop_slow(name, host, slow)
        raise
    return slow


def relay_listening(log_path: Path, seed: int) -> bool:
    return f" seed {seed}\n" in log_tail(log_path)


def stop_slow(name: str, host: Host, slow: Slow) -> None:
    if slow.method == "netem":
        for netns, device in link_ends(name, host):
            if "netem" in sh(in_netns(netns, ["tc", "qdisc", "show", "dev", device])):
                sh(in_netns(netns, ["tc", "qdisc", "del", "dev", device, "root"]))
        return
    bridge_ns = bridge_netns(name)
    link_end, relay_end, _ = relay_devices(host)
    kill_all(bridge_ns, [slow.relay_pid], only_recorded=True)
    ip = ["ip", "-n", bridge_ns, "link"]
    if link_exists(bridge_ns, relay_end):
        sh([*ip, "del", relay_end])  # and its peer on the bridge
    sh([*ip, "set", link_end, "master", BRIDGE, "up"])


def start_slow(layout: Layout, name: str, host: Host, delay: str, loss: str) -> Slow:
    delay_seconds(delay)
    loss_fraction(loss)
    if slow_method(name) == "relay":
        return start_relay(layout, name, host, delay, loss)
    installed: list[tuple[str, str]] = []
    for netns, device in link_ends(name, host):
        try:
            install_netem(netns, device, delay, loss)
        except SlatesError:
            for undo_netns, undo_device in installed:  # all or nothing
                sh(in_netns(undo_netns, ["tc", "qdisc", "del", "dev", undo_device, "root"]))
            raise
        installed.append((netns, device))
    return Slow(delay, loss, "netem")


def command_slow(layout: Layout, host_id: str, delay: str, loss: str | None) -> None:
    with locked(layout):
        testbed = load(layout)
        host = testbed.host(host_id)
        slowed = dict(testbed.slowed)
        if loss is None and delay != "off":
            raise InvalidArgument("slow HOST DELAY LOSS (e.g. 100ms 5%), or slow HOST off")
        if delay == "off" and loss is not None:
            raise InvalidArgument("slow HOST off takes nothing more", loss=loss)
        previous = slowed.pop(host_id, None)
        if previous is None and loss is None:
            raise InvalidArgument(f"the link of {host_id} is not slowed", host=host_id)
        if previous is not None:
            stop_slow(testbed.name, host, previous)
            save(layout, dataclasses.replace(testbed, slowed=slowed))
        if loss is not None:
            slowed[host_id] = start_slow(layout, testbed.name, host, delay, loss)
        save(layout, dataclasses.replace(testbed, slowed=slowed))


def summary(layout: Layout, testbed: Testbed) -> dict[str, object]:
    hosts = []
    for host in testbed.hosts:
        pids = testbed.pids.get(host.id, {})
        hosts.append(
            {
                **dataclasses.asdict(host),
                "runtime_dir": str(layout.runtime_dir(host.id)),
                "fleet_config": str(layout.host_dir(host.id) / "fleet.json"),
                "boots": testbed.boots.get(host.id, 0),
                "daemons": {d: {"pid": p, "alive": alive(p)} for d, p in pids.items()},
                "slow": dataclasses.asdict(s) if (s := testbed.slowed.get(host.id)) else None,
            }
        )
    return {
        "name": testbed.name,
        "state_dir": str(layout.root),
        "bridge_netns": bridge_netns(testbed.name),
        "etcd_endpoints": etcd_endpoints(testbed.hosts),
        "partitions": [sorted(c.side) for c in testbed.cuts],
        "hosts": hosts,
    }


def command_status(layout: Layout) -> None:
    print(json.dumps(summary(layout, load(layout)), indent=1))


def command_down(layout: Layout) -> None:
    teardown(layout)


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="testbed", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("up", help="make N hosts h1..hN").add_argument("count", type=int)
    run = commands.add_parser("run", help="run a command on a host")
    run.add_argument("host", type=parse_host_id)
    run.add_argument("argv", nargs=argparse.REMAINDER)
    for verb, text in (("kill", "kill every process of a host"), ("start", "boot a host again")):
        commands.add_parser(verb, help=text).add_argument("host", type=parse_host_id)
    partition = commands.add_parser("partition", help="cut these hosts off from the rest")
    partition.add_argument("hosts", nargs="+", type=parse_host_id)
    commands.add_parser("heal", help="remove every partition")
    slow = commands.add_parser("slow", help="netem DELAY LOSS on a host's link, or off")
    slow.add_argument("host", type=parse_host_id)
    slow.add_argument("delay")
    slow.add_argument("loss", nargs="?")
    commands.add_parser("status", help="the testbed as JSON")
    commands.add_parser("down", help="remove everything")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    arguments = parse_arguments(argv)
    if os.geteuid() != 0:
        print("testbed: must run as root", file=sys.stderr)
        return 1
    try:
        layout = Layout.from_environment()
        match arguments.command:
            case "up":
                command_up(layout, arguments.count)
            case "run":
                command_run(layout, arguments.host, arguments.argv)
            case "kill":
                command_kill(layout, arguments.host)
            case "start":
                command_start(layout, arguments.host)
            case "partition":
                command_partition(layout, arguments.hosts)
            case "heal":
                command_heal(layout)
            case "slow":
                command_slow(layout, arguments.host, arguments.delay, arguments.loss)
            case "status":
                command_status(layout)
            case "down":
                command_down(layout)
            case other:
                raise InvalidArgument("unknown command", command=other)
    except SlatesError as exc:
        print(f"testbed: {exc.code}: {exc.message}", file=sys.stderr)
        for key, value in exc.details.items():
            print(f"  {key}: {value}", file=sys.stderr)
        return 2 if exc.fault == "caller" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
