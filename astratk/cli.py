"""`astratk` command line. `astratk run -c tutorials/quickstart.yaml [--rollout.group_size 4 ...]`.

The current directory is importable (as with `python -m`): a config may name `mypkg.rewards.exact` for a `mypkg`
next to it, and a local cluster's workers import it too.

One style for every subcommand: `--key value` or `--key=value`, keys with underscores (`--policy_id`,
`--run_config`, `--print_config`), dotted keys for configuration fields (`--trainer.max_steps`).

`astratk run --help` documents every configuration key; `astratk --version` prints the version.

Subcommands:
  run     a whole job: local cluster (or `cluster.scheduler_address`), data layer, rollouts, one trainer per policy
  deploy  the data layer, acquisition and evaluation on an existing Dask scheduler (`--deployment NAME`), for
          trainer jobs
  train   `astratk train fit --run_config RUN.yaml --policy_id P --deployment NAME --scheduler ADDR [--trainer.*]`:
          a LightningCLI trainer job for one policy, attached to a deployment (`astratk train fit --help`)
  probe   `astratk probe --config RUN.yaml [--tasks 32] [overrides]`: before a run, will its rollouts carry learning
          signal? The starting model's mean reward, pass@k and share of groups with signal on N train tasks, greedy
          held-out accuracy, and what to change (`astratk.runtime.probe`)
  status  deployments on a scheduler and their data layers' state (`astratk status --scheduler ADDR`)
  export  `astratk export RUN_DIR OUT_DIR [--policy_id main] [--version N] [--overwrite] [--merge]`: a trained policy
          as an HF model directory, a LoRA policy as a PEFT adapter directory (`--merge`: merged weights)
          (`astratk.models.export`; `astratk export --help` lists the other sources)
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from astratk.config import dump_spec, load_spec, parse, parser
from astratk.runtime import warm
from astratk.runtime.cluster import security as tls_security
from astratk.runtime.drive import DETACHED_TIMEOUT_S
from astratk.runtime.run import Run
from astratk.runtime.status import status_lines
from astratk.spec import StartError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] in ("-V", "--version"):
        try:
            print(f"astratk {version('astratk')}")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            print("astratk (not installed: pip install -e .)")
        return 0
    command, rest = argv[0], argv[1:]

    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does (module docstring)
        sys.path.insert(0, os.getcwd())
    if command == "run":
        return _run(rest)
    if command == "probe":
        return _probe(rest)
    if command == "export":
        return _export(rest)
    if command == "deploy":
        return _deploy(rest)
    if command == "train":
        return _train(rest)
    if command == "status":
        return _status(rest)
    print(f"astratk: unknown command {command!r}; choose one of ['deploy', 'export', 'probe', 'run', 'status', 'train'] "
          "(see `astratk --help`)", file=sys.stderr)
    return 2


def _parse_spec(argv: list[str], command: str) -> Any:
    """The RunSpec of `argv`, or None after printing the error (which names the offending key)."""

    try:
        return parse(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"astratk {command}: {e}", file=sys.stderr)
        return None


def _deploy(argv: list[str]) -> int:
    """`astratk deploy --config RUN.yaml --deployment NAME [--cluster.scheduler_address ADDR]
    [--detached_timeout_s S] [overrides]`: the name trainer jobs attach to (`astratk train fit --deployment NAME`;
    `--name` is accepted too). Once every policy's trainer has ended, the deployment serves S seconds more (default
    600) for another to attach, then ends."""

    name, detached = None, DETACHED_TIMEOUT_S
    given = "--detached_timeout_s" in argv
    value, argv = _take_flag(argv, "--detached_timeout_s")
    if given or value is not None:
        try:
            detached = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            got = "" if value is None else f", got {value!r}"
            print(f"astratk deploy: --detached_timeout_s needs a number of seconds{got}", file=sys.stderr)
            return 2
    for flag in ("--deployment", "--name"):
        if flag in argv:
            i = argv.index(flag)
            if i + 1 >= len(argv):
                print(f"astratk deploy: {flag} needs a value", file=sys.stderr)
                return 2
            name, argv = argv[i + 1], argv[:i] + argv[i + 2:]
            break
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(_deploy.__doc__)
        return 0
    spec = _parse_spec(argv, "deploy")
    if spec is None:
        return 2
    if not spec.cluster.scheduler_address:
        print("astratk deploy: cluster.scheduler_address is required (a running `dask scheduler`); "
              "for a self-contained local job use `astratk run`", file=sys.stderr)
        return 2

    try:
        Run(spec).serve(name or spec.name, detached_timeout_s=detached)
    except StartError as e:
        print(f"astratk deploy: {e}", file=sys.stderr)
        return 2
    return 0


def _train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: astratk train fit --run_config RUN.yaml --policy_id P --deployment NAME --scheduler ADDR "
              "[--trainer.* ...] (`astratk train fit --help` lists everything)")
        return 0

    from astratk.runtime.trainer_job import check_job, job_summary, train_cli

    try:
        if argv[0] == "fit" and not {"-h", "--help", "--print_config"} & set(argv):
            check_job(_flags(argv[1:], ("--run_config", "--policy_id", "--scheduler")))
        with warnings.catch_warnings():  # LightningCLI warns when given args while sys.argv holds the same ones
            warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter")
            cli = train_cli(argv)
    except SystemExit as e:  # argparse (--help, --print_config, usage errors) exits; main returns its code
        return int(e.code or 0)
    except StartError as e:  # a bad run config, policy, scheduler or deployment, found before training: one line
        print(f"astratk train: {e}", file=sys.stderr)
        return 2
    return _stopped_early("train", job_summary(cli))


def _flags(argv: list[str], names: tuple[str, ...]) -> dict[str, str]:
    """The values of `names` given on the command line as `--flag VALUE` or `--flag=VALUE` (the last one wins)."""
    out: dict[str, str] = {}
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in names:
            if eq:
                out[flag] = value
            elif i + 1 < len(argv):
                out[flag] = argv[i + 1]
    return out


def _take_flag(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of `flag` (`--flag VALUE` or `--flag=VALUE`, the last one wins; None when absent) and `argv`
    without it, for flags a command reads itself before the rest goes to the run config's parser."""
    value = _flags(argv, (flag,)).get(flag)
    rest = [a for i, a in enumerate(argv) if not (a.partition("=")[0] == flag or (i > 0 and argv[i - 1] == flag))]
    return value, rest


