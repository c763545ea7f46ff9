"""``satjax <command> -h`` is complete: a description, and help text for every option."""

import argparse

import pytest

from satjax.app.cli import COMMANDS


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help(command_parser, name):
    parser = command_parser(name)
    assert parser.description, f"satjax {name} has no description"
    undocumented = [a.option_strings for a in parser._actions  # argparse has no public list
                    if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not undocumented, f"satjax {name}: options without help: {undocumented}"
