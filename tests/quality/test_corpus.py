"""The text corpus: the `bible` program's output becomes prose (no headers, no verse numbers,
wrapped lines joined), the held-out book is cut off the end, and a cached fetch needs no apt."""

from __future__ import annotations

import hashlib
import json

import pytest

from mamba_stream.quality import corpus as corpus_mod
from mamba_stream.quality.corpus import (
    CORPUS_PACKAGES,
    CorpusUnavailable,
    fetch_corpus,
    normalize,
    parse_bible,
    split_corpus,
    vocabulary,
    words,
)

#: the format of `bible -d .../bible.data gen1:1-rev22:21` (bible-kjv 4.38): a blank line, the
#: chapter's header, a blank line, verses indented two spaces with their wrapped lines flush left.
#: The wrapped line "were 12" looks like a header, and "1 Samuel" is a book whose name starts
#: with a digit.
EXCERPT = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

1 Samuel 3

  10 And the LORD came, and stood, and called as at other times, Samuel,
Samuel. Then Samuel answered, Speak; for thy servant heareth.
  11 And the sons of them that
were 12
in number went out.

Revelation 22

  20 He which testifieth these things saith, Surely I come quickly. Amen.
Even so, come, Lord Jesus.
  21 The grace of our Lord Jesus Christ be with you all. Amen.
"""

TRAIN = (
    "In the beginning God created the heaven and the earth.\n"
    "And the earth was without form, and void; and darkness was upon the face of the deep. "
    "And the Spirit of God moved upon the face of the waters.\n"
    "\n"
    "And the LORD came, and stood, and called as at other times, Samuel, Samuel. "
    "Then Samuel answered, Speak; for thy servant heareth.\n"
    "And the sons of them that were 12 in number went out.\n"
    "\n"
)
HELD_OUT = (
    "He which testifieth these things saith, Surely I come quickly. Amen. Even so, come, Lord Jesus.\n"
    "The grace of our Lord Jesus Christ be with you all. Amen.\n"
)


def test_the_verses_are_parsed_with_their_book_chapter_and_number():
    verses = parse_bible(EXCERPT)
    assert [(v.book, v.chapter, v.verse) for v in verses] == [
        ("Genesis", 1, 1), ("Genesis", 1, 2), ("1 Samuel", 3, 10), ("1 Samuel", 3, 11),
        ("Revelation", 22, 20), ("Revelation", 22, 21)]
    assert verses[3].text == "And the sons of them that were 12 in number went out."  # not a header


def test_normalized_text_is_a_line_per_verse_and_a_blank_line_between_chapters():
    assert normalize(parse_bible(EXCERPT)) == TRAIN + HELD_OUT
    assert normalize([]) == ""


def test_the_held_out_book_is_the_end_of_the_whole():
    train, held_out = split_corpus(parse_bible(EXCERPT))
    assert (train, held_out) == (TRAIN, HELD_OUT)
    verses = parse_bible(EXCERPT)
    with pytest.raises(ValueError, match="no book 'Jude'"):
        split_corpus(verses, "Jude")
    with pytest.raises(ValueError, match="not the last book"):
        split_corpus(verses, "Genesis")


@pytest.mark.parametrize("bad", ["  1 a verse before any header\n", "\nGenesis 1\n\nprose before a verse\n"])
def test_text_in_another_format_is_refused(bad):
    with pytest.raises(ValueError):
        parse_bible(bad)


def test_words_are_lower_cased_tokens_without_their_punctuation():
    assert words("And God said, Let there be light: (the LORD's) 'word'? --") == [
        "and", "god", "said", "let", "there", "be", "light", "the", "lord's", "word", "--"]
    assert vocabulary("b a, A b.") == ["a", "b"]


def test_a_cached_fetch_reads_the_cache_and_records_versions_and_sha256(tmp_path, monkeypatch):
    (tmp_path / "kjv.txt").write_text(EXCERPT)
    (tmp_path / "packages.json").write_text(json.dumps({"bible-kjv-text": "4.38", "bible-kjv": "4.38"}))
    monkeypatch.setattr(corpus_mod.shutil, "which", lambda _tool: None)  # no apt here: the cache must do
    c = fetch_corpus(tmp_path)
    assert (c.train, c.held_out) == (TRAIN, HELD_OUT)
    assert c.sha256 == hashlib.sha256((TRAIN + HELD_OUT).encode()).hexdigest()
    card = c.describe()
    assert card["packages"] == {"bible-kjv-text": "4.38", "bible-kjv": "4.38"} and card["held_out_book"] == "Revelation"
    assert card["train_bytes"] == len(TRAIN) and "expired" in card["licence"]
    assert card["words_sha256"] == hashlib.sha256(("\n".join(vocabulary(TRAIN)) + "\n").encode()).hexdigest()


def test_without_apt_the_error_names_the_packages_and_the_commands(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod.shutil, "which", lambda tool: None if tool == "apt-get" else f"/usr/bin/{tool}")
    with pytest.raises(CorpusUnavailable) as err:
        fetch_corpus(tmp_path / "cache")
    msg = str(err.value)
    assert all(p in msg for p in CORPUS_PACKAGES) and "need apt-get (" in msg and "apt-get download" in msg
    assert "dpkg-deb -x" in msg and "\n" not in msg
