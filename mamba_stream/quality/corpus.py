"""The English text the `kjv-mamba2` preset is trained on: the King James Version of the Bible, as
Debian's `bible-kjv-text` package holds it, decoded by the `bible` program of `bible-kjv`.

    python -m mamba_stream.quality.corpus --cache build/corpus            # fetch, normalize, summarize
    python -m mamba_stream.quality.corpus --words tests/quality/kjv-words.txt

The text's copyright expired (a translation of 1611; the package's copyright file: "The copyright
for the King James Version text of the Bible is expired"); the package's software is GPL-2+ and
its data file's legend allows "unrestricted use ... Users may copy, modify or distribute this file
at will". Fetching needs `apt-get` and `dpkg-deb` (a Debian or Ubuntu machine with package lists),
no root: `apt-get download` and `dpkg-deb -x` into the cache directory. Pure Python otherwise.

Normalized text: one line per verse, a blank line between chapters; no chapter headers, no verse
numbers, wrapped lines re-joined. Headers and numbers are the edition's apparatus, not prose: a
byte model trained on them spends capacity on counting, and its samples print "Genesis 12" and
"  13 " in the middle of sentences. The verse stays a line because it is the text's own unit
(a sentence or two), so samples read like the source.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from mamba_stream.failures import Failure

__all__ = [
    "CORPUS_LICENCE",
    "CORPUS_PACKAGES",
    "HELD_OUT_BOOK",
    "Corpus",
    "CorpusUnavailable",
    "Verse",
    "fetch_corpus",
    "normalize",
    "parse_bible",
    "split_corpus",
    "vocabulary",
    "words",
    "words_file",
]

log = logging.getLogger(__name__)

#: the Debian packages: the text and the program that decodes its compressed data file
CORPUS_PACKAGES = ("bible-kjv-text", "bible-kjv")
CORPUS_LICENCE = (
    "public domain: the King James Version's copyright expired (1611), as bible-kjv-text's copyright file "
    "says; its data file's legend: 'unrestricted use ... Users may copy, modify or distribute this file at "
    "will'; the packages' software is GPL-2+"
)
#: the book held out for validation: the last, so the training text is one prefix of the whole
HELD_OUT_BOOK = "Revelation"
#: every verse of the 66 books, in order (the `bible` program's reference syntax)
_ALL = "gen1:1-rev22:21"
_FETCH_HINT = (
    "apt-get download bible-kjv bible-kjv-text && dpkg-deb -x bible-kjv_*.deb x && "
    "dpkg-deb -x bible-kjv-text_*.deb x && x/usr/bin/bible -d x/usr/lib/bible.data gen1:1-rev22:21 > kjv.txt"
)
#: stripped from a whitespace-separated token's ends to make it a word (`words`)
_PUNCT = ".,;:?!()'\""
_HEADER = re.compile(r"^(?P<book>\S.*?) (?P<chapter>\d+)$")
_VERSE = re.compile(r"^  (?P<verse>\d+) (?P<text>.*)$")


class CorpusUnavailable(Failure):
    """The text cannot be fetched here (no apt-get / dpkg-deb, no package lists, a failed run)."""


@dataclass(frozen=True)
class Verse:
    book: str
    chapter: int
    verse: int
    text: str


@dataclass(frozen=True)
class Corpus:
    """The normalized text, split: `train` + `held_out` == the whole (the held-out book is last)."""

    train: str
    held_out: str
    packages: dict[str, str]  # Debian package -> version
    sha256: str  # of the whole normalized text, UTF-8 (ASCII in fact)

    def describe(self) -> dict[str, object]:
        """What a training card records about the text."""
        return {
            "source": "King James Version of the Bible (Debian packages " + ", ".join(
                f"{p} {v}" for p, v in self.packages.items()) + ")",
            "packages": self.packages,
            "licence": CORPUS_LICENCE,
            "normalization": "one line per verse, a blank line between chapters; no headers or verse numbers",
            "sha256": self.sha256,
            "held_out_book": HELD_OUT_BOOK,
            "train_bytes": len(self.train),
            "held_out_bytes": len(self.held_out),
            "words_sha256": hashlib.sha256(words_file(self.train).encode()).hexdigest(),
        }


def parse_bible(raw: str) -> list[Verse]:
    """The verses of the `bible` program's output: a blank line, a header "<Book> <chapter>", a
    blank line, then each verse as "  <n> <text>" with its wrapped lines unindented below it."""
    verses: list[Verse] = []
    book, chapter, after_blank = "", 0, True
    for line in raw.split("\n"):
        if not line.strip():
            after_blank = True
            continue
        header = _HEADER.match(line) if after_blank else None  # a wrapped line never follows a blank one
        after_blank = False
        if header:
            book, chapter = header["book"], int(header["chapter"])
            continue
        verse = _VERSE.match(line)
        if verse:
            if not book:
                raise ValueError(f"a verse before any chapter header: {line!r}")
            verses.append(Verse(book, chapter, int(verse["verse"]), verse["text"].strip()))
        elif verses:
            last = verses[-1]
            verses[-1] = Verse(last.book, last.chapter, last.verse, f"{last.text} {line.strip()}")
        else:
            raise ValueError(f"text before the first verse: {line!r}")
    return verses


def normalize(verses: list[Verse]) -> str:
    """One line per verse, single spaces, a blank line between chapters, a final newline."""
    out: list[str] = []
    prev: tuple[str, int] | None = None
    for v in verses:
        if prev is not None and (v.book, v.chapter) != prev:
            out.append("")
        out.append(" ".join(v.text.split()))
        prev = (v.book, v.chapter)
    return "\n".join(out) + "\n" if out else ""


def split_corpus(verses: list[Verse], held_out_book: str = HELD_OUT_BOOK) -> tuple[str, str]:
    """(training text, held-out text): normalize(verses) cut where `held_out_book` begins, which
    must be the last book (so the two concatenate to the whole, whose sha256 the card records)."""
    first = next((i for i, v in enumerate(verses) if v.book == held_out_book), None)
    if first is None:
        raise ValueError(f"no book {held_out_book!r} in the text")
    if any(v.book != held_out_book for v in verses[first:]):
        raise ValueError(f"{held_out_book!r} is not the last book")
    whole = normalize(verses)
    train = normalize(verses[:first]) + "\n"  # the chapter break before the held-out book
    if not whole.startswith(train):
        raise AssertionError("the training part is not a prefix of the whole")  # normalize is per verse
    return train, whole[len(train):]


def words(text: str) -> list[str]:
    """Whitespace-separated tokens, lower-cased, punctuation stripped from their ends (empty ones dropped)."""
    return [w for t in text.split() if (w := t.strip(_PUNCT).lower())]


def vocabulary(text: str) -> list[str]:
    """The distinct `words` of `text`, sorted."""
    return sorted(set(words(text)))


def words_file(text: str) -> str:
    """`vocabulary(text)`, one word a line (what `--words` writes; the card records its sha256)."""
    return "\n".join(vocabulary(text)) + "\n"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise CorpusUnavailable(f"{' '.join(cmd)} failed ({exc.returncode}): {' | '.join(tail)}; "
                                "with no package lists, run apt-get update first") from exc


def fetch_corpus(cache: Path = Path("build/corpus")) -> Corpus:
    """Download the packages into `cache` (once), decode every verse, normalize and split.

    Raises CorpusUnavailable, naming the packages and the commands, where apt-get or dpkg-deb is
    missing or fails.
    """
    cache = cache.resolve()  # the commands run inside it
    cache.mkdir(parents=True, exist_ok=True)
    raw_path, meta_path = cache / "kjv.txt", cache / "packages.json"
    if not (raw_path.is_file() and meta_path.is_file()):
        missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
        if missing:
            raise CorpusUnavailable(
                f"the training text comes from the Debian packages {' and '.join(CORPUS_PACKAGES)}, which need "
                f"{' and '.join(missing)} (a Debian or Ubuntu machine): {_FETCH_HINT}")
        for old in cache.glob("*.deb"):
            old.unlink()  # a half-finished earlier fetch: its versions may not be the ones the lists name now
        _run(["apt-get", "download", *CORPUS_PACKAGES], cache)
        packages: dict[str, str] = {}
        root = cache / "x"
        for package in CORPUS_PACKAGES:
            [deb] = cache.glob(f"{package}_*.deb")
            packages[package] = _run(["dpkg-deb", "-f", str(deb), "Version"], cache).stdout.decode().strip()
            _run(["dpkg-deb", "-x", str(deb), str(root)], cache)
        # the data file's path relative to the cache, where the command runs: `bible -d` refuses an
        # absolute one ("Cannot open data file", bible-kjv 4.38)
        data = str((root / "usr/lib/bible.data").relative_to(cache))
        decoded = _run([str(root / "usr/bin/bible"), "-d", data, _ALL], cache).stdout
        raw_path.write_bytes(decoded)
        meta_path.write_text(json.dumps(packages, indent=2) + "\n")  # last: its presence marks a whole fetch
        log.info("fetched %s into %s (%d bytes decoded)", packages, cache, len(decoded))
    verses = parse_bible(raw_path.read_text(encoding="utf-8"))
    train, held_out = split_corpus(verses)
    sha = hashlib.sha256((train + held_out).encode()).hexdigest()
    return Corpus(train, held_out, json.loads(meta_path.read_text()), sha)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(prog="python -m mamba_stream.quality.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("build/corpus"), help="where the packages are kept")
    ap.add_argument("--words", type=Path, help="write the training text's vocabulary here, one word a line")
    ap.add_argument("--out", type=Path, help="write the normalized text (training part, then held-out) here")
    a = ap.parse_args(argv)
    try:
        corpus = fetch_corpus(a.cache)
    except CorpusUnavailable as exc:
        raise SystemExit(f"error: {exc}") from None
    if a.words:
        a.words.write_text(words_file(corpus.train))
    if a.out:
        a.out.write_text(corpus.train + corpus.held_out)
    print(json.dumps({k: v for k, v in asdict(corpus).items() if k not in ("train", "held_out")}
                     | {"train_bytes": len(corpus.train), "held_out_bytes": len(corpus.held_out)}))


if __name__ == "__main__":
    main()
