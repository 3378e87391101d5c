"""deploy/testbed brings up real hosts in network namespaces, breaks them and removes them.

Theory of operation: one testbed of three hosts is brought up for the module
through the wrappers in deploy/testbed (as a person would call them), under
a private name and state directory so that it cannot meet anybody else's
testbed; the fixture always runs `down`.  The tests then run in file order
against it: what `up` promised (each etcd member answers from another host's
namespace, each serf agent sees three alive members, each anchor answers
`slates status` through `run`, nothing in the root namespace changed), `run`
(environment, namespace, exit code), `slow` (a netem qdisc on the host's
link, traffic still flowing; on a kernel without netem, a NotSupported error
that an independent probe confirms and nothing installed), `partition` and
`heal` (connections across the cut fail, others and later ones work),
`kill` (no process of the host is left, serf on h1 declares it failed) and
`start` (it boots again and rejoins), and finally `down` (no namespace,
process, mount or state directory left; a second `down` is harmless).  All
traffic goes to the namespaces' own addresses.  The pure planning functions
(which hosts a set of cuts separates, the hosts' addresses) are checked as
properties with hypothesis.  Runs as root; needs iproute2, nft, etcd, serf.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
TESTBED = REPO / "deploy" / "testbed"
COMMAND_SECONDS = 180
SERF_VERDICT_SECONDS = 90


sys.path.insert(0, str(TESTBED))  # testbed.py's own modules live next to it
plan = importlib.import_module("testbed_plan")
system = importlib.import_module("testbed_system")


class Bed:
    """The wrappers of one testbed, with its name and state directory in the environment."""

    def __init__(self, name: str, state_dir: Path) -> None:
        self.name = name
        self.state_dir = state_dir
        self.env = {**os.environ, "SLATES_TESTBED_NAME": name, "SLATES_TESTBED_DIR": str(state_dir)}

    def call(
        self,
        verb: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = COMMAND_SECONDS,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(TESTBED / verb), *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, verb: str, *args: str, env: dict[str, str] | None = None) -> str:
        done = self.call(verb, *args, env=env)
        assert done.returncode == 0, f"{verb} {args}: {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ok("status"))
        return data

    def host(self, host_id: str) -> dict[str, Any]:
        for host in self.status()["hosts"]:
            if host["id"] == host_id:
                result: dict[str, Any] = host
                return result
        raise AssertionError(f"no {host_id} in the status")

    def address(self, host_id: str) -> str:
        return str(self.host(host_id)["address"])

    def netns(self, host_id: str) -> str:
        return f"{self.name}-{host_id}"

    def http(self, from_host: str, url: str, body: Any = None, timeout: float = 3.0) -> Any:
        """GET url (POST body as JSON) from inside a host's namespace: the reply, or None."""
        script = (
            "import sys, urllib.request\n"
            "data = sys.argv[3].encode() if sys.argv[3] != 'null' else None\n"
            "request = urllib.request.Request(sys.argv[1], data=data)\n"
            "print(urllib.request.urlopen(request, timeout=float(sys.argv[2])).read().decode())"
        )
        done = self.call(
            "run", from_host, sys.executable, "-c", script, url, str(timeout), json.dumps(body)
        )
        return json.loads(done.stdout) if done.returncode == 0 else None

    def etcd_health(self, from_host: str, target: str) -> bool:
        reply = self.http(from_host, f"http://{self.address(target)}:2379/health")
        return reply is not None and reply["health"] == "true"

    def etcd_reachable(self, from_host: str, target: str) -> bool:
        """Whether etcd on target answers at all (its version needs no quorum)."""
        reply = self.http(from_host, f"http://{self.address(target)}:2379/version")
        return reply is not None and "etcdserver" in reply

    def serf_members(self, on_host: str) -> dict[str, str]:
        out = self.ok("run", on_host, "serf", "members", "-format=json")
        return {m["name"]: m["status"] for m in json.loads(out)["members"]}


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, check=False
    )
    return [int(p) for p in out.stdout.split() if system.alive(int(p))]


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts") as mounts:
        return [line for line in mounts if f" {path}/" in line or f" {path} " in line]


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        raise AssertionError("the testbed tests run as root (network namespaces)")
    state_dir = Path(tempfile.mkdtemp(prefix="sltb-", dir="/tmp"))
    running = Bed(f"sltb{os.getpid()}", state_dir)
    try:
        up = running.call("up", "3")
        assert up.returncode == 0, f"up failed:\n{up.stdout}{up.stderr}"
        yield running
    finally:
        down = running.call("down")
        assert down.returncode == 0, down.stderr


