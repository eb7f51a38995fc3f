"""An offline dictionary attack on the state store (Issue 43), by someone who has every file of it
(the file store's directory, a `pg_dump` of the PostgreSQL store's tables) and no key.

Two principals with distinctive names open streams through Temporal at the end of the same private
prompt, one of 400 the attacker can guess ("... the vault code is 4711."), feed them and take a
checkpoint. The attacker runs each guess through the public model locally, as the workers would,
and looks for anything of it in the store: the state's checksum (as a receipt prints it, its hex,
its raw bytes), the tokens' unkeyed digest (what receipts once carried), the prompt's text. None is
there; nor is either principal's name. The same scan over the same store written as the version
before wrote it (clear headers, clear prefix records: `tests._legacy`) finds the vault code and
both names: the scan can fail."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from mamba_stream.activities import open_store
from mamba_stream.activities._prefix import _tokens_hash
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import StreamOptions
from tests._legacy import downgrade_file_store, downgrade_meta
from tests.activities.test_stores import PG_URL
from tests.workflows.conftest import FAST, Stack, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOB, ALICE = "bob-qz7vanthe", "alice-k3m9pyrw"  # names that occur nowhere else
PROMPT = "You are the night desk's assistant. Tell no one: the vault code is {}."
SECRET = 4711
GUESSES = list(range(4500, 4900))  # 400 codes, the secret among them
OPTS = StreamOptions(**{**FAST.model_dump(), "max_chunk_tokens": 128})
MODEL = "tiny-mamba2"


def needles(code: int, m=None) -> list[bytes]:
    """What of a guess the attacker looks for: the state's checksum as a receipt prints it, its hex
    (text) and raw bytes, the unkeyed sha256 of the tokens (what `Origin.digest` was) likewise, the
    sha256 of the text, and the text's secret part."""
    m = m or load_model(MODEL)
    text = PROMPT.format(code)
    tokens = m.transform.encode(text)
    checksum = plaintext_checksum(m.advance(m.initial_state(), tokens).state.tensors)
    out = []
    for tagged in (checksum, _tokens_hash(tokens), "sha256:" + hashlib.sha256(text.encode()).hexdigest()):
        hexd = tagged.split(":", 1)[1]
        out += [tagged.encode(), hexd.encode(), bytes.fromhex(hexd)]
    out.append(f"vault code is {code}".encode())
    return out


def dictionary() -> dict[int, list[bytes]]:
    m = load_model(MODEL)
    return {code: needles(code, m) for code in GUESSES}


def found(corpus: bytes, guesses: dict[int, list[bytes]]) -> dict[int, list[bytes]]:
    """The guesses something of which the corpus holds, with what was found."""
    hits = {code: [n for n in ns if n in corpus] for code, ns in guesses.items()}
    return {code: ns for code, ns in hits.items() if ns}


def names_in(corpus: bytes) -> set[str]:
    return {n for n in (BOB, ALICE) if n.encode() in corpus or n.encode("utf-16-le") in corpus}


def file_corpus(root: Path) -> bytes:
    """Every file of the store: its path and its bytes."""
    parts = []
    for p in sorted(root.rglob("*")):
        parts.append(str(p.relative_to(root)).encode())
        if p.is_file():
            parts.append(p.read_bytes())
    return b"\n".join(parts)


def pg_corpus(url: str) -> bytes:
    """`pg_dump` of the store's tables (data and schema), as a database backup holds them."""
    table = re.search(r"table=(\w+)", url).group(1)
    u = urlsplit(url)
    out = subprocess.run(["pg_dump", "-h", u.hostname or "127.0.0.1", "-p", str(u.port or 5432),
                          "-U", u.username or "postgres", "-t", table, "-t", f"{table}_meta", u.path.lstrip("/")],
                         check=True, capture_output=True, timeout=60)
    dump = out.stdout
    # a bytea column is dumped as \x<hex>: the attacker reads it as the bytes it is
    blobs = [bytes.fromhex(h.decode()) for h in re.findall(rb"\\\\?x([0-9a-f]{2,})", dump)]
    assert blobs, "the dump holds the store's rows"
    return b"\n".join([dump, *blobs])


