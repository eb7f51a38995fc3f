"""generate's sampling settings (issue 48, item 6): top_p, min_p, frequency and presence penalties,
repetition penalty and logit bias (mamba_stream/activities/_sampling.py), wired into the generate
activity (mamba_stream/activities/_chunk.py) and validated where the request is built.

Each setting is checked against a reference written out here in plain Python floats (IEEE
doubles, one rounding per operation, as the sampler's tensors): the adjusted logits and the drawn
token bit for bit, and the distribution of many draws against the probabilities the setting
specifies. No server: the generate runs through the activities (`ActivityEnvironment`).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import ApplicationError

from mamba_stream.activities._sampling import (
    SHAPING_FIELDS,
    ShapedSampler,
    Shaping,
    _in_order,
    _ranked,
    adjust_logits,
    check_logit_bias,
    draw,
    neutral_settings,
)
from mamba_stream.scan import NonFiniteOutput, load_model
from mamba_stream.scan.exact import TWIN_OPS
from mamba_stream.state_codec.payload import StreamPayloadConverter
from mamba_stream.workflows import GenerateRequest, InvalidRequest, ModelInfo
from mamba_stream.workflows._model_stream import check_logit_bias as check_logit_bias_in_workflow
from mamba_stream.workflows._model_stream import generate_request
from mamba_stream.workflows.contract import chunk_digest
from tests.activities._env import generate_after

# --- the reference, by hand ----------------------------------------------------------------------


def ref_adjust(logits: list[float], *, bias: dict[int, float] | None = None, rep: float = 1.0, freq: float = 0.0,
               pres: float = 0.0, counts: dict[int, int] | None = None) -> list[float]:
    """The adjusted logits as the settings specify them: bias added, then for each sampled token
    the repetition penalty (divide a positive logit, multiply a negative one), then the frequency
    penalty per time sampled and the presence penalty once."""
    x = [float(v) for v in logits]
    for t, b in (bias or {}).items():
        x[t] = x[t] + b
    for t, c in (counts or {}).items():
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] = (x[t] - c * freq) - pres
    return x


def exact_exp(values: list[float]) -> list[float]:
    """The exact arithmetic's exp (the one exp the sampler uses), element by element."""
    return TWIN_OPS.exp(torch.tensor(values, dtype=torch.float64)).tolist()


