"""Each package's public surface is its sorted __all__, and every name in it exists."""

from __future__ import annotations

import importlib

import pytest

EXPECTED = {
    "mamba_stream": ["ChatAgent", "ClientConfig", "MambaStreamPlugin", "MambaStreamWorkflow", "ModelStream",
                     "OpenStreamInput", "StreamClient", "StreamFailure", "StreamOptions", "StreamOwner",
                     "conversation_start"],
    "mamba_stream.scan": [
        "BACKENDS", "EXACT_BACKENDS", "PLAIN_CHAT_TEMPLATE", "PRESETS", "TOLERANCES", "TRAINED_PRESETS",
        "WEIGHT_FORMATS", "ByteTransform", "ChatTemplate", "ChatTemplateError", "CheckpointError", "ConfigError",
        "Continuation", "HFTokenizerTransform", "InputTransform", "InvalidInput", "InvalidState", "MambaLM", "Model",
        "ModelConfig", "NoChatTemplate", "NonFiniteInput", "NonFiniteOutput", "NonIntegerInput", "PartitionResult",
        "PositionLimit", "Q8Weight", "ScanError", "State", "StepResult", "TemplateRaised", "TokenOutOfRange",
        "Tolerance", "UnsupportedBackend", "VerifyReport",
        "checkpoint_problem", "config_from_json", "continuation", "embed", "forward", "init_model", "init_weights",
        "load_model", "parameter_shapes", "quantize_q8", "save_checkpoint", "standard_partitions", "tolerance",
        "verify_chunking", "weights_revision", "zero_states", "zeros_on_demand",
    ],
    "mamba_stream.scan.exact": [
        "ARITHMETIC", "ARITHMETIC_FMA", "TWIN_OPS", "TWIN_OPS_FMA", "TWIN_PRIMITIVES", "TWIN_STEP_PRIMITIVES", "Probe",
        "build_kernels", "cache_dir", "exact_backend", "exact_primitives", "exact_step_backend", "linear_fma_ref",
        "probe", "twin_primitives",
    ],
    "mamba_stream.state_codec": [
        "CLEAR", "MASTER", "RECEIPT_VERSION", "SCHEMA_VERSION", "SEALED_ATTR", "SEALER_KEY", "Arithmetic",
        "BadSignature", "CheckpointNotFound", "ChecksumMismatch",
        "ChunkSequenceMismatch", "CorruptBlob", "DTypeMismatch", "Discretization", "EpochMismatch", "ForgedCarry",
        "HybridLayers",
        "InputTransformMismatch",
        "ModelIdentity", "ModelRevisionMismatch", "Origin", "PositionMismatch", "PrincipalMismatch", "Receipt",
        "RequestRejected", "SchemaMismatch", "SealerMismatch", "SegmentMissing", "StateKey", "StateRejected",
        "StateSchema", "StreamMismatch", "TensorSpec",
        "TruncatedBlob", "UnknownKeyId", "UnknownSigner", "UnsealedRequest", "UnsignedRequest",
        "UnsupportedEnvelopeVersion",
        "arithmetic_moved", "continue_arithmetic", "format_state_key", "parse_state_key", "prefix_digest", "record_key",
        "schema_diff",
        "sealer_of", "stream_id_head", "stream_tag",
        "validate_resume",
    ],
    "mamba_stream.state_codec.keyring": ["KEYRING_FILE", "Keyring", "KeyringError", "KeyringNotFound", "default_home",
                            "find_keyring"],
    "mamba_stream.state_codec.payload": ["ENCODED_FAILURE", "ENCRYPTED_ENCODING", "UNDECRYPTABLE_ENCODING",
                            "EncryptionCodec", "SealedPayloadConverter", "StreamModelsJSONConverter",
                            "StreamPayloadConverter",
                            "TypedFailureConverter", "sealed_for_stream",
                            "stream_principal", "with_sealer"],
    "mamba_stream.state_codec.signing": ["DOMAIN", "PrincipalKeys", "RequestSigner", "signing_bytes"],
    "mamba_stream.state_codec.codec": [
        "ALG", "CODE_REVISION", "ENVELOPE_VERSION", "Keyring", "KeyringError", "Opened", "Segment", "SegmentFetch",
        "SegmentRef", "decode_checkpoint", "default_state_key", "encode_checkpoint", "envelope_schema",
        "is_clear_header", "open_bytes", "open_checkpoint", "open_segment", "open_state", "plaintext_checksum",
        "reseal", "seal", "seal_bytes", "seal_segment", "segment_key", "segment_refs", "segment_rows",
        "split_state", "unseal",
    ],
    "mamba_stream.activities": [
        "BURST_WINDOW_S", "HISTOGRAM_BUCKETS", "RELEASE_BYTES", "Bursts", "Fairness", "Fence", "FileStateStore",
        "InvalidStoreKey",
        "KVSegments", "LeaseLost",
        "LegacyObject", "MemoryStateStore", "ModelRegistry", "PostgresStateStore", "PrefixStore",
        "PrefixSweep", "Quotas", "RekeyReport", "SegmentSweep", "SlotTable", "StateStore",
        "StoreCorrupt", "StoreError", "StoreOwnedElsewhere", "StoreOwner", "StoreUnavailable", "StoreUsage",
        "StreamActivities", "StreamEngine", "StreamMetrics", "SweepReport", "TenancyConfigError", "WorkerHealth",
        "apply_weights", "claim_store", "demote", "open_store", "rekey_store", "release_freed", "sweep_orphans",
        "tune_allocator",
    ],
    "mamba_stream.workflows": [
        "BULK_PRIORITY_LEVEL", "DEFAULT_PRIORITY_LEVEL", "DEFAULT_TASK_QUEUE", "NOT_THE_CHUNKS_FAULT",
        "PROGRESS_INTERVAL_S", "ActivityFailed", "AdvanceRequest",
        "AdvanceResult", "CancelRequest", "CarriedStream", "ChatAgent", "ChatInput", "ChatMessage", "CheckpointRequest",
        "CheckpointResult", "ChunkTooLarge", "ClientConfig", "ConflictingChunk", "EmptyContext", "GenerateRequest",
        "GenerateResult", "GenerateStream", "Grammar", "InternalError", "InvalidRequest", "LocalTooSlow",
        "MambaStreamWorkflow",
        "ModelInfo", "ModelStream", "OpenFailed", "OpenStreamInput", "PriorityMismatch", "QuotaExceeded",
        "ReleaseRequest",
        "ReleaseResult", "ReservedStreamId", "ResetRequest", "ResultExpired", "RewindPastWindow", "RewindRequest",
        "RewindResult",
        "RewindUnavailable", "SealedRequest", "StreamCancelled", "StreamClient", "StreamFailure", "StreamMoving",
        "StreamOpening", "StreamOptions", "StreamOwner", "StreamStats", "TokenBatch", "TokenEvent", "TokenLogprob",
        "TokenOutOfRange", "TokenProgress", "UnknownRequest", "UpdateIdMismatch", "WorkerUnhealthy",
        "application_error", "catalogue", "check_prefix", "check_sender", "chunk_digest", "conversation_start",
        "id_key", "invalid_request", "new_stream_id", "parse_update_id", "stream_priority", "update_id",
        # the workflow<->activity contract
        "ACTIVITY_ADVANCE", "ACTIVITY_CHECKPOINT", "ACTIVITY_DISPOSE", "ACTIVITY_GENERATE", "ACTIVITY_OPEN",
        "ACTIVITY_OPEN_CARRY", "ACTIVITY_RECALL", "ACTIVITY_RESET", "ACTIVITY_REWIND", "ACTIVITY_SEAL_CARRY",
        "ACTIVITY_VERIFY", "PRESENTATION", "PRINCIPAL_MEMO", "PROGRESS_BYTES", "STREAM_MEMO", "STREAM_WORKFLOW_TYPE",
        "AdvanceChunkRequest", "AdvanceChunkResult", "CarrySeal", "CarrySealRequest", "CheckpointStreamRequest",
        "DisposeStreamRequest", "DisposeStreamResult", "GenerateChunkRequest", "GenerateChunkResult",
        "OpenStreamRequest", "OpenStreamResult", "RecallResultRequest", "RecallResultResult", "ResetStreamRequest",
        "RewindStreamRequest", "StateResult", "VerifyRequest", "id_digest",
    ],
    "mamba_stream.workflows.contract": [
        "ACTIVITY_ADVANCE", "ACTIVITY_CHECKPOINT", "ACTIVITY_DISPOSE", "ACTIVITY_GENERATE", "ACTIVITY_OPEN",
        "ACTIVITY_OPEN_CARRY", "ACTIVITY_RECALL", "ACTIVITY_RESET", "ACTIVITY_REWIND", "ACTIVITY_SEAL_CARRY",
        "ACTIVITY_VERIFY", "AdvanceChunkRequest", "AdvanceChunkResult", "CarrySealRequest",
        "CheckpointStreamRequest", "DisposeStreamRequest", "DisposeStreamResult", "GenerateChunkRequest",
        "GenerateChunkResult", "OpenStreamRequest", "OpenStreamResult", "RecallResultRequest", "RecallResultResult",
        "ResetStreamRequest", "RewindStreamRequest", "StateResult", "VerifyRequest", "carry_digest", "chunk_digest",
        "id_digest", "parse_update_id", "update_id",
    ],
    "mamba_stream.cli": ["main"],
    "mamba_stream.conversations": [
        "CONVERSATION_CHECKPOINTS", "HANDLE_PREFIX", "PRINCIPAL_MEMO", "Conversations", "ParsedReply", "Rendered",
        "ResponseHandle", "Turn", "activity_failures", "chat_messages", "conversation_start", "first_turn",
        "next_turn", "open_handle",
        "parse_reply", "reply_end", "reply_grammar", "seal_handle", "tool_schema",
    ],
    "mamba_stream.openai_agents": ["DEFAULT_MAX_TOKENS", "EXTRA_ARGS", "MambaAgentModel", "MambaModelProvider",
                                   "conversation_start"],
    "mamba_stream.pydantic_ai": ["DEFAULT_MAX_TOKENS", "EXTRA_BODY", "PROVIDER_NAME", "MambaModel",
                                 "conversation_start", "message_items", "sampling"],
    "mamba_stream.quality": ["DISTRACTOR_WORDS", "KEYS", "VALUES", "Corpus", "CorpusUnavailable", "Sample",
                             "fetch_corpus", "parity_sample", "recall_sample"],
}


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_public_names(package):
    mod = importlib.import_module(package)
    assert list(mod.__all__) == EXPECTED[package]
    for name in mod.__all__:
        assert hasattr(mod, name), name


_PACKAGES = ("activities", "cli", "conversations", "openai_agents", "pydantic_ai", "quality", "scan", "state_codec",
             "workflows")


def test_shipped_modules_import_no_other_packages_private_modules():
    """What two packages share is public: a shipped module imports another package's names from
    that package, never from one of its `_x` modules (benches and tests may look inside)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "mamba_stream"
    files = [root / "worker.py", root / "plugin.py"] + [p for pkg in _PACKAGES for p in (root / pkg).rglob("*.py")]
    pattern = re.compile(r"^\s*(?:from|import)\s+mamba_stream\.(" + "|".join(_PACKAGES) + r")\._\w+", re.M)
    found = []
    for path in files:
        rel = path.relative_to(root)
        for m in pattern.finditer(path.read_text()):
            if rel.parts[0] != m.group(1):
                found.append(f"{rel}: {m.group(0).strip()}")
    assert not found, found
