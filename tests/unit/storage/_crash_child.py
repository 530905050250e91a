"""The crash-point harness's other half (test_crash_points.py): plans, the child that runs one, the
reference model the parent checks a recovered store against, and a zygote that forks children.

A *plan* is a seeded list of operations on one storage node's durable files: applies of training
writers' batches (shares of one batch id among them, retries, floors), a stream-like untracked
writer, column drops, group-commit syncs, snapshots in the timer's three steps with applies between
them, log rotations, delta folds, vocabulary puts and register accepts. The child runs a plan and
appends to a report file, with the ``os.write`` it saved before anything was wrapped, which
operation it starts (``S i calls``: with the trapped calls made so far) and which ones a sync made
durable (``A i``), as a service acknowledges them, ``F i`` for one an injected fault failed, and
``D calls`` once the plan is done. It dies by SIGKILL, sent to itself at a point the parent chose
from the seed:

- ``trap (n, how, cut)``: at the n-th call of the wrapped ``os`` functions below (every write,
  rename, unlink, truncate, sync and file creation of the stores), ``before`` the call, ``after``
  it, or (a write) ``partial``, after writing the first ``cut`` share of its bytes. A plan without
  threads makes the same calls in the same order every run, so a trap names one crash point;
- ``recover_only``: no plan; the trap counts the calls of the stores' recovery (of a directory a
  crash left) and kills it in the middle;
- ``kill_op k``: when operation k starts; a snapshot's write then runs in a thread beside the
  applies (as under the service), so the kill lands wherever that thread is.

Why a zygote (``python _crash_child.py``, commands on stdin): a fresh interpreter takes ~1.3 s to
import the engine; the zygote imports it once, warms it up, and forks one child per crash point from
a process with no other threads (a fork of the pytest process would copy whatever threads other
tests left).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from giaannd.model.ids import column_id, feature_id  # noqa: E402
from giaannd.model.rows import RowBatch  # noqa: E402
from giaannd.protocol import BatchId  # noqa: E402
from giaannd.storage import DurableStore  # noqa: E402
from giaannd.storage.engine import register_store, snapshot, snapshot_io  # noqa: E402
from giaannd.storage.engine.register_store import RegisterState, RegisterStore  # noqa: E402
from giaannd.storage.engine.vocab_store import VocabStore  # noqa: E402
from tests.unit.storage._gen import random_batch  # noqa: E402

BIG = 1 << 40
SEGMENT_MAX_BYTES = 24 << 10  # small: appends rotate segments on their own
SPILL_BYTES = 512  # some register values stay on disk (register_store.py "Large values")
COMPACT_MIN_BYTES, COMPACT_RATIO = 2 << 10, 2  # the register log compacts within a plan
TRACKED = (1, 2)  # training writers (per-column idempotency)
UNTRACKED = 3  # a stream-like writer: whole-id idempotency
REG_KEYS = ("job", "lease", "chunk")
#: the ``os`` functions a trap counts (module docstring)
TRAPPED = ("writev", "write", "pwrite", "replace", "rename", "unlink", "ftruncate", "truncate",
           "fsync", "fdatasync", "open")
_WRITES = ("writev", "write", "pwrite")


# -- plans -------------------------------------------------------------------------------------------

def batch_for(plan_seed: int, writer: int, seq: int) -> RowBatch:
    """The whole batch ``(writer, seq)`` of a plan (every share of it is a part of this)."""
    rng = np.random.default_rng([plan_seed, writer, seq])
    return random_batch(rng, int(rng.integers(8, 90)), columns=6, features=4, key_space=12)


def share_of(batch: RowBatch, columns: list[int] | None) -> RowBatch:
    return batch if columns is None else batch.select_rows(np.isin(batch.row_column, np.array(columns, np.uint64)))


def reg_value(plan_seed: int, key: str, n: int) -> bytes:
    rng = np.random.default_rng([plan_seed, len(key), n])
    size = int(rng.integers(600, 1500)) if key == "chunk" else int(rng.choice([0, 20, 60]))  # chunk: spilled
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def vocab_entry(kind: int, word: str) -> tuple[int, int, str]:
    return kind, column_id(word) if kind == 0 else feature_id(word), word


def make_plan(plan_seed: int, ops: int = 90) -> list[list[Any]]:
    """A seeded list of operations (module docstring); JSON-able, the same in parent and child."""
    rng = np.random.default_rng(plan_seed)
    plan: list[list[Any]] = []
    next_seq = {w: 1 for w in (*TRACKED, UNTRACKED)}
    partial: list[tuple[int, int]] = []  # ids applied as a share only
    reg_round = dict.fromkeys(REG_KEYS, 0)
    words = 0
    snap_phase = 0  # 0 none, 1 begun, 2 written
    for _ in range(ops):
        r = rng.random()
        if snap_phase and rng.random() < 0.25:  # the timer's snapshot goes on between applies
            mode = str(rng.choice(["cached", "dropped", "direct"]))  # (snapshot.write_frozen's modes)
            plan.append(["snap_write", mode] if snap_phase == 1 else ["snap_finish"])
            snap_phase = (snap_phase + 1) % 3
            continue
        if r < 0.45:
            w = int(rng.choice([*TRACKED, UNTRACKED]))
            if partial and w != UNTRACKED and rng.random() < 0.3:  # the rest of a batch id: another share
                w, s = partial.pop(int(rng.integers(len(partial))))
                plan.append(["apply", w, s, None])
                continue
            s = next_seq[w]
            next_seq[w] += 1
            cols = None
            if w != UNTRACKED and rng.random() < 0.3:
                cols = sorted({int(c) for c in batch_for(plan_seed, w, s).row_column[:: 2]})
                partial.append((w, s))
            plan.append(["apply", w, s, cols])
        elif r < 0.52:
            w = int(rng.choice([*TRACKED, UNTRACKED]))
            if next_seq[w] > 1:  # a retry of an earlier id (a duplicate, or its missing columns)
                plan.append(["apply", w, int(rng.integers(1, next_seq[w])), None])
        elif r < 0.64:
            plan.append(["sync"])
        elif r < 0.67:
            w = int(rng.choice(TRACKED))
            if next_seq[w] > 2:
                plan.append(["floor", w, int(rng.integers(1, next_seq[w] - 1))])
        elif r < 0.70:
            b = batch_for(plan_seed, 1, 1)
            plan.append(["drop", [int(b.row_column[int(rng.integers(b.num_rows))])]])
        elif r < 0.76:
            if snap_phase == 0:
                plan.append(["snap_begin"])
                snap_phase = 1
        elif r < 0.79:
            plan.append(["rotate"])
        elif r < 0.82:
            plan.append(["fold"])
        elif r < 0.87:
            kinds = rng.integers(0, 2, int(rng.integers(1, 4)))
            plan.append(["vocab", [[int(k), f"w{plan_seed}x{words + i}"] for i, k in enumerate(kinds)]])
            words += len(kinds)
            if rng.random() < 0.7:
                plan.append(["vsync"])
        else:
            key = str(rng.choice(REG_KEYS))
            reg_round[key] += int(rng.integers(1, 3))
            plan.append(["reg", key, reg_round[key]])
            if rng.random() < 0.7:
                plan.append(["rsync"])
    plan += [["snap_write", "cached"], ["snap_finish"]][snap_phase - 1:] if snap_phase else []
    plan += [["sync"], ["vsync"], ["rsync"]]
    return plan


def reg_accept_args(plan_seed: int, key: str, rnd: int) -> tuple[tuple[int, int], tuple[int, int, int], bytes]:
    """(ballot, version, value) of a plan's accept of ``key`` in round ``rnd``."""
    return (rnd, 7), (rnd, rnd, 7), reg_value(plan_seed, key, rnd)


