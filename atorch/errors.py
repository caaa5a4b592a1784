"""Exceptions atorch raises for user errors.

Every user mistake (an unknown method, a config typo, a bad strategy file, a world size that does
not fit) raises a subclass of :class:`AtorchConfigError`, which is a ``ValueError``: callers that
already catch ``ValueError`` keep working, and the message always says what to change.
"""


class AtorchConfigError(ValueError):
    """Base class of every error caused by the user's input."""


class UnknownMethodError(AtorchConfigError):
    """A strategy names a method that is not registered."""


class MethodConfigError(AtorchConfigError):
    """A method's config does not validate (a typo, a wrong type, an out-of-range value)."""


class StrategyFileError(AtorchConfigError):
    """A strategy file or text is missing, malformed, or of a refused kind (pickle)."""


class StrategyConflictError(AtorchConfigError):
    """Two methods in one strategy cannot be applied together."""


class WorldSizeError(AtorchConfigError):
    """Parallel dims or batch sizes that cannot be matched to the number of processes."""


class NotSupportedError(AtorchConfigError):
    """A requested feature exists in the API but is not available in this build."""


class CompressionError(AtorchConfigError):
    """A genomic-bottleneck setup or checkpoint that cannot work (atorch.compression)."""


class CheckpointError(AtorchConfigError):
    """A checkpoint is missing, incomplete or corrupt, or does not hold what was asked of it."""
