"""Conversations: an agent framework's model calls as turns of a stream (worker side).

Each turn feeds only what is new after the previous response's handle, renders it with the
model's chat template, and forks where the history was edited; exactly once per model activity.
The frameworks' adapters (`mamba_stream.openai_agents`) build on it; docs/agents.md says how.
"""

from mamba_stream.conversations._handles import HANDLE_PREFIX, ResponseHandle, open_handle, seal_handle
from mamba_stream.conversations._render import (
    ParsedReply,
    Rendered,
    chat_messages,
    first_turn,
    next_turn,
    parse_reply,
    reply_end,
    reply_grammar,
    tool_schema,
)
from mamba_stream.conversations._turns import CONVERSATION_CHECKPOINTS, Conversations, Turn, activity_failures
from mamba_stream.workflows import PRINCIPAL_MEMO, conversation_start

__all__ = ["CONVERSATION_CHECKPOINTS", "HANDLE_PREFIX", "PRINCIPAL_MEMO", "Conversations", "ParsedReply", "Rendered",
           "ResponseHandle", "Turn", "activity_failures", "chat_messages", "conversation_start", "first_turn",
           "next_turn", "open_handle", "parse_reply", "reply_end", "reply_grammar", "seal_handle", "tool_schema"]
