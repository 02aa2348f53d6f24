"""HyperMPMD: separate programs per submesh, pipeline schedules as data, heterogeneous models."""

from hyperjax.mpmd.schedules import SCHEDULES, Schedule, ScheduleError, Task, make_schedule, theory_bubble, validate

__all__ = ["SCHEDULES", "Schedule", "ScheduleError", "Task", "make_schedule", "theory_bubble", "validate"]
