"""The checkpoint codec: bit-exact round trips, tamper and fuzz resistance, binding, keys."""

from __future__ import annotations

import json
import os

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba_stream.scan import PRESETS, ModelConfig, init_model, load_model
from mamba_stream.state_codec import (
    ChecksumMismatch,
    ChunkSequenceMismatch,
    CorruptBlob,
    DTypeMismatch,
    EpochMismatch,
    InputTransformMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    PrincipalMismatch,
    SchemaMismatch,
    StateRejected,
    StreamMismatch,
    TruncatedBlob,
    UnknownKeyId,
    UnsupportedEnvelopeVersion,
)
from mamba_stream.state_codec.codec import (
    ENVELOPE_VERSION,
    Keyring,
    KeyringError,
    decode_checkpoint,
    encode_checkpoint,
    envelope_schema,
    open_checkpoint,
    seal,
    unseal,
)

STATE_DTYPES = {"float32": (torch.float32, None), "float64": (torch.float64, None),
                "bfloat16": (torch.float32, torch.bfloat16), "float16": (torch.float32, torch.float16)}
RING = Keyring.generate()


def _sealed(preset="tiny-mamba2", *, dtype="float32", tokens=29, ring=RING, **kw):
    compute, state_dtype = STATE_DTYPES[dtype]
    model = load_model(preset, dtype=compute, state_dtype=state_dtype)
    state = model.advance(model.initial_state(), list(range(1, tokens + 1))).state
    args = dict(stream_id="stream-1", principal="alice", chunk_seq=4, epoch=1, keyring=ring) | kw
    receipt, blob = seal(model, state, **args)
    return model, state, receipt, blob


