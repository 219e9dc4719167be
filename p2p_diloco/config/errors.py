"""The configuration subsystem's exception type."""


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the offending key."""
