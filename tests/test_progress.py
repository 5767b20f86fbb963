"""Progress bars: drawn only on a terminal (or in a notebook) and never with progress=False."""

import io
import sys

from tests.conftest import PROMPTS
from interp_engine import forward, generate, logit_lens


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_are_quiet_off_a_terminal_and_shown_on_one(eager, capsys, monkeypatch):
    model = eager("llama")
    forward(model, PROMPTS[0], progress=False)
    capsys.readouterr()  # building and loading the model draws transformers' own bars
    forward(model, PROMPTS, batch_size=1)  # progress=True by default: pytest's stderr is not a terminal
    generate(model, PROMPTS[0], max_new_tokens=4)
    assert capsys.readouterr().err == ""

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    forward(model, PROMPTS, batch_size=1, progress=False)
    assert terminal.getvalue() == ""
    forward(model, PROMPTS, batch_size=1)
    logit_lens(model, PROMPTS, batch_size=1, positions="last")
    generate(model, PROMPTS[0], max_new_tokens=4)  # one prompt: the bar counts its generated tokens
    shown = terminal.getvalue()
    # A bar draws its empty state once when it starts; its later redraws depend on the machine's speed.
    assert shown.count("forward:   0%") == 2 and f"{len(PROMPTS)}/{len(PROMPTS)}" in shown, shown
    assert "generate: 100%" in shown and "4/4" in shown, shown