def ref_draw(x: list[float], temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The token the settings specify for uniform draw `u`, written out with Python floats."""
    n = len(x)
    if temperature == 0.0:
        return max(range(n), key=lambda i: (x[i], -i))  # the argmax, the lowest id among equals
    z = [v / temperature for v in x]
    zmax = max(z)
    w = exact_exp([v - zmax for v in z])
    kept = sorted(range(n), key=lambda i: (-z[i], i))  # ranked: z descending, equal ones by id
    if top_k:
        kept = kept[:top_k]
    if top_p < 1.0:
        total = 0.0
        for i in sorted(kept):  # S: in token-id order
            total += w[i]
        run, cut = 0.0, len(kept)
        for j, i in enumerate(kept):  # the shortest ranked prefix reaching top_p * S
            run += w[i]
            if run >= top_p * total:
                cut = j + 1
                break
        kept = kept[:cut]
    if min_p > 0.0:
        kept = [i for i in kept if w[i] >= min_p]
    kept = sorted(kept)
    total = 0.0
    for i in kept:
        total += w[i]
    run = 0.0
    for i in kept:  # the first whose running sum exceeds u * total
        run += w[i]
        if run > u * total:
            return i
    return kept[-1]


def ref_probs(x: list[float], temperature: float, keep: set[int]) -> dict[int, float]:
    """softmax(x / temperature) over the tokens `keep` (what the draws' frequencies estimate)."""
    e = {i: math.exp(x[i] / temperature) for i in keep}
    total = sum(e.values())
    return {i: v / total for i, v in e.items()}


def next_u(gen: torch.Generator) -> float:
    """The uniform draw the sampler takes next from `gen` (from a copy: `gen` is untouched)."""
    g = torch.Generator()
    g.set_state(gen.get_state())
    return float(torch.rand((), dtype=torch.float64, generator=g))


# --- adjusted logits ----------------------------------------------------------------------------

#: small logits (float32, as a model gives them): positives, negatives, a zero, ties
LOGITS = [1.5, -0.75, 0.0, 2.25, 2.25, -3.0, 0.3125, 1.0e-3]


@pytest.mark.parametrize("settings", [
    {"bias": {0: -1.25, 5: 100.0, 7: -100.0}},
    {"rep": 1.3},
    {"rep": 0.7},
    {"freq": 0.4},
    {"pres": -1.5},
    {"freq": -2.0, "pres": 2.0},
    {"bias": {3: 0.5, 1: 7.0}, "rep": 1.8, "freq": 0.25, "pres": 0.5},
], ids=["bias", "repetition", "repetition-below-1", "frequency", "presence", "both-penalties", "all"])
def test_adjusted_logits_are_the_hand_reference_bit_for_bit(settings):
    counts = {0: 3, 1: 1, 2: 2, 3: 1, 5: 4}  # sampled: a positive, a negative, the zero, a tie, a biased one
    shaping = Shaping(frequency_penalty=settings.get("freq", 0.0), presence_penalty=settings.get("pres", 0.0),
                      repetition_penalty=settings.get("rep", 1.0),
                      logit_bias=tuple(sorted(settings.get("bias", {}).items())))
    logits = torch.tensor(LOGITS, dtype=torch.float32)
    got = adjust_logits(logits, shaping, counts)
    want = ref_adjust(logits.tolist(), counts=counts, **settings)
    assert got.dtype == torch.float64 and got.tolist() == want
    assert logits.tolist() == torch.tensor(LOGITS, dtype=torch.float32).tolist()  # the row is not mutated
    # a token never sampled is left as it was by the penalties
    assert got[4].item() == LOGITS[4] + settings.get("bias", {}).get(4, 0.0)


def test_the_penalties_count_the_tokens_this_generate_sampled_only():
    """The first token is drawn from the logits as given (the prompt counts nothing); each later
    one from logits penalized by what the sampler returned before it."""
    logits = torch.tensor([2.0, 1.9, 1.8, -5.0], dtype=torch.float32)
    s = ShapedSampler(0.0, 0, Shaping(presence_penalty=2.0, frequency_penalty=0.0), torch.Generator())
    taken: list[int] = []
    s.taken = taken.append
    # greedy: 0, then 1 (0 penalized by 2), then 2, then 0 again (0.0 vs -0.1 vs -0.2 vs -5.0)
    assert [s(logits) for _ in range(4)] == [0, 1, 2, 0] == taken
    assert s.counts == {0: 2, 1: 1, 2: 1}


# --- the draw -----------------------------------------------------------------------------------

#: (temperature, top_k, top_p, min_p)
DRAWS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 3, 1.0, 0.0), (0.9, 4, 0.6, 0.1),
         (2.0, 0, 0.35, 0.0), (1.0, 100, 0.999, 0.05), (0.0, 2, 0.1, 0.9)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), DRAWS)
def test_each_draw_is_the_hand_reference_bit_for_bit(temperature, top_k, top_p, min_p):
    x = adjust_logits(torch.tensor(LOGITS), Shaping(), {})
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        want = ref_draw(x.tolist(), temperature, top_k, top_p, min_p, next_u(gen))
        assert draw(x, temperature, top_k, top_p, min_p, gen) == want, seed
        g = torch.Generator().manual_seed(seed)
        if temperature:
            torch.rand((), dtype=torch.float64, generator=g)  # one 64-bit draw per token, none at temperature 0
        assert torch.equal(gen.get_state(), g.get_state())


