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

    ``assigner`` is incremental: the fold keeps what each window taught first, and one *base*
    assigner holding the flags of the windows before some window ``b``; the assigner of window
    ``w >= b`` is the base advanced by what windows ``b..w-1`` taught, then copied (the copy is
    encoded with, the base never). Why: building a fresh assigner per window walked every flag
    of the fold in Python, a cost per window that grows with the features seen, so the cluster
    job's CPU per sentence grew with the corpus (tools/bench/scale.py --cluster: 38 % of the
    compute node's CPU at 2·10^5 sentences). A window before ``b`` (taken over after the node
    moved on) rebuilds the base from the start.
    """

    def __init__(self) -> None:
        self.upto = INITIAL  # the next window to fold (INITIAL: not even the initial flags)
        self._det: dict[int, tuple[int, bool]] = {}
        self._prob: dict[int, int] = {}
        #: per folded window, from INITIAL: the (feature, flag) pairs and probabilistic flags it
        #: taught first
        self._taught: list[tuple[dict[int, bool], list[int]]] = []
        #: an assigner holding exactly the flags of the windows < ``_base_at`` (never encoded with)
        self._base: ColumnAssigner | None = None
        self._base_at = INITIAL

    def add(self, window: int, findings: Findings) -> None:
        """Fold ``window``'s findings (the next one: ``window == upto``)."""
        if window != self.upto:
            raise ValueError(f"fold is at window {self.upto}, not {window}")
        det: dict[int, bool] = {}
        for ids, flag in ((findings.det_true, True), (findings.det_false, False)):
            for fid in ids:
                if fid not in self._det:
                    self._det[fid] = (window, flag)
                    det[fid] = flag
        prob = [fid for fid in findings.prob if fid not in self._prob]
        for fid in prob:
            self._prob[fid] = window
        self._taught.append((det, prob))
        self.upto += 1

    def flags_before(self, window: int) -> tuple[set[int], dict[int, bool]]:
        """(probabilistic, deterministic) flags of the windows ``< window`` and the initial ones."""
        if window > self.upto:
            raise ValueError(f"fold is at window {self.upto}, cannot give window {window}")
        prob = {f for f, w in self._prob.items() if w < window}
        det = {f: flag for f, (w, flag) in self._det.items() if w < window}
        return prob, det

    def assigner(self, lexicon: Lexicon, window: int) -> ColumnAssigner:
        """A fresh assigner holding the flags of the windows ``< window`` (class docstring: made
        from the base, advanced to ``window``)."""
        if window > self.upto:
            raise ValueError(f"fold is at window {self.upto}, cannot give window {window}")
        if self._base is None or self._base.lexicon is not lexicon or window < self._base_at:
            self._base, self._base_at = ColumnAssigner(lexicon), INITIAL
        base = self._base
        for w in range(self._base_at, window):
            det, prob = self._taught[w - INITIAL]
            base.add_probabilistic_flags(prob)
            base.add_deterministic_flags(det)
        self._base_at = window
        return base.copy()


def initial_findings(prob: Iterable[int]) -> Findings:
    """The initial slot: the probabilistic flags storage held when the job was created."""
    return Findings([], [], sorted(prob))
