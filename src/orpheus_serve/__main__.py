"""`python -m orpheus_serve COMMAND ...`: the debugging and tooling views of each part.

    generate     the token engine alone: prompt ids in, generated ids out (JSON)
    decode       audio token ids (JSON) to a 24 kHz WAV through the codec
    synthesize   the whole service in-process, text to WAV, no network

Each command lives in the module that owns what it exercises; this file only
dispatches. A module provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("orpheus_serve.engines.cli", "generate audio token ids with the token engine alone"),
    "decode": ("orpheus_serve.codec.cli", "decode audio token ids to a WAV"),
    "synthesize": ("orpheus_serve.service.cli", "text to WAV through the whole service, in-process"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orpheus_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
