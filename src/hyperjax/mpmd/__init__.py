"""HyperMPMD: separate programs per submesh, pipeline schedules as data, heterogeneous models."""

from hyperjax.mpmd.chunks import Chunk, model_chunks
from hyperjax.mpmd.lanes import LaneSchedule, LaneTask, lane_schedule, replay_lanes, validate_lanes
from hyperjax.mpmd.runner import PipelineRunner
from hyperjax.mpmd.schedules import SCHEDULES, Schedule, ScheduleError, Task, make_schedule, run_schedule, validate
from hyperjax.mpmd.state import from_host, host_like, to_host
from hyperjax.mpmd.timing import (
    closed_form_idle,
    replay,
    replayed_bubble,
    task_seconds,
    theory_bubble,
    uniform_bubble,
)

__all__ = [
    "SCHEDULES",
    "Chunk",
    "LaneSchedule",
    "LaneTask",
    "PipelineRunner",
    "Schedule",
    "ScheduleError",
    "Task",
    "closed_form_idle",
    "from_host",
    "host_like",
    "lane_schedule",
    "make_schedule",
    "model_chunks",
    "replay",
    "replay_lanes",
    "replayed_bubble",
    "run_schedule",
    "task_seconds",
    "theory_bubble",
    "to_host",
    "uniform_bubble",
    "validate",
    "validate_lanes",
]
