"""help() is enough: every public name has a docstring that names each of its arguments and shows a use."""

import inspect
import re

import pytest

import autojigsaw


def _documented(obj) -> tuple[str, list[str]]:
    """The docstring and the argument names of a public function or class (a class: its constructor)."""
    doc = inspect.getdoc(obj) or ""
    params = [p.name for p in inspect.signature(obj).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return doc, params


@pytest.mark.parametrize("name", autojigsaw.__all__)
def test_every_public_name_documents_its_arguments_and_shows_an_example(name):
    doc, params = _documented(getattr(autojigsaw, name))
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"autojigsaw.{name}'s docstring does not mention {missing}"
    assert re.search(rf"\b{name}\b\(|autojigsaw\.{name}\b", doc.split("\n\n", 1)[-1]), \
        f"autojigsaw.{name}'s docstring shows no example of its use"
