"""Lifecycle events a harness may send about a trajectory (POST /v1/trajectories/{id}/events).

Every event is optional: without any, the server infers a trajectory's state from its
responses (trajectory/residency.py). An event that does not fit the trajectory's state (a
tool_finished with no tool running, a second trajectory_finished) is a counted no-op.
"""

from __future__ import annotations

import enum


class Event(enum.Enum):
    MODEL_STARTED = "model_started"  # a model call is about to be sent (the trajectory returns)
    TOOL_STARTED = "tool_started"  # a tool runs now (its class names what kind; a duration hint)
    TOOL_FINISHED = "tool_finished"  # the tool's result is in: the next request is imminent
    TRAJECTORY_FINISHED = "trajectory_finished"
    TRAJECTORY_CANCELLED = "trajectory_cancelled"


class Outcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # the trajectory is already in the state the event announces
    OUT_OF_ORDER = "out_of_order"  # the event does not follow from its state (e.g. it ended)


EVENT_NAMES = tuple(e.value for e in Event)
