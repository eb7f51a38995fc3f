"""`Model`: a loaded language model that advances explicit per-stream states.

Dimension letters: B streams, L tokens, D d_model, V padded vocabulary.

Every backend runs the one forward pass of `scan._forward` and the mixers' one `forward`; a
backend is a set of primitives (`scan._backends`):
    reference  one token at a time through each layer, with batch-invariant primitives
               (`scan._ops.REFERENCE_OPS`). Chunking cannot change its arithmetic, so every
               partition of a token sequence gives bit-identical logits and state; batching
               streams gives bit-identical results too.
    exact      the CPU default: C kernels with one fixed IEEE operation order per output, or their
               torch twins (`scan.exact`); bit-identical under any chunking, batching, thread
               count and instruction set.
    chunked    parallel over the chunk: GEMMs over all L tokens, the chunked SSD form for
               Mamba-2/3 and the selective scan for Mamba-1 (projections over all L, the
               recurrence token by token); single tokens take the step formulas with PyTorch's
               native kernels. Within `scan.TOLERANCES` of the truth.
    triton     CUDA only: the chunked primitives with mamba-ssm's Triton kernels as the scans
               (`scan._triton`).
    auto       exact on the CPU (a narrow state dtype included); on CUDA triton when its
               kernels import, else chunked (reference for a narrow state dtype).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mamba_stream.scan._backends import EXACT_BACKENDS, Backend, RoundState
from mamba_stream.scan._chat import ChatTemplate, ChatTemplateError, NoChatTemplate
from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._errors import (
    ConfigError,
    InvalidInput,
    InvalidState,
    NonFiniteInput,
    NonFiniteOutput,
    NonIntegerInput,
    PositionLimit,
    TokenOutOfRange,
    UnsupportedBackend,
)
from mamba_stream.scan._forward import LayerStates, backend_named, embed, forward
from mamba_stream.scan._lm import MambaLM
from mamba_stream.scan._state import State, StepResult, zeros_on_demand
from mamba_stream.state_codec import (
    Arithmetic,
    Discretization,
    HybridLayers,
    ModelIdentity,
    StateSchema,
    TensorSpec,
)

__all__ = ["BACKENDS", "Model", "build_schema"]

log = logging.getLogger(__name__)

Tensor = torch.Tensor

#: Backends a caller may name; "auto" resolves to one of the others.
BACKENDS = ("auto", "reference", "chunked", "exact", "exact-fma", "triton")

#: dtypes the engine computes in
COMPUTE_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
#: dtypes a state may be kept in (narrower than the compute dtype: rounded after every token)
STATE_DTYPES = {**COMPUTE_DTYPES, torch.bfloat16: "bfloat16", torch.float16: "float16"}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN and no infinity: its least and greatest values are
    finite (a NaN makes both NaN, an infinity one of them). The same answer as
    `torch.isfinite(t).all()`, which builds a mask: 113 ms against 4 ms on 512 x 50288 logits."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def build_schema(cfg: ModelConfig, dtype: torch.dtype, lm: MambaLM,
                 state_dtype: torch.dtype | None = None) -> StateSchema:
    """The StateSchema of a model built from `cfg`, computing in `dtype`, keeping state in
    `state_dtype`, its matrices read in `lm`'s weight dtype."""
    sname = STATE_DTYPES[state_dtype or dtype]
    # an attention layer's k and v hold a row per position (`TensorSpec.rows`; Mamba-3's k and v
    # are its previous token's, fixed in size)
    specs = [
        TensorSpec(name=f"layers.{i}.{role}", layer=i, role=role, shape=tuple(shape), dtype=sname,
                   rows="position" if role in getattr(mixer, "growing_roles", ()) else None)
        for i, mixer in enumerate(lm.mixers)
        for role, shape in mixer.state_shapes()
    ]
    if cfg.architecture == "mamba3":
        disc = Discretization(
            a_activation="neg_softplus_clamped", a_floor=cfg.A_floor, rule="exp_trapezoidal",
            rope="halved" if cfg.mimo_rank > 1 else "pairwise", angle_wrap="mod_2pi",
        )
    else:
        clamp = cfg.architecture == "mamba2"
        # FalconMamba's norms change what enters the recurrence, not the state's shapes: without
        # them in the schema its state would pass for a plain Mamba-1's of the same sizes
        norms = cfg.bcdt_rms_eps if cfg.architecture == "mamba1" else None
        disc = Discretization(
            a_activation="neg_exp_log", rule="zoh_euler",
            dt_min=cfg.dt_min_clamp if clamp else 0.0, dt_max=cfg.dt_max_clamp if clamp else None,
            bcdt_rms_eps=None if norms is None else float(norms),
            bcdt_norm_weights=True if norms is not None and cfg.bcdt_norm_weights else None,
        )
    is_ssd = cfg.architecture != "mamba1"
    layers = None
    if cfg.is_hybrid:  # a plain Mamba model's schema has no such field: its fingerprint is unchanged
        fields = {name: getattr(cfg, name) for name in HybridLayers.model_fields if name not in ("kinds", "ffns")}
        layers = HybridLayers(
            kinds=tuple(cfg.kinds), ffns=None if set(cfg.ffns) == {"none"} else tuple(cfg.ffns),
            **{name: _float(v) if name in _FLOAT_FIELDS else v for name, v in fields.items()})
    return StateSchema(
        architecture=cfg.architecture,
        dtype=COMPUTE_DTYPES[dtype],
        weights=None if lm.weight_format == COMPUTE_DTYPES[dtype] else lm.weight_format,
        d_model=cfg.d_model,
        n_layer=cfg.n_layer,
        d_state=cfg.d_state,
        d_conv=cfg.d_conv,
        expand=float(cfg.expand),
        d_inner=cfg.d_inner,
        headdim=cfg.headdim if is_ssd else None,
        nheads=cfg.nheads if is_ssd else None,
        ngroups=cfg.ngroups if is_ssd else 1,
        mimo_rank=cfg.mimo_rank if cfg.architecture == "mamba3" else 1,
        rope_fraction=cfg.rope_fraction if cfg.architecture == "mamba3" else None,
        n_angles=cfg.n_angles,
        representation="real",
        discretization=disc,
        layer_order=tuple(range(cfg.n_layer)),
        tensors=tuple(specs),
        layers=layers,
    )