#: p = 0.5, 0.3, 0.15, 0.05 at temperature 1
P4 = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "keep"), [
    (0, 1.0, 0.0, {0, 1, 2, 3}),
    (0, 0.75, 0.0, {0, 1}),     # 0.5 < 0.75 <= 0.8
    (0, 0.5, 0.0, {0}),         # the first token alone reaches 0.5
    (0, 0.81, 0.0, {0, 1, 2}),
    (0, 1.0, 0.2, {0, 1, 2}),   # p >= 0.2 x 0.5
    (0, 1.0, 0.61, {0}),        # 0.3 < 0.61 x 0.5
    (3, 1.0, 0.0, {0, 1, 2}),
    (3, 0.8, 0.0, {0, 1}),      # of the top 3 (0.95): 0.5 < 0.76 <= 0.8
    (0, 0.9, 0.4, {0, 1}),      # top_p keeps 0..2, min_p (>= 0.2) drops 2
], ids=["none", "top_p-0.75", "top_p-0.5", "top_p-0.81", "min_p-0.2", "min_p-0.61", "top_k-3", "top_k-then-top_p",
        "top_p-then-min_p"])
def test_each_cut_samples_the_specified_distribution(top_k, top_p, min_p, keep):
    """Many seeded draws: only the kept tokens, at their renormalized probabilities (within 5
    standard deviations of 2000 draws)."""
    x = torch.tensor(P4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1234)
    n = 2000
    counts = {i: 0 for i in range(4)}
    for _ in range(n):
        counts[draw(x, 1.0, top_k, top_p, min_p, gen)] += 1
    assert {i for i, c in counts.items() if c} == keep
    for i, p in ref_probs(P4, 1.0, keep).items():
        assert abs(counts[i] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (i, counts, p)


@pytest.mark.parametrize(("shaping", "counts", "want"), [
    # logit_bias: +ln 2 on token 3 doubles its odds (p 0.05 -> 0.1 / 1.05)
    (Shaping(logit_bias=((3, math.log(2.0)),)), {}, [0.5, 0.3, 0.15, 0.1]),
    (Shaping(logit_bias=((0, -100.0),)), {}, [0.0, 0.3, 0.15, 0.05]),
    # frequency: token 0 sampled twice, 0.5 each: x0 - 1
    (Shaping(frequency_penalty=0.5), {0: 2}, [0.5 * math.exp(-1.0), 0.3, 0.15, 0.05]),
    # presence: token 1 sampled three times, once -ln 3
    (Shaping(presence_penalty=math.log(3.0)), {1: 3}, [0.5, 0.1, 0.15, 0.05]),
    # repetition 2 on negative logits: x * 2 (p -> p^2 unnormalized)
    (Shaping(repetition_penalty=2.0), {0: 1, 2: 1}, [0.25, 0.3, 0.0225, 0.05]),
], ids=["bias-doubles", "bias-bans", "frequency", "presence", "repetition"])
def test_each_adjustment_samples_the_specified_distribution(shaping, counts, want):
    x = adjust_logits(torch.tensor(P4, dtype=torch.float32), shaping, counts)
    gen = torch.Generator().manual_seed(99)
    n = 2000
    got = [0] * 4
    for _ in range(n):
        got[draw(x, 1.0, 0, 1.0, 0.0, gen)] += 1
    total = sum(want)
    for i, w in enumerate(want):
        p = w / total
        assert abs(got[i] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-9, (i, got, p)


def test_a_bias_of_100_always_wins_and_of_minus_100_never_does():
    x = adjust_logits(torch.tensor([30.0, 0.0, -20.0, 5.0]), Shaping(logit_bias=((2, 100.0), (0, -100.0))), {})
    gen = torch.Generator().manual_seed(5)
    assert {draw(x, 1.0, 0, 1.0, 0.0, gen) for _ in range(200)} == {2}


def test_greedy_takes_the_penalties_and_the_bias_but_no_cut():
    """Temperature 0: the bias and the penalties change the argmax; top_k, top_p and min_p never
    remove the argmax, so they change nothing, and no random number is drawn."""
    logits = torch.tensor([1.0, 3.0, 2.0, 2.9], dtype=torch.float32)
    plain = int(torch.argmax(logits))
    for top_k, top_p, min_p in [(0, 0.01, 0.0), (0, 1.0, 0.99), (1, 0.5, 0.5)]:
        gen = torch.Generator().manual_seed(0)
        state = gen.get_state()
        assert ShapedSampler(0.0, top_k, Shaping(top_p=top_p, min_p=min_p), gen)(logits) == plain == 1
        assert torch.equal(gen.get_state(), state)
    assert ShapedSampler(0.0, 0, Shaping(logit_bias=((2, 1.5),)), torch.Generator())(logits) == 2
    # a repeated argmax is penalized away: 1, then 3 (3.0 / 2 < 2.9), then 2 (2.9 / 2 < 2)
    rep = ShapedSampler(0.0, 0, Shaping(repetition_penalty=2.0), torch.Generator())
    assert [rep(logits) for _ in range(3)] == [1, 3, 2]
    freq = ShapedSampler(0.0, 0, Shaping(frequency_penalty=0.2), torch.Generator())
    assert [freq(logits) for _ in range(3)] == [1, 3, 1]  # 3.0; 3.0 - 0.2 < 2.9; 2.9 - 0.2 < 2.8
    # equal maxima: the lowest id, as torch.argmax of the plain logits
    tie = torch.tensor([0.0, 4.0, 4.0, 1.0])
    assert ShapedSampler(0.0, 0, Shaping(top_p=0.5), torch.Generator())(tie) == 1


def test_a_sampler_stops_when_proceed_says_so_and_a_non_finite_row_is_refused():
    s = ShapedSampler(1.0, 0, Shaping(top_p=0.9), torch.Generator(), proceed=lambda: False)
    assert s(torch.tensor([1.0, 2.0])) is None and s.counts == {}
    with pytest.raises(NonFiniteOutput):
        draw(torch.tensor([1.0, math.nan], dtype=torch.float64), 1.0, 0, 0.9, 0.0, torch.Generator())
    with pytest.raises(NonFiniteOutput):  # a temperature that overflows the logits
        draw(torch.tensor([1.0e300, 0.0], dtype=torch.float64), 1.0e-10, 0, 1.0, 0.0, torch.Generator())


# --- what the draw's exactness rests on -----------------------------------------------------------


def test_the_running_sums_are_added_in_index_order():
    """`_in_order` (torch.cumsum on the CPU) is the sequential loop, bit for bit, over values of
    very different sizes (where another order of addition would round otherwise)."""
    g = torch.Generator().manual_seed(3)
    w = torch.exp(torch.randn(100_000, dtype=torch.float64, generator=g) * 20.0)
    w[::7] = 0.0
    want = list(itertools.accumulate(w.tolist()))
    assert _in_order(w).tolist() == want


def test_the_ranking_is_by_value_then_token_id_without_sorting_the_vocabulary():
    g = torch.Generator().manual_seed(4)
    z = torch.randint(-20, 20, (5000,), generator=g).to(torch.float64) / 4.0  # many ties
    full = sorted(range(z.numel()), key=lambda i: (-z[i].item(), i))
    for m in (1, 7, 64, 333, 5000):
        assert _ranked(z, m).tolist() == full[:m]
    # the nucleus of a large vocabulary (grown in pieces) is the reference's, tie boundaries included
    x = z * 3.0
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        want = ref_draw(x.tolist(), 1.0, 0, 0.3, 0.0, next_u(gen))
        assert draw(x, 1.0, 0, 0.3, 0.0, gen) == want


# --- requests: ranges, refusals, and what the defaults leave as it was ---------------------------


def _generate(**kw) -> dict:
    return {"principal": "alice", "chunk_seq": 2, "max_tokens": 4, **kw}


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan),
    ("min_p", 1.0), ("min_p", -0.01),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", 3.0),
    ("presence_penalty", -math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {2**31: 1.0}),
    ("logit_bias", {5: True}), ("logit_bias", {"5": 1.0}),
])
def test_a_setting_out_of_range_is_refused_typed_naming_it(field, value):
    with pytest.raises(ApplicationError) as exc:
        generate_request(**_generate(**{field: value}))
    assert exc.value.type == InvalidRequest.reason and exc.value.non_retryable
    assert exc.value.details[0]["field"] == field, exc.value.details
    if (isinstance(value, float) and not math.isfinite(value)) or (isinstance(value, dict) and "5" in value):
        return  # not in JSON (NaN), or JSON's own form of a key (a string): the decoder takes it
    # as the workers decode a payload any client sent: refused typed there too
    body = json.dumps(_generate(**{field: value}))
    payload = Payload(metadata={"encoding": b"json/plain"}, data=body.encode())
    with pytest.raises(ApplicationError) as decoded:
        StreamPayloadConverter().from_payloads([payload], [GenerateRequest])
    assert decoded.value.type == InvalidRequest.reason and field in str(decoded.value)


