"""Warning categories of our own, so callers can filter them precisely."""


class InterpEngineWarning(UserWarning):
    """Root of interp_engine's warnings."""


class BackendFallbackWarning(InterpEngineWarning):
    """backend="auto" fell back to eager; the message says why."""
