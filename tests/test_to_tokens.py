"""model.to_tokens refuses what is not text with an InputTypeError (also a TypeError) that names the fix."""

import pytest

from interp_engine.errors import InputTypeError, InterpEngineError, SpecError


@pytest.mark.parametrize("value, shown", [(3, "got 3."), (None, "got None."), ([1, 2], "got [1, 2]."),
                                          (["Hi", 3], "got ['Hi', 3].")])
def test_to_tokens_refuses_what_is_not_text(eager, value, shown):
    model = eager("llama")
    with pytest.raises(InputTypeError) as info:
        model.to_tokens(value)
    message = str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, InterpEngineError)
    assert message.startswith("to_tokens takes a string or a list of strings, " + shown), message
    assert '\n  Fix: e.g. model.to_tokens("Hi") or model.to_tokens(["Hi", "Yo"])' in message, message


def test_to_tokens_of_an_empty_list_is_still_a_spec_error(eager):
    with pytest.raises(SpecError, match="non-empty list of strings"):
        eager("llama").to_tokens([])


def test_to_tokens_still_takes_a_tuple_of_strings(eager):
    model = eager("llama")
    assert model.to_tokens(("Hi", "Hi")).shape[0] == 2
