"""A stand-alone membership agent: ``python -m peers.membership``.

Used by the integration and fault tests (and handy for poking a cluster): it
joins, prints member events as JSON lines on stdout, and rewrites a JSON status
file (member table, health, counters) every ``--status-interval`` seconds.
SIGTERM leaves gracefully; SIGKILL is a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import msgspec

from peers.keyring import Keyring
from peers.membership.config import MembershipConfig
from peers.membership.events import MemberEvent
from peers.membership.node import JoinError, MembershipNode, NameConflictError


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m peers.membership",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--node-id", default=None)
    p.add_argument("--bind", type=_addr, default=("127.0.0.1", 0))
    p.add_argument("--seed", type=_addr, action="append", default=[])
    p.add_argument("--cluster", default="giaannd")
    p.add_argument("--key-file", required=True)
    p.add_argument("--profile", default="loopback")
    p.add_argument("--no-lifeguard", action="store_true")
    p.add_argument("--config-json", default=None, help="JSON overrides of config fields")
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--status-file", default=None)
    p.add_argument("--status-interval", type=float, default=0.1)
    return p.parse_args(argv)


def _write_status(node: MembershipNode, path: str) -> None:
    doc = {"name": node.name, "node_id": node.node_id, "addr": list(node.addr),
           "health": node.local_health(), "counters": node.counters(),
           "members": [msgspec.to_builtins(m) for m in node.members()]}
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc))
    os.replace(tmp, path)


async def _main(args: argparse.Namespace) -> int:
    config = MembershipConfig.profile(args.profile)
    overrides = json.loads(args.config_json) if args.config_json else {}
    if args.no_lifeguard:
        overrides["lifeguard"] = False
    if overrides:
        config = msgspec.convert({**msgspec.to_builtins(config), **overrides},
                                 MembershipConfig)
    node = MembershipNode(name=args.name, bind=args.bind, cluster=args.cluster,
                          keyring=Keyring.load(args.key_file), config=config,
                          node_id=args.node_id, incarnation=args.incarnation)

    def emit(event: MemberEvent) -> None:
        print(json.dumps({"event": type(event).__name__,
                          **msgspec.to_builtins(event)}), flush=True)

    node.on_event(emit)
    await node.start()
    print(json.dumps({"event": "started", "addr": list(node.addr)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        if args.seed:
            await node.join(args.seed)
        print(json.dumps({"event": "joined"}), flush=True)
        while not stop.is_set():
            if args.status_file:
                _write_status(node, args.status_file)
            try:
                await asyncio.wait_for(stop.wait(), args.status_interval)
            except TimeoutError:
                pass
        await node.leave()
        if args.status_file:
            _write_status(node, args.status_file)
        return 0
    except (JoinError, NameConflictError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        await node.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_main(args))
    return uvloop.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
