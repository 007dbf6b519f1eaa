"""Project error types. User mistakes raise these (subclasses of ValueError) with a message that names
the bad thing and the fix; `assert` is kept for internal invariants."""


class PipelineError(ValueError):
    """A user-facing error: bad input, bad configuration, or an incompatible environment."""


class ConfigError(PipelineError):
    """The configuration names a bad field or value."""


class DataError(PipelineError):
    """The dataset cannot be read or yields no usable samples."""


class CompatError(PipelineError):
    """The installed libraries or the model cannot give correct results in this combination."""


class StoreError(PipelineError):
    """The hidden-state store cannot be written or does not match this run."""


class ValidationFailed(PipelineError):
    """A stored hidden state failed a validation check. Never retried."""