def test_the_bounds_themselves_are_taken():
    req = generate_request(**_generate(top_p=1.0, min_p=0.0, frequency_penalty=-2.0, presence_penalty=2.0,
                                       repetition_penalty=1000.0, logit_bias={0: -100.0, 255: 100}))
    assert req.logit_bias == {0: -100.0, 255: 100.0}
    assert generate_request(**_generate(top_p=1e-9, min_p=0.999)).top_p == 1e-9


def test_a_bias_outside_the_vocabulary_is_refused_typed_naming_logit_bias():
    req = generate_request(**_generate(logit_bias={3: 1.0, 256: -5.0, 900: 2.0}))
    with pytest.raises(InvalidRequest) as exc:
        check_logit_bias(req, 256)
    assert exc.value.details() == {"field": "logit_bias", "value": 256, "limit": 256}
    check_logit_bias(req, 901)
    info = ModelInfo(model_id="m", model_revision="r", architecture="mamba2", vocab_size=256, input_transform="t",
                     input_transform_revision="r", schema_fingerprint="f", state_bytes=1)
    with pytest.raises(ApplicationError) as wf:
        check_logit_bias_in_workflow(req, info)
    assert wf.value.type == "InvalidRequest" and wf.value.details[0]["field"] == "logit_bias"
    check_logit_bias_in_workflow(req, None)  # the model not known: the activity refuses it


