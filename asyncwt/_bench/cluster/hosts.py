"""Emulated hosts: one network namespace each, joined by a bridge, links capped by `tc`.

Topology (nothing of it in the root namespace, so nothing is visible on the machine's
own network)::

    namespace TAG-br:   bridge TAGbr ── TAGb0  TAGb1  ...   (the switch's ports)
                                          │      │
                               veth pairs │      │
    namespace TAG-t0:                   TAGh0    │          10.213.0.1/24
    namespace TAG-w0:                          TAGh1        10.213.0.11/24 ...

`TAG` is `awt<pid>`: every namespace, interface and queue discipline a run creates
carries it, so a run only ever names (and removes) what it made itself.

A link is capped in both directions by a token bucket (`tbf`), the kernel's shaper:
on the host-side end (the host's egress: what it sends) and on the bridge-side end
(the bridge's egress towards the host: what the host receives). Both ends are plain
egress queues, so no `ifb` device and no ingress policing is needed, and a policer's
drops would only make TCP saw-tooth below the rate. Each host thus behaves like a
full-duplex NIC of the chosen rate behind a non-blocking switch.

Cleanup is by construction: a name is recorded before the command that creates it
runs, and `Cluster.down` (idempotent, run by the context manager, by `atexit` and so
on every exit path the process survives) deletes every recorded link from the bridge
side (its peer goes with it, and the queue disciplines with both) and then every
recorded namespace. The processes running inside must be stopped first.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from typing_extensions import Self

from .signals import deferred_signals, interrupts_unwind

__all__ = [
    "SUBNET",
    "Cluster",
    "ClusterError",
    "ClusterUnsupportedError",
    "Host",
    "check_support",
    "run_tag",
    "stale_namespaces",
    "tbf_args",
]

SUBNET = ipaddress.IPv4Network("10.213.0.0/24")
"""The emulated hosts' addresses; they exist only inside this run's namespaces."""
MTU_BYTES = 1500
TBF_LATENCY_MS = 20
"""The most a packet may wait in a link's queue (the queue's length, as time)."""
_TBF_MIN_BURST = 128 << 10
"""The bucket holds at least two 64 KiB GSO packets (veth's largest), so that the
shaper never splits one to let it through."""
_TBF_BURST_S = 0.001
"""...and at least 1 ms of traffic at the rate, so that timer granularity cannot
hold a fast link below its rate."""


class ClusterError(RuntimeError):
    """Building or removing the emulated cluster failed; the message quotes `ip`/`tc`."""


class ClusterUnsupportedError(ClusterError):
    """This machine cannot emulate hosts (no root, no `ip`/`tc`, no network namespaces)."""


def check_support(
    *,
    geteuid: Callable[[], int] = os.geteuid,
    which: Callable[[str], str | None] = shutil.which,
    netns_path: str = "/proc/self/ns/net",
) -> None:
    """Raise `ClusterUnsupportedError` saying why, unless the cluster can be built.

    The cluster bench never runs uncapped in place of capped: without root, iproute2
    or network namespaces it stops here. (The arguments exist so tests can simulate
    a machine without them.)
    """
    missing: list[str] = []
    if geteuid() != 0:
        missing.append(
            "root (creating network namespaces, veth links and tc queues needs "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN: run it as root)"
        )
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"the `{tool}` command (install iproute2)")
    if not os.path.exists(netns_path):
        missing.append(f"network namespaces (the kernel has no {netns_path})")
    if missing:
        raise ClusterUnsupportedError(
            "cannot emulate a cluster on this machine: it needs " + "; ".join(missing) + ". "
            "Nothing was measured: the cluster bench never falls back to uncapped loopback."
        )


def run_tag(pid: int | None = None) -> str:
    """`awt<pid>`: the prefix of every name a run creates (short enough for the
    15-character interface names)."""
    return f"awt{os.getpid() if pid is None else pid}"


_TAG_RE = re.compile(r"^awt(\d+)-")


def stale_namespaces(listing: str | None = None) -> list[str]:
    """Namespaces a cluster bench made whose process is gone (it was SIGKILLed):
    names `awt<pid>-...` where no process `pid` runs. Reported, never removed
    automatically."""
    if listing is None:
        listing = _run(["ip", "netns", "list"], check=False).stdout
    stale = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0].strip()
        match = _TAG_RE.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            stale.append(name)
    return stale


def tbf_args(rate_bps: int) -> list[str]:
    """`tc` arguments of a token bucket at `rate_bps` bits per second."""
    rate_bytes = rate_bps / 8
    burst = max(_TBF_MIN_BURST, int(rate_bytes * _TBF_BURST_S))
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    """One emulated host: a namespace, its end of a veth pair, an address."""

    name: str
    """What the report calls it (`t0` for trainer rank 0, `w3` for worker 3)."""
    netns: str
    """Its network namespace (`TAG-name`)."""
    ifname: str
    """Its interface, inside `netns` (`TAGh<i>`)."""
    port: str
    """The other end of its veth pair, a port of the bridge (`TAGb<i>`)."""
    address: str
    """Its IPv4 address in `SUBNET`."""

    def exec_prefix(self, env: Mapping[str, str]) -> list[str]:
        """`ip netns exec NETNS env K=V ...`: run a command in this host with `env`."""
        return ["ip", "netns", "exec", self.netns, "env", *(f"{k}={v}" for k, v in env.items())]


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
    )
    if check and proc.returncode != 0:
        raise ClusterError(
            f"`{' '.join(cmd)}` failed (exit code {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


class Cluster:
    """Hosts named `names` (addresses in order from `addresses`), a bridge, capped links.

    `up()` builds it, `set_rate()` caps every link (None: uncapped), `down()` removes
    everything it made. A context manager (down on exit); `down` is also registered
    with `atexit` while the cluster is up.
    """

    def __init__(
        self,
        addresses: Mapping[str, int],
        *,
        tag: str | None = None,
        runner: Callable[[Sequence[str]], object] | None = None,
    ) -> None:
        """`addresses`: host name → host number in `SUBNET` (1-254)."""
        self.tag = tag or run_tag()
        if len(self.tag) + 4 > 15:
            raise ValueError(f"tag {self.tag!r} is too long for 15-character interface names")
        self._runner = runner or (lambda cmd: _run(cmd))
        self.bridge_netns = f"{self.tag}-br"
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        for index, (name, number) in enumerate(addresses.items()):
            if not 1 <= number <= 254:
                raise ValueError(f"host {name!r}: number should be in [1, 254], got {number}")
            self.hosts[name] = Host(
                name=name,
                netns=f"{self.tag}-{name}",
                ifname=f"{self.tag}h{index}",
                port=f"{self.tag}b{index}",
                address=str(SUBNET.network_address + number),
            )
        self.rate_bps: int | None = None
        self._netns: list[str] = []
        """Namespaces this object created (or was about to), in creation order."""
        self._links: list[str] = []
        """Bridge-side veth ends this object created (or was about to)."""
        self._shaped: set[tuple[str, str]] = set()

    def _ip(self, *args: str) -> None:
        self._runner(["ip", *args])

    def up(self) -> Self:
        """Create the namespaces, the bridge and one veth pair per host; no caps yet."""
        atexit.register(self.down)
        self._netns.append(self.bridge_netns)  # recorded first: a failure still removes it
        self._ip("netns", "add", self.bridge_netns)
        br = self.bridge_netns
        self._ip("-n", br, "link", "add", self.bridge, "type", "bridge", "stp_state", "0")
        self._ip("-n", br, "link", "set", self.bridge, "up")
        for host in self.hosts.values():
            self._netns.append(host.netns)
            self._ip("netns", "add", host.netns)
            self._ip("-n", host.netns, "link", "set", "lo", "up")  # the namespace's own lo
            self._links.append(host.port)
            self._ip(
                "-n", br, "link", "add", host.port, "mtu", str(MTU_BYTES), "type", "veth",
                "peer", "name", host.ifname, "netns", host.netns,
            )  # fmt: skip
            self._ip("-n", br, "link", "set", host.port, "master", self.bridge, "up")
            self._ip("-n", host.netns, "link", "set", host.ifname, "mtu", str(MTU_BYTES))
            prefix = f"{host.address}/{SUBNET.prefixlen}"
            self._ip("-n", host.netns, "addr", "add", prefix, "dev", host.ifname)
            self._ip("-n", host.netns, "link", "set", host.ifname, "up")
        return self

    def set_rate(self, rate_bps: int | None) -> None:
        """Cap every host's egress and ingress at `rate_bps` (None: remove the caps)."""
        for host in self.hosts.values():
            for netns, dev in ((host.netns, host.ifname), (self.bridge_netns, host.port)):
                if rate_bps is None:
                    if (netns, dev) in self._shaped:
                        self._runner(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])
                        self._shaped.discard((netns, dev))
                else:
                    self._shaped.add((netns, dev))
                    self._runner(
                        ["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root",
                         *tbf_args(rate_bps)]
                    )  # fmt: skip
        self.rate_bps = rate_bps

    def down(self) -> list[str]:
        """Remove every link and namespace this cluster made; what could not be
        removed (empty when all went). Idempotent; never raises."""
        left: list[str] = []
        while self._links:
            port = self._links.pop()
            # Deleting one end of a veth pair deletes its peer, and both ends' qdiscs.
            # It fails harmlessly when the link was never made (or went with its namespace).
            self._try(["ip", "-n", self.bridge_netns, "link", "del", port])
        self._shaped.clear()
        while self._netns:
            netns = self._netns.pop()
            error = self._try(["ip", "netns", "del", netns])
            if error and os.path.exists(f"/run/netns/{netns}"):
                left.append(f"{netns}: {error}")
        atexit.unregister(self.down)
        return left

    def _try(self, cmd: Sequence[str]) -> str:
        """Run `cmd`; its error message, or "" when it succeeded."""
        try:
            self._runner(cmd)
        except (ClusterError, OSError) as exc:
            return str(exc)
        return ""

    def leftovers(self) -> list[str]:
        """Namespaces with this cluster's tag that still exist (none after `down`)."""
        listing = _run(["ip", "netns", "list"], check=False).stdout
        return [
            line.split(" ", 1)[0]
            for line in listing.splitlines()
            if line.startswith(f"{self.tag}-")
        ]

    def __enter__(self) -> Self:
        """Make the hosts; until the block ends, SIGTERM and SIGHUP unwind it as Ctrl-C
        does (a script killed by its supervisor removes what it made), and the removal
        itself is not cut short by a second signal."""
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(interrupts_unwind())
        try:
            return self.up()
        except BaseException:
            self._leave()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _leave(self) -> None:
        try:
            with deferred_signals():
                self.down()
        finally:
            self._signals.close()