def _status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="astratk status", description="Deployments on a Dask scheduler and the "
                                "state of their data layers.")
    p.add_argument("--scheduler", required=True, help="the scheduler's address (tcp://host:8786)")
    p.add_argument("--name", default=None, help="only this deployment")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the scheduler and each answer")
    p.add_argument("--config", default=None, help="a run config whose cluster.tls certificates to use (tls://)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)

    try:
        security = None
        if args.config:
            security = tls_security(load_spec(args.config, []))
        for line in status_lines(args.scheduler, args.name, args.timeout, security):
            print(line)
    except (OSError, TimeoutError, ValueError) as e:
        print(f"astratk status: {e}", file=sys.stderr)
        return 2
    return 0


def _run(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help", "--print_config") for a in argv):
        if "--print_config" in argv:
            argv = [a for a in argv if a != "--print_config"]
            try:
                print(dump_spec(parse(argv)))
            except (ValueError, FileNotFoundError) as e:
                print(f"astratk run: {e}", file=sys.stderr)
                return 2
            return 0
        parser().print_help()
        return 0
    spec = _parse_spec(argv, "run")
    if spec is None:
        return 2

    try:
        with warm.last_run():  # the command exits after this run: its cluster is closed, not kept for another
            result = Run(spec).start()
    except StartError as e:  # bad input found at start, before anything was written: one line
        print(f"astratk run: {e}", file=sys.stderr)
        return 2
    return _stopped_early("run", result.summary)


def _probe(argv: list[str]) -> int:
    """`astratk probe --config RUN.yaml [--tasks N] [--eval_tasks N] [overrides]`: N train tasks (default 32) rolled
    out with the run's engine, sampling and group size in this process, and N held-out tasks decoded greedily; prints
    the signal the run would get and what to change. Exits 1 when every probed task was dropped before generation (a
    run would have nothing to train)."""
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(_probe.__doc__)
        return 0
    counts = {"--tasks": 32, "--eval_tasks": None}
    for flag in counts:
        value, argv = _take_flag(argv, flag)
        if value is not None:
            try:
                counts[flag] = int(value)
            except ValueError:
                print(f"astratk probe: {flag} needs a whole number, got {value!r}", file=sys.stderr)
                return 2
    spec = _parse_spec(argv, "probe")
    if spec is None:
        return 2
    from astratk.runtime.probe import probe  # loads torch and transformers

    try:
        report = probe(spec, counts["--tasks"], eval_tasks=counts["--eval_tasks"])
    except (StartError, ValueError) as e:
        print(f"astratk probe: {e}", file=sys.stderr)
        return 2
    print(report)
    return 1 if report.nothing_to_train else 0  # a script can gate a run on it


def _stopped_early(command: str, summary: dict[str, Any]) -> int:
    """1 after printing why, in one line, when training ended early (a starved trainer, a diverged
    policy: what the run gathered is written already); else 0."""
    if not summary.get("stopped_early"):
        return 0
    print(f"astratk {command}: stopped early: {summary['stop_reason']}", file=sys.stderr)
    return 1


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="astratk export", description="Write a trained policy as an HF model directory (model + tokenizer) "
        "that transformers, vLLM and `model.path` of a new run load.")
    p.add_argument("source", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>); or, with --base-model, "
                   "a weight-store URL or directory; or a PolicyModule Lightning checkpoint (.ckpt)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (new or empty unless --overwrite)")
    p.add_argument("--policy_id", "--policy", dest="policy", default="main",
                   help="the policy to export (default: main)")
    p.add_argument("--version", type=int, default=None, help="the weight version (default: the newest published)")
    p.add_argument("--base_model", "--base-model", dest="base_model", default=None, help="the HF directory the policy started from (default: the "
                   "run's summary.json model_path, or the checkpoint's model_path)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the dtype to write (default: the base model's)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--merge", action="store_true", help="a LoRA policy: write the base model with the adapters "
                   "merged in (a full HF model) instead of a PEFT adapter directory")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed); main returns instead of exiting
        return int(e.code or 0)
    from astratk.models.export import export_hf

    try:
        out = export_hf(args.source, args.out_dir, policy_id=args.policy, version=args.version,
                        base_model=args.base_model, dtype=args.dtype, overwrite=args.overwrite,
                        merge=args.merge)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        print(f"astratk export: {message}", file=sys.stderr)
        return 2
    print(f"exported policy {args.policy!r} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
