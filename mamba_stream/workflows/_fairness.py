"""A stream's fairness key: its principal's keyed tag, never the name in clear.

Temporal's task queues dispatch by fairness key when the server runs with
`matching.enableFairness` (every dev server this project starts does): each key's backlog gets
its share in turn, weighted by the operator's overrides (`activities.Fairness`), so one principal's
flood of workflow and activity tasks does not hold up another's. A stream's id already names the
tag (`ms.<tag>.<32 hex>`), so the client that starts a stream and the workflow that schedules its
activities both find the key there, with no key of their own.

A start may carry this priority or none; a stream refuses another (`check_stream_id`:
another principal's key, a weight of the client's own, a level above the default). A level below
the default is taken: it is where a worker moves a principal's burst of streams.

Sandbox-safe: the standard library, temporalio and the record half of state_codec.
"""

from __future__ import annotations

from temporalio.common import Priority

from mamba_stream.state_codec import stream_tag

__all__ = ["BULK_PRIORITY_LEVEL", "DEFAULT_PRIORITY_LEVEL", "stream_priority"]

#: Temporal's priority levels run 1 (first) to 5; a task that names none is at 3
DEFAULT_PRIORITY_LEVEL = 3
#: the level a worker moves a principal's burst of new streams to (`activities.Fairness.burst`):
#: their workflow tasks yield to everyone's at the default level. A worker's own (sticky) queue
#: dispatches by level and then in arrival order, not by fairness key (Temporal server 1.32
#: dispatches a sticky queue with its priority matcher): a flood's workflow tasks there, at the
#: same level, would come before a quiet principal's, however fair the shared queues are.
BULK_PRIORITY_LEVEL = 4


def stream_priority(stream_id: str) -> Priority:
    """The Temporal priority of a stream's workflow and activities: its principal tag as the
    fairness key (an id of another form: the default, one shared key)."""
    tag = stream_tag(stream_id)
    return Priority(fairness_key=tag) if tag is not None else Priority.default
