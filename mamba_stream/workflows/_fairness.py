"""A stream's fairness key: its principal's keyed tag, never the name in clear.

Temporal's task queues dispatch by fairness key when the server runs with
`matching.enableFairness` (every dev server this project starts does): each key's backlog gets
its share in turn, weighted by the operator's overrides (`activities.Fairness`), so one principal's
flood of workflow and activity tasks does not hold up another's. A stream's id already names the
tag (`ms.<tag>.<32 hex>`), so the client that starts a stream and the workflow that schedules its
activities both find the key there, with no key of their own.

Sandbox-safe: the standard library, temporalio and the record half of state_codec.
"""

from __future__ import annotations

from temporalio.common import Priority

from mamba_stream.state_codec import stream_tag

__all__ = ["stream_priority"]


def stream_priority(stream_id: str) -> Priority:
    """The Temporal priority of a stream's workflow and activities: its principal tag as the
    fairness key (an id of another form: the default, one shared key)."""
    tag = stream_tag(stream_id)
    return Priority(fairness_key=tag) if tag is not None else Priority.default
