"""`asyncrl` command line. Exit codes: 0 done, 1 failure during the run, 2 bad input
(config, data, run dir) with a message naming what to fix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncrl.config import ConfigError, load_config

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description="Asynchronous RL post-training for language models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="start a run (async GRPO)")
    train.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    train.add_argument("--run-dir", required=True, help="directory for the run's files")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, before or after --run-dir (e.g. rollout.num_prompts_per_step=8)",
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the command line; `section.key=value` overrides may stand anywhere after the
    config file, before or after `--run-dir`."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and args.command != "train"):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if args.command == "train":
        args.overrides = [*args.overrides, *extra]
    return args


def _train(args: argparse.Namespace) -> int:
    from asyncrl.train.trainer import RunDirError, train

    try:
        config = load_config(args.config, args.overrides)
        summary = train(config, Path(args.run_dir))
    except (ConfigError, RunDirError) as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(summary)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "train":
        return _train(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
