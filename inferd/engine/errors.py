"""The error an engine raises to its caller for a request it refuses (importable without torch)."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before scheduling it (bad parameters, too long, larger than the pool)."""
