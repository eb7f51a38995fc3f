"""A generate's grammar (`GenerateRequest.grammar`, issue 48): llguidance's token masks over the
model's vocabulary, the one place this package touches llguidance.

llguidance (the `agents` extra: an abi3 wheel with no dependencies, the matcher llama.cpp and vLLM
use) compiles the grammar against the model's vocabulary as byte strings (`grammar_vocab`, built
once per vocabulary and cached) and says, after each token, which tokens may come next. Its masks
are a function of the grammar, the vocabulary and the tokens consumed alone, so a retry or a
replay masks the same tokens.

How a generate uses it (`GrammarSampler`, `GrammarGuide`):

- before each draw, the tokens the grammar does not allow have their logits set to -inf, after
  every other setting (`Shaping`), and the draw is the one the generate would make without a
  grammar (`activities._engine.SeededSampler`'s arithmetic, or `ShapedSampler`'s);
- the model's end-of-sequence tokens are allowed only where the grammar may end (it accepts);
- where the grammar is complete (stopped, or it accepts and no token but its end can follow),
  the generate ends "stop" (`GenerateEnd`), its last token in the state as a stop text's is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mamba_stream.activities._engine import _sample_one
from mamba_stream.activities._sampling import Shaping, adjust_logits, draw
from mamba_stream.scan import ByteTransform, HFTokenizerTransform, Model
from mamba_stream.workflows import Grammar, InvalidRequest

if TYPE_CHECKING:  # llguidance is imported when a grammar is first used: it is an optional extra
    import llguidance

__all__ = ["GrammarGuide", "GrammarSampler", "GrammarVocab", "compile_grammar", "grammar_vocab"]

#: vocabularies kept built (`grammar_vocab`): building one from a 50k-token tokenizer.json takes
#: about half a second
VOCABS_KEPT = 8


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest("this worker cannot match grammars: it has no llguidance (install the package's "
                             "'agents' extra)", field="grammar") from None
    return llguidance


@dataclass(frozen=True)
class GrammarVocab:
    """A model's vocabulary as llguidance sees it.

    tokenizer: llguidance's, over `size` >= the model's `vocab_size` token ids (the model's ids
        first; for a byte vocabulary one more, its end-of-sequence token, which no model token is).
    n_model: the model's vocabulary size (the logits' columns).
    eos: the model's end-of-sequence ids (allowed where the grammar accepts).
    off: llguidance's end-of-sequence ids that are not the model's, never sampled (its bit only
        says the grammar may end; `GrammarGuide` asks the matcher that).
    """

    tokenizer: llguidance.LLTokenizer
    size: int
    n_model: int
    eos: tuple[int, ...]
    off: tuple[int, ...]


class _Bytes:
    """ByteTransform's vocabulary in llguidance's form (`llguidance.TokenizerWrapper`): token i is
    byte i; the ids past 255 that the model pads its vocabulary with are special tokens no text
    spells, and one more, past the model's, is the end of sequence llguidance needs."""

    def __init__(self, n_model: int) -> None:
        self.eos_token_id = n_model
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|pad{i}|>".encode() for i in range(256, n_model)] \
            + [b"<|eos|>"]
        self.special_token_ids = list(range(256, n_model + 1))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


_vocabs: OrderedDict[tuple, GrammarVocab] = OrderedDict()
_vocabs_lock = threading.Lock()