@pytest.mark.parametrize("dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_round_trip_is_bit_exact(preset, dtype):
    model, state, receipt, blob = _sealed(preset, dtype=dtype)
    back = unseal(blob, receipt, RING, model=model, principal="alice")
    assert back.equal(state) and back.position == state.position == 29
    assert all(t.dtype == STATE_DTYPES[dtype][1] or STATE_DTYPES[dtype][0] for t in back.tensors.values())
    # the state continues exactly like the original
    a, b = model.advance(state, [7, 8, 9]), model.advance(back, [7, 8, 9])
    assert torch.equal(a.logits, b.logits) and a.state.equal(b.state)
    # the low-level pair agrees, and the receipt is small enough for history
    assert all(torch.equal(decode_checkpoint(blob, receipt, RING)[k], v) for k, v in state.tensors.items())
    assert len(receipt.model_dump_json()) < 1024
    assert receipt.dtype == dtype and receipt.position == 29 and receipt.state_bytes == model.schema.state_bytes


def test_encode_checkpoint_requires_the_receipt_checksum():
    model, state, receipt, _ = _sealed()
    blob = encode_checkpoint(state.tensors, receipt, RING, schema=model.schema)
    assert all(torch.equal(decode_checkpoint(blob, receipt, RING)[k], v) for k, v in state.tensors.items())
    other = model.advance(state, [1]).state
    with pytest.raises(ChecksumMismatch):
        encode_checkpoint(other.tensors, receipt, RING)


def test_every_write_uses_a_fresh_nonce():
    _, _state, r1, b1 = _sealed()
    _, _, r2, b2 = _sealed()
    assert r1.checksum == r2.checksum and r1.state_key == r2.state_key  # content-derived key
    assert bytes(b1) != bytes(b2)


def test_ciphertext_does_not_contain_the_plaintext():
    _, state, _, blob = _sealed("tiny-mamba1", tokens=40)
    raw = state.tensors["layers.1.ssm"].numpy().tobytes()
    assert any(raw[i : i + 64].count(0) < 32 for i in range(0, len(raw) - 64, 64))  # not all zeros
    for i in range(0, len(raw) - 64, 64):
        assert raw[i : i + 64] not in blob


def _positions(n: int, count: int = 160) -> list[int]:
    head = list(range(min(n, 96)))  # every byte of the envelope header's start
    return sorted(set(head + [int(i * (n - 1) / (count - 1)) for i in range(count)]))


def test_any_single_bit_flip_is_rejected():
    _, _, receipt, blob = _sealed()
    blob = bytes(blob)
    for pos in _positions(len(blob)):
        for bit in (0, 5):
            bad = bytearray(blob)
            bad[pos] ^= 1 << bit
            with pytest.raises(StateRejected):
                decode_checkpoint(bad, receipt, RING)


def test_truncation_and_appending_are_rejected():
    _, _, receipt, blob = _sealed()
    blob = bytes(blob)
    for n in [0, 1, 5, 30, 100, len(blob) // 2, len(blob) - 17, len(blob) - 1]:
        with pytest.raises(StateRejected):
            decode_checkpoint(blob[:n], receipt, RING)
    with pytest.raises(TruncatedBlob):
        decode_checkpoint(blob[:-1], receipt, RING)
    for extra in (b"\x00", b"appended", bytes(4096)):
        with pytest.raises(CorruptBlob):
            decode_checkpoint(blob + extra, receipt, RING)


FUZZ = {"arbitrary": 0, "mutated": 0}


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes_only_raise_state_rejected(data):
    _, _, receipt, _ = _cached()
    FUZZ["arbitrary"] += 1
    with pytest.raises(StateRejected):
        decode_checkpoint(data, receipt, RING)


_CACHE: dict[str, tuple] = {}


def _cached():
    if "x" not in _CACHE:
        _CACHE["x"] = _sealed("tiny-mamba3", tokens=11)
    return _CACHE["x"]


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    _, _, _, blob = _cached()
    out = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        head_biased = st.one_of(st.integers(0, min(400, len(out) - 1)), st.integers(0, len(out) - 1))
        i = draw(head_biased) if out else 0
        if op == "flip" and out:
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and out:
            out[i] = draw(st.integers(0, 255))
        elif op == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and out:
            del out[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del out[i:]
        elif op == "splice" and out:
            out[i : i + 4] = draw(st.binary(min_size=4, max_size=4))
    return bytes(out)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=mutations())
def test_fuzz_mutated_envelopes_only_raise_state_rejected(bad):
    _, _state, receipt, blob = _cached()
    FUZZ["mutated"] += 1
    if bad == bytes(blob):
        return  # a mutation that changed nothing (set a byte to its own value)
    with pytest.raises(StateRejected):
        decode_checkpoint(bad, receipt, RING)


def test_fuzz_counts_reported():
    """Printed for the closing note (`pytest -s`); run after the two fuzz tests."""
    if not any(FUZZ.values()):
        pytest.skip("the fuzz tests did not run in this session")
    print(f"FUZZ examples: arbitrary bytes {FUZZ['arbitrary']}, mutated envelopes {FUZZ['mutated']}")
    assert FUZZ["arbitrary"] >= 1000 and FUZZ["mutated"] >= 1000


@pytest.mark.parametrize(
    "field,value,error",
    [
        ("stream_id", "stream-2", StreamMismatch),
        ("principal", "mallory", PrincipalMismatch),
        ("position", 28, PositionMismatch),
        ("chunk_seq", 5, ChunkSequenceMismatch),
        ("epoch", 0, EpochMismatch),
        ("model_revision", "sha256:" + "0" * 64, ModelRevisionMismatch),
        ("checksum", "sha256:" + "1" * 64, ChecksumMismatch),
    ],
)
def test_blob_is_bound_to_its_receipt(field, value, error):
    _, _, receipt, blob = _sealed()
    forged = receipt.model_copy(update={field: value})
    with pytest.raises(error) as exc:
        decode_checkpoint(blob, forged, RING)
    assert exc.value.field == field
    assert exc.value.actual == getattr(receipt, field) or field == "checksum"


def test_unseal_checks_principal_model_and_transform_first():
    model, _, receipt, blob = _sealed()
    with pytest.raises(PrincipalMismatch) as exc:
        unseal(blob, receipt, RING, model=model, principal="mallory")
    assert (exc.value.expected, exc.value.actual) == ("mallory", "alice")
    other_weights = init_model(model.config, seed=99)
    with pytest.raises(ModelRevisionMismatch):
        unseal(blob, receipt, RING, model=other_weights, principal="alice")
    relabeled = receipt.model_copy(update={"input_transform_revision": "utf-16/v0"})
    with pytest.raises(InputTransformMismatch):
        unseal(blob, relabeled, RING, model=model, principal="alice")
    with pytest.raises(DTypeMismatch):
        unseal(blob, receipt, RING, model=load_model("tiny-mamba2", state_dtype=torch.bfloat16), principal="alice")


def _equal_size_pair():
    """A Mamba-2 and a Mamba-3 model whose states have the same byte count."""
    base = {"d_model": 64, "n_layer": 2, "vocab_size": 256, "d_state": 32}
    m2 = init_model(ModelConfig.create(architecture="mamba2", headdim=16, ngroups=1, d_conv=4, **base), 1)
    m3 = init_model(ModelConfig.create(architecture="mamba3", headdim=8, **base), 1)
    assert m2.schema.state_bytes == m3.schema.state_bytes
    return m2, m3


def test_same_bytes_other_schema_is_rejected_naming_the_field():
    m2, m3 = _equal_size_pair()
    state = m2.advance(m2.initial_state(), [1, 2, 3]).state
    receipt, blob = seal(m2, state, stream_id="s", principal="p", chunk_seq=1, epoch=0, keyring=RING)
    # the receipt re-labelled with the other model's revision and fingerprint: the blob's
    # authenticated schema still tells which field differs
    forged = receipt.model_copy(update={"model_revision": m3.revision})
    with pytest.raises(SchemaMismatch) as exc:
        unseal(blob, forged, RING, model=m3, principal="p")
    assert exc.value.field.startswith("schema.")
    # same layout, another discretization (A floor): same shapes, same bytes, different schema
    fields, seed = PRESETS["tiny-mamba3"]
    a = init_model(ModelConfig.create(**fields), seed)
    b = init_model(ModelConfig.create(**{**fields, "A_floor": 1e-3}), seed)
    assert a.revision == b.revision and a.schema.state_bytes == b.schema.state_bytes
    st_a = a.advance(a.initial_state(), [4, 5]).state
    ra, ba = seal(a, st_a, stream_id="s", principal="p", chunk_seq=1, epoch=0, keyring=RING)
    with pytest.raises(SchemaMismatch) as exc:
        unseal(ba, ra, RING, model=b, principal="p")
    assert exc.value.field == "schema.discretization.a_floor"
    assert envelope_schema(ba, RING) == a.schema


def test_a_state_made_under_one_weight_format_does_not_open_under_another():
    """The same checkpoint read in bfloat16 and in float32 gives the same bits (widening is exact),
    but a format is part of the schema: a receipt made under one is refused, naming the field,
    under the other, both ways; a float32 model's schema is the one from before the field."""
    f32 = load_model("tiny-mamba2", backend="exact")
    bf16 = load_model("tiny-mamba2", backend="exact", weights="bfloat16")
    assert bf16.revision == f32.revision and bf16.schema.weights == "bfloat16" and f32.schema.weights is None
    assert "weights" not in f32.schema.canonical_json() and '"weights":"bfloat16"' in bf16.schema.canonical_json()
    for made, other in ((bf16, f32), (f32, bf16)):
        state = made.advance(made.initial_state(), [1, 2, 3]).state
        receipt, blob = seal(made, state, stream_id="s", principal="p", chunk_seq=1, epoch=0, keyring=RING)
        with pytest.raises(SchemaMismatch) as exc:
            unseal(blob, receipt, RING, model=other, principal="p")
        assert exc.value.field in ("schema.fingerprint", "schema.weights")
        assert unseal(blob, receipt, RING, model=made, principal="p").equal(state)


def test_key_rotation_and_unknown_keys():
    old = Keyring.generate()
    model, state, r_old, b_old = _sealed(ring=old)
    new = old.rotate()
    assert new.active_id != old.active_id and set(old.ids) < set(new.ids)
    assert unseal(b_old, r_old, new, model=model, principal="alice").equal(state)
    r_new, b_new = seal(model, state, stream_id="stream-1", principal="alice", chunk_seq=4, epoch=1, keyring=new)
    assert new.active_id.encode() in bytes(b_new[:200]) and old.active_id.encode() not in bytes(b_new[:200])
    with pytest.raises(UnknownKeyId):
        decode_checkpoint(b_new, r_new, old)
    with pytest.raises(UnknownKeyId):
        decode_checkpoint(b_old, r_old, Keyring.generate())
    with pytest.raises(CorruptBlob):  # same key id, another key: authentication fails
        impostor = Keyring({old.active_id: os.urandom(32)}, old.active_id)
        decode_checkpoint(b_old, r_old, impostor)


def test_unsupported_envelope_version():
    _, _, receipt, blob = _sealed()
    bad = bytearray(blob)
    i = bytes(bad).index(b"\xa1v") + 2  # fixstr "v", then its value (positive fixint 2)
    assert bad[i] == ENVELOPE_VERSION == 2
    bad[i] = 3
    with pytest.raises(UnsupportedEnvelopeVersion):
        decode_checkpoint(bad, receipt, RING)


def test_keyring_files_and_environment(tmp_path, monkeypatch):
    ring = Keyring.generate().rotate()
    path = tmp_path / "keys" / "keyring.json"
    ring.save(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    back = Keyring.from_file(path)
    assert back.ids == ring.ids and back.active_id == ring.active_id
    assert all(back.key(k) == ring.key(k) for k in ring.ids)
    os.chmod(path, 0o644)
    with pytest.raises(KeyringError, match="readable by others"):
        Keyring.from_file(path)
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", ring.to_json())
    assert Keyring.from_env().active_id == ring.active_id
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", json.dumps({"active": "x", "keys": {"x": "c2hvcnQ="}}))
    with pytest.raises(KeyringError):
        Keyring.from_env()
    fresh = Keyring.load_or_generate(tmp_path / "embedded" / "keyring.json")
    assert Keyring.load_or_generate(tmp_path / "embedded" / "keyring.json").active_id == fresh.active_id
    assert "key" not in repr(fresh).lower().replace("keyring", "")


def test_checksums_are_blake3_and_sha256_checkpoints_still_verify(monkeypatch):
    import mamba_stream.state_codec.codec as codec
    from mamba_stream.state_codec.codec import plaintext_checksum

    model, state, receipt, blob = _sealed()
    assert receipt.checksum.startswith("blake3:") and receipt.checksum == plaintext_checksum(state.tensors)
    again = decode_checkpoint(blob, receipt, RING, rehash=True)
    assert all(torch.equal(again[k], v) for k, v in state.tensors.items())
    # a checkpoint written before BLAKE3: its header names no digest, its digest is SHA-256
    monkeypatch.setattr(codec, "DIGEST", "sha256")
    _, _, old_receipt, old_blob = _sealed()
    monkeypatch.undo()
    assert old_receipt.checksum.startswith("sha256:")
    assert old_receipt.checksum == plaintext_checksum(state.tensors, "sha256") != receipt.checksum
    back = unseal(old_blob, old_receipt, RING, model=model, principal="alice")
    assert back.equal(state)
    decode_checkpoint(old_blob, old_receipt, RING, rehash=True)
    # the algorithm is bound too: the same digest under the other tag is refused
    for blob_, rec in ((old_blob, old_receipt), (blob, receipt)):
        other = "blake3" if rec.checksum.startswith("sha256:") else "sha256"
        relabelled = rec.model_copy(update={"checksum": other + ":" + rec.checksum.partition(":")[2]})
        with pytest.raises(ChecksumMismatch):
            decode_checkpoint(blob_, relabelled, RING)


# --- the associated data binds every bound field (Issue 19, mutant 1) ---------------------------


def _envelope(blob: bytes) -> tuple[list[tuple[str, object]], bytes]:
    """The blob's header entries in order, and its ciphertext: read with plain msgpack, not the
    codec's reader, so a bug there cannot hide in the test."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(blob))
    unpacker.feed(blob)
    n = unpacker.read_map_header()
    entries = [(unpacker.unpack(), unpacker.unpack()) for _ in range(n)]
    assert entries[-1][0] == "ct"
    return entries[:-1], entries[-1][1]


def _repack(entries: list[tuple[str, object]], ct: bytes) -> bytes:
    """The envelope as the codec writes it: a fixmap, entries in order, the ciphertext as bin32."""
    head = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in entries)
    fixmap = bytes([0x80 | (len(entries) + 1)])
    return fixmap + head + msgpack.packb("ct") + b"\xc6" + len(ct).to_bytes(4, "big") + ct


def _other(value: object) -> object:
    """A different value of the same type, for a bound field (epoch 1 -> 7, as the issue's case)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"bound field of unexpected type {type(value).__name__}")
    if isinstance(value, int):
        return value + 6
    if value.startswith("sha256:"):
        return "sha256:" + "ab" * 32
    return value + "-moved"


def test_every_bound_field_of_the_codec_is_one_of_the_receipt():
    # the parametrization below takes the codec's own list: a field added there is tested too
    from mamba_stream.state_codec.codec import _BOUND_ERRORS

    _, _, receipt, _ = _sealed()
    assert set(_BOUND_ERRORS) == set(receipt.bound())


BOUND_FIELDS = ["stream_id", "principal", "model_revision", "schema_fingerprint", "position", "chunk_seq", "epoch"]


@pytest.mark.parametrize("field", BOUND_FIELDS)
def test_a_sealed_header_moved_from_a_blob_of_other_bound_fields_fails_authentication(field):
    """The bound fields are sealed in the header: without the key nobody writes one. What a forger
    can do is move the sealed header of another blob, one bound to the fields they want (another
    stream, tenant, position or epoch), onto this blob's ciphertext, and present that blob's
    receipt: the header then opens and agrees with the receipt, and only the associated data, which
    holds the header, stands between the ciphertext and the other binding."""
    model, state, receipt, blob = _sealed()
    args = {"stream_id": "stream-1", "principal": "alice", "chunk_seq": 4, "epoch": 1, "keyring": RING}
    if field in args:
        args[field] = _other(receipt.bound()[field])
    if field == "position":  # another position: the state after one more token
        other_receipt, other_blob = seal(model, model.advance(state, [7]).state, **args)
    else:
        other_receipt, other_blob = seal(model, state, **args)
        if field not in args:  # a field seal() takes from the model: encoded under a forged receipt
            other_receipt = other_receipt.model_copy(update={field: _other(receipt.bound()[field])})
            other_blob = encode_checkpoint(state.tensors, other_receipt, RING)
    differs = {k for k, v in other_receipt.bound().items() if receipt.bound()[k] != v}
    assert differs == {field}
    entries, ct = _envelope(bytes(blob))
    theirs, _ = _envelope(bytes(other_blob))
    assert [k for k, _ in entries] == ["v", "alg", "kid", "nonce", "head"]
    assert _repack(entries, ct) == bytes(blob)  # the re-pack is byte-exact: the one change below is the only one
    moved = [(k, dict(theirs)["head"] if k == "head" else v) for k, v in entries]
    forged = receipt.model_copy(update={"stream_id": other_receipt.stream_id, "principal": other_receipt.principal,
                                        "model_revision": other_receipt.model_revision,
                                        "schema_fingerprint": other_receipt.schema_fingerprint,
                                        "position": other_receipt.position, "chunk_seq": other_receipt.chunk_seq,
                                        "epoch": other_receipt.epoch})
    assert forged.bound() == other_receipt.bound()
    with pytest.raises(CorruptBlob, match="authentication failed") as err:
        decode_checkpoint(_repack(moved, ct), forged, RING)
    assert err.value.field == "ct"
    # and the moved header under this blob's own receipt names the field that differs
    with pytest.raises(StateRejected) as err2:
        decode_checkpoint(_repack(moved, ct), receipt, RING)
    assert err2.value.field == field


def test_a_blob_says_nothing_in_clear_and_its_length_hides_the_names():
    """Whoever reads a blob without the key learns its version, algorithm, key id and size only:
    not the principal, the stream, the position, the model, the schema or the checksum."""
    principal, sid = "principal-alice-7q2x", "stream-zz9-k3"
    model, _, receipt, blob = _sealed(principal=principal, stream_id=sid)
    raw = bytes(blob)
    digest = bytes.fromhex(receipt.checksum.partition(":")[2])
    for needle in (principal.encode(), sid.encode(), receipt.checksum.encode(), digest,
                   receipt.checksum.partition(":")[2].encode(), receipt.schema_fingerprint.encode(),
                   receipt.model_revision.encode(), model.schema.canonical_json().encode()[:40], b"bound", b"schema"):
        assert needle not in raw, needle[:40]
    # a one-letter principal and a 60-letter one: the same length of blob
    _, _, _, short = _sealed(principal="p", stream_id="s")
    _, _, _, long_ = _sealed(principal="p" * 60, stream_id="s" * 60)
    assert len(short) == len(long_) == len(blob)
    # the sealed header authenticates on its own: one bit of it flipped, nothing opens
    entries, ct = _envelope(raw)
    head = bytearray(dict(entries)["head"])
    head[20] ^= 1
    bad = _repack([(k, bytes(head) if k == "head" else v) for k, v in entries], ct)
    with pytest.raises(CorruptBlob) as err:
        decode_checkpoint(bad, receipt, RING)
    assert err.value.field == "head"


@pytest.mark.parametrize("field", BOUND_FIELDS)
def test_a_version_1_blob_rewritten_in_header_and_receipt_together_fails_authentication(field):
    """A checkpoint written before the header was sealed (its bound fields in clear) is still read;
    rewriting its clear header and the receipt together is caught by the associated data."""
    from tests._legacy import legacy_blob

    model, state, receipt, _ = _sealed()
    blob = legacy_blob(state.tensors, receipt, RING, model.schema.canonical_json())
    assert all(torch.equal(decode_checkpoint(blob, receipt, RING)[k], v) for k, v in state.tensors.items())
    entries, ct = _envelope(blob)
    assert _repack(entries, ct) == blob
    bound = dict(entries)["bound"]
    new = _other(bound[field])
    moved = [(k, {**v, field: new} if k == "bound" else v) for k, v in entries]
    forged = receipt.model_copy(update={field: new})
    with pytest.raises(CorruptBlob, match="authentication failed") as err:
        decode_checkpoint(_repack(moved, ct), forged, RING)
    assert err.value.field == "ct"


def test_a_version_1_blob_is_read_and_resealed_with_the_same_plaintext():
    from mamba_stream.state_codec.codec import is_clear_header, reseal
    from tests._legacy import legacy_blob

    model, state, receipt, v2 = _sealed(principal="principal-old-4k")
    old = legacy_blob(state.tensors, receipt, RING, model.schema.canonical_json())
    assert b"principal-old-4k" in old and is_clear_header(old) and not is_clear_header(v2)
    assert not is_clear_header(b"not a blob")
    assert unseal(old, receipt, RING, model=model, principal="principal-old-4k").equal(state)
    assert envelope_schema(old, RING) == model.schema
    new = reseal(old, RING.rotate())  # sealed under the active key; the old one still reads it
    assert not is_clear_header(new) and b"principal-old-4k" not in bytes(new)
    rotated = RING.rotate()
    with pytest.raises(UnknownKeyId):  # resealed under a key this ring does not hold
        decode_checkpoint(new, receipt, RING)
    new = reseal(old, RING)
    back = decode_checkpoint(new, receipt, RING, rehash=True)
    assert all(torch.equal(back[k], v) for k, v in state.tensors.items())
    assert open_checkpoint(new, receipt, RING)[1] == receipt.checksum  # the same checksum: receipts stay valid
    assert bytes(reseal(new, rotated)) == bytes(new)  # a version-2 blob is left as it is
    tampered = bytearray(old)
    tampered[-1] ^= 1
    with pytest.raises(CorruptBlob):
        reseal(bytes(tampered), RING)