# -- what up promised -------------------------------------------------------------------


def test_etcd_answers_from_other_hosts(bed: Bed) -> None:
    for target, source in (("h1", "h2"), ("h2", "h3"), ("h3", "h1")):
        assert bed.etcd_health(source, target), f"etcd on {target} from {source}"
    key, value = (base64.b64encode(x).decode() for x in (b"/slates/testbed", b"written on h1"))
    put = bed.http("h1", "http://127.0.0.1:2379/v3/kv/put", {"key": key, "value": value})
    assert put is not None
    reply = bed.http("h3", f"http://{bed.address('h2')}:2379/v3/kv/range", {"key": key})
    assert reply is not None and [kv["value"] for kv in reply["kvs"]] == [value]


def test_serf_sees_three_alive_members(bed: Bed) -> None:
    for host in ("h1", "h2", "h3"):
        assert bed.serf_members(host) == {"h1": "alive", "h2": "alive", "h3": "alive"}


def test_each_anchor_answers_status_through_run(bed: Bed) -> None:
    takes_fleet = (
        "--fleet"
        in subprocess.run(
            [sys.executable, "-m", "slates_cli.main", "anchor", "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    for host in ("h1", "h2", "h3"):
        described = bed.host(host)
        anchor_pid = described["daemons"]["anchor"]["pid"]
        status = json.loads(bed.ok("run", host, "slates", "status", "--json"))
        assert status["anchor_pid"] == anchor_pid
        assert Path(described["runtime_dir"]) == bed.state_dir / host / "runtime"
        config = json.loads((bed.state_dir / host / "fleet.json").read_text())
        assert config["host_id"] == config["failure_domain"] == host
        assert config["quic_address"] == f"{described['address']}:4433"
        assert len(config["etcd_endpoints"]) == 3
        cmdline = Path(f"/proc/{anchor_pid}/cmdline").read_bytes().split(b"\0")
        assert (b"--fleet" in cmdline) == takes_fleet
        assert described["fleet_config"] == str(bed.state_dir / host / "fleet.json")
        certs = Path(config["cert_dir"])
        if importlib.util.find_spec("slates.fleet.pki") is not None:
            pki = importlib.import_module("slates.fleet.pki")  # being written alongside
            credentials = pki.load_credentials(certs)
            assert credentials.host_id == host
            assert (certs / "ca.crt").read_bytes() == (bed.state_dir / "ca" / "ca.crt").read_bytes()
        else:
            assert certs.is_dir() and not any(certs.iterdir())


def test_root_namespace_is_untouched(bed: Bed) -> None:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert "slates-br0" not in links.stdout and "veth-h" not in links.stdout
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    assert "10.250.0." not in addresses.stdout
    assert {bed.netns(h) for h in ("h1", "h2", "h3")} | {f"{bed.name}-tb"} <= set(netns_names())


def test_up_refuses_a_second_testbed(bed: Bed) -> None:
    before = bed.status()
    again = bed.call("up", "2")
    assert again.returncode == 2 and "AlreadyExists" in again.stderr
    assert bed.status()["hosts"] == before["hosts"]


def test_run_enters_the_host_and_passes_the_exit_code(bed: Bed) -> None:
    script = 'echo "$SLATES_TESTBED_HOST $SLATES_RUNTIME_DIR"; ip -o -4 addr show dev eth0; exit 7'
    done = bed.call("run", "h2", "sh", "-c", script)
    assert done.returncode == 7
    first, interface = done.stdout.splitlines()[:2]
    assert first == f"h2 {bed.state_dir / 'h2' / 'runtime'}"
    assert f" {bed.address('h2')}/24 " in interface
    assert bed.call("run", "h9", "true").returncode == 2


# -- faults -----------------------------------------------------------------------------


def kernel_has_netem(netns: str) -> bool:
    """An independent probe: add and remove a netem qdisc on the namespace's loopback."""
    add = subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", "tc", "qdisc", "add", "dev", "lo", "root",
         "netem", "delay", "1ms"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if add.returncode != 0:
        assert "unknown" in add.stderr.lower(), add.stderr
        return False
    subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", "tc", "qdisc", "del", "dev", "lo", "root"],
        check=True,
    )
    return True


def bridge_link(bed: Bed, device: str) -> str:
    out = subprocess.run(
        ["ip", "-n", f"{bed.name}-tb", "-o", "link", "show"],
        capture_output=True,
        text=True,
        check=True,
    )
    return "".join(line for line in out.stdout.splitlines() if f": {device}@" in line)


def timed_health(bed: Bed) -> float:
    started = time.monotonic()
    wait_for("etcd on h2 answers h1", lambda: bed.etcd_health("h1", "h2"), 60)
    return time.monotonic() - started


def assert_link_restored(bed: Bed) -> None:
    assert bed.host("h2")["slow"] is None
    assert "netem" not in bed.ok("run", "h2", "tc", "qdisc", "show", "dev", "eth0")
    assert "master slates-br0" in bridge_link(bed, "veth-h2")
    assert bridge_link(bed, "dl-h2") == bridge_link(bed, "db-h2") == ""
    assert bed.etcd_health("h1", "h2")


def check_netem(bed: Bed) -> None:
    qdisc = bed.ok("run", "h2", "tc", "qdisc", "show", "dev", "eth0")
    assert "netem" in qdisc and "delay 100ms" in qdisc and "loss 5%" in qdisc
    assert bed.host("h2")["slow"]["method"] == "netem"
    print(f"netem: etcd health from h1 to h2 in {timed_health(bed):.2f} s (not asserted)")
    bed.ok("slow", "h2", "off")
    assert_link_restored(bed)


def check_relay(bed: Bed) -> None:
    slow = bed.host("h2")["slow"]
    assert slow["method"] == "relay" and (slow["delay"], slow["loss"]) == ("100ms", "5%")
    relay_pid = slow["relay_pid"]
    assert b"delay_relay.py" in Path(f"/proc/{relay_pid}/cmdline").read_bytes()
    assert "master slates-br0" not in bridge_link(bed, "veth-h2")
    assert "master slates-br0" in bridge_link(bed, "db-h2")
    print(f"relay: etcd health from h1 to h2 in {timed_health(bed):.2f} s (not asserted)")
    bed.ok("slow", "h2", "off")
    assert not system.alive(relay_pid)
    assert_link_restored(bed)


def test_slow_delays_a_hosts_link_and_traffic_still_flows(bed: Bed) -> None:
    print(f"before: etcd health from h1 to h2 in {timed_health(bed):.2f} s (not asserted)")
    bed.ok("slow", "h2", "100ms", "5%")
    if kernel_has_netem(bed.netns("h2")):
        check_netem(bed)
        bed.ok("slow", "h2", "100ms", "5%", env={"SLATES_TESTBED_SLOW": "relay"})
        check_relay(bed)
    else:
        check_relay(bed)
        forced = bed.call("slow", "h2", "100ms", "5%", env={"SLATES_TESTBED_SLOW": "netem"})
        assert forced.returncode != 0 and "NotSupported" in forced.stderr, forced.stderr
        assert_link_restored(bed)
    for bad in (("fast", "5%"), ("100ms", "150%"), ("100ms",), ("off",), ("off", "5%")):
        assert bed.call("slow", "h2", *bad).returncode == 2
    assert_link_restored(bed)


def partitioned(bed: Bed) -> None:
    """What `partition h3` must do: h3 reaches nobody and nobody reaches it."""
    assert not bed.etcd_reachable("h1", "h3")
    assert not bed.etcd_reachable("h3", "h2")
    assert bed.etcd_reachable("h3", "h3")  # its own address still answers inside
    # h1 and h2 are a quorum (once they elected a leader, if h3 was the leader)
    wait_for("etcd's quorum of h1 and h2", lambda: bed.etcd_health("h1", "h2"), 60)
    assert bed.host("h3")["daemons"]["etcd"]["alive"]
    assert bed.status()["partitions"] == [["h3"]]
    wait_for("serf on h1 to see h3 cut off", lambda: bed.serf_members("h1")["h3"] != "alive", 90)


def test_partition_cuts_a_host_off_and_heal_restores_it(bed: Bed) -> None:
    bed.ok("partition", "h3")
    try:
        partitioned(bed)
    finally:
        bed.call("heal")  # a failure here must not leave the next tests a cut-off host
    assert bed.status()["partitions"] == []
    assert bed.etcd_reachable("h1", "h3")
    assert bed.etcd_reachable("h3", "h2")
    wait_for("etcd on h3 to rejoin", lambda: bed.etcd_health("h1", "h3"), 60)
    wait_for("serf on h1 to see h3 again", lambda: bed.serf_members("h1")["h3"] == "alive", 90)
    assert bed.call("partition", "h1", "h2", "h3").returncode == 2


def test_kill_leaves_nothing_of_the_host_and_serf_declares_it_failed(bed: Bed) -> None:
    recorded = [d["pid"] for d in bed.host("h2")["daemons"].values()]
    in_namespace = netns_pids(bed.netns("h2"))
    assert set(recorded) <= set(in_namespace)
    bed.ok("kill", "h2")
    assert netns_pids(bed.netns("h2")) == []
    assert not any(system.alive(pid) for pid in in_namespace)
    assert bed.host("h2")["daemons"] == {}
    wait_for(
        "serf on h1 declares h2 failed",
        lambda: bed.serf_members("h1").get("h2") == "failed",
        SERF_VERDICT_SECONDS,
    )
    # two of three members: still a quorum (once they elected a leader, if h2 was it)
    wait_for("etcd's quorum of h1 and h3", lambda: bed.etcd_health("h3", "h1"), 60)
    again = bed.call("kill", "h2")
    assert again.returncode == 2 and "down already" in again.stderr


def test_start_boots_a_killed_host_again(bed: Bed) -> None:
    bed.ok("start", "h2")
    described = bed.host("h2")
    assert described["boots"] == 2
    assert all(d["alive"] for d in described["daemons"].values())
    assert bed.serf_members("h1") == {"h1": "alive", "h2": "alive", "h3": "alive"}
    wait_for("etcd on h2 answers h1 again", lambda: bed.etcd_health("h1", "h2"), 60)
    status = json.loads(bed.ok("run", "h2", "slates", "status", "--json"))
    assert status["anchor_pid"] == described["daemons"]["anchor"]["pid"]
    assert bed.call("start", "h2").returncode == 2  # already running


def test_down_leaves_nothing(bed: Bed) -> None:
    mount_dir = bed.state_dir / "h1" / "mnt"
    mount_dir.mkdir()
    bed.ok("run", "h1", "slates", "volume", "create", "scratch")
    bed.ok("run", "h1", "slates", "mount", "scratch", str(mount_dir))
    assert mounts_under(bed.state_dir)
    pids = [p for h in ("h1", "h2", "h3") for p in netns_pids(bed.netns(h))]
    assert pids
    bed.ok("down")
    assert not [ns for ns in netns_names() if ns.startswith(f"{bed.name}-")]
    assert not any(system.alive(pid) for pid in pids)
    assert not mounts_under(bed.state_dir)
    assert not bed.state_dir.exists()
    assert bed.call("status").returncode == 2
    bed.ok("down")  # idempotent


def test_a_failed_up_names_the_daemon_and_leaves_nothing() -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="sltb-", dir="/tmp"))
    failing = Bed(f"sltbf{os.getpid()}", state_dir)
    try:
        done = failing.call("up", "1", env={"SLATES_TESTBED_CAPACITY": "lots"})
        assert done.returncode == 1
        assert "anchor on h1 died" in done.stderr and "not a size" in done.stderr
        assert not [ns for ns in netns_names() if ns.startswith(f"{failing.name}-")]
        assert not state_dir.exists()
    finally:
        failing.call("down")