def grammar_vocab(model: Model) -> GrammarVocab:
    """`model`'s vocabulary for llguidance, built once per vocabulary (its transform's id and
    revision, the model's size and end-of-sequence ids) and kept (`VOCABS_KEPT`).

    Raises:
        InvalidRequest: field `grammar`: the model's transform gives no byte strings (none, or one
            this module does not know), or llguidance cannot take its vocabulary.
    """
    t = model.transform
    if not isinstance(t, ByteTransform | HFTokenizerTransform):
        raise InvalidRequest(f"model {model.model_id!r} has no vocabulary of byte strings (input transform "
                             f"{getattr(t, 'transform_id', None)!r}): it cannot be held to a grammar",
                             field="grammar")
    key = (t.transform_id, t.revision, model.vocab_size, model.eos_token_ids)
    with _vocabs_lock:
        got = _vocabs.get(key)
        if got is not None:
            _vocabs.move_to_end(key)
            return got
    llg = _llguidance()
    eos = tuple(model.eos_token_ids)
    try:
        if isinstance(t, ByteTransform):
            tok = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes(model.vocab_size)))
        else:
            # llguidance reads tokenizer.json itself (byte-level BPE, sentencepiece byte fallback...);
            # the model's padding rows past the tokenizer's ids are tokens no text spells
            tok = llg.LLTokenizer(t.path.read_text(encoding="utf-8"), n_vocab=model.vocab_size,
                                  eos_token=list(eos) if eos else None)
    except (ValueError, RuntimeError, OSError) as exc:
        raise InvalidRequest(f"llguidance cannot take the vocabulary of model {model.model_id!r}: {exc}",
                             field="grammar") from None
    off = tuple(sorted(set(tok.eos_tokens) - set(eos)))
    vocab = GrammarVocab(tokenizer=tok, size=tok.vocab_size, n_model=model.vocab_size, eos=eos, off=off)
    with _vocabs_lock:
        _vocabs[key] = vocab
        while len(_vocabs) > VOCABS_KEPT:
            _vocabs.popitem(last=False)
    return vocab


def compile_grammar(grammar: Grammar, vocab: GrammarVocab) -> llguidance.LLMatcher:
    """A matcher of `grammar` over `vocab`, at its start.

    Raises:
        InvalidRequest: field `grammar`, llguidance's reason in the message: the grammar does not
            compile, or not over this vocabulary.
    """
    llg = _llguidance()
    make = {"lark": llg.LLMatcher.grammar_from_lark, "json_schema": llg.LLMatcher.grammar_from_json_schema,
            "regex": llg.LLMatcher.grammar_from_regex}[grammar.kind]
    try:
        text = make(grammar.source)
    except ValueError as exc:
        raise InvalidRequest(f"the {grammar.kind} grammar does not compile: {exc}", field="grammar") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, vocab.tokenizer)
    if failed:
        raise InvalidRequest(f"the {grammar.kind} grammar does not compile: {messages[0]}", field="grammar")
    matcher = llg.LLMatcher(vocab.tokenizer, text, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"the {grammar.kind} grammar does not compile over the model's vocabulary: "
                             f"{matcher.get_error()}", field="grammar")
    return matcher


#: bit j of a mask byte is token 8 * byte + j (llguidance's masks are little-endian u32 words)
_BITS = torch.arange(8, dtype=torch.uint8)


