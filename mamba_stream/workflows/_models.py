"""Requests and results of the stream workflow (pydantic; sandbox-safe); its activities' are in
`workflows.contract`.

One model in, one model out, for every update, signal, query and activity; new fields are
optional, so histories written by an older version still decode.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from mamba_stream.state_codec import Receipt

__all__ = [
    "MAX_GRAMMAR_BYTES",
    "MAX_LOGIT_BIAS",
    "MAX_PREFIX_TOKENS",
    "PRINCIPAL_MEMO",
    "STREAM_MEMO",
    "STREAM_WORKFLOW_TYPE",
    "TIMEOUT_FLOORS",
    "AdvanceRequest",
    "AdvanceResult",
    "CancelRequest",
    "CarriedStream",
    "CarrySeal",
    "CheckpointRequest",
    "CheckpointResult",
    "GenerateRequest",
    "GenerateResult",
    "Grammar",
    "ModelInfo",
    "OpenStreamInput",
    "RecentResult",
    "ReleaseRequest",
    "ReleaseResult",
    "ResetRequest",
    "RewindRequest",
    "RewindResult",
    "StreamCarry",
    "StreamOptions",
    "StreamStats",
    "TokenLogprob",
]

#: the Temporal workflow type of `MambaStreamWorkflow` (the CLI lists streams by it)
STREAM_WORKFLOW_TYPE = "MambaStream"
#: the memo field a workflow that owns a stream (`ModelStream.open`) carries, its value the model's id
#: (encrypted as every payload): the CLI lists agents' streams by it. Its name is in clear.
STREAM_MEMO = "mamba_stream"
#: the memo field of an agent workflow whose model is a stream (`conversation_start`): its
#: principal, sealed by the principal's keyring (who sealed it is checked, not just what it says)
PRINCIPAL_MEMO = "mamba_stream.principal"

class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Sealed(BaseModel):
    """Who sealed a decoded value travels beside it (`state_codec.sealer_of`), never serialized:
    the payload converter sets it. It is not part of the value: two values equal field for field
    are equal, whoever sealed them."""

    _sealer: str | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BaseModel) and type(other) is type(self):
            return self.__dict__ == other.__dict__
        return NotImplemented


class _ActivityResult(_Sealed, _Model):
    """An activity's result. Who sealed it travels beside it, as a request's does: the workers seal
    it under the stream's key, and anyone who reaches the frontend can complete a running activity
    by its id with a result of their own (`ModelStream._call` takes only the workers')."""


class SealedRequest(_Sealed, _Model):
    """A request from a caller: no coercion ("7" is not 7, true is not 1), no NaN or infinity,
    every number bounded. A request that does not validate is refused before it reaches history.
    Who sealed it (the key that opened its payload) travels beside it (`_Sealed`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


#: what a result's `backend` says (`scan.Model.ran` builds it)
BACKEND_RAN = 'the backend and the path of it that ran, "<backend>:<path>" ("exact:fused", "reference:open")'
#: the largest chunk sequence, epoch or count a request may name (far beyond any real stream)
MAX_INDEX = 2**53
#: token ids fit int32 in every vocabulary we serve
_Token = Annotated[int, Field(ge=0, lt=2**31)]


_SIGNATURE = Field(default=None, description="Ed25519 signature of the request by its principal "
                   "(state_codec.signing); required by workers configured with principals' keys")


class _Signed(SealedRequest):
    """A request a client may sign: its claims are its fields but the signature."""

    signature: str | None = _SIGNATURE

    def claims(self) -> dict:
        """The signed fields. Fields at their defaults are left out, so a field added later with a
        default leaves the signatures of older clients valid."""
        return self.model_dump(mode="json", exclude={"signature"}, exclude_defaults=True)


def open_claims(principal: str, model_id: str, input_transform: str | None, resume: Receipt | None,
                prefix: str | list[int] | None = None) -> dict:
    """The signed fields of opening a stream (the start input carries more than the activity sees)."""
    claims: dict = {"principal": principal, "model_id": model_id}
    if input_transform is not None:
        claims["input_transform"] = input_transform
    if resume is not None:
        claims["resume"] = resume.model_dump(mode="json")
    if prefix is not None:
        claims["prefix"] = prefix
    return claims


#: the most tokens a prefix may name in a start input (`StreamOptions.max_prefix_tokens`' bound): as
#: JSON about 7 bytes each, well inside the server's 2 MiB payload limit
MAX_PREFIX_TOKENS = 131072
#: StreamOptions.max_prefix_tokens' default
DEFAULT_PREFIX_TOKENS = 65536

_PREFIX = Field(default=None, description="a prefix the stream starts from (text, encoded by the model's input "
                "transform, or token ids): the stream opens at the prefix's end, from the prefix store when it "
                "holds the prefix or a shorter one of it (an exact arithmetic only), computing the rest once. "
                "Empty: an ordinary open")


#: the largest share of the workflow task timeout a local attempt may take (`StreamOptions.local_timeout_s`)
LOCAL_SHARE = 0.5

#: the least each client-settable timeout may be (seconds), enforced where the workers decode a
#: stream's start input (a lower value is refused `InvalidRequest`): a timeout a loaded worker cannot
#: meet turns healthy attempts into abandoned ones that still run, and retries that repeat them.
#: Each field's description says why its floor is what it is. Every value the project has used
#: (the defaults, the tests' short timeouts) is above them, so histories that used them still decode.
TIMEOUT_FLOORS: dict[str, float] = {
    "activity_timeout_s": 10.0,
    "heartbeat_timeout_s": 2.0,
    "schedule_to_start_s": 1.0,
    "local_timeout_s": 1.0,
    "task_timeout_s": 2.0,
}


class StreamOptions(SealedRequest):
    """Per-stream knobs, fixed at open time. Timeouts have floors (`TIMEOUT_FLOORS`)."""

    affinity: bool = Field(default=True, description="send activities to the worker holding the hot state")
    checkpoints_kept: int = Field(default=4, ge=1, le=4096, description="the rewind window: a rewind reaches "
                                  "any of the stream's newest checkpoints_kept checkpoints, and a rewind after a "
                                  "rewind any of its own window's; the store holds up to 2 x checkpoints_kept - 1 "
                                  "of them (a checkpoint leaves it once out of the window for a whole window), "
                                  "each one state (ModelInfo.state_bytes) and its result record")
    max_chunk_tokens: int = Field(default=65536, ge=1, le=2**24)
    max_text_bytes: int = Field(default=262144, ge=1, le=2**26)
    max_generate_tokens: int = Field(default=4096, ge=1, le=2**20)
    max_prefix_tokens: int = Field(default=DEFAULT_PREFIX_TOKENS, ge=1, le=MAX_PREFIX_TOKENS,
                                   description="the most tokens an open's prefix may hold (it is computed in "
                                   "pieces, whatever max_chunk_tokens is); its text is bounded by max_text_bytes")
    recent_results: int = Field(default=256, ge=1, le=65536,
                                description="results kept to deduplicate across continue-as-new")
    carry_bytes: int = Field(default=262144, ge=4096, le=1 << 24,
                             description="bytes of recent results carried across continue-as-new in full (JSON); "
                             "older ones cross as their digests and are answered from the store's records; "
                             "keep it well under the server's limit.blobSize.error (2 MiB by default)")
    activity_timeout_s: float = Field(
        default=600.0, ge=TIMEOUT_FLOORS["activity_timeout_s"], le=86400.0,
        description="a regular attempt's start-to-close timeout. At least 10 s: an attempt loads the state from "
        "the store and commits the new one (seal, write, fsync of the whole state: 19 MB for a 130M Mamba-2) "
        "without heartbeating, and on a loaded box a shorter limit fails healthy attempts whose retries "
        "repeat the work")
    heartbeat_timeout_s: float = Field(
        default=30.0, ge=TIMEOUT_FLOORS["heartbeat_timeout_s"], le=86400.0,
        description="a regular attempt heartbeats once a second while it waits on the engine; past this "
        "without one, the server retries the chunk elsewhere. At least 2 s: one late beat on a loaded box "
        "(a busy event loop, a long kernel call) must not time out a healthy attempt")
    schedule_to_start_s: float = Field(
        default=10.0, ge=TIMEOUT_FLOORS["schedule_to_start_s"], le=86400.0,
        description="wait for the affine worker, then rebind. At least 1 s: the worker's own queue costs a "
        "transfer-queue hop (50-100 ms at the server's default dynamic config) and a poll, and a loaded "
        "worker that is merely slow to poll would otherwise lose its streams to the shared queue (each "
        "move reloads the state from the store)")
    retry_max_attempts: int = Field(default=0, ge=0, le=10000,
                                    description="0: retry transient failures until they pass")
    local_chunks: bool = Field(default=True, description="run short chunks as local activities: on the worker "
                               "whose cache holds the workflow (and the stream's hot state), with no task queue "
                               "or server hop in between; a longer chunk, or a failed local attempt, takes the "
                               "regular activity path. Every worker that runs stream workflows must then serve "
                               "the stream activities too (worker.py's all do): a workflows-only worker fails "
                               "the workflow task, and a worker that can run it takes it over")
    local_max_tokens: int = Field(default=256, ge=0, le=2**20,
                                  description="the longest chunk run locally: tokens fed (a text's bytes) or "
                                  "max_tokens of a generate")
    local_timeout_s: float = Field(default=5.0, ge=TIMEOUT_FLOORS["local_timeout_s"], le=3600.0,
                                   description="a local attempt's deadline, from when it is scheduled (waiting "
                                   "for a free slot counts); past it the chunk takes the regular path. A workflow "
                                   "task is held open while its local activities run: the deadline is capped at "
                                   "half of task_timeout_s, the rest being the worker's margin for the task's own "
                                   "work on a loaded box (at most 0.8 x task_timeout_s may be set). At least 1 s: "
                                   "a short chunk takes tens of milliseconds on a warm worker, and an attempt that "
                                   "times out is not stopped but abandoned (it ends at its next safe point), so a "
                                   "limit a loaded box cannot meet would run every chunk twice")
    token_log_events: int = Field(default=1024, ge=1, le=65536,
                                  description="entries of the token log kept for readers that subscribe late or "
                                  "reconnect; across continue-as-new the newest carry_bytes/4 of them")
    task_timeout_s: float = Field(default=10.0, ge=TIMEOUT_FLOORS["task_timeout_s"], le=120.0,
                                  description="the stream's workflow task timeout: how long a worker that died "
                                  "inside a workflow task (a local chunk) holds the stream up. At least 2 s: "
                                  "it must hold a local attempt at its floor (0.8 x 2 s) and the task's own "
                                  "work on a loaded box; a workflow task that times out is retried from the "
                                  "start. The workflow refuses to run under a shorter one than its start "
                                  "request set")

    @model_validator(mode="after")
    def _local_fits_the_task(self) -> StreamOptions:
        if self.local_chunks and self.local_timeout_s > 0.8 * self.task_timeout_s:
            # past 80% of its timeout the SDK sends heartbeat workflow tasks: a local chunk that
            # long is a regular activity's work
            raise ValueError(f"local_timeout_s {self.local_timeout_s} must be at most 0.8 x task_timeout_s "
                             f"({0.8 * self.task_timeout_s:g})")
        return self

    @property
    def local_deadline_s(self) -> float:
        """A local attempt's deadline: `local_timeout_s`, at most `LOCAL_SHARE` of the task timeout
        (the cap applies at use, so start inputs that were valid before it still decode)."""
        return min(self.local_timeout_s, LOCAL_SHARE * self.task_timeout_s)


class ModelInfo(_Model):
    """What the workflow needs to know of the serving model (no tensors)."""

    model_id: str
    model_revision: str
    architecture: str
    vocab_size: int
    input_transform: str
    input_transform_revision: str
    schema_fingerprint: str
    state_bytes: int


class StreamStats(_Model):
    """The `stats` query: counters of one stream, carried across continue-as-new."""

    stream_id: str = ""
    principal: str = ""
    model_id: str = ""
    position: int = 0
    epoch: int = 0
    chunk_seq: int = 0
    chunks: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    duplicates: int = Field(default=0, description="repeated update ids answered by this workflow "
                            "(after continue-as-new; within a run the server answers them itself)")
    resets: int = 0
    operator_resets: int = Field(default=0, description="resets the operator sent (sealed under the workers' key)")
    rejected_resets: int = Field(default=0, description="reset signals refused: another principal, a stale "
                                 "epoch, a missing or invalid argument, a bad signature")
    last_refusal: str = Field(default="", description="the newest refused signal or cancel: its kind, reason "
                              "and message (a refused update tells its caller instead)")
    unknown_signals: int = Field(default=0, description="signals of a name the stream does not have: "
                                 "counted, nothing changed")
    migrations: int = 0
    local_chunks: int = Field(default=0, description="chunks committed by a local activity (the rest: regular ones)")
    local_fallbacks: int = Field(default=0, description="local attempts that failed and went the regular path")
    regular_until: int = Field(default=0, description="chunks up to this sequence take the regular path: a local "
                               "attempt of the stream timed out (a loaded worker), so the next few do not try")
    continued_as_new: int = 0
    forced_moves: int = Field(default=0, description="continue-as-new forced by a history near the server's "
                              "limits while a chunk ran (the chunk was stopped and sent again to the next run)")
    version_moves: int = Field(default=0, description="continue-as-new onto a new worker deployment version")
    last_backend: str = Field(default="", description=BACKEND_RAN + ", of the last state committed")
    arithmetic: str = Field(default="", description="the current state's arithmetic id (what decided its bits)")
    arithmetic_changes: int = Field(default=0, description="chunks that continued the state under another "
                                    "arithmetic (a move to a worker whose bits differ)")
    cancelled: bool = False
    cancelled_by: Literal["", "principal", "operator"] = Field(
        default="", description="who cancelled the stream: its principal or the operator (a sealed `cancel`)")
    refused_cancels: int = Field(default=0, description="cancellations refused: a bare Temporal cancel request "
                                 "(it carries no key) or a `cancel` sealed by someone else")
    rewinds: int = Field(default=0, description="rewinds to an earlier chunk (each moved the stream to a new run)")
    forged_results: int = Field(default=0, description="activity results the workers did not seal (an activity "
                                "completed by its id from outside): dropped, and the activity run again")
    next_seq: int | None = Field(default=None, description="the chunk_seq a chunk sent now takes: after the "
                                 "committed one and those in flight (the `stats` query's answer; None where the "
                                 "stats are carried or recorded)")


class TokenLogprob(_Model):
    token: int
    logprob: float


class AdvanceRequest(_Signed):
    """Feed a chunk: token ids or text (encoded by the stream's input transform), not both."""

    principal: str
    chunk_seq: int = Field(ge=1, le=MAX_INDEX, description="must be exactly the stream's last chunk_seq + 1")
    tokens: list[_Token] | None = None
    text: str | None = None
    top_k: int = Field(default=5, ge=0, le=100)

    @model_validator(mode="after")
    def _one_input(self) -> AdvanceRequest:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("give exactly one of tokens and text")
        return self


class AdvanceResult(_Model):
    stream_id: str
    chunk_seq: int
    position: int
    n_tokens: int
    receipt: Receipt
    top_k: list[TokenLogprob] = Field(description="log-probabilities of the most likely next tokens")
    output_digest: str = Field(description="sha256 of the chunk's float32 logits, all positions")
    backend: str = Field(description=BACKEND_RAN)
    duplicate: bool = False


#: the most entries a generate's `logit_bias` may hold
MAX_LOGIT_BIAS = 4096


#: the largest grammar a generate may carry, in UTF-8 bytes of its source
MAX_GRAMMAR_BYTES = 64 * 1024


class Grammar(_Model):
    """What a generate's tokens must spell (`GenerateRequest.grammar`): at each token, the tokens
    that cannot continue the grammar are taken out before the draw, and the generate ends
    ("stop") where the grammar is complete. Matched by llguidance in the activity
    (`activities._grammar`); here only its form is checked (the workflow cannot load it): the
    kind, the size, and that a JSON schema is a JSON object. A grammar llguidance does not
    compile is refused by the activity, typed `InvalidRequest` naming `grammar`, before anything
    runs."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kind: Literal["lark", "json_schema", "regex"] = Field(description="lark: a Lark grammar in llguidance's "
                                                          "dialect (it may embed a schema: `%json {...}`); "
                                                          "json_schema: a JSON schema, as JSON text; regex: a "
                                                          "regular expression the whole output matches")
    source: str = Field(min_length=1, max_length=MAX_GRAMMAR_BYTES,
                        description=f"the grammar's text, at most {MAX_GRAMMAR_BYTES} bytes of UTF-8")

    @model_validator(mode="after")
    def _bounded_and_formed(self) -> Grammar:
        # max_length counts characters: a character is up to 4 bytes
        size = len(self.source.encode("utf-8", errors="surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the grammar's source is {size} bytes; at most {MAX_GRAMMAR_BYTES}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as exc:
                raise ValueError(f"a json_schema grammar's source is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("a json_schema grammar's source is a JSON object")
        return self


class GenerateRequest(_Signed):
    """Sample up to max_tokens; seeded, so a retry or replay samples the same tokens.

    The settings after `stop` came later (issue 48): each defaults to the value that changes
    nothing, is left out of the chunk's digest and signature at that value (`claims`), and with
    all of them there a generate samples exactly as before they existed. How each one acts, and in
    which order, is `activities._sampling.ShapedSampler`'s docstring and docs/lifecycle.md
    ("Sampling"); `grammar`'s, `activities._grammar`'s and docs/lifecycle.md ("Grammars")."""

    principal: str
    chunk_seq: int = Field(ge=1, le=MAX_INDEX)
    max_tokens: int = Field(ge=1, le=2**20)
    temperature: float = Field(default=1.0, ge=0.0, le=1000.0, description="0: greedy")
    top_k: int = Field(default=0, ge=0, le=2**31, description="0: no top-k filter")
    seed: int | None = Field(default=None, ge=0, lt=2**63,
                             description="None: derived from the stream and chunk_seq; else in [0, 2**63)")
    stop: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list, max_length=64,
                                                                description="stop after any of these texts")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus: sample from the likeliest tokens whose "
                         "probabilities (after top_k) sum to at least top_p; 1: no cut. Not applied at temperature 0")
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0, description="drop the tokens less likely than min_p times the "
                         "likeliest one; 0: none dropped. Not applied at temperature 0")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="subtracted from a token's logit "
                                     "once per time this generate has sampled it (OpenAI's)")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="subtracted from a token's logit "
                                    "once if this generate has sampled it (OpenAI's)")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=1000.0, description="a token this generate has "
                                      "sampled has a positive logit divided by it, a negative one multiplied "
                                      "(transformers'); 1: none")
    logit_bias: dict[_Token, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS, description="token id -> added to its logit, in [-100, "
        "100]; every id must be in the model's vocabulary")
    grammar: Grammar | None = Field(default=None, description="what the tokens must spell (a Lark grammar, a "
                                    "JSON schema or a regex): at each token the ones that cannot continue it "
                                    "are taken out, after the settings above, and the generate ends with "
                                    "finish_reason \"stop\" where it is complete; None: no constraint")
    stream: bool = Field(default=False, description="show the tokens as they are sampled: the activity "
                         "heartbeats them (`TokenProgress`) and readers poll (`StreamClient.generate_stream`, "
                         "`tokens`). Presentation only: not part of the chunk's content, its digest or its "
                         "state key, and the chunk still commits once, whole")


class GenerateResult(_Model):
    stream_id: str
    chunk_seq: int
    position: int
    tokens: list[int]
    text: str | None = None
    finish_reason: Literal["length", "stop", "eos"] = Field(description=(
        "length: max_tokens sampled; stop: the last token completed a stop text, or the request's grammar "
        "(nothing can follow it but its end); eos: the last token is the model's end-of-sequence token. "
        "The token that ended it is in `tokens` and in the state"))
    receipt: Receipt
    output_digest: str
    backend: str = Field(description=BACKEND_RAN)
    duplicate: bool = False


class ResetRequest(_Signed):
    """Payload of the `reset` signal: `{"principal": "..."}`."""

    principal: str
    epoch: int | None = Field(default=None, ge=1, le=MAX_INDEX, description="the epoch this reset begins; when "
                              "given, a reset arriving for any other epoch is refused (a signed reset gives it, so "
                              "replaying its signal resets nothing)")
    revoke: bool = Field(default=False, description="also delete every checkpoint of the earlier epochs, pinned "
                         "ones included, so that no receipt handed out before the reset resumes them; default: "
                         "pinned checkpoints survive a reset (the rewind window of the old epoch too)")


class CheckpointRequest(_Signed):
    principal: str
    at_seq: int | None = Field(default=None, ge=0, le=MAX_INDEX, description="the chunk whose checkpoint to hand "
                               "out (one of the rewind window's; 0: the opened state); None: the state now. "
                               "`StreamClient.fork` opens a new stream from it")


class CheckpointResult(_Model):
    stream_id: str
    receipt: Receipt


class CancelRequest(_Signed):
    """Payload of the `cancel` signal: the stream's principal (or the operator) ends it, and its
    state is destroyed. A Temporal cancel request alone carries no key and is refused; the one
    that follows this signal ends the run as cancelled (`StreamClient.cancel` sends both)."""

    principal: str


class ReleaseRequest(_Signed):
    """The `release` update: a checkpoint the stream handed out (`checkpoint`, `fork`) is no longer
    needed; it leaves the store with the stream's next chunk, unless it is still in the rewind
    window (then it leaves as the window moves on, like any checkpoint)."""

    principal: str
    state_key: str = Field(min_length=1, max_length=300, description="the handed-out receipt's state_key")


class ReleaseResult(_Model):
    stream_id: str
    state_key: str
    pinned: int = Field(description="holds of handed-out checkpoints the stream still keeps for others")


class RewindRequest(_Signed):
    """The `rewind` update: go back to just after chunk `to_seq` (0: the opened state)."""

    principal: str
    to_seq: int = Field(ge=0, le=MAX_INDEX)


class RewindResult(_Model):
    stream_id: str
    chunk_seq: int
    position: int
    receipt: Receipt = Field(description="the state the stream continues from, in its next run")


class RecentResult(_Model):
    """A finished update, kept to answer its id again after continue-as-new."""

    update_id: str
    advance: AdvanceResult | None = None
    generate: GenerateResult | None = None
    digest: str | None = Field(default=None,
                               description="the request's `chunk_digest` (None: recorded before it existed)")
    kind: Literal["advance", "generate"] | None = Field(default=None, description="set on a digest-only entry")
    chunk_seq: int | None = Field(default=None, description="set on a digest-only entry")
    state_key: str | None = Field(default=None, description="set on a digest-only entry: where its result is recorded")


class TokenEvent(_Model):
    """Tokens of one generate chunk, as a reader sees them: an entry of the stream's token log, or
    a piece of a streamed generate shown live (from its activity's heartbeats).

    A chunk's events are its tokens in order, `index` counting from 0 within the chunk; the last
    one has `done` set (with the finish reason, or the failure's reason in `error`). `restart`:
    the tokens shown while the chunk ran were not the ones it committed (a retry on an
    approximate backend sampled others); this event holds all of them, from index 0.
    """

    offset: int = Field(default=0, description="the log entry that holds (or, shown live, will hold) the chunk; "
                        "-1: not known to the reader")
    chunk_seq: int
    epoch: int = 0
    index: int = 0
    tokens: list[int] = Field(default_factory=list)
    text: str | None = Field(default=None, description="the tokens' text, where the model has an input transform")
    done: bool = False
    finish_reason: Literal["length", "stop", "eos"] | None = None
    error: str | None = Field(default=None, description="the reason the chunk failed (a catalogue class name)")
    restart: bool = False
    update_id: str | None = Field(default=None, description="the generate update that made these tokens")


#: how often a streaming generate's activity heartbeats its newest tokens (at most), and the
#: worker's heartbeat throttle (`MambaStreamPlugin`): readers see tokens about this late
PROGRESS_INTERVAL_S = 0.1
#: the most a streaming generate's progress holds, in JSON bytes: its newest tokens and text that
#: fit (a heartbeat's details live in the server's mutable state and every describe returns them)
PROGRESS_BYTES = 64 * 1024


class TokenProgress(_Model):
    """A streaming generate's newest tokens, as its activity heartbeats them (presentation only).

    Not history: heartbeat details live in the server's record of the pending activity, and a
    reader gets them from `describe` (encrypted under the stream's principal's history key, like
    every payload). Each heartbeat replaces the last one. It holds the newest tokens and stable
    text that fit `PROGRESS_BYTES`: `start` is the index of tokens[0] within the chunk and
    `text_start` the index of text[0] within the chunk's text, so a reader that fell further
    behind gets the rest from the committed result.
    """

    chunk_seq: int
    epoch: int
    update_id: str | None = None
    offset: int | None = Field(default=None, description="the log entry the chunk will take")
    attempt: int = 1
    start: int = 0
    tokens: list[int] = Field(default_factory=list)
    text_start: int = 0
    text: str | None = Field(default=None, description="stable text: no trailing incomplete character")


#: the most token-log entries one read returns by default (`ReadTokensRequest.max_events`)
READ_EVENTS = 256


class ReadTokensRequest(SealedRequest):
    """Read a stream's token log from `from_offset` (the `read_tokens` query)."""

    from_offset: int = Field(default=0, ge=0, le=MAX_INDEX)
    chunk_seq: int | None = Field(default=None, ge=1, le=MAX_INDEX, description="only this chunk's entries")
    update_id: str | None = Field(default=None, max_length=512, description="only the entries this generate "
                                  "update made (a reader that starts with its chunk needs no offset)")
    max_events: int = Field(default=READ_EVENTS, ge=1, le=4096)


class TokenBatch(_Model):
    events: list[TokenEvent] = Field(default_factory=list)
    next_offset: int = Field(description="where the next read starts")
    base_offset: int = Field(default=0, description="the oldest entry still kept (older ones were truncated)")
    closed: bool = Field(default=False, description="the stream is cancelled: nothing more will come")
    more: bool = Field(default=False, description="entries were held back (the read's count or byte limit): "
                       "read again from next_offset")


class StreamCarry(_Model):
    """Everything a stream carries across continue-as-new."""

    receipt: Receipt
    info: ModelInfo
    stats: StreamStats
    recent: list[RecentResult] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list, description="state keys of the line's stored checkpoints "
                            "(the rewind window and the window before it), oldest first")
    pinned: list[str] = Field(default_factory=list, description="state keys handed out by `checkpoint`, once per "
                              "hold (`release` takes one back)")
    worker_queue: str | None = None
    token_log: list[TokenEvent] = Field(default_factory=list, description="the newest entries of the token log")
    token_base: int = Field(default=0, description="the offset of the log's first entry carried (or the next one)")


class CarrySeal(_Model):
    """The workers' seal on a continue-as-new carry: an HMAC under a key only they hold over
    (stream id, the run that continued as new, `carry_digest`). The next run accepts the carry only
    with a seal that verifies for its own stream and its `continued_run_id`: a client cannot make
    one, nor move one to another stream or run."""

    run_id: str
    mac: str


class CarriedStream(_Model):
    """A `ModelStream` handed to the next run of its workflow (`ModelStream.carry_over`, then
    `ModelStream.open(..., carried=)` in the run that continue-as-new starts): the stream's record
    and the workers' seal on it for this workflow and run."""

    carry: StreamCarry
    seal: CarrySeal | None = None


class OpenStreamInput(SealedRequest):
    """Start input of MambaStreamWorkflow."""

    principal: str
    model_id: str
    input_transform: str | None = Field(default=None, description="transform id; None: the model's own")
    resume: Receipt | None = Field(default=None, description="a checkpoint to continue from")
    prefix: str | list[_Token] | None = _PREFIX
    options: StreamOptions = Field(default_factory=StreamOptions)
    carry: StreamCarry | None = Field(default=None, description="what a continue-as-new carries over; "
                                      "accepted only with the workers' `carry_seal` for this stream's previous run")
    carry_seal: CarrySeal | None = None
    signature: str | None = _SIGNATURE

    def claims(self) -> dict:
        return open_claims(self.principal, self.model_id, self.input_transform, self.resume, self.prefix)


# --- activity inputs and outputs ---------------------------------------------------------------