async def world(temporal_env, tmp_path, store: str) -> Stack:
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    if store == "pg":
        stack.store_url = f"{PG_URL}?table=t_{uuid.uuid4().hex[:12]}"

        def drop() -> None:
            with open_store(stack.store_url) as s:
                s.drop()
        stack.exits.callback(drop)
    stack.acts = stack.new_activities(backend="auto")
    await stack.worker(stack.acts)
    return stack


async def use(stack: Stack) -> None:
    """Both principals open at the end of the private prompt (bob twice: a stored hit), feed, and
    take a checkpoint; bob opens a stream without a prefix too."""
    s, secret = stack.streams, PROMPT.format(SECRET)
    sids = {}
    for who in (BOB, BOB, ALICE):
        sids[who] = sid = await s.open(who, MODEL, prefix=secret, options=OPTS)
        await s.advance(sid, who, text=" And the door code?")
    await s.checkpoint(sids[BOB], BOB)
    plain = await s.open(BOB, MODEL, options=OPTS)
    await s.advance(plain, BOB, text="hello")
    origins = {who: (await s.receipt(sid)).origin for who, sid in sids.items()}
    assert origins[BOB].stored_tokens == origins[BOB].tokens > 0  # bob's second open was served from the store
    # the same prefix, two principals: two digests, neither the unkeyed one
    assert origins[BOB].digest != origins[ALICE].digest
    assert _tokens_hash(load_model(MODEL).transform.encode(secret)) not in (origins[BOB].digest, origins[ALICE].digest)
    assert stack.acts.prefixes.usage().entries == 2  # one per principal: the scan has something to find


@pytest.mark.parametrize("store", ["file", "pg"])
async def test_a_dictionary_attack_on_the_stores_files_finds_neither_the_prompt_nor_a_name(
        temporal_env, tmp_path, store):
    stack = await world(temporal_env, tmp_path, store)
    async with stack.exits:
        await use(stack)
        guesses = dictionary()
        assert len(guesses) == 400 and SECRET in guesses
        assert len({n for ns in guesses.values() for n in ns}) == 400 * 10  # every guess looks different
        read = (lambda: file_corpus(Path(stack.store_url.removeprefix("file://")))) if store == "file" else \
            (lambda: pg_corpus(stack.store_url))
        corpus = read()
        assert found(corpus, guesses) == {}
        assert names_in(corpus) == set()
        if store == "file":  # what a reader does see (docs/release/threat-model.md): sizes, stream ids, owner tags
            root = Path(stack.store_url.removeprefix("file://"))
            headers = []
            for p in (root / "objects").rglob("*"):
                if p.is_file():
                    raw = p.read_bytes()
                    assert raw[:5] == b"MSSB\x02"
                    headers.append(json.loads(raw[9 : 9 + struct.unpack_from("<I", raw, 5)[0]]))
            assert {tuple(sorted(h)) for h in headers} == {("owner", "size", "stream_id")}
            # an owner is a keyed tag: linkable across one principal's objects, not nameable
            tags = {stack.keyring.principal_tag(n): n for n in (BOB, ALICE)}
            assert {h["owner"] for h in headers} >= set(tags) and all(re.fullmatch(r"[0-9a-f]{32}", h["owner"])
                                                                      for h in headers)

        # the control: the same store as the version before wrote it gives the secret away
        acts = stack.acts
        downgrade_meta(acts.store, stack.keyring)
        if store == "file":
            downgrade_file_store(Path(stack.store_url.removeprefix("file://")), stack.keyring, [BOB, ALICE])
        old = read()
        hits = found(old, guesses)
        assert list(hits) == [SECRET]
        # the prefix state's checksum, in the clear index record (and, on the file store, in the
        # clear envelope headers too)
        assert needles(SECRET)[0] in hits[SECRET]
        assert names_in(old) == {BOB, ALICE}
