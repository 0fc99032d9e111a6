"""The CLI's parser tree, walked (test helper, not a test)."""

from __future__ import annotations

import argparse


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("oscar",)):
    """(path, parser) for the top parser and every subcommand parser below it, nested levels included."""
    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from walk(sub, path + (name,))
