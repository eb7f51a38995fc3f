"""The OpenAI Agents SDK on this project's streams: `MambaModelProvider` for
`temporalio.contrib.openai_agents.OpenAIAgentsPlugin(model_provider=...)` (docs/agents.md).

Needs the `agents` extra (`pip install 'mamba-stream-state[agents]'`).
"""

from mamba_stream.conversations import conversation_start
from mamba_stream.openai_agents._provider import DEFAULT_MAX_TOKENS, EXTRA_ARGS, MambaAgentModel, MambaModelProvider

__all__ = ["DEFAULT_MAX_TOKENS", "EXTRA_ARGS", "MambaAgentModel", "MambaModelProvider", "conversation_start"]
