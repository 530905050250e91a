"""Build the bundled corpus: decode the World English Bible SWORD module, tag it, write CoNLL-U.

Usage (root)::

    apt-get update && apt-get install -y sword-text-web
    python -m tools.prepare_corpus \\
        --excerpt giaannd/data/web_excerpt.conllu.gz --excerpt-sentences 10000 \\
        --full /var/tmp/web_full.conllu.gz          # the whole Bible, ~55k sentences, for benchmarks

The World English Bible is in the public domain (see docs/corpus.md for the attribution text).

The SWORD ``zText`` format (own reading of the on-disk layout, stdlib only): per testament
(``ot``, ``nt``) three files. ``*.bzs`` is an array of little-endian ``(offset, compressed size,
uncompressed size)`` uint32 triples, one per zlib block stored in ``*.bzz``. ``*.bzv`` is an array of
``(block number: uint32, offset: uint32, size: uint16)`` entries, one per index slot of the KJV
versification (module/testament/book/chapter headings and verses); a slot's text is bytes
``[offset, offset+size)`` of its decompressed block, UTF-8 OSIS markup. A slot holding a
``<chapter .../>`` element starts a new chapter (any text in it belongs to that chapter): we join the verses of one
chapter into one text so that spaCy's sentence
splitter sees sentences that run across verse boundaries.

Cleaning: footnotes (``<note>``) and headings (``<title>``) are dropped (a space is kept where a
footnote sat between two words), all other tags are removed, entities unescaped, whitespace
collapsed. The front matter before Genesis 1 (a preface) and the glossary appended to the last verse
of Revelation are left out.
"""

from __future__ import annotations

import argparse
import html
import re
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from giaannd.model.tokens import TaggedSentence, TaggerUnavailableError, load_english, tag_texts, write_conllu

DEFAULT_MODULE_DIR = Path("/usr/share/sword/modules/texts/ztext/engWEB2015eb")
TESTAMENTS = ("ot", "nt")
#: Text that starts the glossary appended to the very last verse.
GLOSSARY_MARKER = "The following words used in the World English Bible"
#: spaCy batch size in chapters (~700 tokens each): bounds the tagger's working memory.
_CHAPTERS_PER_BATCH = 16
_BLOCK = struct.Struct("<III")
_SLOT = struct.Struct("<IIH")

_NOTE_BETWEEN_WORDS = re.compile(r"</w>(?:<note\b.*?</note>)+<w", re.S)
_DROPPED_ELEMENTS = re.compile(r"<(note|title)\b[^>]*?(?<!/)>.*?</\1>", re.S)
_TAG = re.compile(r"<[^>]*>")
_CHAPTER = re.compile(r"<chapter\b[^>]*\bsID=")


class ModuleFormatError(ValueError):
    """The SWORD module files are missing or inconsistent."""


def read_slots(module_dir: Path, testament: str) -> Iterator[str]:
    """Yield the raw OSIS text of every non-empty index slot of one testament, in order."""
    try:
        bzs, bzv, bzz = ((module_dir / f"{testament}.{ext}").read_bytes() for ext in ("bzs", "bzv", "bzz"))
    except FileNotFoundError as exc:
        raise ModuleFormatError(f"{exc.filename} not found: apt-get update && apt-get install -y "
                                "sword-text-web (or pass --module-dir)") from exc
    if len(bzs) % _BLOCK.size or len(bzv) % _SLOT.size:
        raise ModuleFormatError(f"{module_dir}/{testament}.bzs/.bzv sizes are not whole records")
    blocks = [_BLOCK.unpack_from(bzs, i) for i in range(0, len(bzs), _BLOCK.size)]
    current, data = -1, b""
    for pos in range(0, len(bzv), _SLOT.size):
        block, offset, size = _SLOT.unpack_from(bzv, pos)
        if size == 0:
            continue
        if block >= len(blocks):
            raise ModuleFormatError(f"{testament}.bzv slot {pos // _SLOT.size}: block {block} out of range")
        if block != current:
            start, csize, usize = blocks[block]
            data = zlib.decompress(bzz[start:start + csize])
            if len(data) != usize:
                raise ModuleFormatError(f"{testament}.bzz block {block}: size {len(data)} != {usize}")
            current = block
        if offset + size > len(data):
            raise ModuleFormatError(f"{testament}.bzv slot {pos // _SLOT.size}: past end of block")
        yield data[offset:offset + size].decode("utf-8")