def test_the_defaults_change_nothing_a_chunk_was_before_them():
    """A generate without the later settings, or with them at their neutral values, samples with
    the engine's batched sampler (`Shaping.of` is None) and has the digest, signature and store
    key content it had before they existed."""
    before = {"chunk_seq", "max_tokens", "temperature", "top_k", "seed", "stop", "signature"}
    for req in (GenerateRequest(**_generate(seed=3, temperature=0.5)),
                GenerateRequest(**_generate(seed=3, temperature=0.5, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
                                            presence_penalty=0.0, repetition_penalty=1.0, logit_bias={}))):
        assert Shaping.of(req) is None and neutral_settings(req) == set(SHAPING_FIELDS)
        assert set(req.claims()) == {"principal", "chunk_seq", "max_tokens", "temperature", "seed"}
        kept = req.model_dump(mode="json", exclude={"principal", "stream", *neutral_settings(req)})
        assert set(kept) == before
    old = GenerateRequest(**_generate(seed=3, temperature=0.5))
    assert chunk_digest("generate", old) == chunk_digest("generate", GenerateRequest(**_generate(
        seed=3, temperature=0.5, top_p=1.0, logit_bias={})))
    one = GenerateRequest(**_generate(top_p=0.5))
    assert Shaping.of(one) == Shaping(top_p=0.5) and neutral_settings(one) == set(SHAPING_FIELDS) - {"top_p"}
    assert chunk_digest("generate", one) != chunk_digest("generate", old)


# --- through the generate activity ----------------------------------------------------------------

