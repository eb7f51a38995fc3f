"""An `ActivityEnvironment` whose activity info names the stream's own workflow: the stream
activities refuse an attempt scheduled by any other (`StreamActivities._guarded`)."""

from __future__ import annotations

import dataclasses

from temporalio.testing import ActivityEnvironment


def stream_env(stream_id: str = "s1") -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=stream_id)
    return env
