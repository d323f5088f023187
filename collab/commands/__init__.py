"""One module per CLI command, each with add_parser(subparsers) and run(args).

The parser imports every command module for every invocation (`collab --help`, `collab status`), so a command
imports what it runs with (torch, hivemind, transformers) inside its run(), not at the top: importing collab.cli
took 0.2 s where collab.train.trainer took 21 s (2 busy cores, 2026-11-27). That is the one reason imports sit inside
functions in this package.
"""
