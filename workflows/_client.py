"""Client helpers: open streams with server-made ids, feed them with idempotent update ids."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from state_codec import Receipt
from workflows._config import DEFAULT_TASK_QUEUE
from workflows._models import (
    AdvanceRequest,
    AdvanceResult,
    CheckpointRequest,
    CheckpointResult,
    GenerateRequest,
    GenerateResult,
    OpenStreamInput,
    ResetRequest,
    StreamOptions,
    StreamStats,
)
from workflows._stream import MambaStreamWorkflow

if TYPE_CHECKING:
    from state_codec.signing import RequestSigner

__all__ = ["StreamClient", "new_stream_id", "update_id"]


def new_stream_id() -> str:
    """Opaque, unguessable, and valid as a store key prefix."""
    return "ms-" + uuid.uuid4().hex


def update_id(chunk_seq: int, signature: str | None = None) -> str:
    """The idempotency key of a chunk: re-sending the same chunk_seq returns the first result.

    A signed chunk's id also names its signature (deterministic: the same request signs to the
    same bytes), so a forged request refused under `seq-N` cannot take the id of the real one.
    """
    if signature is None:
        return f"seq-{chunk_seq}"
    return f"seq-{chunk_seq}-{hashlib.sha256(signature.encode()).hexdigest()[:16]}"


class StreamClient:
    """Operations on streams through a Temporal client carrying the MambaStreamPlugin.

    Args:
        signer: signs every request for its principal (`state_codec.signing.RequestSigner`);
            needed when the workers verify signatures.
    """

    def __init__(self, client: Client, task_queue: str = DEFAULT_TASK_QUEUE, *,
                 signer: RequestSigner | None = None) -> None:
        self.client = client
        self.task_queue = task_queue
        self.signer = signer

    def sign(self, kind: str, stream_id: str, request):  # noqa: ANN001, ANN201 - any signed request model
        """`request` with its signature, when this client signs (unchanged otherwise)."""
        if self.signer is None:
            return request
        return request.model_copy(update={"signature": self.signer.sign(kind, stream_id, request.claims())})

    def handle(self, stream_id: str) -> WorkflowHandle:
        return self.client.get_workflow_handle_for(MambaStreamWorkflow.run, stream_id)

    async def open(self, principal: str, model_id: str, *, options: StreamOptions | None = None,
                   input_transform: str | None = None, resume: Receipt | None = None,
                   stream_id: str | None = None, wait: bool = True) -> str:
        """Start a stream; returns its id (server-made unless given) once it is open.

        Raises:
            WorkflowFailureError: opening failed; its cause is typed by reason (a resume from an
                incompatible checkpoint: PrincipalMismatch, SchemaMismatch, ...).
        """
        sid = stream_id or new_stream_id()
        inp = self.sign("open", sid, OpenStreamInput(principal=principal, model_id=model_id,
                                                     input_transform=input_transform, resume=resume,
                                                     options=options or StreamOptions()))
        handle = await self.client.start_workflow(
            MambaStreamWorkflow.run, inp,
            id=sid, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
        if wait:
            try:
                await handle.execute_update(MambaStreamWorkflow.ready, id="ready")
            except WorkflowUpdateFailedError:
                await handle.result()  # raises the typed reason the stream failed to open with
                raise
            except RPCError:
                # The stream closed before it took the update (it could not read its input: another
                # keyring): its failure is the reason. Still running: the RPC error is.
                if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                    await handle.result()
                raise
        return sid

    async def next_seq(self, stream_id: str) -> int:
        return (await self.stats(stream_id)).chunk_seq + 1

    async def advance(self, stream_id: str, principal: str, *, tokens: Sequence[int] | None = None,
                      text: str | None = None, chunk_seq: int | None = None, top_k: int = 5) -> AdvanceResult:
        seq = chunk_seq if chunk_seq is not None else await self.next_seq(stream_id)
        req = self.sign("advance", stream_id, AdvanceRequest(
            principal=principal, chunk_seq=seq, tokens=list(tokens) if tokens is not None else None, text=text,
            top_k=top_k))
        return await self.handle(stream_id).execute_update(MambaStreamWorkflow.advance, req,
                                                           id=update_id(seq, req.signature))

    async def generate(self, stream_id: str, principal: str, max_tokens: int, *, temperature: float = 1.0,
                       top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                       chunk_seq: int | None = None) -> GenerateResult:
        seq = chunk_seq if chunk_seq is not None else await self.next_seq(stream_id)
        req = self.sign("generate", stream_id, GenerateRequest(
            principal=principal, chunk_seq=seq, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
            seed=seed, stop=list(stop)))
        return await self.handle(stream_id).execute_update(MambaStreamWorkflow.generate, req,
                                                           id=update_id(seq, req.signature))

    async def reset(self, stream_id: str, principal: str, *, epoch: int | None = None) -> None:
        """Signal a reset. A signing client names the epoch it begins (the current one + 1 unless
        given), so the signed signal cannot be replayed to reset the stream again."""
        if epoch is None and self.signer is not None:
            epoch = (await self.stats(stream_id)).epoch + 1
        req = self.sign("reset", stream_id, ResetRequest(principal=principal, epoch=epoch))
        await self.handle(stream_id).signal(MambaStreamWorkflow.reset, req)

    async def checkpoint(self, stream_id: str, principal: str) -> CheckpointResult:
        req = self.sign("checkpoint", stream_id, CheckpointRequest(principal=principal))
        return await self.handle(stream_id).execute_update(MambaStreamWorkflow.checkpoint, req)

    async def receipt(self, stream_id: str) -> Receipt | None:
        return await self.handle(stream_id).query(MambaStreamWorkflow.receipt)

    async def stats(self, stream_id: str) -> StreamStats:
        return await self.handle(stream_id).query(MambaStreamWorkflow.stats)

    async def cancel(self, stream_id: str, *, wait: bool = True) -> None:
        """Cancel the stream; with `wait`, return once it has disposed of its state and ended."""
        h = self.handle(stream_id)
        await h.cancel()
        if wait:
            try:
                await h.result()
            except Exception:  # noqa: BLE001 - a cancelled run ends in WorkflowFailureError
                pass
