"""Session scheduling over KV-cache slots (pure Python: no torch, and no engine, codec or api imports;
the step types it plans come from `orpheus_serve.scheduler.step`).

See `scheduler.py` for the flow; `session.py` (state machine), `slots.py`
(slot allocator), `policy.py` (fair / deadline), `flush.py` (when frames go to
the codec), `flow.py` (backpressure, admission, first push sizing),
`capacity.py` (the running measure admission uses), `events.py` (what the
caller acts on), `errors.py` (why `submit()` refuses a session).
`benchmarking/simulate.py` runs it on a virtual clock against the sim engine.
"""

from .errors import AdmissionError, InvalidSessionError, SchedulerFullError
from .events import FramesReady, SchedulerEvent, SessionFailed, SessionFinished
from .feedback import SchedulerStats
from .flow import FlowControl, FlowStats
from .flush import FlushPolicy, FrameBuffer
from .policy import DeadlinePolicy, FairPolicy, SchedulingPolicy, make_policy
from .scheduler import Scheduler
from .session import Session, SessionRequest, SessionState
from .slots import SlotAllocator

__all__ = [
    "AdmissionError",
    "DeadlinePolicy",
    "FairPolicy",
    "FlowControl",
    "FlowStats",
    "FlushPolicy",
    "FrameBuffer",
    "FramesReady",
    "InvalidSessionError",
    "Scheduler",
    "SchedulerEvent",
    "SchedulerFullError",
    "SchedulerStats",
    "SchedulingPolicy",
    "Session",
    "SessionFailed",
    "SessionFinished",
    "SessionRequest",
    "SessionState",
    "SlotAllocator",
    "make_policy",
]