# -- pure planning -------------------------------------------------------------------------

host_names = st.lists(
    st.integers(1, 12).map(lambda i: f"h{i}"), min_size=1, max_size=8, unique=True
)


@given(host_names, st.data())
def test_cuts_separate_symmetrically_and_only_across_sides(hosts: list[str], data: Any) -> None:
    cuts = data.draw(st.lists(st.frozensets(st.sampled_from(hosts)), max_size=4))
    blocked = plan.blocked_peers(hosts, [plan.Cut(c) for c in cuts])
    assert set(blocked) == set(hosts)
    for a in hosts:
        assert a not in blocked[a]
        for b in blocked[a]:
            assert a in blocked[b]
    if cuts:
        side = cuts[0]
        for a in hosts:
            for b in hosts:
                if (a in side) != (b in side):
                    assert b in blocked[a]
    extra = plan.blocked_peers(hosts, [plan.Cut(c) for c in [*cuts, frozenset(hosts[:1])]])
    assert all(blocked[a] <= extra[a] for a in hosts)  # a further cut never reconnects
    healed = plan.blocked_peers(hosts, [])
    assert all(not peers for peers in healed.values())


@given(st.integers(1, 200))
def test_hosts_get_distinct_addresses_in_the_subnet(count: int) -> None:
    hosts = plan.plan_hosts("t", count)
    assert [h.id for h in hosts] == [f"h{i}" for i in range(1, count + 1)]
    addresses = [h.address for h in hosts]
    assert len(set(addresses)) == count
    assert all(address.startswith("10.250.0.") for address in addresses)
    assert sum(h.etcd_member for h in hosts) == min(count, 3)