class GrammarGuide:
    """One generate's grammar: its matcher (`compile_grammar`), told each sampled token (`take`),
    and what may come next (`allowed`, `complete`), computed once per position."""

    def __init__(self, grammar: Grammar, vocab: GrammarVocab) -> None:
        self.vocab = vocab
        self.matcher = compile_grammar(grammar, vocab)
        self._allowed: torch.Tensor | None = None  # (n_model,) bool, for the tokens taken so far
        self._complete: bool | None = None  # `complete` for the tokens taken so far
        self._ended = False

    def _fail(self, why: str) -> InvalidRequest:
        return InvalidRequest(f"the grammar {why}: {self.matcher.get_error() or 'no reason given'}",
                              field="grammar")

    def allowed(self) -> torch.Tensor:
        """(n_model,) bool: the tokens that may come next. The model's end-of-sequence tokens
        where the grammar accepts; llguidance's own end that is not the model's, never."""
        if self._allowed is None:
            v = self.vocab
            raw = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
            if self.matcher.is_error():
                raise self._fail("failed")
            bits = ((raw.unsqueeze(1) >> _BITS) & 1).flatten()[: v.n_model].bool()
            if v.off:
                bits[[t for t in v.off if t < v.n_model]] = False
            if v.eos:
                bits[list(v.eos)] = self.matcher.is_accepting()
            self._allowed = bits
        return self._allowed

    def complete(self) -> bool:
        """Whether the grammar is complete: nothing can follow the tokens taken but its end (an
        end-of-sequence token taken counts as its end). Raises InvalidRequest (field `grammar`)
        where nothing can follow and the grammar does not accept (a dead end, or a matcher in
        error, e.g. past llguidance's limits)."""
        if self._ended:
            return True
        if self._complete is None:  # asked twice a token: by the generate's end, then by the sampler
            self._complete = self._completes()
        return self._complete

    def _completes(self) -> bool:
        if self.matcher.is_error():
            raise self._fail("failed")
        if self.matcher.is_stopped():
            return True
        allowed = self.allowed()
        eos = sorted(set(self.vocab.eos))
        if int(allowed.sum()) > (int(allowed[eos].sum()) if eos else 0):  # a token that is not an end
            return False
        if self.matcher.is_accepting():
            return True
        raise self._fail("allows no token of the model's vocabulary here and does not accept")

    def take(self, tok: int) -> None:
        """Advance past sampled token `tok` (one `allowed` gave)."""
        self._allowed, self._complete = None, None
        if tok in self.vocab.eos:
            self._ended = True  # the generate ends at it ("eos"); the matcher need not see it
            return
        if not self.matcher.consume_token(tok):
            raise self._fail(f"refused token {tok}")


class GrammarSampler:
    """A generate's sampler when it has a grammar: the draw it would make without one (`shaping`
    None: `SeededSampler`'s, `_sample_one`; else `ShapedSampler`'s, `adjust_logits` then `draw`),
    on the row with the tokens the grammar does not allow (`GrammarGuide.allowed`) at -inf, after
    every other setting. Called row by row by the engine (it is not a `SeededSampler`).

    The masking is the only change to the arithmetic, the unmasked tokens' numbers are the same:
    - `_sample_one` takes the masked row as it is (softmax and argmax give the -inf tokens
      probability 0 and never pick them while any other is allowed);
    - `draw` refuses a row that is not finite, so the shaped path draws over the allowed ids
      alone, in id order, and maps the pick back: the same draw as over the whole masked row,
      since a -inf token's weight exp(-inf) = 0 adds exactly nothing to any running sum, ranks
      after every finite one, and fails min_p.

    proceed: called before each token is sampled; False ends the generation there. taken: told
    each token sampled. (As `SeededSampler`'s.)
    """

    def __init__(self, temperature: float, top_k: int, shaping: Shaping | None, generator: torch.Generator,
                 guide: GrammarGuide, *, proceed: Callable[[], bool] | None = None,
                 taken: Callable[[int], None] | None = None) -> None:
        self.temperature, self.top_k, self.shaping, self.generator = temperature, top_k, shaping, generator
        self.guide, self.proceed, self.taken = guide, proceed, taken
        self.counts: dict[int, int] = {}

    def __call__(self, next_logits: torch.Tensor) -> int | None:
        if self.proceed is not None and not self.proceed():
            return None
        if self.guide.complete():  # `proceed` (GenerateEnd) has ended it here already, with its reason
            return None
        allowed = self.guide.allowed()
        if self.shaping is None:
            row = next_logits.detach().cpu().masked_fill(~allowed, float("-inf"))
            tok = _sample_one(row, self.temperature, self.top_k, self.generator)
        else:
            s = self.shaping
            ids = torch.nonzero(allowed).squeeze(1)
            x = adjust_logits(next_logits, s, self.counts)[ids]
            tok = int(ids[draw(x, self.temperature, self.top_k, s.top_p, s.min_p, self.generator)])
        self.counts[tok] = self.counts.get(tok, 0) + 1
        self.guide.take(tok)
        if self.taken is not None:
            self.taken(tok)
        return tok
