"""GradSync.step_boundary's context: the backward passes run inside belong to the step's last micro-batch or not.
The driver says which, from the schedule (never counted): the last one's backward reduces."""


class StepBoundary:
    """GradSync.step_boundary's context (a plain class: entered once a micro-batch under pp > 1, where a generator's
    context costs several times more host time)."""
    __slots__ = ("sync", "last", "before")

    def __init__(self, sync, last: bool):
        self.sync, self.last = sync, last

    def __enter__(self):
        self.sync.explicit_steps, self.before = True, self.sync._last_microbatch
        self.sync._last_microbatch = self.last

    def __exit__(self, *exc):
        self.sync._last_microbatch = self.before
        return False
