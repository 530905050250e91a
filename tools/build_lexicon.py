"""Build giaannd's ever-POS lexicon (giaannd/data/ever_pos.tsv.gz) from WordNet 3.0 and closed-class lists.

Usage (root; installs the Debian package if missing is up to you)::

    apt-get update && apt-get install -y wordnet-base
    python -m tools.build_lexicon [--wordnet-dir /usr/share/wordnet] [--out giaannd/data/ever_pos.tsv.gz]

What goes in (giaann-algorithm.md §2.4 asks "can this word, or its lemma, ever be VERB / ADP /
CCONJ / SCONJ?"):

* **VERB**: every single-word lemma of WordNet 3.0 ``index.verb``; every inflected form of
  ``verb.exc`` whose base is such a lemma (irregular forms: "went", "sang", "abode"; a base that is
  no verb lemma, e.g. "easy" of "easied", "may" of "might", "pretty" of "prettied", adds nothing:
  WordNet lists those exceptions for lemmatisation, and v1 of this builder wrongly made every
  base a verb, so "may" became a deterministic delimiter); regular inflections generated here from
  each lemma (-s/-es/-ies, -ed/-d/-ied, -ing, with consonant doubling in both variants when the
  stress cannot be known: "prefer" -> "preferred" and "prefered"); the verb contractions
  ('s 're 'm 've 'd) that Penn Treebank tags VBZ/VBP/VBD.
* **ADP / SCONJ / CCONJ / AUX**: closed-class lists written for this project from the Universal
  Dependencies English guidelines (https://universaldependencies.org/en/pos/ADP.html, SCONJ.html,
  CCONJ.html, AUX.html) and the Penn Treebank tagging guidelines (Santorini 1990). Following the
  reference's PTB -> UPOS mapping (IN -> ADP *and* SCONJ, TO -> ADP, CC -> CCONJ), every word that PTB
  tags IN gets both ADP and SCONJ: prepositions ("on") and subordinators ("because", "if", "that").
  Wh-subordinators ("when", "where") are PTB WRB -> ADV in the reference and are left out.
* Manual additions of the reference: "towards", "afterwards" as ADP.

The output is deterministic (sorted, gzip mtime 0): the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from giaannd.model.lexicon import DEFAULT_LEXICON_FILE, Lexicon, PosClass

BUILDER_VERSION = "2"
DEFAULT_WORDNET_DIR = Path("/usr/share/wordnet")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "giaannd" / "data" / DEFAULT_LEXICON_FILE

# --- closed classes (UD English guidelines; PTB tags in comments) ------------------------------

#: Prepositions (UD ADP; PTB IN, and TO for "to").
PREPOSITIONS = """
aboard about above absent across after against albeit along alongside amid amidst among amongst
around as astride at atop bar barring before behind below beneath beside besides between betwixt
beyond but by circa concerning considering despite down during except excepting excluding failing
following for from given in including inside into like minus near neath next notwithstanding of off
on onto opposite out outside over pace past pending per plus re regarding respecting round sans save
saving since than through throughout thru till to toward towards under underneath unlike until unto
up upon versus via vis-a-vis with within without worth ago o'er 'til whilst afterwards
""".split()

#: Subordinating conjunctions that PTB tags IN (UD SCONJ).
SUBORDINATORS = """
after although albeit as because before cos 'cause cause except if lest like once provided
providing seeing since so than that tho though till unless until whereas whether while whilst
""".split()

#: Coordinating conjunctions (UD CCONJ; PTB CC).
COORDINATORS = """
and or but nor yet either neither both plus minus versus vs vs. & 'n 'n' n' and/or et
""".split()

#: Auxiliaries (UD AUX: be, have, do, modals). Informational: not a delimiter class.
AUXILIARIES = """
am are is was were be being been 's 're 'm 'd 've 'll ai do does did doing done have has had having
can could may might must shall should will would ought need dare ca wo sha 'd
""".split()

#: Verb contractions that PTB tags VBZ / VBP / VBD (the reference sees them as VERB in the treebank).
VERB_CONTRACTIONS = ["'s", "'re", "'m", "'ve", "'d", "ai"]

_VOWELS = set("aeiou")


def _is_cvc(word: str) -> bool:
    """Ends consonant-vowel-consonant with a doublable last consonant (stop -> stopping)."""
    if len(word) < 3:
        return False
    a, b, c = word[-3], word[-2], word[-1]
    return a not in _VOWELS and b in _VOWELS and c not in _VOWELS and c not in "wxy"


def _vowel_groups(word: str) -> int:
    groups, prev = 0, False
    for ch in word:
        cur = ch in _VOWELS or ch == "y"
        if cur and not prev:
            groups += 1
        prev = cur
    return groups


def inflections(lemma: str) -> set[str]:
    """Regular English verb forms of a lemma (a superset: both doubling variants when unsure)."""
    if not lemma.isalpha():
        return set()
    w = lemma
    out: set[str] = set()
    # third person singular
    if w.endswith(("s", "x", "z", "ch", "sh", "o")):
        out.add(w + "es")
    elif w.endswith("y") and len(w) > 1 and w[-2] not in _VOWELS:
        out.add(w[:-1] + "ies")
    else:
        out.add(w + "s")
    # past / past participle and present participle
    if w.endswith("e"):
        out.add(w + "d")
        if w.endswith("ie"):
            out.add(w[:-2] + "ying")
        elif w.endswith(("ee", "ye", "oe")):
            out.add(w + "ing")
        else:
            out.add(w[:-1] + "ing")
            out.add(w + "ing")  # singe -> singeing, dye-like exceptions; harmless superset
    elif w.endswith("y") and len(w) > 1 and w[-2] not in _VOWELS:
        out.add(w[:-1] + "ied")
        out.add(w + "ing")
    else:
        out.add(w + "ed")
        out.add(w + "ing")
        if _is_cvc(w):
            doubled = w + w[-1]
            out.add(doubled + "ed")
            out.add(doubled + "ing")
            if _vowel_groups(w) == 1:  # monosyllable: only the doubled form is right
                out.discard(w + "ed")
                out.discard(w + "ing")
        if w.endswith("c"):  # panic -> panicked
            out.add(w + "ked")
            out.add(w + "king")
    return out


def read_index_verb(path: Path) -> list[str]:
    """Single-word verb lemmas from a WordNet ``index.verb`` (licence header lines start with spaces)."""
    lemmas = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line or line[0] == " ":
            continue
        lemma = line.split(" ", 1)[0]
        if "_" not in lemma:
            lemmas.append(lemma)
    return lemmas


def read_verb_exc(path: Path) -> list[tuple[str, str]]:
    """(inflected form, base) pairs of single words from a WordNet ``verb.exc``."""
    pairs: list[tuple[str, str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) >= 2 and "_" not in parts[0]:
            pairs.extend((parts[0], base) for base in parts[1:] if "_" not in base)
    return pairs


def _package_version(name: str) -> str:
    try:
        res = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True,
                             text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return res.stdout.strip() or "unknown"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(wordnet_dir: Path) -> Lexicon:
    """Build the lexicon from a WordNet 3.0 database directory and the closed-class lists."""
    index_verb, verb_exc = wordnet_dir / "index.verb", wordnet_dir / "verb.exc"
    for f in (index_verb, verb_exc):
        if not f.is_file():  # a host environment error: one line, exit status 2
            print(f"build_lexicon: error: {f} not found: apt-get update && apt-get install -y wordnet-base "
                  "(or pass --wordnet-dir)", file=sys.stderr)
            raise SystemExit(2)
    table: dict[str, PosClass] = {}

    def add(words: Iterable[str], cls: PosClass) -> None:
        for w in words:
            key = w.lower()
            table[key] = table.get(key, PosClass.NONE) | cls

    lemmas = read_index_verb(index_verb)
    add(lemmas, PosClass.VERB)
    for lemma in lemmas:
        add(inflections(lemma), PosClass.VERB)
    verbs = set(lemmas)
    exc = [(form, base) for form, base in read_verb_exc(verb_exc) if base in verbs]
    add((form for form, _ in exc), PosClass.VERB)
    add(VERB_CONTRACTIONS, PosClass.VERB)
    ptb_in = PosClass.ADP | PosClass.SCONJ  # the reference maps PTB IN to both
    add(PREPOSITIONS, ptb_in)
    add(SUBORDINATORS, ptb_in)
    add(COORDINATORS, PosClass.CCONJ)
    add(AUXILIARIES, PosClass.AUX)
    header = [
        f"builder: tools/build_lexicon.py v{BUILDER_VERSION}",
        f"source: WordNet 3.0, Debian wordnet-base {_package_version('wordnet-base')} "
        "(Princeton WordNet licence)",
        f"source: index.verb sha256 {_sha256(index_verb)} ({len(lemmas)} single-word lemmas)",
        f"source: verb.exc sha256 {_sha256(verb_exc)} ({len(exc)} irregular pairs whose base is a verb lemma)",
        "source: generated regular inflections (-s/-es/-ies, -ed/-d/-ied, -ing, doubling)",
        "source: closed-class lists (UD English ADP/SCONJ/CCONJ/AUX guidelines; PTB IN -> ADP+SCONJ)",
        "flags: V=VERB A=ADP C=CCONJ S=SCONJ X=AUX",
    ]
    return Lexicon(table, header=header)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wordnet-dir", type=Path, default=DEFAULT_WORDNET_DIR)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    lexicon = build(args.wordnet_dir)
    data = gzip.compress(lexicon.dumps().encode("utf-8"), compresslevel=9, mtime=0)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(args.out)
    counts = {c.name: lexicon.count(c) for c in PosClass if c and c.name}
    print(f"wrote {args.out}: {len(lexicon)} words, {len(data)} bytes; {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
