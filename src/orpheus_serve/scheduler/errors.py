"""Why the scheduler refuses a session at `submit()`.

The scheduler raises these and knows nothing of protocols or services; the
service maps them onto its own errors (`request.errors.InvalidRequestError`,
`request.errors.QueueFullError`), which the gateways map onto their wire's
convention.
"""

from __future__ import annotations


class AdmissionError(Exception):
    """A session the scheduler will not queue."""


class InvalidSessionError(AdmissionError):
    """A session that can never run: empty prompt, no room for audio, request id in use."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SchedulerFullError(AdmissionError):
    """Past the queue bound or, with `admission: reject`, past the measured capacity."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
