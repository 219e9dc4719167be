"""The swarm subsystem's exception type."""


class SwarmError(RuntimeError):
    """The swarm could not be reached or joined (bad address, no initial peer answered, refused config...)."""
