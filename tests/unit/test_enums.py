"""packctl/enums.py: the choices of the options as StrEnum classes, each member documented, each
the string the command line takes."""
from __future__ import annotations

import ast
import inspect
import json

import pytest

from packctl import enums
from packctl.config import FIELDS

CHOICES = [c for c in vars(enums).values() if inspect.isclass(c) and issubclass(c, enums.Choice) and c is not enums.Choice]


def test_every_member_has_a_docstring():
    """A string under each member (OLMo-core's style: IDEs and the docs show it)."""
    tree = ast.parse(inspect.getsource(enums))
    undocumented = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in {c.__name__ for c in CHOICES}:
            body = node.body
            for k, statement in enumerate(body):
                if isinstance(statement, ast.Assign):
                    follows = body[k + 1] if k + 1 < len(body) else None
                    if not (isinstance(follows, ast.Expr) and isinstance(follows.value, ast.Constant)
                            and isinstance(follows.value.value, str) and follows.value.value.strip()):
                        undocumented.append(f"{node.name}.{statement.targets[0].id}")
    assert len(CHOICES) >= 14 and undocumented == []


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.__name__)
def test_a_member_is_its_string(choice):
    for member in choice:
        assert member == member.value and str(member) == f"{member}" == member.value
        assert {member.value: 1}[member] == 1 and choice(member.value) is member
        assert json.dumps(member) == json.dumps(member.value)
        assert member.name == member.value.upper().replace("-", "_")
    assert choice.values() == tuple(m.value for m in choice)


def test_each_option_with_a_choice_enum_takes_its_values():
    by_values = {c.values(): c for c in CHOICES}
    used = {by_values[f.metadata["choices"]] for f in FIELDS.values() if f.metadata["choices"] in by_values}
    assert used == set(CHOICES)  # every enum is an option's choices
