"""Randomized crash points of a storage node's durable files (DurableStore, vocab and register logs).

A child process (``_crash_child.py``: forked by a zygote that imported the engine once) runs a
seeded plan of applies, floors, drops, syncs, snapshots in the timer's three steps, log rotations,
folds, vocabulary puts and register accepts, reporting what each sync made durable, and dies by
SIGKILL at a seeded point: at the n-th write, rename, unlink, truncate, sync or file creation of
the stores (before it, after it, or in the middle of a write), the points picked among the calls of
snapshot writes, rotations, snapshot finishes, applies and the other logs; or, with the snapshot
written by a thread beside the applies, when a seeded operation starts; or in the middle of the
recovery of what such a crash left; or some calls after a disk error (a full disk, a failed fsync)
that the plan went on from. Then, in this process:

1. recovery succeeds (no corruption error) at every point;
2. the rows and touch counts are a plain dict model's after some prefix of the plan that holds
   every operation acknowledged as durable: an unacknowledged batch is there wholly or not at all,
   and never twice; the applied set agrees with that prefix;
3. the store takes the rest of the plan and every batch again (retries: no batch counts twice), a
   snapshot and a restart give the same rows; the vocabulary and the registers hold every
   acknowledged put and accept, nothing that was never sent, and take new ones across a restart.

A SIGKILL keeps what reached the page cache, so this checks what a process crash leaves (record
boundaries, the order of renames and deletions, replay), not a power loss. The seeds are fixed, and
a plan without threads makes the same calls in the same order, so a failing trap seed reproduces.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from giaannd.protocol import BatchId
from giaannd.storage import DurableStore
from giaannd.storage.engine.register_store import EMPTY, RegisterStore
from giaannd.storage.engine.vocab_store import VocabStore
from tests.unit.storage import _crash_child as cc

REPO = Path(__file__).resolve().parents[3]
PLANS = (11, 12, 13)
#: (seed, the kind of operation whose calls the trap lands in)
TRAP_POINTS = [(seed, kind) for seed, kind in enumerate(
    ["snap_write", "snap_begin", "snap_finish", "apply", "rotate", "snap_write", "drop", "reg",
     "rsync", "vocab", "snap_write", "snap_begin", "snap_finish", "apply", "floor", "snap_write",
     "sync", "compact", "snap_write", "apply", "snap_finish", "vsync", "compact", "any"])]
KILL_OPS = range(5)
RUN_TIMEOUT_S = 60


class Zygote:
    """The forking server of ``_crash_child.py`` (a subprocess; every wait bounded)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, str(Path(cc.__file__))], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.child: int | None = None
        assert self._line(120).get("ready")

    def _line(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError("crash harness zygote did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"crash harness zygote exited: {self.proc.wait(10)}")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        self.child = self._line(30)["pid"]
        try:
            out = self._line(RUN_TIMEOUT_S)
        except TimeoutError:  # a child that hangs: killed, and its status read, so the zygote goes on
            os.kill(self.child, signal.SIGKILL)
            self._line(30)
            raise
        self.child = None
        return out

    def close(self) -> None:
        if self.child is not None:  # a run that timed out: its child first (the zygote's own)
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@dataclass(frozen=True)
class Report:
    started: list[int]  # trapped calls made before each operation started, by operation
    acked: set[int]
    done_calls: int | None
    failed: frozenset[int] = frozenset()  # operations an injected fault failed
    compactions: int = 0  # of the register log, in a run to the end


def _read_report(path: Path) -> Report:
    started, acked, failed, done, compactions = [], set(), set(), None, 0
    for line in path.read_text().splitlines() if path.exists() else []:
        kind, *rest = line.split()
        if kind == "S":
            started.append(int(rest[1]))
        elif kind == "A":
            acked.add(int(rest[0]))
        elif kind == "F":
            failed.add(int(rest[0]))
        elif kind == "D":
            done, compactions = int(rest[0]), int(rest[1])
    return Report(started, acked, done, frozenset(failed), compactions)


def _run(zygote: Zygote, root: Path, plan_seed: int, **spec: Any) -> Report:
    root.mkdir(parents=True, exist_ok=True)
    spec.setdefault("report", str(root / "report"))
    out = zygote.run({"plan_seed": plan_seed, "dir": str(root), **spec})
    report = _read_report(Path(spec["report"]))
    if spec.get("trap") or spec.get("kill_op") is not None:
        assert out["signal"] == signal.SIGKILL or (out["code"] == 0 and report.done_calls is not None), out
    else:
        assert out["code"] == 0 and report.done_calls is not None, out
    return report


@pytest.fixture(scope="module")
def dry_runs(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Report]:
    """Each plan run to its end once: which trapped calls each operation makes."""
    return {seed: _run(zygote, tmp_path_factory.mktemp(f"dry{seed}"), seed) for seed in PLANS}


# -- checks ----------------------------------------------------------------------------------------

_MUTATES = ("apply", "floor", "drop")


def _ids(plan: list[list[Any]]) -> list[tuple[int, int]]:
    return sorted({(op[1], op[2]) for op in plan if op[0] == "apply"})


def _recovered_prefix(ds: DurableStore, plan: list[list[Any]], report: Report, plan_seed: int) -> cc.Reference:
    """The reference after the prefix of ``plan`` the recovered store holds (module docstring, 2)."""
    last_started = len(report.started) - 1
    acked = [i for i in report.acked if plan[i][0] in _MUTATES]
    lo = max(acked) + 1 if acked else 0
    ref = cc.Reference(plan_seed)
    for i, op in enumerate(plan[:lo]):
        if i not in report.failed:
            ref.do(op)
    rows, touches = cc.store_rows(ds)
    for p in range(lo, last_started + 2):
        if p > lo and p - 1 not in report.failed:
            ref.do(plan[p - 1])
        if cc.same_rows(rows, ref.rows) and touches == ref.touches and all(
                (BatchId(w, s) in ds.store.applied) == ref.is_applied(w, s) for w, s in _ids(plan)):
            return ref
    raise AssertionError(f"recovered rows match no prefix of the plan from op {lo} (last acknowledged "
                         f"change) to op {last_started + 1}: {len(rows)} rows, report {report.acked}")


def _check_rows(root: Path, plan_seed: int, report: Report) -> None:
    plan = cc.make_plan(plan_seed)
    ds = DurableStore.open(root / "rows", cc.BIG, segment_max_bytes=cc.SEGMENT_MAX_BYTES)
    ref = _recovered_prefix(ds, plan, report, plan_seed)
    ds.store.on_fold_due = lambda: None
    done = len(report.started) - 1
    # the rest of the plan's changes, then every batch again (a writer's retries)
    rest = [op for op in plan[done:] if op[0] in _MUTATES] + [["apply", w, s, None] for w, s in _ids(plan)]
    for op in rest:
        if op[0] == "apply":
            w, s, cols = op[1], op[2], op[3]
            ds.apply(BatchId(w, s), cc.share_of(cc.batch_for(plan_seed, w, s), cols), track=w != cc.UNTRACKED)
        elif op[0] == "floor":
            ds.advance_floor(op[1], op[2])
        else:
            ds.drop_columns(np.array(op[1], np.uint64))
        ref.do(op)
    ds.close()
    # a restart from the log written after the crash, then from a snapshot with a batch after it
    for step in ("log", "snapshot"):
        ds = DurableStore.open(root / "rows", cc.BIG, segment_max_bytes=cc.SEGMENT_MAX_BYTES)
        assert ds.recovery.torn_tail_bytes == 0, step
        rows, touches = cc.store_rows(ds)
        assert cc.same_rows(rows, ref.rows) and touches == ref.touches, f"after the retries, restart from the {step}"
        if step == "log":
            ds.snapshot()
            ds.apply(BatchId(9, 1), cc.batch_for(plan_seed, 9, 1), track=True)
            ref.apply(9, 1, None)
        ds.close()


def _check_vocab(root: Path, plan_seed: int, report: Report) -> None:
    plan = cc.make_plan(plan_seed)
    started = len(report.started)
    sent = {cc.vocab_entry(k, word) for op in plan[:started] if op[0] == "vocab" for k, word in op[1]}
    acked = {cc.vocab_entry(k, word) for i in report.acked if plan[i][0] == "vocab" for k, word in plan[i][1]}
    vocab = VocabStore.open(root / "vocab")
    held = {(k, i, vocab.get(k, i)) for k, i, _ in sent if vocab.get(k, i) is not None}
    assert acked <= held <= sent and len(vocab) == len(held)
    new = cc.vocab_entry(0, f"after{plan_seed}")
    vocab.put([new])
    vocab.sync()
    vocab.close()
    again = VocabStore.open(root / "vocab")
    assert again.get(new[0], new[1]) == new[2] and len(again) == len(held) + 1
    again.close()


def _check_registers(root: Path, plan_seed: int, report: Report) -> None:
    plan = cc.make_plan(plan_seed)
    started = len(report.started)
    regs = RegisterStore.open(root / "regs", spill_bytes=cc.SPILL_BYTES)
    for key in cc.REG_KEYS:
        tries = [(i, op[2]) for i, op in enumerate(plan[:started])
                 if op[0] == "reg" and op[1] == key and i not in report.failed]
        acked = [n for n, (i, _) in enumerate(tries) if i in report.acked]
        allowed = [cc.register_state(plan_seed, key, rnd) for _, rnd in tries[acked[-1] if acked else 0:]]
        if not acked:
            allowed.append(EMPTY)
        assert regs.get(key) in allowed, f"register {key}: {regs.get(key)}"
    top = max((op[2] for op in plan if op[0] == "reg"), default=0) + 1
    state = cc.register_state(plan_seed, "job", top)
    result, seq = regs.accept("job", state.accepted, state.version, state.value)
    assert result == state and regs.sync() >= seq
    regs.close()
    again = RegisterStore.open(root / "regs", spill_bytes=cc.SPILL_BYTES)
    assert again.get("job") == state
    again.close()


def _check(root: Path, plan_seed: int, report: Report) -> None:
    _check_rows(root, plan_seed, report)
    _check_vocab(root, plan_seed, report)
    _check_registers(root, plan_seed, report)


# -- tests -----------------------------------------------------------------------------------------

def _trap_for(seed: int, kind: str, dry: dict[int, Report]) -> tuple[int, list[Any]]:
    """(plan, trap) of a seed: a call made by an operation of ``kind`` (any call for "any")."""
    rng = np.random.default_rng([7, seed])
    plan_seed = PLANS[seed % len(PLANS)]
    report, plan = dry[plan_seed], cc.make_plan(plan_seed)
    assert report.done_calls is not None
    bounds = [*report.started, report.done_calls]
    calls = [n for i, op in enumerate(plan) if kind in ("any", op[0]) or (
                 kind == "compact" and op[0] == "rsync" and bounds[i + 1] - bounds[i] > 2)  # (a compaction's)
             for n in range(bounds[i] + 1, bounds[i + 1] + 1)]
    assert calls, f"plan {plan_seed} makes no call in a {kind} operation"
    return plan_seed, [int(rng.choice(calls)), str(rng.choice(["before", "after", "partial"])), float(rng.random())]


@pytest.mark.parametrize(("seed", "kind"), TRAP_POINTS)
def test_crash_points_at_a_trapped_call_recover_every_acknowledged_write(
        zygote: Zygote, dry_runs: dict[int, Report], tmp_path: Path, seed: int, kind: str) -> None:
    plan_seed, trap = _trap_for(seed, kind, dry_runs)
    report = _run(zygote, tmp_path, plan_seed, trap=trap)
    _check(tmp_path, plan_seed, report)


@pytest.mark.parametrize("seed", KILL_OPS)
def test_crash_points_while_a_thread_writes_the_snapshot(zygote: Zygote, tmp_path: Path, seed: int) -> None:
    plan_seed = PLANS[seed % len(PLANS)]
    plan = cc.make_plan(plan_seed)
    writes = [i for i, op in enumerate(plan) if op[0] == "snap_write" and i + 1 < len(plan)]
    kill_op = writes[seed % len(writes)] + 1 + seed % 2  # just after the thread started, or one op later
    report = _run(zygote, tmp_path, plan_seed, kill_op=kill_op)
    _check(tmp_path, plan_seed, report)


@pytest.mark.parametrize("seed", range(4))
def test_crash_points_in_the_middle_of_recovery_then_recovery_again(zygote: Zygote, dry_runs: dict[int, Report],
                                                                    tmp_path: Path, seed: int) -> None:
    # a crash that leaves work to recovery (a torn record, a snapshot's temporary, segments and a
    # snapshot a finish did not delete), then a crash at a seeded call of that recovery
    plan_seed, trap = _trap_for(seed, ("apply", "snap_write", "snap_finish", "vocab")[seed], dry_runs)
    if seed != 2:
        trap[1:] = ["partial", 0.5]
    root = tmp_path / "crashed"
    report = _run(zygote, root, plan_seed, trap=trap)
    probe = tmp_path / "probe"
    shutil.copytree(root, probe)
    calls = _run(zygote, probe, plan_seed, recover_only=True, report=str(tmp_path / "probe.report"))
    assert calls.done_calls
    n = int(np.random.default_rng([9, seed]).integers(1, calls.done_calls + 1))
    _run(zygote, root, plan_seed, recover_only=True, trap=[n, "after", 0.0], report=str(tmp_path / "recover.report"))
    _check(root, plan_seed, report)


#: (seed, the kind of operation whose call fails, its errno)
FAULT_POINTS = [(0, "apply", errno.ENOSPC), (1, "sync", errno.EIO), (2, "snap_write", errno.ENOSPC),
                (3, "rsync", errno.EIO), (4, "vocab", errno.ENOSPC), (5, "snap_begin", errno.EIO)]


@pytest.mark.parametrize(("seed", "kind", "code"), FAULT_POINTS)
def test_crash_points_after_a_disk_error_recover_every_acknowledged_write(
        zygote: Zygote, dry_runs: dict[int, Report], tmp_path: Path, seed: int, kind: str, code: int) -> None:
    # a call that fails (a full disk, a failed fsync: the plan goes on, the operation not
    # acknowledged), then a crash a seeded number of calls later
    plan_seed, (n, how, cut) = _trap_for(100 + seed, kind, dry_runs)
    later = n + int(np.random.default_rng([11, seed]).integers(1, 40))
    report = _run(zygote, tmp_path, plan_seed, faults=[[n, code, cut]], trap=[later, how, cut])
    failing_op = max(i for i, calls in enumerate(dry_runs[plan_seed].started) if calls < n)
    assert failing_op in report.failed  # (the fault reached the caller: nothing swallowed it)
    _check(tmp_path, plan_seed, report)


def _calls_of(report: Report, op: int) -> range:
    """The trapped calls operation ``op`` of a run made (numbered as the trap counts them)."""
    assert report.done_calls is not None
    bounds = [*report.started, report.done_calls]
    return range(bounds[op] + 1, bounds[op + 1] + 1)


def test_crash_in_a_register_compaction_leaves_no_temporary_after_the_restart(
        zygote: Zygote, dry_runs: dict[int, Report], tmp_path: Path) -> None:
    # found by this harness: a kill in a compaction left ``registers.log.compact`` (a copy of every
    # live state, spilled values included: up to storage.register-disk-bytes) until the next
    # compaction, which may not come for long
    plan_seed = next(seed for seed in PLANS if dry_runs[seed].compactions)
    plan, dry = cc.make_plan(plan_seed), dry_runs[plan_seed]
    op = next(i for i, o in enumerate(plan) if o[0] == "rsync" and len(_calls_of(dry, i)) > 2)
    report = _run(zygote, tmp_path, plan_seed, trap=[_calls_of(dry, op)[0], "after", 0.0])  # its file created
    assert (tmp_path / "regs" / "registers.log.compact").exists()
    _check(tmp_path, plan_seed, report)
    assert sorted(p.name for p in (tmp_path / "regs").iterdir()) == ["registers.log"]


def test_crash_in_a_vocab_rewrite_leaves_no_temporary_after_the_restart(
        zygote: Zygote, dry_runs: dict[int, Report], tmp_path: Path) -> None:
    # the same for the vocabulary log's rewrite after a failed fsync (vocab_store.py ``_rewrite``)
    plan_seed = PLANS[0]
    plan, dry = cc.make_plan(plan_seed), dry_runs[plan_seed]
    syncs = [i for i, o in enumerate(plan) if o[0] == "vsync" and len(_calls_of(dry, i))]
    faults = [[_calls_of(dry, syncs[0])[0], errno.EIO, 0.0]]
    faulted = _run(zygote, tmp_path / "probe", plan_seed, faults=faults)
    rewrite = next(i for i in syncs[1:] if len(_calls_of(faulted, i)) > 1)
    trap = [_calls_of(faulted, rewrite)[0], "after", 0.0]  # its file created
    report = _run(zygote, tmp_path / "run", plan_seed, faults=faults, trap=trap)
    assert (tmp_path / "run" / "vocab" / "vocab.log.rewrite").exists()
    _check(tmp_path / "run", plan_seed, report)
    assert sorted(p.name for p in (tmp_path / "run" / "vocab").iterdir()) == ["vocab.log"]
