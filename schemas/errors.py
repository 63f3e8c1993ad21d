"""The error of a configuration that cannot be used, raised by every layer that reads one (the CLI prints it as
one line, exit code 2)."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""
