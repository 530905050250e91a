"""Network namespaces + veth + tc netem (or nftables) for fault tests (root only; always cleaned up).

Builds a private star network that never touches the host's own interfaces:

    hub namespace  <prefix>hub   with bridge  br0
    node namespace <prefix>N     with veth    eth0 = 10.<net>.0.<N+1>/24, bridged in the hub

Only namespaces whose names start with this object's prefix are created or
deleted, and only addresses in its private /24 are used. ``netem`` shapes a
node's egress (loss, delay, duplication). Use as a context manager; teardown
runs on exit, on errors, and at interpreter exit as a last resort.

    with NetnsCluster(3) as net:
        net.netem(0, loss_pct=5)
        proc = net.popen(0, ["python", "-m", "giaannd", "--config", ...])

Other engineers may reuse it (tests/faults). ``python -m tools.netns --cleanup PREFIX``
removes namespaces left by a killed test run.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from types import TracebackType

__all__ = ["NetnsCluster", "NetnsUnavailable", "available", "cleanup_prefix", "loss_backend"]

#: Every namespace we create starts with this, so cleanup can never touch others'.
PREFIX_ROOT = "gdns"


class NetnsUnavailable(RuntimeError):
    """Not root, no ip/tc, or the kernel lacks netns/veth/netem support."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=30)


def _nft_loss_works(ns: str) -> bool:
    """Whether nftables can drop packets at random in namespace ``ns`` (the netem fallback)."""
    if shutil.which("nft") is None and shutil.which("apt-get") is not None:
        # Like the systemd unit test: install the one package the check needs, bounded.
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "nftables"]):
            if subprocess.run(cmd, check=False, capture_output=True, timeout=300, env=env).returncode:
                break
    if shutil.which("nft") is None:
        return False
    return _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "gdprobe"],
                check=False).returncode == 0


def loss_backend(ns: str) -> str | None:
    """How packet loss can be made in namespace ``ns``: "netem", "nft", or None."""
    _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=False)
    r = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
              "netem", "loss", "1%"], check=False)
    if r.returncode == 0:
        return "netem"
    return "nft" if _nft_loss_works(ns) else None


def available(need_netem: bool = True) -> str | None:
    """None when fault tests can run here, else the reason they cannot.

    ``need_netem``: the tests need random packet loss. tc netem gives it; where the kernel has no
    netem (seen here: "Specified qdisc kind is unknown") nftables' ``numgen random`` does the same
    for loss, so either is accepted. Delay and duplication need netem itself (``NetnsCluster.netem``
    says so when asked for them without it).
    """
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    probe = f"{PREFIX_ROOT}probe{uuid.uuid4().hex[:6]}"
    try:
        if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
            return "cannot create network namespaces here"
        if need_netem and loss_backend(probe) is None:
            return "neither tc netem nor nftables can drop packets here"
        return None
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def cleanup_prefix(prefix: str) -> list[str]:
    """Delete namespaces named ``prefix*`` (prefix must start with PREFIX_ROOT)."""
    if not prefix.startswith(PREFIX_ROOT):
        raise ValueError(f"refusing to clean namespaces not starting with {PREFIX_ROOT!r}")
    out = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    names = [line.split()[0] for line in out if line.strip()]
    mine = [n for n in names if n.startswith(prefix)]
    for name in mine:
        _run(["ip", "netns", "del", name], check=False)
    return mine