PROMPT = [72, 101, 108, 108, 111, 32]  # "Hello "
SETTINGS = {"temperature": 0.9, "top_k": 50, "top_p": 0.8, "min_p": 0.02, "frequency_penalty": 0.7,
            "presence_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {101: 2.5, 32: -100.0}}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-mamba2", backend="reference")


def _through_activities(requests: list[dict]) -> tuple[list, list[str]]:
    """Each generate request from the same prompt, on a stream of its own, through the
    activities; the store's keys of the last stream after its generate."""
    out, keys = generate_after(PROMPT, requests)
    return out, keys[-1]


def _reference_tokens(model, kw: dict) -> list[int]:
    """The tokens the settings specify, sampled by hand: the model's logits after the prompt and
    each token, adjusted and drawn by the reference above."""
    shaping = {k: kw.get(k, v) for k, v in
               {"logit_bias": {}, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "top_p": 1.0, "min_p": 0.0}.items()}
    out = model.advance(model.initial_state(), PROMPT)
    state, row = out.state, out.logits[-1]
    gen = torch.Generator().manual_seed(kw["seed"])
    counts: dict[int, int] = {}
    tokens: list[int] = []
    for _ in range(kw["max_tokens"]):
        x = ref_adjust(row.tolist(), bias=shaping["logit_bias"], rep=shaping["repetition_penalty"],
                       freq=shaping["frequency_penalty"], pres=shaping["presence_penalty"], counts=counts)
        u = next_u(gen)
        tok = ref_draw(x, kw["temperature"], kw.get("top_k", 0), shaping["top_p"], shaping["min_p"], u)
        if kw["temperature"]:
            torch.rand((), dtype=torch.float64, generator=gen)
        tokens.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        step = model.advance(state, [tok])
        state, row = step.state, step.logits[-1]
    return tokens


def test_a_generate_with_the_settings_samples_the_reference_tokens_seeded(model):
    """Through the activity and its engine: the hand reference's tokens; the same seed the same
    tokens, another seed others; greedy with a bias and a penalty the penalized argmax."""
    # tiny-mamba2's logits after the prompt are within +-0.5: a bias of 1 makes 108 the argmax, and
    # the penalties take it down once it is sampled
    greedy = {"temperature": 0.0, "top_p": 0.1, "min_p": 0.5, "logit_bias": {108: 1.0}, "presence_penalty": 2.0,
              "repetition_penalty": 50.0}
    asks = [{**SETTINGS, "max_tokens": 24, "seed": 7}, {**SETTINGS, "max_tokens": 24, "seed": 7},
            {**SETTINGS, "max_tokens": 24, "seed": 8}, {**greedy, "max_tokens": 6, "seed": 1}]
    (a, b, c, g), _ = _through_activities(asks)
    assert a.tokens == _reference_tokens(model, asks[0])
    assert (b.tokens, b.receipt.checksum, b.output_digest) == (a.tokens, a.receipt.checksum, a.output_digest)
    assert c.tokens != a.tokens and c.tokens == _reference_tokens(model, asks[2])
    assert 32 not in a.tokens + c.tokens  # banned by its bias of -100
    assert g.tokens == _reference_tokens(model, asks[3])
    assert g.tokens[0] == 108 and g.tokens.count(108) == 1  # biased to first, then penalized away
    assert a.position == len(PROMPT) + 24 and a.finish_reason == "length"


def test_a_bias_outside_the_vocabulary_is_refused_by_the_activity_before_any_work():
    ok = {"max_tokens": 4, "seed": 1}
    outs, keys = _through_activities([ok, {**ok, "logit_bias": {1000: 1.0}}])
    refused = outs[1]
    assert isinstance(refused, ApplicationError) and refused.type == "InvalidRequest"
    assert refused.details[0]["field"] == "logit_bias" and refused.non_retryable
    # nothing of the chunk was stored: the stream's keys are its open and its prompt's
    assert not any(".c2." in k for k in keys) and any(".c1." in k for k in keys)
