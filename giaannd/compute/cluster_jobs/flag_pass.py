"""The flag pass of a cluster job and its fold: why any node's run of window ``w`` computes the same
bytes as the single-process core (docs/compute.md, "Exact results with learned flags").

Theory of operation
-------------------
The core encodes window ``w`` with the delimiter flags learned from the corpus prefix
``[0, w * K)``. Both kinds of flag are a function of that prefix alone (giaannd/model/columns.py
``encode``): a *deterministic* flag is fixed at the feature's first sighting to ``det_ctx`` of
that token, a test of the token itself; a *probabilistic* flag is found from one sentence's own
tokens (``_detect_probabilistic`` reads ``det_ctx``, never the stored flags). So:

1. **stage 0** (leased like any stage): window ``w``'s :class:`Findings` are what a *fresh*
   ``ColumnAssigner`` learns encoding the window with ``update_flags=True``: per feature, the
   deterministic flag at its first sighting in the window, and the probabilistic flags found. The
   findings are stored at ``job/<id>/f/<w>`` (a few KB);
2. **stage 1** (starts when every window of stage 0 is done): window ``w`` is encoded by a fresh
   assigner holding the fold of the findings of windows ``< w`` (:class:`FlagFold`: first sighting
   wins, in window order; probabilistic flags are a union, plus the flags storage held when the
   job was created), with ``update_flags=True`` exactly as the core does inside its own window.

Every run of window ``w``, on any node, after any crash, thus sends the same batch under the same
batch id, and the export equals the core's whatever the node count and the crash schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from giaannd.errors import CorruptDataError
from giaannd.model.columns import ColumnAssigner
from giaannd.model.lexicon import Lexicon
from giaannd.model.tokens import TaggedSentence

__all__ = [
    "INITIAL",
    "FlagFold",
    "Findings",
    "FindingsCorrupt",
    "decode_findings",
    "encode_findings",
    "findings_key",
    "initial_findings",
    "window_findings",
]

#: The findings slot of the flags storage held when the job was created (folded before window 0).
INITIAL: Final = -1


class Findings(msgspec.Struct, frozen=True, array_like=True):
    """What one window teaches a fresh assigner (module docstring), ids sorted."""

    det_true: list[int]
    det_false: list[int]
    prob: list[int]


class FindingsCorrupt(CorruptDataError):
    reason = "flag_findings_corrupt"


_ENC: Final = msgspec.msgpack.Encoder()
_DEC: Final = msgspec.msgpack.Decoder(Findings)


def findings_key(job_id: str, window: int) -> str:
    return f"job/{job_id}/f/{'init' if window == INITIAL else window}"


def window_findings(lexicon: Lexicon, sentences: Sequence[TaggedSentence]) -> Findings:
    """Stage 0 of window ``sentences`` (module docstring); synchronous (run it in a thread)."""
    assigner = ColumnAssigner(lexicon)
    for s in sentences:
        assigner.encode(s, update_flags=True)
    det = assigner.deterministic_flags
    return Findings(sorted(f for f, v in det.items() if v), sorted(f for f, v in det.items() if not v),
                    sorted(assigner.probabilistic_flags))


def encode_findings(findings: Findings) -> bytes:
    return _ENC.encode(findings)


def decode_findings(data: bytes) -> Findings:
    """Raises: FindingsCorrupt."""
    try:
        return _DEC.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FindingsCorrupt(f"register does not hold flag findings: {exc}") from None


class FlagFold:
    """The fold of findings in window order, over a prefix of the windows (``upto``).

    It keeps, per feature, the window that first taught it, so the assigner for any window ``w <=
    upto`` can be built from one fold (a window taken over later than the node's fold has moved
    on): memory is one entry per feature seen, whatever the corpus size.

    ``assigner`` copies nothing: it reads the fold's flags *as of* its window (``FlagsAsOf``)
    beneath the ones it learns (``ColumnAssigner.over``). The fold's maps are first-write-wins and
    only gain features at windows >= ``upto``, so the view of window ``w <= upto`` never changes
    while the fold moves on, and one fold serves every window at once. Why: building a fresh
    assigner per window walked every flag of the fold in Python (38 % of the compute node's CPU
    at 2·10^5 sentences, tools/bench/scale.py --cluster); an assigner advanced window by window
    and copied for each (the design until Nov 29) still copied every flag per window: 4-6 % of
    the compute node's CPU at 3·10^5 sentences, growing with the features seen.
    """

    def __init__(self) -> None:
        self.upto = INITIAL  # the next window to fold (INITIAL: not even the initial flags)
        self._det: dict[int, tuple[int, bool]] = {}
        self._prob: dict[int, int] = {}
        #: the assigner whose settings and contextual memos every window's assigner shares
        self._template: ColumnAssigner | None = None

    def add(self, window: int, findings: Findings) -> None:
        """Fold ``window``'s findings (the next one: ``window == upto``)."""
        if window != self.upto:
            raise ValueError(f"fold is at window {self.upto}, not {window}")
        for ids, flag in ((findings.det_true, True), (findings.det_false, False)):
            for fid in ids:
                if fid not in self._det:
                    self._det[fid] = (window, flag)
        for fid in findings.prob:
            self._prob.setdefault(fid, window)
        self.upto += 1

    def flags_before(self, window: int) -> tuple[set[int], dict[int, bool]]:
        """(probabilistic, deterministic) flags of the windows ``< window`` and the initial ones."""
        if window > self.upto:
            raise ValueError(f"fold is at window {self.upto}, cannot give window {window}")
        prob = {f for f, w in self._prob.items() if w < window}
        det = {f: flag for f, (w, flag) in self._det.items() if w < window}
        return prob, det

    def assigner(self, lexicon: Lexicon, window: int) -> ColumnAssigner:
        """A fresh assigner reading the flags of the windows ``< window`` (and the initial ones)
        beneath those it learns (class docstring); its contextual memos are shared with every other
        window's assigner of ``lexicon``."""
        if window > self.upto:
            raise ValueError(f"fold is at window {self.upto}, cannot give window {window}")
        if self._template is None or self._template.lexicon is not lexicon:
            self._template = ColumnAssigner(lexicon)
        return self._template.over(FlagsAsOf(self._det, self._prob, window))


class FlagsAsOf:
    """A fold's flags as of one window (``FlagFold.assigner``): the features the windows before it
    taught first. Reads the fold's first-write-wins maps (feature -> (window, flag), feature ->
    window), which later windows only add to."""

    __slots__ = ("_det", "_prob", "_window")

    def __init__(self, det: dict[int, tuple[int, bool]], prob: dict[int, int], window: int) -> None:
        self._det, self._prob, self._window = det, prob, window

    def deterministic(self, feature_id: int) -> bool | None:
        got = self._det.get(feature_id)
        return got[1] if got is not None and got[0] < self._window else None

    def probabilistic(self, feature_id: int) -> bool:
        taught = self._prob.get(feature_id)
        return taught is not None and taught < self._window


def initial_findings(prob: Iterable[int]) -> Findings:
    """The initial slot: the probabilistic flags storage held when the job was created."""
    return Findings([], [], sorted(prob))
