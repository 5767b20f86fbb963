"""One rule for every progress bar: drawn on a terminal or in a notebook, never into a log or a pipe, never when
the call says `progress=False`."""

import sys

from tqdm.auto import tqdm

# tqdm.auto picks the notebook widget under Jupyter, whose stderr is not a TTY but shows the widget anyway.
_NOTEBOOK = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)


def showing(progress: bool) -> bool:
    """Whether a bar asked for with `progress` is drawn now (stderr is a terminal, or a notebook runs us)."""
    return bool(progress) and (_NOTEBOOK or getattr(sys.stderr, "isatty", lambda: False)())


def bar(iterable=None, *, progress: bool, **kwargs) -> tqdm:
    """A tqdm bar that follows the rule; `kwargs` are tqdm's."""
    return tqdm(iterable, disable=not showing(progress), **kwargs)


class Silent(tqdm):
    """For libraries that take a tqdm class (huggingface_hub's downloads), when the call says `progress=False`."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
