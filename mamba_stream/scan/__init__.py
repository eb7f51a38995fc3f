"""The scan engine: Mamba-1, Mamba-2 and Mamba-3 language models with explicit state, and hybrids of
them with attention (GraniteMoeHybrid dense).

    from mamba_stream.scan import load_model
    model = load_model("tiny-mamba2")
    state = model.initial_state()
    step = model.advance(state, [1, 2, 3])      # step.logits (3, V) float32, step.state

    text = model.chat_template.render([{"role": "user", "content": "hi"}])  # docs/chat-templates.md
"""

from mamba_stream.scan._backends import EXACT_BACKENDS
from mamba_stream.scan._chat import (
    PLAIN_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    Continuation,
    NoChatTemplate,
    TemplateRaised,
    continuation,
)
from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._errors import (
    CheckpointError,
    ConfigError,
    InvalidInput,
    InvalidState,
    NonFiniteInput,
    NonFiniteOutput,
    NonIntegerInput,
    PositionLimit,
    ScanError,
    TokenOutOfRange,
    UnsupportedBackend,
)
from mamba_stream.scan._forward import embed, forward, zero_states
from mamba_stream.scan._init import init_weights
from mamba_stream.scan._lm import MambaLM
from mamba_stream.scan._loading import (
    WEIGHT_FORMATS,
    checkpoint_problem,
    config_from_json,
    init_model,
    load_model,
    parameter_shapes,
    save_checkpoint,
    weights_revision,
)
from mamba_stream.scan._model import BACKENDS, Model
from mamba_stream.scan._presets import PRESETS, TRAINED_PRESETS
from mamba_stream.scan._quant import Q8Weight, quantize_q8
from mamba_stream.scan._state import State, StepResult, zeros_on_demand
from mamba_stream.scan._tolerance import TOLERANCES, Tolerance, tolerance
from mamba_stream.scan._transforms import ByteTransform, HFTokenizerTransform, InputTransform
from mamba_stream.scan._verify import PartitionResult, VerifyReport, standard_partitions, verify_chunking

__all__ = [
    "BACKENDS",
    "EXACT_BACKENDS",
    "PLAIN_CHAT_TEMPLATE",
    "PRESETS",
    "TOLERANCES",
    "TRAINED_PRESETS",
    "WEIGHT_FORMATS",
    "ByteTransform",
    "ChatTemplate",
    "ChatTemplateError",
    "CheckpointError",
    "ConfigError",
    "Continuation",
    "HFTokenizerTransform",
    "InputTransform",
    "InvalidInput",
    "InvalidState",
    "MambaLM",
    "Model",
    "ModelConfig",
    "NoChatTemplate",
    "NonFiniteInput",
    "NonFiniteOutput",
    "NonIntegerInput",
    "PartitionResult",
    "PositionLimit",
    "Q8Weight",
    "ScanError",
    "State",
    "StepResult",
    "TemplateRaised",
    "TokenOutOfRange",
    "Tolerance",
    "UnsupportedBackend",
    "VerifyReport",
    "checkpoint_problem",
    "config_from_json",
    "continuation",
    "embed",
    "forward",
    "init_model",
    "init_weights",
    "load_model",
    "parameter_shapes",
    "quantize_q8",
    "save_checkpoint",
    "standard_partitions",
    "tolerance",
    "verify_chunking",
    "weights_revision",
    "zero_states",
    "zeros_on_demand",
]