#: the hybrid fields the schema holds as floats (strict there: a config's int is converted)
_FLOAT_FIELDS = ("rope_theta", "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                 "ssm_in_multiplier", "ssm_multipliers", "ssm_out_multiplier", "attention_in_multiplier",
                 "attention_out_multiplier", "key_multiplier", "mlp_gate_multiplier", "mlp_down_multiplier",
                 "logits_multiplier", "moe_scaling")


def _float(v: Any) -> Any:
    """A config's number as the schema's float (strict: an int is refused there)."""
    if isinstance(v, tuple):  # Falcon-H1's ssm_multipliers: each entry
        return tuple(float(x) for x in v)
    return None if v is None else float(v)


def _eos_ids(ids: Sequence[int], vocab: int) -> tuple[int, ...]:
    """End-of-sequence ids, checked: integers the model can emit (a generation could never stop at
    one outside its logits' columns, so such a config is refused rather than silently ignored)."""
    out: list[int] = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
            raise ConfigError(f"{i!r} is not a token id of a {vocab}-token vocabulary", field="eos_token_id")
        if i not in out:
            out.append(i)
    return tuple(out)


class Model:
    """A Mamba-1/2/3 language model (or a hybrid of Mamba-2 and attention layers) with explicit,
    immutable per-stream state.

    Build one with `scan.load_model`. Attributes:
        model_id: preset name or checkpoint directory it was loaded from.
        config: the ModelConfig.
        schema: the StateSchema of its states.
        revision: "sha256:<hex>" over the checkpoint's weights (independent of dtype/device).
        backend: the backend `advance` runs (`BACKENDS`: "exact", "exact-fma", "reference", ...).
        transform: the default input transform (text <-> token ids), or None.
        chat_template: the ChatTemplate that renders a conversation as its text (docs/chat-templates.md);
            it raises NoChatTemplate where the model has none. (Built with `chat_template=` a
            ChatTemplate, or the ChatTemplateError to raise when it is asked for: `load_model`
            passes a directory's refusal.)
        eos_token_ids: the token ids that end a generation (config.json's `eos_token_id`, or its
            tokenizer's end-of-sequence token); empty: the model has none, and a generation runs to
            its length or a stop text.
        dtype: the dtype of weights and computation (float32 or float64).
        state_dtype: the dtype states are kept in; by default `dtype`. A narrower one (bfloat16,
            float16) rounds the state after every token, on the exact and reference backends only
            (each layer then advances one token at a time), so that chunking stays invisible; the
            rounding is part of the schema.
    """

    def __init__(
        self,
        lm: MambaLM,
        *,
        model_id: str,
        revision: str,
        backend: str = "auto",
        transform: Any = None,
        state_dtype: torch.dtype | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: ChatTemplate | ChatTemplateError | None = None,
    ) -> None:
        self._lm = lm
        # the template, or why there is none (a directory without one, or with a broken one): kept,
        # not raised, because a model is served token by token without one
        self._chat_template = chat_template
        self.config: ModelConfig = lm.cfg
        self.model_id = model_id
        self.revision = revision
        self.transform = transform
        self.eos_token_ids: tuple[int, ...] = _eos_ids(eos_token_ids, self.config.padded_vocab_size)
        param = lm.backbone.embedding.weight
        self.dtype: torch.dtype = lm.compute_dtype
        #: the format the matrices are held and read in: the compute dtype's name, "bfloat16",
        #: "float16" or "q8" (`scan.WEIGHT_FORMATS`)
        self.weight_format: str = lm.weight_format
        self.device: torch.device = param.device
        if self.dtype not in COMPUTE_DTYPES:
            raise UnsupportedBackend(f"dtype {self.dtype} is not supported; use float32 or float64")
        self.state_dtype: torch.dtype = state_dtype or self.dtype
        if self.state_dtype not in STATE_DTYPES:
            raise UnsupportedBackend(f"state dtype {self.state_dtype} is not supported; use one of "
                                     f"{sorted(STATE_DTYPES.values())}")
        self.schema: StateSchema = build_schema(self.config, self.dtype, lm, self.state_dtype)
        self._fingerprint = self.schema.fingerprint()
        self._names = [t.name for t in self.schema.tensors]
        # which of them hold a row per position (an attention layer's k and v)
        self._grows = [t.rows == "position" for t in self.schema.tensors]
        # each layer's state tensors, in schema order (a hybrid's layers hold different numbers)
        counts = [len(blk.mixer.state_shapes()) for blk in lm.backbone.layers]
        self._layer_spans = [(sum(counts[:i]), sum(counts[: i + 1])) for i in range(len(counts))]
        self.backend = self._resolve_backend(backend)
        #: rows of the embedding (the padded vocabulary); logits have this many columns
        self.vocab_size: int = self.config.padded_vocab_size

    # --- public API --------------------------------------------------------------------------

    @property
    def module(self) -> MambaLM:
        """The parameters, as a torch module with mamba-ssm's names."""
        return self._lm

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template: its checkpoint directory's (`ChatTemplate.from_directory`), or the
        presets' plain one (`PLAIN_CHAT_TEMPLATE`).

        Raises:
            NoChatTemplate: the model has none (the message names the file looked in).
            ChatTemplateError: its directory's template cannot be read or compiled.
        """
        found = self._chat_template
        if isinstance(found, ChatTemplate):
            return found
        if found is None:
            raise NoChatTemplate(f"model {self.model_id!r} has no chat template: it was not loaded from a "
                                 "directory with one", origin=self.model_id)
        raise found.with_traceback(None)  # as it was refused at load, without the earlier raise's frames

    def identity(self) -> ModelIdentity:
        """What a resume checks this model against (revision, transform, schema), without tensors."""
        t = self.transform
        return ModelIdentity(
            model_id=self.model_id,
            model_revision=self.revision,
            input_transform=getattr(t, "transform_id", "none"),
            input_transform_revision=getattr(t, "revision", ""),
            state_schema=self.schema,
        )

    def ran(self, path: str) -> str:
        """What receipts and results record as their `backend`: this model's backend and the path
        of it that ran (a `StepResult.path`, or "open" / "reset" for a state of its own), as
        "<backend>:<path>" ("exact:fused", "reference:open"). A backend name alone is
        `Model.backend`; the primitives it runs are a `Backend`."""
        return f"{self.backend}:{path}"

    def arithmetic(self, path: str | None = None) -> Arithmetic:
        """What decides the bits of this model's results (`state_codec.Arithmetic`).

        `path`: the path that ran (a `StepResult.path`); by default the one this backend runs,
        for the exact backend the one its load-time probe chose.
        """
        if self.backend in EXACT_BACKENDS:
            scheme, path = EXACT_BACKENDS[self.backend], path or self.exact_probe.path
        else:
            scheme, path = "torch", path or self.backend
        build = _torch_build()
        return Arithmetic(scheme=scheme, backend=self.backend, path=path, dtype=COMPUTE_DTYPES[self.dtype],
                          torch=build["torch"], blas=build["blas"], cpu_capability=build["cpu_capability"],
                          threads=torch.get_num_threads(), device=self.device.type, weights=self.schema.weights)

    def step_rows(self, buffers: Mapping[str, Tensor], rows: Tensor, tokens: Tensor, *,
                  in_place: bool = False, positions: Tensor | None = None) -> tuple[Tensor, str]:
        """Advance the states at `rows` of per-name buffers (K, *shape) by one token each, in place.

        For a slot table, where the states live in preallocated buffers rather than in State
        objects: one gather, one step of every layer for all rows, one scatter, with none of the
        per-stream work of `advance_batch`. The arithmetic is `advance_batch`'s for single tokens,
        so results are bit-identical on the reference and exact backends. Nothing is written if
        the step overflows (NonFiniteOutput), unless `in_place`.

        Args:
            buffers: tensor name -> (K, *shape) buffer in the schema's dtype, for every schema name.
            rows: (B,) int64 row indices, distinct.
            tokens: (B,) int64 token ids, already validated.
            in_place: where the backend can (exact, state dtype = compute dtype), the layers write
                their new states straight into the buffers' rows as they run, and a run of
                adjacent rows is not copied back at all (at 32 streams of bench_serving's model,
                16 MB a step). The bits are the same; the price is that a step that raises leaves
                the rows partly advanced: the caller must drop them (the slot table does).
            positions: (B,) int64, each row's position before the step: required by a model with
                attention layers (the token's KV row is written at it, and its query reads the rows
                before it), ignored by the others. A row at `max_positions` is refused
                (PositionLimit) before anything runs.

        Returns:
            float32 logits (B, V) and the path that ran.
        """
        lm, names = self._lm, self._names
        limit = self.config.max_positions
        if limit is not None:
            if positions is None or positions.shape != rows.shape:
                raise InvalidInput("a model with attention layers steps rows at their positions: pass positions (B,)")
            if rows.numel() and int(positions.max()) + 1 > limit:
                raise PositionLimit(f"a row at position {int(positions.max())} cannot take a token: the model "
                                    f"holds at most max_positions={limit} per stream",
                                    limit=limit, actual=int(positions.max()) + 1)
        # Adjacent slots of the table are a run of rows: read them as a view and write them
        # back as a slice, saving the gather's copy of every state (decode is bound by that traffic).
        b = int(rows.numel())
        if b == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device), "step"
        first = int(rows[0])
        span = bool((rows == torch.arange(first, first + b, device=rows.device)).all())
        impl = self._step_impl() if in_place else self._impl()
        # a growing tensor (an attention layer's k, v) is read up to the furthest row's position
        # and written back at each row's position only: a step costs the rows the streams hold,
        # never the bound's (the buffers hold max_positions rows)
        top = int(positions.max()) if limit is not None and positions is not None else 0
        with torch.inference_mode(), impl.running():
            flat = []
            for n, grows in zip(names, self._grows, strict=True):
                if span:
                    t = buffers[n].narrow(0, first, b)
                    flat.append((t[:, :top] if grows else t).to(self.dtype))
                else:
                    flat.append((buffers[n][rows, :top] if grows else buffers[n].index_select(0, rows)).to(self.dtype))
            layer_states = self._split_layers(flat)
            hidden = embed(lm, tokens.unsqueeze(1))  # (B, 1, D)
            logits, new_states, path = forward(lm, hidden, layer_states, impl, self._rounding(),
                                               None if positions is None else positions.to(self.device))
            logits = logits[:, 0].to(torch.float32)
            if not all_finite(logits):
                raise NonFiniteOutput("the batched step produced non-finite logits; no state was written"
                                      if not in_place else "the batched step produced non-finite logits")
            news = (t for layer in new_states for t in layer)
            # where each stream's new KV row lies: (row in the batch, position), once for every growing tensor
            at = None if positions is None else positions.to(self.device)
            batch = torch.arange(b, device=self.device)
            for name, old, new, grows in zip(names, flat, news, self._grows, strict=False):
                if grows:  # the new row of each stream, at its position
                    assert at is not None
                    buffers[name][rows, at] = new[batch, at].to(buffers[name].dtype)
                elif span:
                    if new is not old:  # a state written in place is already in its rows
                        buffers[name].narrow(0, first, b).copy_(new)
                else:
                    buffers[name].index_copy_(0, rows, new.to(buffers[name].dtype))
        return logits, path

    def _step_impl(self) -> Backend:
        """The backend of an in-place step: the exact one's in-place primitives where states are
        kept in the compute dtype (a narrow state is rounded into new tensors anyway)."""
        if self.backend in EXACT_BACKENDS and self.state_dtype == self.dtype:
            from mamba_stream.scan.exact import exact_step_backend

            return exact_step_backend(self._lm, self.dtype, self.backend)
        return self._impl()

    def check_tokens(self, tokens: Any) -> Tensor:
        """Validate token ids as `advance` would (typed InvalidInput), returning them as a tensor."""
        return self._check_tokens(tokens)

    def validate_state(self, state: State) -> None:
        """Raise InvalidState unless `state` fits this model's schema (names, shapes, dtypes, values)."""
        self._check_state(state, 0)

    def with_backend(self, backend: str) -> Model:
        """The same weights, advanced by another backend."""
        other = object.__new__(Model)
        other.__dict__.update(self.__dict__)
        other.backend = self._resolve_backend(backend)
        return other

    def initial_state(self) -> State:
        """The model-defined initial state (all zeros) at position 0."""
        tensors = {  # zeros that take memory only where a caller writes (a state is written anew, not in place)
            t.name: zeros_on_demand(t.shape_at(0), self.state_dtype, self.device) for t in self.schema.tensors
        }
        return State(0, tensors, self._fingerprint)

    def restore_state(self, position: int, tensors: Mapping[str, torch.Tensor]) -> State:
        """A State of this model from checkpointed tensors (already checked against its schema),
        moved to the model's device."""
        if self.device.type != "cpu":
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return State(position, tensors, self._fingerprint)

    def advance(self, state: State, tokens: Any, *, logits: str = "all") -> StepResult:
        """Continue `state` with `tokens` (any number, zero included).

        Args:
            state: a State of this model's schema; never modified.
            tokens: a sequence of ints or a 1-D integer tensor.
            logits: "all": a row of logits per token; "last": the last token's row only (what a
                prompt's prefill needs, the next token's distribution; on the exact backends the
                head, a product over the whole vocabulary, then runs on one row instead of every
                token's, as llama.cpp's prefill does). The row is the same bits as the last row of
                "all"; the state is the same.

        Returns:
            StepResult with float32 logits (len(tokens), V), or (1, V) for "last" (0 rows for
            no tokens), and the new State.

        Raises:
            InvalidInput subclasses for bad tokens or a `logits` that is neither, InvalidState for
            a foreign state, NonFiniteOutput if the scan overflowed. Nothing is advanced when they
            are raised.
        """
        return self.advance_batch([state], [tokens], logits=logits)[0]

    def advance_embeddings(self, state: State, embeddings: Tensor) -> StepResult:
        """Continue `state` with input embeddings (L, D) instead of token ids."""
        self._check_state(state, 0)
        emb = self._check_embeddings(embeddings)
        self._check_room(state, len(emb), 0)
        return self._run([state], [emb], embedded=True)[0]

    def advance_batch(self, states: Sequence[State], tokens: Sequence[Any], *, logits: str = "all"
                      ) -> list[StepResult]:
        """Advance several streams at once; each result equals that stream's own `advance`
        (`logits` as there).

        Every input is validated before any computation, so one bad stream fails the call and
        advances none.
        """
        if logits not in ("all", "last"):
            raise InvalidInput(f"logits must be 'all' or 'last', not {logits!r}")
        if len(states) != len(tokens):
            raise InvalidInput(f"{len(states)} states but {len(tokens)} token sequences")
        for i, s in enumerate(states):
            self._check_state(s, i)
        ids = [self._check_tokens(t) for t in tokens]
        for i, (s, t) in enumerate(zip(states, ids, strict=True)):
            self._check_room(s, len(t), i)
        return self._run(list(states), ids, embedded=False, last_only=logits == "last")

    def _check_room(self, state: State, length: int, index: int) -> None:
        """PositionLimit where `length` more tokens would take the stream past `max_positions`
        (the rows its attention layers' KV holds): refused before anything runs."""
        limit = self.config.max_positions
        if limit is not None and state.position + length > limit:
            raise PositionLimit(f"state[{index}] at position {state.position} cannot take {length} more tokens: "
                                f"the model holds at most max_positions={limit} per stream",
                                limit=limit, actual=state.position + length)

    # --- validation --------------------------------------------------------------------------

    def _resolve_backend(self, backend: str) -> str:
        if backend not in BACKENDS:
            raise UnsupportedBackend(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        from mamba_stream.scan import _triton

        lossy = self.state_dtype != self.dtype
        if backend == "auto":
            if self.device.type == "cpu":
                backend = "exact"
            elif lossy:
                return "reference"
            else:
                # no Triton attention kernel is wired: a hybrid takes the chunked backend on CUDA
                triton_ok = _triton.unavailable_reason(self.device) is None and not self.config.has_attention
                backend = "triton" if triton_ok else "chunked"
        if self.weight_format != COMPUTE_DTYPES.get(self.dtype) and backend not in EXACT_BACKENDS:
            raise UnsupportedBackend(f"{self.weight_format} weights are read as they are by the exact backend only; "
                                     f"load with weights={COMPUTE_DTYPES[self.dtype]!r} for the {backend} backend")
        if backend in EXACT_BACKENDS and self.device.type != "cpu":
            raise UnsupportedBackend(f"the {backend} backend runs on the CPU; the model is on {self.device}")
        if EXACT_BACKENDS.get(backend) == "exact-2" and self.dtype != torch.float32:
            raise UnsupportedBackend(f"the {backend} backend (exact-2) computes in float32, not {self.dtype}; "
                                     "use the exact backend (exact-1) for float64")
        if backend in ("chunked", "triton") and lossy:
            # chunked scans round the state once per call, not once per token: chunking would show
            raise UnsupportedBackend(f"the {backend} backend keeps state in {self.dtype}; "
                                     f"a {self.state_dtype} state needs the exact or reference backend")
        if backend == "triton" and self.config.has_attention:
            raise UnsupportedBackend("the triton backend has no attention kernel; run a hybrid model on the exact, "
                                     "chunked or reference backend")
        if backend == "triton":
            reason = _triton.unavailable_reason(self.device)
            if reason is not None:
                raise UnsupportedBackend(reason)
        if backend in EXACT_BACKENDS:
            backend_named(backend, self._lm, self.dtype)  # the probe runs now, at load
        return backend

    def _check_state(self, state: Any, index: int) -> None:
        where = f"state[{index}]"
        if not isinstance(state, State):
            raise InvalidState(f"{where} is a {type(state).__name__}, not a State", field="state")
        pos = state.position
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise InvalidState(f"{where}.position must be a non-negative int, got {pos!r}",
                               field="position", actual=pos)
        names = list(state.tensors)
        if names != self._names:
            raise InvalidState(f"{where} tensors {names} do not match the schema's {self._names}",
                               field="tensors", expected=self._names, actual=names)
        limit = self.config.max_positions
        if limit is not None and pos > limit:
            raise InvalidState(f"{where}.position {pos} is past max_positions={limit}", field="position",
                               expected=limit, actual=pos)
        for spec in self.schema.tensors:
            t = state.tensors[spec.name]
            if not isinstance(t, torch.Tensor):
                raise InvalidState(f"{where}.{spec.name} is not a tensor", field=spec.name)
            shape = spec.shape_at(pos)
            if tuple(t.shape) != shape:
                raise InvalidState(f"{where}.{spec.name} has shape {tuple(t.shape)}, schema says {shape} at "
                                   f"position {pos}", field=f"{spec.name}.shape", expected=shape,
                                   actual=tuple(t.shape))
            if t.dtype != self.state_dtype:
                raise InvalidState(f"{where}.{spec.name} has dtype {t.dtype}, schema says {self.state_dtype}",
                                   field=f"{spec.name}.dtype", expected=str(self.state_dtype), actual=str(t.dtype))
            if t.device != self.device:
                raise InvalidState(f"{where}.{spec.name} is on {t.device}, the model on {self.device}",
                                   field=f"{spec.name}.device", expected=str(self.device), actual=str(t.device))
            # States this model produced are finite by construction (logits are checked);
            # anything else is checked before it can poison a stream.
            if state.origin != self._fingerprint and not all_finite(t):
                raise InvalidState(f"{where}.{spec.name} holds NaN or infinity", field=spec.name)

    def _check_tokens(self, tokens: Any) -> Tensor:
        if isinstance(tokens, (str, bytes)):
            raise NonIntegerInput("tokens must be integer ids; encode text with model.transform first",
                                  value=tokens)
        if isinstance(tokens, torch.Tensor):
            t = tokens
        else:
            try:
                items = list(tokens)
            except TypeError:
                raise NonIntegerInput(f"tokens must be a sequence of ints, got {type(tokens).__name__}",
                                      value=tokens) from None
            for i, v in enumerate(items):
                if type(v) is not int and (isinstance(v, bool) or not _is_int(v)):  # a plain int: no call
                    if isinstance(v, float) and not math.isfinite(v):
                        raise NonFiniteInput(f"token {i} is {v}", position=i, value=v)
                    raise NonIntegerInput(f"token {i} is {v!r} ({type(v).__name__}), not an int",
                                          position=i, value=v)
                if not 0 <= int(v) < self.vocab_size:  # before torch.tensor, which overflows past int64
                    raise TokenOutOfRange(f"token {i} is {int(v)}, outside [0, {self.vocab_size})",
                                          position=i, value=int(v))
            t = torch.tensor([int(v) for v in items], dtype=torch.long)
        if t.dim() != 1:
            raise NonIntegerInput(f"tokens must be 1-D, got shape {tuple(t.shape)}", value=tuple(t.shape))
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            if t.dtype.is_floating_point and not all_finite(t):
                i = int((~torch.isfinite(t)).nonzero()[0])
                raise NonFiniteInput(f"token {i} is {t[i].item()}", position=i, value=t[i].item())
            raise NonIntegerInput(f"tokens must have an integer dtype, got {t.dtype}", value=str(t.dtype))
        t = t.to(device=self.device, dtype=torch.long)
        if t.numel():
            bad = (t < 0) | (t >= self.vocab_size)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise TokenOutOfRange(f"token {i} is {int(t[i])}, outside [0, {self.vocab_size})",
                                      position=i, value=int(t[i]))
        return t

    def _check_embeddings(self, emb: Any) -> Tensor:
        if not isinstance(emb, torch.Tensor) or not emb.dtype.is_floating_point:
            raise NonIntegerInput("embeddings must be a floating-point tensor", value=type(emb).__name__)
        if emb.dim() != 2 or emb.shape[1] != self.config.d_model:
            raise NonIntegerInput(f"embeddings must be (L, {self.config.d_model}), got {tuple(emb.shape)}",
                                  value=tuple(emb.shape))
        if not all_finite(emb):
            i = int((~torch.isfinite(emb)).any(dim=1).nonzero()[0])
            raise NonFiniteInput(f"embedding row {i} holds NaN or infinity", position=i)
        return emb.to(device=self.device, dtype=self.dtype)

    # --- execution ---------------------------------------------------------------------------

    def _impl(self) -> Backend:
        """The primitives behind `self.backend`."""
        return backend_named(self.backend, self._lm, self.dtype)

    @property
    def exact_probe(self) -> Any:
        """What the exact backend's load-time probe found (`scan.exact.Probe`), or None on another backend."""
        if self.backend not in EXACT_BACKENDS:
            return None
        from mamba_stream.scan.exact import exact_backend

        return exact_backend(self._lm, self.dtype, self.backend)[1]

    def _run(self, states: list[State], inputs: list[Tensor], *, embedded: bool, last_only: bool = False
             ) -> list[StepResult]:
        results: list[StepResult | None] = [None] * len(states)
        impl, lm = self._impl(), self._lm
        with torch.inference_mode(), impl.running():
            groups: dict[int, list[int]] = {}
            for i, x in enumerate(inputs):
                if len(x):
                    groups.setdefault(len(x), []).append(i)
            for idx in groups.values():  # streams of one length advance together
                group_states, group_inputs = [states[i] for i in idx], [inputs[i] for i in idx]
                x = torch.stack(group_inputs)  # (B, L) ids or (B, L, D) embeddings
                hidden = x if embedded else embed(lm, x)
                positions = torch.tensor([s.position for s in group_states], dtype=torch.long, device=self.device)
                logits, new_states, path = forward(lm, hidden, self._stack(group_states), impl, self._rounding(),
                                                   positions, last_only=last_only)
                out = self._finish(group_states, group_inputs, list(logits), new_states, path)
                for i, r in zip(idx, out, strict=True):
                    results[i] = r
        for i, r in enumerate(results):
            if r is None:  # empty chunk: nothing to scan, the state is returned as it was
                logits = torch.zeros((0, self.vocab_size), dtype=torch.float32, device=self.device)
                results[i] = StepResult(logits, states[i], self.backend, "empty")
        return results  # type: ignore[return-value]

    def _split_layers(self, flat: Sequence[Tensor]) -> LayerStates:
        """Schema-ordered tensors -> one tuple per layer."""
        return [tuple(flat[a:b]) for a, b in self._layer_spans]

    def _stack(self, states: list[State]) -> LayerStates:
        names = self._names
        if len(states) == 1:  # mixers never write into their inputs: a view is enough
            stacked = [states[0].tensors[n].unsqueeze(0) for n in names]
        else:
            stacked = [self._rows_padded([s.tensors[n] for s in states]) if grows else
                       torch.stack([s.tensors[n] for s in states]) for n, grows in zip(names, self._grows, strict=True)]
        if self.state_dtype != self.dtype:
            stacked = [t.to(self.dtype) for t in stacked]
        return self._split_layers(stacked)

    def _rounding(self) -> RoundState:
        """Rounds a layer's states to the state dtype, kept in the compute dtype (None: no rounding)."""
        if self.state_dtype == self.dtype:
            return None
        narrow, wide = self.state_dtype, self.dtype
        return lambda states: tuple(t.to(narrow).to(wide) for t in states)

    @staticmethod
    def _rows_padded(ts: list[Tensor]) -> Tensor:
        """Streams' KV tensors (P_b, Hkv, Dh) at different positions as one (B, max P_b, Hkv, Dh),
        zeros past each stream's rows (which its attention never reads)."""
        out = ts[0].new_zeros((len(ts), max(t.shape[0] for t in ts), *ts[0].shape[1:]))
        for b, t in enumerate(ts):
            out[b, : t.shape[0]] = t
        return out

    def _unstack(self, layer_states: LayerStates, b: int, position: int) -> dict[str, Tensor]:
        """Stream b's new tensors (its KV: its first `position` rows)."""
        flat = [t.to(self.state_dtype) for layer in layer_states for t in layer]
        rows = [t[b, :position] if grows else t[b] for t, grows in zip(flat, self._grows, strict=True)]
        if flat and flat[0].shape[0] == 1:  # fresh outputs of one stream: no copy needed
            return {n: rows[j] if not self._grows[j] or rows[j].shape[0] == flat[j].shape[1] else rows[j].clone()
                    for j, n in enumerate(self._names)}
        # a stream's own storage, so that it does not keep the whole batch alive
        return {n: rows[j].clone() for j, n in enumerate(self._names)}

    def _finish(self, states: list[State], inputs: list[Tensor], logits: list[Tensor],
                layer_states: LayerStates, path: str) -> list[StepResult]:
        out = []
        for b, (s, x, lg) in enumerate(zip(states, inputs, logits, strict=True)):
            lg = lg.to(torch.float32)
            if not all_finite(lg):
                raise NonFiniteOutput(
                    f"the scan produced non-finite logits at position {s.position}..{s.position + len(x)}; "
                    "the state was not advanced"
                )
            new = State(s.position + len(x), self._unstack(layer_states, b, s.position + len(x)), self._fingerprint)
            out.append(StepResult(lg, new, self.backend, path))
        return out


@functools.cache
def _torch_build() -> dict[str, str]:
    """The torch build's version, BLAS and the instruction set its kernels dispatch to."""
    config = torch.__config__.show()
    found = re.search(r"BLAS_INFO=([^,\s]+)", config)
    blas = found.group(1) if found else "unknown"
    version = re.search(r"Math Kernel Library Version (\S+)", config)
    if blas == "mkl" and version:
        blas = f"mkl-{version.group(1)}"
    return {"torch": torch.__version__, "blas": blas[:80], "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _is_int(v: Any) -> bool:
    if isinstance(v, int):
        return True
    # numpy integer scalars and 0-d integer tensors, without importing numpy
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.dtype.is_floating_point and v.dtype != torch.bool
    kind = getattr(getattr(v, "dtype", None), "kind", None)
    return kind in ("i", "u") and hasattr(v, "__index__")
