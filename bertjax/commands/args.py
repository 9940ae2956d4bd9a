"""The argument parser of the tool commands (``embed``, ``evaluate``, ``mine-negatives``): argparse
with a "did you mean" for a misspelt option, as the training commands have for config keys."""

from __future__ import annotations

import argparse
import difflib
import functools
import sys


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors name the closest known option (of the parser and
    its sub-commands) for each unknown one given: ``unknown --chekpoint (did you mean
    "--checkpoint"?)``, also when a misspelt required option is reported missing first."""

    def __init__(self, *args, family: dict | None = None, **kwargs):
        self.family = {"options": [], "given": []} if family is None else family
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        options = self.family["options"]
        options.extend(a for a in args if isinstance(a, str) and a.startswith("--"))
        return super().add_argument(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", functools.partial(Parser, family=self.family))
        return super().add_subparsers(**kwargs)

    def parse_args(self, args=None, namespace=None):
        self.family["given"] = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str):
        options = self.family["options"]
        given = [a.split("=", 1)[0] for a in self.family["given"] if str(a).startswith("--")]
        hints = []
        for name in dict.fromkeys(n for n in given if n not in options):
            close = difflib.get_close_matches(name, options, n=1)
            if close:
                hints.append(f'{name} (did you mean "{close[0]}"?)')
        if hints:
            message = f"{message}; unknown {', '.join(hints)}"
        super().error(message)