# -- the child ---------------------------------------------------------------------------------------

class _Trap:
    """Counts the calls of ``TRAPPED`` and kills the process at the n-th (module docstring).
    ``faults``: call number -> (errno, cut): that call fails with the errno instead, a write after
    writing the first ``cut`` share of its bytes (a disk that fills up, a failed fsync)."""

    def __init__(self, n: int, how: str, cut: float, faults: dict[int, tuple[int, float]] | None = None) -> None:
        self.n, self.how, self.cut, self.calls = n, how, cut, 0
        self.faults = faults or {}
        self.real = {name: getattr(os, name) for name in TRAPPED}
        for name in TRAPPED:
            setattr(os, name, self._wrap(name))

    def _wrap(self, name: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._call(name, args, kwargs)
            except OSError as exc:
                # raised without this frame's arguments: a traceback holding a memoryview of a
                # caller's mmap makes its ``with mmap`` fail to close (BufferError), which the
                # C function's own error never does
                args = kwargs = None  # type: ignore[assignment]
                raise exc.with_traceback(None)  # noqa: B904

        return wrapped

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        real = self.real[name]
        self.calls += 1
        fault = self.faults.get(self.calls)
        if fault is not None:
            if name in _WRITES:
                self._partial(name, args, fault[1])
            raise OSError(fault[0], os.strerror(fault[0]))
        if self.calls != self.n:
            return real(*args, **kwargs)
        if self.how == "partial" and name in _WRITES:
            self._partial(name, args, self.cut)
        elif self.how == "after":
            real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    def _partial(self, name: str, args: tuple[Any, ...], cut: float) -> None:
        data = b"".join(bytes(p) for p in args[1]) if name == "writev" else bytes(args[1])
        head = data[: int(len(data) * cut)]
        try:
            if name == "pwrite":
                self.real["pwrite"](args[0], head, args[2])
            else:
                self.real["write"](args[0], head)
        except OSError:  # (an O_DIRECT file takes whole blocks only: then no part of it)
            pass


@dataclass
class _Child:
    plan_seed: int
    root: Path
    report: int
    ds: DurableStore = field(init=False)
    vocab: VocabStore = field(init=False)
    regs: RegisterStore = field(init=False)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (op, log seq) not acked yet
    vpending: list[tuple[int, int]] = field(default_factory=list)
    rpending: list[tuple[int, int]] = field(default_factory=list)
    job: Any = None
    writer: threading.Thread | None = None

    def say(self, line: str, write: Any) -> None:
        write(self.report, (line + "\n").encode())

    def open(self) -> None:
        self.ds = DurableStore.open(self.root / "rows", BIG, segment_max_bytes=SEGMENT_MAX_BYTES)
        self.ds.store.on_fold_due = lambda: None  # the service's way: delta runs pile up until a fold
        self.vocab = VocabStore.open(self.root / "vocab")
        self.regs = RegisterStore.open(self.root / "regs", spill_bytes=SPILL_BYTES)

    def run(self, plan: list[list[Any]], kill_op: int | None, trap: _Trap, write: Any) -> None:
        for i, op in enumerate(plan):
            self.say(f"S {i} {trap.calls}", write)
            if i == kill_op:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                for done in self.step(i, op, threaded=kill_op is not None):
                    self.say(f"A {done}", write)
            except OSError:  # an injected fault (``_Trap.faults``): the service's caller sees it
                self.say(f"F {i}", write)
                if op[0] in ("snap_begin", "snap_write"):  # a snapshot that failed is given up
                    if self.job is not None and op[0] == "snap_write":
                        self.job.view.release()
                    self.job = None

    def step(self, i: int, op: list[Any], threaded: bool) -> list[int]:
        kind, ds = op[0], self.ds
        if kind == "apply":
            w, s, cols = op[1], op[2], op[3]
            res = ds.apply(BatchId(w, s), share_of(batch_for(self.plan_seed, w, s), cols), track=w != UNTRACKED)
            self.pending.append((i, res.seq))
        elif kind == "floor":
            self.pending.append((i, ds.advance_floor(op[1], op[2])))
        elif kind == "drop":
            ds.drop_columns(np.array(op[1], np.uint64))
            self.pending.append((i, ds.log.last_seq))
        elif kind == "sync":
            durable = ds.sync()
            done = [j for j, seq in self.pending if seq <= durable]
            self.pending = [(j, seq) for j, seq in self.pending if seq > durable]
            return done
        elif kind == "snap_begin":
            self.job = ds.begin_snapshot(ds.freeze_room())
        elif kind == "snap_write":
            if self.job is None:
                return []
            if threaded:
                self.writer = threading.Thread(target=self.job.write, args=(1.0, op[1]))
                self.writer.start()
            else:
                self.job.write(mode=op[1])
        elif kind == "snap_finish":
            if self.writer is not None:
                self.writer.join()
                self.writer = None
            job, self.job = self.job, None
            if job is not None:
                ds.finish_snapshot(job)
        elif kind == "rotate":
            ds.log.rotate()
        elif kind == "fold":
            ds.fold_deltas()  # (while a snapshot's view is held too, as a background fold may)
        elif kind == "vocab":
            put = self.vocab.put([vocab_entry(k, word) for k, word in op[1]])
            self.vpending.append((i, put.offset))
        elif kind == "vsync":
            durable = self.vocab.sync()
            done = [j for j, off in self.vpending if off <= durable]
            self.vpending = [(j, off) for j, off in self.vpending if off > durable]
            return done
        elif kind == "reg":
            _, seq = self.regs.accept(op[1], *reg_accept_args(self.plan_seed, op[1], op[2]))
            self.rpending.append((i, seq))
        elif kind == "rsync":
            durable = self.regs.sync()
            done = [j for j, seq in self.rpending if seq <= durable]
            self.rpending = [(j, seq) for j, seq in self.rpending if seq > durable]
            return done
        return []


def run_child(spec: dict[str, Any]) -> None:
    """In a forked child: run ``spec``'s plan in its directory, then exit (or die at its trap)."""
    # (module constants, read where they are used: a small log compacts within a plan, and a small
    # snapshot is written in many pieces, synced and staged as a large one is)
    setattr(register_store, "COMPACT_MIN_BYTES", COMPACT_MIN_BYTES)  # noqa: B010
    setattr(register_store, "COMPACT_RATIO", COMPACT_RATIO)  # noqa: B010
    snapshot.WRITE_CHUNK_BYTES = 2048
    snapshot_io.SYNC_EVERY_BYTES = 16 << 10
    setattr(snapshot_io, "DIRECT_STAGE_BYTES", 2 * snapshot_io.DIRECT_BLOCK)  # noqa: B010
    write = os.write
    report = os.open(spec["report"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    child = _Child(spec["plan_seed"], Path(spec["dir"]), report)
    faults = {int(n): (int(e), float(c)) for n, e, c in spec.get("faults", [])}
    if spec.get("recover_only"):  # a crash in the middle of recovery: the trap counts its calls
        trap = _Trap(*spec.get("trap") or (0, "before", 0.0))
        child.open()
        write(report, f"D {trap.calls} 0\n".encode())
        os._exit(0)
    child.open()
    n, how, cut = spec.get("trap") or (0, "before", 0.0)
    trap = _Trap(n, how, cut, faults)
    child.run(make_plan(spec["plan_seed"], spec.get("ops", 90)), spec.get("kill_op"), trap, write)
    write(report, f"D {trap.calls} {child.regs.compactions}\n".encode())
    os._exit(0)


# -- the zygote --------------------------------------------------------------------------------------

def _warm_up() -> None:
    """Run a small plan once, so the forked children start with every lazy import and cache made."""
    with tempfile.TemporaryDirectory() as d:
        pid = os.fork()
        if pid == 0:
            try:
                run_child({"plan_seed": 0, "dir": d, "report": os.path.join(d, "report"), "ops": 30})
            finally:
                os._exit(1)
        os.waitpid(pid, 0)


def zygote() -> None:
    """Read one JSON spec a line; fork a child for it; answer ``{"pid"}`` then ``{"status"}``."""
    _warm_up()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                sys.stdin.close()
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # (stdout answers the parent)
                run_child(spec)
            except BaseException:
                traceback.print_exc()  # (to the test's stderr: the zygote's)
            finally:
                os._exit(3)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                          "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}), flush=True)


# -- the parent's reference model --------------------------------------------------------------------

@dataclass
class Reference:
    """A storage node's rows and applied set as plain dicts, by the documented rules (applied_set.py
    "Which columns", column_store.py ``prepare``, recovery.py ``drop_columns``)."""

    plan_seed: int
    rows: dict[tuple[int, int], dict[tuple[int, int, int], np.float32]] = field(default_factory=dict)
    touches: dict[tuple[int, int], int] = field(default_factory=dict)
    applied: set[tuple[int, int]] = field(default_factory=set)
    floor: dict[int, int] = field(default_factory=dict)
    promised: dict[int, int] = field(default_factory=dict)
    columns: dict[tuple[int, int], set[int]] = field(default_factory=dict)

    def is_applied(self, w: int, s: int) -> bool:
        return s <= self.floor.get(w, 0) or (w, s) in self.applied

    def _done(self, w: int, s: int) -> set[int] | None:
        applied = self.is_applied(w, s)
        if w not in self.promised or s <= self.promised[w]:
            return None if applied else set()
        known = self.columns.get((w, s))
        if known is not None:
            return known
        return None if applied else set()

    def do(self, op: list[Any]) -> None:
        kind = op[0]
        if kind == "apply":
            self.apply(op[1], op[2], op[3])
        elif kind == "floor":
            self.advance_floor(op[1], op[2])
        elif kind == "drop":
            for key in [k for k in self.rows if k[0] in op[1]]:
                del self.rows[key], self.touches[key]

    def apply(self, w: int, s: int, cols: list[int] | None) -> None:
        done = self._done(w, s)
        if done is None:
            return
        batch = share_of(batch_for(self.plan_seed, w, s), cols)
        fresh = [i for i in range(batch.num_rows) if int(batch.row_column[i]) not in done]
        if not fresh:
            return
        if w != UNTRACKED and w not in self.promised:
            self.promised[w] = 0
        part_cols = {int(batch.row_column[i]) for i in fresh}
        if s > self.promised.get(w, 1 << 64):
            had = self.columns.get((w, s))
            if had is not None or not self.is_applied(w, s):
                self.columns[(w, s)] = part_cols | (had or set())
        self.applied.add((w, s))
        for i in fresh:
            key = (int(batch.row_column[i]), int(batch.row_feature[i]))
            row = self.rows.setdefault(key, {})
            a, z = int(batch.offsets[i]), int(batch.offsets[i + 1])
            for seg, tc, tf, st in zip(batch.segment[a:z].tolist(), batch.target_column[a:z].tolist(),
                                       batch.target_feature[a:z].tolist(), batch.strength[a:z]):
                t = (seg, tc, tf)
                row[t] = st if t not in row else np.float32(row[t] + st)
            self.touches[key] = self.touches.get(key, 0) + 1

    def advance_floor(self, w: int, f: int) -> None:
        if not (w in self.promised and f <= self.promised[w]):
            self.promised[w] = max(f, self.promised.get(w, 0))
            for key in [k for k in self.columns if k[0] == w and k[1] <= f]:
                del self.columns[key]
        self.floor[w] = max(self.floor.get(w, 0), f)


def store_rows(ds: DurableStore) -> tuple[dict[tuple[int, int], dict[tuple[int, int, int], np.float32]],
                                          dict[tuple[int, int], int]]:
    """The durable store's rows and touches in the reference's shape."""
    b = ds.store.read_all()
    rows: dict[tuple[int, int], dict[tuple[int, int, int], np.float32]] = {}
    for i in range(b.num_rows):
        a, z = int(b.offsets[i]), int(b.offsets[i + 1])
        rows[(int(b.row_column[i]), int(b.row_feature[i]))] = dict(zip(
            zip(b.segment[a:z].tolist(), b.target_column[a:z].tolist(), b.target_feature[a:z].tolist()),
            b.strength[a:z]))
    _, touches = ds.store.row_touches(b.row_column, b.row_feature)
    return rows, {k: int(t) for k, t in zip(rows, touches.tolist())}


def same_rows(got: dict[Any, dict[Any, np.float32]], want: dict[Any, dict[Any, np.float32]]) -> bool:
    """Equal keys, and every strength equal bit for bit."""
    if got.keys() != want.keys():
        return False
    for key, row in want.items():
        other = got[key]
        if other.keys() != row.keys():
            return False
        if any(np.float32(other[t]).view(np.uint32) != np.float32(v).view(np.uint32) for t, v in row.items()):
            return False
    return True


def register_state(plan_seed: int, key: str, rnd: int) -> RegisterState:
    ballot, version, value = reg_accept_args(plan_seed, key, rnd)
    return RegisterState(ballot, ballot, version, value)


if __name__ == "__main__":
    zygote()
