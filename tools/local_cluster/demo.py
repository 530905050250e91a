"""The demo (``make demo``): start a local cluster, train, evaluate, generate, print the figures,
stop. See the package docstring for the steps and flags."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
import urllib.error
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from giaannd.sdk.client import Client
from giaannd.sdk.errors import ClientError
from giaannd.sdk.local_cluster import BUNDLED_CORPUS, LocalCluster, NodeFailed, split_corpus

__all__ = ["main"]

DEFAULT_PROMPT: Final = "In the beginning, God created the heavens"
#: ``max_tokens`` bound of ``POST /v1/generate`` (giaannd.compute.routes.MAX_GENERATE_TOKENS, not
#: imported: that loads the compute role, ~1 s): checked here, before the cluster trains.
MAX_GENERATE_TOKENS: Final = 1024
#: Exit status after Ctrl-C (as giaannctl's and the daemon's).
EXIT_INTERRUPTED: Final = 130


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.local_cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", type=int, default=3, help="storage daemons (default 3)")
    ap.add_argument("--compute", type=int, default=1, help="compute daemons (default 1)")
    ap.add_argument("--sentences", type=int, default=None,
                    help="training sentences (default 2000; 300 with --quick)")
    ap.add_argument("--heldout", type=int, default=None,
                    help="held-out evaluation sentences (default 200; 50 with --quick)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="generation prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default 20)")
    ap.add_argument("--transport", choices=["auto", "ucx", "tcp"], default="auto")
    ap.add_argument("--quick", action="store_true", help="small sizes: under a minute (CI)")
    ap.add_argument("--keep", action="store_true", help="keep the data directories and logs")
    ap.add_argument("--dir", type=Path, default=None,
                    help="root directory (default: a temp dir); without --keep, what the demo adds "
                         "to it is removed at the end")
    ap.add_argument("--verbose", action="store_true", help="print every figure the node reports")
    ap.add_argument("--serve", action="store_true",
                    help="start the cluster, print how to reach it, wait for Ctrl-C")
    ap.add_argument("--cluster-jobs", action=argparse.BooleanOptionalAction, default=True,
                    help="train as a cluster job every compute node works on (compute.cluster-jobs, "
                         "the default); --no-cluster-jobs: a node-local job on the first compute node")
    ap.add_argument("--json", action="store_true",
                    help="print, as the last line, one JSON object of the figures (trained, sentences_per_s, "
                         "by_node, top1, ...)")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"],
                    help="daemon log level (logs go to <dir>/<node>/giaannd.log)")
    args = ap.parse_args(argv)
    args.sentences = args.sentences if args.sentences is not None else (300 if args.quick else 2000)
    args.heldout = args.heldout if args.heldout is not None else (50 if args.quick else 200)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (10 if args.quick else 20)
    if args.storage < 1 or args.compute < 0 or args.sentences < 1 or args.heldout < 0:
        ap.error("need --storage >= 1, --compute >= 0, --sentences >= 1, --heldout >= 0")
    if not args.serve and args.compute < 1:
        ap.error("the demo trains on a compute node: --compute must be >= 1")
    if not 0 <= args.max_tokens <= MAX_GENERATE_TOKENS:
        ap.error(f"--max-tokens must be in [0, {MAX_GENERATE_TOKENS}]")
    if not args.prompt.strip():
        ap.error("--prompt must not be blank")
    if args.dir is not None:  # the daemons run in their data directories: a relative path breaks there
        args.dir = args.dir.resolve()
    return args


def _say(text: str = "") -> None:
    print(text, flush=True)


def _metric(client: Client, name: str) -> float:
    """Sum of one metric's samples from a node's /metrics (0 when absent)."""
    total = 0.0
    for line in client.metrics().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def _figure_lines(doc: Any, prefix: str = "") -> list[str]:
    """Every numeric/text leaf of a job/eval/generate reply, as ``key: value`` lines."""
    if isinstance(doc, dict):
        out = []
        for key, value in doc.items():
            out += _figure_lines(value, f"{prefix}{key}.")
        return out
    if isinstance(doc, float):
        return [f"  {prefix[:-1]}: {doc:.4g}"]
    if isinstance(doc, (int, str, bool)) or doc is None:
        return [f"  {prefix[:-1]}: {doc}"]
    return [f"  {prefix[:-1]}: {json.dumps(doc)[:200]}"]


def _demo(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    """Steps 2-6 of the module docstring; raises on the first failing step. Returns the figures."""
    compute = cluster.compute_nodes[0]
    status = compute.status()
    if not str(status["roles"].get("compute", "")).startswith("running"):
        raise NodeFailed(f"{compute.name} does not run the compute role: "
                         f"{status['roles'].get('compute')}")
    _say(f"data plane: {cluster.data_plane()}")
    _say("\n$ giaannctl members list")
    _say(compute.ctl("members", "list").stdout.rstrip())

    train_path, held_path, n_train, n_held = split_corpus(cluster.corpus_dir, args.sentences,
                                                          args.heldout)
    _say(f"\ncorpus: {n_train} training sentences -> {train_path}; {n_held} held-out -> "
         f"{held_path} (bundled {BUNDLED_CORPUS.name}, nothing downloaded)")
    client = cluster.client(compute)  # giaannd.Client: what a researcher's notebook uses
    _say(f"\n$ giaannctl --data-dir {compute.data_dir} train start {train_path}")
    started = time.perf_counter()
    job = client.train(train_path, epochs=1)
    final = job.wait(progress=True)  # JobFailedError unless it succeeded
    train_s = time.perf_counter() - started
    _say(f"training job {job.job_id} {final.get('state')} in {train_s:.1f}s wall")
    if final.get("cluster"):  # a cluster job's document has no node's rate: the wall time here
        final["sentences_per_s"] = round(float(final.get("done", 0)) / train_s, 1) if train_s else 0.0
        for node, part in sorted(final.get("by_node", {}).items()):
            _say(f"  {node}: {part.get('sentences')} sentences ({part.get('windows')} windows), flag pass "
                 f"{part.get('flag_windows')} windows, leases expired {part.get('leases_expired')}, "
                 f"taken over {part.get('leases_taken_over')}")

    _say(f"\n$ giaannctl eval --corpus {held_path}")
    started = time.perf_counter()
    # Held-out sentences are scored with the test-set constants, as tools/single_process does.
    ev = client.eval(corpus=held_path, constants="test")
    eval_s = time.perf_counter() - started
    _say(f"top-1 {_num(ev.get('top1'))} on {ev.get('prompts', '?')} held-out sentences "
         f"({ev.get('matches', '?')}/{ev.get('prediction_tokens', '?')} prediction tokens)")
    eval_nodes = ev.get("by_node", {})
    if len(eval_nodes) > 1 or ev.get("redone"):  # spread over the compute nodes (compute.eval-spread)
        for node, part in sorted(eval_nodes.items()):
            _say(f"  {node}: {part.get('prompts', '?')} prompts, {part.get('hits', '?')}/"
                 f"{part.get('predictions', '?')} hits, {_num(part.get('seconds'))} s")
        for redo in ev.get("redone", []):
            _say(f"  share of {redo.get('node')} redone on {redo.get('by')}: {redo.get('error')}")

    _say(f"\n$ giaannctl generate {args.prompt!r} --max-tokens {args.max_tokens}")
    gen = client.call("POST", "/v1/generate", {"prompt": args.prompt, "max_tokens": args.max_tokens})
    tokens = gen.get("tokens") if isinstance(gen, dict) else None
    _say(f"{args.prompt} -> {' '.join(map(str, tokens)) if tokens else json.dumps(gen)}")

    sent = _metric(client, "giaannd_transport_sent_bytes_total")
    received = sum(_metric(n.client(), "giaannd_transport_received_bytes_total")
                   for n in cluster.nodes if "storage" in n.roles and n.exit_code is None)
    _say("\nmeasured figures (reported by the compute node; wall times measured here)")
    rows = [
        ("training sentences/s", _num(final.get("sentences_per_s"))),
        ("sentences trained / skipped", f"{final.get('trained', '?')} / {final.get('skipped', '?')}"),
        ("training wall time", f"{train_s:.2f} s"),
        ("update bytes sent", _num(final.get("bytes_sent"))),
        ("bytes per sentence", _num(final.get("bytes_per_sentence"))),
        ("coalescing ratio (entries before/after)", _num(final.get("coalescing_ratio"))),
        ("write batches / retries", f"{final.get('batches', '?')} / {final.get('retries', '?')}"),
        ("top-1 held-out (test constants)", _num(ev.get("top1"))),
        ("inference steps/s (eval)", _num(ev.get("steps_per_s"))),
        ("eval wall time", f"{eval_s:.2f} s"),
        ("data plane bytes: compute sent / storage received",
         f"{sent / 2**20:.2f} MiB / {received / 2**20:.2f} MiB"),
    ]
    # a cluster job's document has no node-local write figures (bytes, batches): left out, not "n/a"
    rows = [(k, v) for k, v in rows if v not in ("n/a", "? / ?")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        _say(f"  {key:<{width}}  {value}")
    if args.verbose:
        _say("\nall job figures:\n" + "\n".join(_figure_lines(final)))
        _say("all eval figures:\n" + "\n".join(_figure_lines(ev)))
    return {"compute_nodes": len(cluster.compute_nodes), "cluster_job": bool(final.get("cluster")),
            "trained": final.get("trained"), "skipped": final.get("skipped"), "sentences": final.get("done"),
            "sentences_per_s": final.get("sentences_per_s"), "train_wall_s": round(train_s, 3),
            "by_node": final.get("by_node", {}), "top1": ev.get("top1"), "heldout_prompts": ev.get("prompts"),
            "eval_wall_s": round(eval_s, 3), "eval_by_node": ev.get("by_node", {}),
            "eval_redone": ev.get("redone", [])}


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="giaann-cluster-"))
    # What a given --dir already holds is the user's: cleaning up removes only what the demo adds.
    before = _entries(root) if args.dir is not None else None
    cluster = LocalCluster(root, storage=args.storage, compute=args.compute,
                           transport=args.transport, log_level=args.log_level,
                           compute_options={"cluster_jobs": args.cluster_jobs})
    _say(f"starting {args.storage} storage + {args.compute} compute daemons on loopback "
         f"(root {root})")
    failed: str | None = None
    interrupted = False
    figures: dict[str, Any] = {}
    codes: dict[str, int | None] = {}
    started = time.perf_counter()
    # SIGTERM (``timeout … make demo``, a CI runner) as Ctrl-C: the daemons run in sessions of their
    # own and an atexit hook does not run on a signal, so they were left running
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        cluster.wait_converged()
        _say(f"all {len(cluster.nodes)} daemons READY and converged in "
             f"{time.perf_counter() - started:.1f}s")
        if args.serve:
            _serve(cluster)
        else:
            figures = _demo(cluster, args)
    except (NodeFailed, ClientError, OSError, KeyError, urllib.error.URLError) as exc:
        failed = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:  # --serve: how it is meant to end; the demo: stopped by the user
        interrupted = not args.serve
    finally:
        _say("\nstopping the cluster (SIGTERM)")
        try:
            codes = cluster.stop()
        except KeyboardInterrupt:  # Ctrl-C again: no graceful drain, kill what is left
            interrupted = True
        finally:
            cluster.kill_all()
            signal.signal(signal.SIGTERM, previous)
    if codes:
        _say("exit statuses: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
    bad = {k: v for k, v in codes.items() if v != 0}
    if failed:
        _say(f"FAILED: {failed}")
    elif interrupted:
        failed = "interrupted"
        _say("interrupted: the cluster is stopped")
    if bad and not failed:
        failed = f"daemons did not exit cleanly: {bad}"
        _say(f"FAILED: {failed}")
    if args.keep or (failed and not interrupted):
        _say(f"node data and logs kept in {root}")
    else:
        _remove_created(root, before)
    if not failed:
        _say(f"demo finished in {time.perf_counter() - started:.1f}s")
    if args.json:  # the last line, whatever happened
        _say(json.dumps({**figures, "ok": not failed, **({"error": failed} if failed else {})}))
    return EXIT_INTERRUPTED if interrupted else 1 if failed else 0


def _entries(root: Path) -> set[str] | None:
    """Names in ``root`` now (None: it does not exist, so the demo creates it and may remove it)."""
    try:
        return {p.name for p in root.iterdir()}
    except FileNotFoundError:
        return None
    except OSError:  # not a directory, not readable: the start fails there and says why
        return set()


def _remove_created(root: Path, before: set[str] | None) -> None:
    """Remove ``root`` (``before`` None: the demo made it) or only the entries not in ``before``."""
    if before is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    for entry in _entries(root) or set():
        if entry not in before:
            path = root / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _serve(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        _say(f"  {node.name:<10} giaannctl --data-dir {node.data_dir} node status")
    _say("Ctrl-C stops the cluster")
    while True:
        for node in cluster.nodes:
            cluster._check_alive(node)
        time.sleep(1.0)