def clean_osis(osis: str) -> str:
    """Plain text of one OSIS fragment (footnotes and headings removed)."""
    text = _NOTE_BETWEEN_WORDS.sub("</w> <w", osis)
    text = _DROPPED_ELEMENTS.sub(" ", text)
    text = _TAG.sub("", text)
    return " ".join(html.unescape(text).split())


def chapters(module_dir: Path, *, per_verse: bool = False) -> Iterator[str]:
    """The clean text of every chapter of the Bible, Genesis 1 to Revelation 22.

    Args:
        per_verse: yield every verse as its own text instead (sentences then never cross a verse
            boundary; this is how corpus-and-tagging.md counted 55k sentences).
    """
    for testament in TESTAMENTS:
        started = False
        verses: list[str] = []
        for raw in read_slots(module_dir, testament):
            if _CHAPTER.search(raw):
                if verses:
                    yield " ".join(verses)
                verses = []
                started = True
            elif not started:  # module/testament headers and the preface before Genesis 1
                continue
            text = clean_osis(raw)
            cut = text.find(GLOSSARY_MARKER)
            if cut >= 0:
                text = text[:cut].rstrip()
            if text and per_verse:
                yield text
            elif text:
                verses.append(text)
        if verses:
            yield " ".join(verses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Decode, tag and write the World English Bible as CoNLL-U.")
    ap.add_argument("--module-dir", type=Path, default=DEFAULT_MODULE_DIR)
    ap.add_argument("--excerpt", type=Path, help="write the first --excerpt-sentences sentences here")
    ap.add_argument("--excerpt-sentences", type=int, default=10_000)
    ap.add_argument("--full", type=Path, help="write the whole tagged corpus here")
    ap.add_argument("--max-chapters", type=int, default=None, help="stop after this many chapters")
    ap.add_argument("--per-verse", action="store_true",
                    help="tag each verse separately (default: whole chapters, so sentences may span verses)")
    args = ap.parse_args(argv)
    if args.excerpt is None and args.full is None:
        ap.error("give --excerpt and/or --full")
    try:
        return _prepare(args)
    except (ModuleFormatError, TaggerUnavailableError, OSError) as exc:  # the host's files, not a bug
        print(f"prepare_corpus: error: {exc}", file=sys.stderr)
        return 2


def _prepare(args: argparse.Namespace) -> int:
    texts = list(chapters(args.module_dir, per_verse=args.per_verse))[: args.max_chapters]
    if args.full is None:  # the excerpt needs only the first chapters; stop tagging early
        texts = _enough_chapters(texts, args.excerpt_sentences)
    nlp = load_english()
    t0, c0 = time.perf_counter(), time.process_time()
    sentences: list[TaggedSentence] = []
    batch = 256 if args.per_verse else _CHAPTERS_PER_BATCH
    for sentence in tag_texts(texts, nlp=nlp, batch_size=batch):
        sentences.append(sentence)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ntok = sum(len(s) for s in sentences)
    print(f"tagged {len(texts)} texts: {len(sentences)} sentences, {ntok} tokens in {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU ({len(sentences) / cpu:.0f} sentences/CPU-s, {ntok / cpu:.0f} tokens/CPU-s)",
          file=sys.stderr)
    if args.full is not None:
        write_conllu(sentences, args.full)
        print(f"wrote {args.full}", file=sys.stderr)
    if args.excerpt is not None:
        n = write_conllu(sentences[: args.excerpt_sentences], args.excerpt)
        print(f"wrote {args.excerpt}: {n} sentences", file=sys.stderr)
    return 0


def _enough_chapters(texts: list[str], sentences: int) -> list[str]:
    """A prefix of chapters that surely holds `sentences` sentences (~1 per 22 words, 2x margin)."""
    words, out = 0, []
    for text in texts:
        out.append(text)
        words += text.count(" ") + 1
        if words > sentences * 40:
            break
    return out


if __name__ == "__main__":
    raise SystemExit(main())
