"""StateSchema: strict, frozen, fingerprinted; every semantic field changes the fingerprint."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mamba_stream.scan import PRESETS, load_model
from mamba_stream.state_codec import StateSchema


def test_fingerprint_is_stable_and_distinguishes_every_preset():
    prints = {}
    for name in PRESETS:
        a, b = load_model(name).schema, load_model(name).schema
        assert a.fingerprint() == b.fingerprint() and a.fingerprint().startswith("sha256:")
        prints[name] = a.fingerprint()
    assert len(set(prints.values())) == len(prints)


def test_round_trips_through_json():
    s = load_model("tiny-mamba3").schema
    back = StateSchema.model_validate_json(s.model_dump_json())
    assert back == s and back.fingerprint() == s.fingerprint()
    assert json.loads(s.canonical_json())["architecture"] == "mamba3"


def test_tensor_specs_match_the_issue_contract():
    m1, m2, m3 = (load_model(p).schema for p in ("tiny-mamba1", "tiny-mamba2", "tiny-mamba3"))
    assert m1.spec("layers.0.conv").shape == (m1.d_inner, m1.d_conv)
    assert m1.spec("layers.0.ssm").shape == (m1.d_inner, m1.d_state)
    assert m2.spec("layers.1.conv").shape == (m2.d_inner + 2 * m2.ngroups * m2.d_state, m2.d_conv)
    assert m2.spec("layers.1.ssm").shape == (m2.nheads, m2.headdim, m2.d_state)
    assert [t.role for t in m3.tensors if t.layer == 0] == ["angle", "ssm", "k", "v"]
    assert m3.spec("layers.0.angle").shape == (m3.nheads, m3.n_angles)
    assert m3.spec("layers.0.k").shape == (m3.mimo_rank, m3.nheads, m3.d_state)
    assert m3.spec("layers.0.v").shape == (m3.nheads, m3.headdim)
    assert m3.discretization.rule == "exp_trapezoidal" and m3.discretization.angle_wrap == "mod_2pi"
    assert m3.representation == "real" and m3.d_conv == 0
    assert m1.state_bytes == sum(t.nbytes for t in m1.tensors) == 2 * 128 * (4 + 16) * 4


@pytest.mark.parametrize(
    "change",
    [
        {"architecture": "mamba1"},
        {"dtype": "float64"},
        {"schema_version": 2},
        {"expand": 3.0},
        {"rope_fraction": 1.0},
        {"mimo_rank": 2},
        {"representation": "complex"},
        {"layer_order": (1, 0)},
    ],
)
def test_any_field_change_changes_the_fingerprint(change):
    s = load_model("tiny-mamba3").schema
    other = s.model_copy(update=change)
    assert other.fingerprint() != s.fingerprint()


def test_same_bytes_different_recurrence_is_a_different_schema():
    s = load_model("tiny-mamba3").schema
    disc = s.discretization.model_copy(update={"rope": "halved"})
    other = s.model_copy(update={"discretization": disc})
    assert other.state_bytes == s.state_bytes and other.fingerprint() != s.fingerprint()


def test_strict_frozen_and_validated():
    s = load_model("tiny-mamba2").schema
    with pytest.raises(ValidationError):
        s.d_model = 3  # frozen
    data = s.model_dump()
    with pytest.raises(ValidationError):
        StateSchema.model_validate({**data, "d_model": "64"})  # strict: no coercion
    with pytest.raises(ValidationError):
        StateSchema.model_validate({**data, "surprise": 1})
    with pytest.raises(ValidationError):
        StateSchema.model_validate({**data, "layer_order": (0, 0)})
