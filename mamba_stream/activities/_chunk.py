"""A chunk of a stream, advance or generate: prepared, run by the model's engine, committed; each
returns the result it committed (or the one an earlier attempt committed).

Prepared (`_prepare`, `_prior`, `_local_fits`): the request is the principal's, under the update
id that names its content; the receipt is the stream's, of the model that serves it; the result
an earlier attempt committed under the chunk's key is returned as it is; a local attempt that
would not finish in time declines. Run: the engine advances the state from its slot when the
slot holds that committed state (by state key, never by shape), otherwise after loading it from
the store (`StreamActivities._fetch`, a migration), batching the single-token steps of
concurrent streams. Committed (`_complete`) by the commit protocol (`activities._commit.ChunkCommit`:
derived keys, seal, put-if-absent, adoption of an earlier attempt's write, result records, drops,
and the commit edges the crash tests use, `StreamActivities._edge`): a chunk is never advanced
twice, whatever was lost.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from temporalio import activity

from mamba_stream.activities._engine import SeededSampler
from mamba_stream.activities._grammar import GrammarGuide, GrammarSampler, grammar_vocab
from mamba_stream.activities._guards import beat, cancel_point, live_wait
from mamba_stream.activities._live import LiveTokens
from mamba_stream.activities._sampling import (
    GenerateEnd,
    ShapedSampler,
    Shaping,
    check_logit_bias,
    generate_seed,
    neutral_settings,
    output_digest,
    top_k,
)
from mamba_stream.scan import Model, PositionLimit, State
from mamba_stream.state_codec import Receipt, stream_tag
from mamba_stream.state_codec.codec import Keyring, unseal
from mamba_stream.workflows import (
    PRESENTATION,
    AdvanceChunkRequest,
    AdvanceChunkResult,
    AdvanceResult,
    ChunkTooLarge,
    EmptyContext,
    GenerateChunkRequest,
    GenerateChunkResult,
    GenerateResult,
    InvalidRequest,
    LocalTooSlow,
    TokenProgress,
    UpdateIdMismatch,
    id_digest,
    parse_update_id,
)

if TYPE_CHECKING:
    from mamba_stream.activities._activities import StreamActivities

__all__ = ["UNMEASURED_LOCAL_ROUNDS", "advance", "generate"]

#: the most engine rounds a local attempt takes on before its engine has measured its pace
UNMEASURED_LOCAL_ROUNDS = 16


def advance(acts: StreamActivities, req: AdvanceChunkRequest, t0: float) -> AdvanceChunkResult:
    """Advance the stream by one chunk, exactly once (`t0`: when the attempt started)."""
    model = _prepare(acts, "advance", req)
    ask = req.request
    if ask.text is not None:
        if model.transform is None:
            raise InvalidRequest("this model has no input transform; send tokens")
        tokens = model.transform.encode(ask.text)
    else:
        tokens = list(ask.tokens or [])
    if len(tokens) > req.max_chunk_tokens:
        raise ChunkTooLarge(f"{len(tokens)} tokens exceed the chunk limit {req.max_chunk_tokens}",
                            limit=req.max_chunk_tokens, actual=len(tokens))
    model.check_tokens(tokens)  # typed InvalidInput before any work
    _check_room(model, req.receipt.position, len(tokens))
    digest = hashlib.sha256(f"advance|{ask.top_k}|".encode() + torch.tensor(tokens, dtype=torch.int64)
                            .numpy().tobytes()).hexdigest()
    key, prior = _prior(acts, req, model, digest)
    if prior is not None:  # an earlier attempt finished: its result, not a second advance
        return AdvanceChunkResult(result=AdvanceResult.model_validate(prior), worker_queue=acts.worker_queue)
    _local_fits(acts, model, 1 + len(tokens) // max(acts._engine_args["prefill_piece"], 1))
    cancel_point()
    acts._edge("admitted", req.stream_id, ask.chunk_seq)
    reference = _reference_input(acts, model, req.receipt, req.principal) if acts.drift.due() else None
    out = acts.engine(model).advance(
        req.stream_id, tokens, expected_key=req.receipt.state_key, epoch=req.receipt.epoch,
        load=lambda: acts._fetch(model, req.receipt, req.principal), on_wait=beat)
    state, logits, last = out.state, out.logits, out.last_logits
    labels = {"model": model.model_id, "kind": "advance"}
    acts.metrics.time_to_first_output.record(time.perf_counter() - t0, labels)
    acts.metrics.tokens.add(len(tokens), {"model": model.model_id, "kind": "prefill"})
    if reference is not None:
        acts.drift.sample(acts.metrics, model, reference, tokens, logits, state)
    backend = model.ran(out.path)

    def result(receipt: Receipt) -> AdvanceResult:
        return AdvanceResult(
            stream_id=req.stream_id, chunk_seq=ask.chunk_seq, position=receipt.position,
            n_tokens=len(tokens), receipt=receipt, top_k=top_k(last, ask.top_k),
            output_digest=output_digest(logits), backend=backend)

    done = _complete(acts, model, req.stream_id, req.principal, req.receipt, ask.chunk_seq, key, state,
                     out.path, last, result, req.drop_keys)
    acts._gauge()
    return AdvanceChunkResult(result=done, worker_queue=acts.worker_queue)


def generate(acts: StreamActivities, req: GenerateChunkRequest, t0: float) -> GenerateChunkResult:
    """Sample tokens with a seeded generator; each one advances the state like input.

    The generation ends after `max_tokens` ("length"), after the token that completes one of
    the `stop` texts ("stop"), or after the model's end-of-sequence token
    (`Model.eos_token_ids`: "eos"), whichever comes first; a token that completes a stop text
    and is an end-of-sequence token too ends it as "stop" (`GenerateEnd`). The token that ends
    it, stop text's or end-of-sequence, is one of the chunk's tokens: it was sampled, so it
    advanced the state like any other, and the committed position is the input's plus every
    token returned. Where the stop is decided (here, between the engine's rounds) and what it
    depends on (the sampled tokens, the model) are deterministic, so a retry stops at the same
    token, and the chunk commits once.

    With a grammar (`GenerateRequest.grammar`, `activities._grammar`), the tokens it does not
    allow are masked before each draw, and the generation ends "stop" where it is complete. A
    grammar llguidance does not compile, or a model it cannot match, is refused here, typed
    `InvalidRequest` naming `grammar`, before anything runs (the workflow cannot load llguidance:
    it checks only the grammar's form).
    """
    model = _prepare(acts, "generate", req)
    ask = req.request
    check_logit_bias(ask, model.vocab_size)  # typed, before any work (the stream checks it too)
    # compiled per attempt, before any work: a matcher is the state of one generate
    guide = GrammarGuide(ask.grammar, grammar_vocab(model)) if ask.grammar is not None else None
    # a hybrid's stream ends its generation at its position bound ("length"), as at max_tokens;
    # a stream already there is refused, typed
    room = _check_room(model, req.receipt.position, 1)
    seed = generate_seed(req.stream_id, ask.chunk_seq, ask.seed)
    # how the chunk is shown (PRESENTATION) is not what it is; the later settings at their
    # defaults (a grammar of None too) are left out, so a chunk committed before they existed
    # keeps its key
    digest = hashlib.sha256(
        json.dumps(ask.model_dump(mode="json", exclude={"principal", *PRESENTATION, *neutral_settings(ask)})
                   | {"seed": seed}, sort_keys=True).encode()
    ).hexdigest()
    key, prior = _prior(acts, req, model, digest)
    if prior is not None:  # an earlier attempt finished: its result, not a second generate
        return GenerateChunkResult(result=GenerateResult.model_validate(prior), worker_queue=acts.worker_queue)
    _local_fits(acts, model, ask.max_tokens)
    cancel_point()
    acts._edge("admitted", req.stream_id, ask.chunk_seq)
    gen = torch.Generator().manual_seed(seed)
    transform = model.transform
    live = None
    if ask.stream and activity.in_activity() and not activity.info().is_local:
        # its tokens go out as this activity's heartbeats (a local activity has none: its
        # tokens come whole, with its result)
        live = LiveTokens(TokenProgress(chunk_seq=ask.chunk_seq, epoch=req.receipt.epoch,
                                        update_id=req.update_id, offset=req.log_offset,
                                        attempt=activity.info().attempt),
                          transform.decode if transform is not None else None)
    end = GenerateEnd(model, ask.stop, acts.metrics, t0, live, guide.complete if guide is not None else None)
    # the engine samples the streams of one round together (same tokens as one by one); the later
    # settings adjust each row by what this generate sampled before it, and a grammar masks each
    # row by it, so theirs go row by row
    shaping = Shaping.of(ask)
    sampler: SeededSampler | ShapedSampler | GrammarSampler
    if guide is not None:
        sampler = GrammarSampler(ask.temperature, ask.top_k, shaping, gen, guide, proceed=end.proceed,
                                 taken=end.taken)
    elif shaping is None:
        sampler = SeededSampler(ask.temperature, ask.top_k, gen, proceed=end.proceed, taken=end.taken)
    else:
        sampler = ShapedSampler(ask.temperature, ask.top_k, shaping, gen, proceed=end.proceed, taken=end.taken)
    try:
        out = acts.engine(model).generate(
            req.stream_id, sampler, min(ask.max_tokens, room), expected_key=req.receipt.state_key,
            epoch=req.receipt.epoch, load=lambda: acts._fetch(model, req.receipt, req.principal),
            on_wait=beat if live is None else live_wait(live), wake=live.wake if live is not None else None)
    except ValueError as exc:
        raise EmptyContext(str(exc)) from None
    tokens, state, logits, rows = out.tokens, out.state, out.last_logits, [out.logits]
    finish = end.finished(tokens)
    backend = model.ran(out.path)
    text = transform.decode(tokens) if transform is not None else None

    def result(receipt: Receipt) -> GenerateResult:
        return GenerateResult(
            stream_id=req.stream_id, chunk_seq=ask.chunk_seq, position=receipt.position, tokens=tokens,
            text=text, finish_reason=finish, receipt=receipt, output_digest=output_digest(torch.cat(rows)),
            backend=backend)

    done = _complete(acts, model, req.stream_id, req.principal, req.receipt, ask.chunk_seq, key, state,
                     out.path, logits, result, req.drop_keys)
    acts.metrics.tokens.add(len(tokens), {"model": model.model_id, "kind": "decode"})
    acts._gauge()
    return GenerateChunkResult(result=done, worker_queue=acts.worker_queue)


# --- prepare --------------------------------------------------------------------------------


def _check_room(model: Model, position: int, length: int) -> int:
    """The positions left to a stream at `position` (its model's `max_positions`, where it has
    attention layers: their KV rows); PositionLimit, before any work, where `length` more tokens
    do not fit. A model without a bound has room for anything."""
    limit = model.config.max_positions
    if limit is None:
        return 1 << 62
    if position + length > limit:
        raise PositionLimit(f"the stream at position {position} cannot take {length} more tokens: model "
                            f"{model.model_id!r} holds at most max_positions={limit} per stream",
                            limit=limit, actual=position + length)
    return limit - position


def _prepare(acts: StreamActivities, kind: str, req: AdvanceChunkRequest | GenerateChunkRequest) -> Model:
    """The prologue of a chunk, before any work: the request is the principal's
    (`StreamActivities._verify`) under the update id that names it, and the receipt is this
    stream's, of the model that serves it (returned)."""
    acts._verify(kind, req.stream_id, req.principal, req.request)
    _check_update_id(acts.keyring, kind, req.stream_id, req.update_id, req.request)
    model = acts._model(req.receipt.model_id)
    acts._check(model, req.receipt, req.principal, req.stream_id)
    return model


def _check_update_id(keyring: Keyring, kind: str, stream_id: str, update_id: str | None, request: Any) -> None:
    """An update id made by `workflows.update_id` names this chunk's content: its digest is the
    content's, keyed by the stream's id key (which only the principal and the workers hold)."""
    named = parse_update_id(update_id) if update_id else None
    if named is None:
        return
    want = id_digest(keyring.id_key(stream_tag(stream_id)), kind, request)
    if not hmac.compare_digest(named[3], want):
        raise UpdateIdMismatch(f"update id {update_id!r} does not name this {kind}'s content", update_id=update_id)


def _prior(acts: StreamActivities, req: AdvanceChunkRequest | GenerateChunkRequest, model: Model, digest: str
           ) -> tuple[str, Any | None]:
    """The chunk's key in the commit protocol (its stream, receipt, sequence and content
    `digest`), and the result an earlier attempt committed under it, if one did (None: this
    attempt computes it). An earlier attempt may have died before its bookkeeping: its drops
    are done again."""
    key = acts.commits.chunk_key(req.stream_id, req.receipt, req.request.chunk_seq, digest)
    prior = acts.commits.prior(key, req.principal)
    if prior is None:
        return key, None
    acts.metrics.duplicate_chunks.add(1, {"model": model.model_id})
    acts.commits.drop(req.drop_keys, stream_id=req.stream_id, principal=req.principal, model=model)
    return key, prior.result


def _local_fits(acts: StreamActivities, model: Model, rounds: int) -> None:
    """In a local attempt, decline a chunk the engine would not finish within half the local
    timeout at its recent pace (a busy engine): the workflow takes the regular path at once,
    instead of holding its workflow task open and then racing a timed-out attempt."""
    if not activity.in_activity() or not activity.info().is_local:
        return
    timeout = activity.info().start_to_close_timeout
    expected = acts.engine(model).expected_seconds(rounds)
    if expected is None and rounds > UNMEASURED_LOCAL_ROUNDS:
        # an engine that has not run yet has no pace: a long chunk on a large model could
        # hold the workflow task past the local timeout
        raise LocalTooSlow(f"{rounds} engine rounds on an engine that has not measured its pace yet")
    if timeout is not None and expected is not None and expected > 0.5 * timeout.total_seconds():
        raise LocalTooSlow(f"{rounds} engine rounds take about {expected:.2f} s now; the local timeout is "
                           f"{timeout.total_seconds():g} s", expected_s=round(expected, 3))


def _reference_input(acts: StreamActivities, model: Model, receipt: Receipt, principal: str) -> State | None:
    """The chunk's input state, read from the store for the reference check (None if gone)."""
    blob = acts.store.get(key=receipt.state_key, owner=acts.commits.owner(principal), legacy=principal)
    return None if blob is None else unseal(blob, receipt, acts.keyring, model=model, principal=principal,
                                            segments=acts.commits.segments.reader(principal))


# --- commit ---------------------------------------------------------------------------------


def _complete(acts: StreamActivities, model: Model, stream_id: str, principal: str, before: Receipt, chunk_seq: int,
              key: str, state: State, path: str, last: torch.Tensor | None,
              make_result: Callable[[Receipt], Any], drop_keys: list[str]) -> Any:
    """A computed chunk through the commit protocol; the slot then holds exactly the committed state."""
    cancel_point()  # the slot ran ahead of the store: the stream's next chunk reloads from there
    done = acts.commits.complete(model, state, stream_id=stream_id, principal=principal, before=before,
                                 chunk_seq=chunk_seq, key=key, path=path, last=last, make_result=make_result,
                                 drop_keys=drop_keys)
    engine, committed = acts.engine(model), done.committed
    if committed.adopted:  # the engine wrote ours; the store holds an earlier attempt's
        engine.put(stream_id, committed.state, epoch=before.epoch, state_key=key, logits=last)
    else:
        engine.mark_committed(stream_id, key)
    return done.result