class NetnsCluster:
    """n node namespaces on one private bridge."""

    def __init__(self, n: int, *, subnet: int | None = None) -> None:
        if not 1 <= n <= 250:
            raise ValueError("1..250 nodes")
        self.n = n
        self.prefix = f"{PREFIX_ROOT}{uuid.uuid4().hex[:6]}"
        self.subnet = subnet if subnet is not None else 200 + os.getpid() % 50
        self._created: list[str] = []
        self._up = False
        self._loss_backend: str | None = None

    # ---- names -----------------------------------------------------------------------

    @property
    def hub(self) -> str:
        return f"{self.prefix}hub"

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def ip(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    # ---- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.create()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()

    def create(self) -> None:
        """Build the namespaces, bridge and veths. Raises NetnsUnavailable on failure."""
        reason = available(need_netem=False)
        if reason is not None:
            raise NetnsUnavailable(reason)
        atexit.register(self.teardown)
        self._up = True
        try:
            self._ns_add(self.hub)
            self._exec(self.hub, "ip", "link", "set", "lo", "up")
            self._exec(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            self._exec(self.hub, "ip", "link", "set", "br0", "up")
            for i in range(self.n):
                ns = self.ns(i)
                self._ns_add(ns)
                self._exec(ns, "ip", "link", "set", "lo", "up")
                _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                      f"p{i}", "netns", self.hub])
                self._exec(ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                self._exec(ns, "ip", "link", "set", "eth0", "up")
                self._exec(self.hub, "ip", "link", "set", f"p{i}", "master", "br0")
                self._exec(self.hub, "ip", "link", "set", f"p{i}", "up")
        except subprocess.CalledProcessError as exc:
            self.teardown()
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc

    def teardown(self) -> None:
        """Delete everything this object created (veths go with their namespaces)."""
        if not self._up:
            return
        for ns in reversed(self._created):
            _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()
        self._up = False

    def _ns_add(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def _exec(self, ns: str, *cmd: str) -> None:
        _run(["ip", "netns", "exec", ns, *cmd])

    # ---- use -------------------------------------------------------------------------

    def netem(self, i: int, *, loss_pct: float = 0.0, delay_ms: float = 0.0,
              jitter_ms: float = 0.0, duplicate_pct: float = 0.0) -> None:
        """Shape node i's egress (replaces earlier shaping): tc netem, or nftables for loss alone.

        Raises:
            NetnsUnavailable: delay or duplication asked for on a kernel without netem.
        """
        ns = self.ns(i)
        if self._loss_backend is None:
            self._loss_backend = loss_backend(self.hub) or "none"
        if self._loss_backend != "netem":
            if delay_ms or jitter_ms or duplicate_pct:
                raise NetnsUnavailable("delay/duplication need tc netem, which this kernel lacks")
            if self._loss_backend != "nft":
                raise NetnsUnavailable("no way to drop packets here (neither netem nor nftables)")
            # nftables drops on node i's *input* from eth0: a drop in the output hook would fail
            # the sender's sendto() with EPERM instead of losing the packet silently, as a lossy
            # link does. So with nft, "node i's loss" is on what it receives (netem: what it sends).
            # The table is replaced on each call.
            _run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "gdloss"], check=False)
            if loss_pct:
                self._exec(ns, "nft", "add", "table", "inet", "gdloss")
                self._exec(ns, "nft", "add", "chain", "inet", "gdloss", "in",
                           "{ type filter hook input priority 0; policy accept; }")
                # numgen random mod 10000 < loss*100: the rule drops loss_pct % of packets.
                self._exec(ns, "nft", "add", "rule", "inet", "gdloss", "in", "iifname", "eth0",
                           "numgen", "random", "mod", "10000", "<", str(int(round(loss_pct * 100))),
                           "drop")
            return
        args = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem"]
        if delay_ms:
            args += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        if duplicate_pct:
            args += ["duplicate", f"{duplicate_pct}%"]
        self._exec(ns, *args)

    def popen(self, i: int, cmd: Sequence[str], **kw: object) -> subprocess.Popen[str]:
        """Start a process inside node i's namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd],  # type: ignore[call-overload,no-any-return]
                                text=True, **kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="netns helper for fault tests")
    p.add_argument("--check", action="store_true", help="say whether fault tests can run")
    p.add_argument("--cleanup", metavar="PREFIX", help=f"delete namespaces PREFIX* "
                   f"(must start with {PREFIX_ROOT})")
    args = p.parse_args(argv)
    if args.cleanup:
        if not args.cleanup.startswith(PREFIX_ROOT):
            p.error(f"--cleanup: refusing to clean namespaces not starting with {PREFIX_ROOT!r}")
        print("\n".join(cleanup_prefix(args.cleanup)))
        return 0
    reason = available()
    print(reason or "ok")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
