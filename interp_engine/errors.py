"""One error hierarchy. Every message says what went wrong, why, and the fix.

Each class also inherits the builtin a caller would naturally catch, so `except ValueError` still works.
"""


class InterpEngineError(Exception):
    """Root of every error interp_engine raises on purpose."""


class PointError(InterpEngineError, LookupError):
    """An address names a point or layer this model does not have."""


class SpecError(InterpEngineError, ValueError):
    """A spec, vector, position or input fails validation (raised before any forward pass)."""


class BackendError(InterpEngineError, NotImplementedError):
    """The backend cannot serve this request; the message names the one that can."""


class LoadError(InterpEngineError, RuntimeError):
    """A model cannot be loaded as asked (missing files, unknown architecture, bad keyword)."""


class HarvestError(LoadError):
    """A harvest folder fails verification (damaged or edited manifest, missing or changed shard)."""


class InputTypeError(InterpEngineError, TypeError):
    """An argument has the wrong type."""


class ResultTypeError(InterpEngineError, TypeError):
    """A result does not have the type or axes its function promises (see typing.py): a bug in interp_engine or
    a backend, not in the call. Raised by the result check in func/shapes.py."""


def fix(what: str, remedy: str) -> str:
    """Format a message in the house shape: what happened, then an indented `Fix:` line."""
    return f"{what}\n  Fix: {remedy}"


def env_bytes(name: str, default: int, least: int = 1, why: str = "") -> int:
    """A whole number of bytes, at least `least` (`why`: what less could not hold), from environment variable
    `name` (unset or empty: `default`)."""
    import os

    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < least:
        at_least = f"at least {least} ({why})" if why else "positive"
        raise SpecError(fix(f"{name}={raw!r} is not a whole number of bytes, {at_least}.",
                            f"set it to whole bytes, e.g. {name}={default} (the default), or unset it."))
    return int(raw)
