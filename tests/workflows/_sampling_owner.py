"""A workflow of the tests' own that owns a `ModelStream` and generates with the sampling settings
(tests/workflows/test_sampling_settings.py): a prompt, one generate with every setting, then two
the stream refuses (a setting out of its range, a bias outside the vocabulary), each caught in
the workflow with the receipt it left. With a grammar (tests/workflows/test_grammar_generate.py)
the first generate is held to it."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from mamba_stream.workflows import Grammar, ModelStream, SealedRequest, StreamOptions, StreamOwner, check_sender


class SamplingInput(SealedRequest):
    principal: str
    model_id: str
    options: StreamOptions
    prompt: list[int]
    max_tokens: int
    seed: int
    settings: dict[str, float]
    logit_bias: dict[int, float]
    grammar: Grammar | None = None


class SamplingOutput(SealedRequest):
    tokens: list[int]
    checksum: str
    refusals: list[tuple[str, str, str]]  # (reason, field, the receipt's checksum after it)
    position: int


@workflow.defn(name="TestSamplingOwner")
class SamplingOwner(StreamOwner):
    @workflow.run
    async def run(self, inp: SamplingInput) -> SamplingOutput:
        check_sender(inp, inp.principal, "start")
        stream = await ModelStream.open(inp.principal, inp.model_id, inp.options)
        try:
            await stream.advance(tokens=inp.prompt)
            gen = await stream.generate(inp.max_tokens, seed=inp.seed, logit_bias=inp.logit_bias, grammar=inp.grammar,
                                        **inp.settings)  # type: ignore[arg-type]
            refusals = []
            for bad in ({"top_p": 0.0}, {"logit_bias": {10_000: 1.0}}):
                try:
                    await stream.generate(2, seed=1, **bad)  # type: ignore[arg-type]
                except ApplicationError as err:
                    refusals.append((err.type or "", err.details[0]["field"] if err.details else "",
                                     stream.receipt.checksum if stream.receipt else ""))
            return SamplingOutput(tokens=gen.tokens, checksum=gen.receipt.checksum, refusals=refusals,
                                  position=stream.position or 0)
        finally:
            await stream.dispose()