def test_a_testbed_has_a_bounded_size() -> None:
    for count in (0, 201):
        with pytest.raises(plan.InvalidArgument):
            plan.plan_hosts("t", count)


def test_delays_and_losses_are_read_with_their_units() -> None:
    for text, seconds in (("100ms", 0.1), ("1.5s", 1.5), ("250us", 0.00025), ("0ms", 0.0)):
        assert plan.delay_seconds(text) == pytest.approx(seconds)
    for text, fraction in (("5%", 0.05), ("0%", 0.0), ("100%", 1.0), ("0.5%", 0.005)):
        assert plan.loss_fraction(text) == pytest.approx(fraction)
    for bad_delay in ("100", "ms", "-1ms", "1m", "off"):
        with pytest.raises(plan.InvalidArgument):
            plan.delay_seconds(bad_delay)
    for bad_loss in ("5", "101%", "-1%", "x%"):
        with pytest.raises(plan.InvalidArgument):
            plan.loss_fraction(bad_loss)


def test_a_host_is_killed_only_when_running_and_started_only_when_down() -> None:
    assert plan.host_transition("h1", True, "kill") is False
    assert plan.host_transition("h1", False, "start") is True
    with pytest.raises(plan.AlreadyExists):
        plan.host_transition("h1", True, "start")
    for running in (True, False):
        with pytest.raises(plan.InvalidArgument):
            plan.host_transition("h1", running, "reboot")
    with pytest.raises(plan.InvalidArgument):
        plan.host_transition("h1", False, "kill")
