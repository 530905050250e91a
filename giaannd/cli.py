"""``giaannd``: parse flags, load config, run the daemon, map errors to exit statuses.

Commands::

    giaannd [run] --config FILE [--role storage --role compute] [--set section.field=value ...]
    giaannd config show [--config FILE] [--defaults] [--json] [--set ...]

Exit statuses: 0 clean stop, 1 runtime failure, 2 usage or configuration error, 130 forced stop.
Logging is configured here and nowhere else (STYLE.md item 21).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from giaannd import __version__, failpoints
from giaannd.config import ENV_PREFIX, Config, load_config, to_toml
from giaannd.daemon import Daemon, build_role_services
from giaannd.errors import GiaannError
from giaannd.logs import configure_logging
from giaannd.service import Service

__all__ = ["loop_factory", "main"]

log = logging.getLogger(__name__)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop when installed (faster sockets and timers), else the stdlib loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def _config_args(parser: argparse.ArgumentParser, *, after_command: bool = False) -> None:
    """The config flags. ``after_command``: the copies a command word takes (``giaannd run
    --config F``). A subcommand's defaults would replace the values given before the word
    (``giaannd --config F run``: argparse copies every key of the subcommand's namespace over),
    so there ``--config`` has no default (given after the word, it wins) and ``--set`` collects
    into its own list, applied after those given before the word (``_load``)."""
    parser.add_argument("--config", "-c", metavar="FILE",
                        default=argparse.SUPPRESS if after_command else None,
                        help="TOML config file (default: built-in defaults only)")
    parser.add_argument("--set", dest="overrides_after" if after_command else "overrides",
                        action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one config key, e.g. storage.capacity-bytes=2_000_000_000 "
                             "(repeatable; applied after the file and "
                             f"{ENV_PREFIX}SECTION__FIELD environment variables)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="giaannd", description="The GIAANN cluster daemon.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"giaannd {__version__}")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the daemon (the default command)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for target, after_command in ((parser, False), (run, True)):
        _config_args(target, after_command=after_command)
        target.add_argument("--role", dest="role_after" if after_command else "role",
                            action="append", choices=["storage", "compute", "both"],
                            help="roles to run, overriding node.roles (repeatable)")
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the effective (or default) configuration")
    _config_args(show, after_command=True)
    show.add_argument("--defaults", action="store_true",
                      help="print the built-in defaults, ignoring file, environment and --set")
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    return parser


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """The cyclic GC off while the daemon's modules load and its services are built, and what that
    left frozen after (``gc.freeze``: never walked by a collection again).

    Why: those imports allocate ~180,000 GC-tracked objects (numba's type system and the compiled
    kernels, most of them) that live as long as the process and leave almost no cyclic garbage
    (~800 objects); left on, the collector walks them again and again while they load (3 full and
    ~320 young collections, 0.06-0.08 s of the ~0.75 s of CPU the imports take), and every full
    collection after that once more (~0.03 s each). The storage service freezes again after its
    recovery (storage/replication/service.py), for what the recovery left."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def _load(args: argparse.Namespace) -> Config:
    # (flags before the command word, then those after it: _config_args)
    overrides = [*args.overrides, *getattr(args, "overrides_after", [])]
    roles = [*(getattr(args, "role", None) or []), *(getattr(args, "role_after", None) or [])]
    if roles:
        expanded = sorted({r for role in roles
                           for r in (("storage", "compute") if role == "both" else (role,))})
        overrides.append("node.roles=" + msgspec.json.encode(expanded).decode())
    return load_config(args.config, overrides=overrides)


def _show(args: argparse.Namespace) -> int:
    cfg = Config() if args.defaults else _load(args)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(cfg).decode(), indent=2) + "\n")
    else:
        sys.stdout.write(to_toml(cfg))
    return 0


def _run(args: argparse.Namespace, extra_services: Sequence[Service]) -> int:
    cfg = _load(args)
    configure_logging(cfg.logging.level, cfg.logging.format)
    failpoints.load(os.environ)  # (ConfigError: exit 2, before anything starts)
    # (the first line of a start: a restart's timeline counts from it, tools/bench/restart.py)
    log.info("starting giaannd version=%s pid=%d roles=%s", __version__, os.getpid(),
             ",".join(cfg.node.roles) or "-")
    with _no_collections():
        # Imported here: the runtime pulls in the data plane, which `giaannd config show` never needs.
        from giaannd.runtime.node import NodeRuntime
        from giaannd.services.membership import MembershipService

        runtime = NodeRuntime(cfg)
        role_services, unavailable = build_role_services(cfg, runtime)
    log.info("services built roles=%s", ",".join(cfg.node.roles) or "-")

    async def _main() -> int:
        # Start order: runtime (keys, listeners), membership (join), extras, roles; stop is
        # the reverse, so roles drain while the node is still a member and can still talk.
        services: list[Service] = [runtime, MembershipService(runtime), *extra_services,
                                   *role_services]
        daemon = Daemon(cfg, services, unavailable_roles=unavailable, runtime=runtime)
        return await daemon.run()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_main())


def main(argv: Sequence[str] | None = None, *, extra_services: Sequence[Service] = ()) -> int:
    """Entry point of ``giaannd`` and ``python -m giaannd``; returns the exit status.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        extra_services: services started after the runtime and membership and before the role
            services (a test's, or an embedder's).
    """
    args: Any = _parser().parse_args(argv)
    try:
        if args.command == "config":
            return _show(args)
        return _run(args, extra_services)
    except GiaannError as exc:
        print(f"giaannd: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # SIGINT before the daemon installed its handlers
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
