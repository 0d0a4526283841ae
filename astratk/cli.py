"""`astratk` command line. `astratk run --config tutorials/quickstart.yaml [--rollout.group_size 4 ...]`.

Subcommands: `run` (a whole local job); `export RUN_DIR OUT_DIR [--policy main] [--version N] [--overwrite]` (a
trained policy as an HF model directory, `astratk.models.export`; `astratk export --help` lists the other sources).
`deploy`, `train fit` and `status` (cluster jobs) arrive with issue 7.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        return _run(rest)
    if command == "export":
        return _export(rest)
    print(f"astratk: unknown command {command!r}; choose one of ['export', 'run'] (see `astratk --help`)",
          file=sys.stderr)
    return 2


def _run(argv: list[str]) -> int:
    from astratk.config import parse, parser

    if not argv or any(a in ("-h", "--help", "--print_config") for a in argv):
        if "--print_config" in argv:
            from astratk.config import dump_spec

            argv = [a for a in argv if a != "--print_config"]
            try:
                print(dump_spec(parse(argv)))
            except (ValueError, FileNotFoundError) as e:
                print(f"astratk run: {e}", file=sys.stderr)
                return 2
            return 0
        parser().print_help()
        return 0
    try:
        spec = parse(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"astratk run: {e}", file=sys.stderr)
        return 2
    from astratk.runtime.run import Run

    Run(spec).start()
    return 0


def _export(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="astratk export", description="Write a trained policy as an HF model directory (model + tokenizer) "
        "that transformers, vLLM and `model.path` of a new run load.")
    p.add_argument("source", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>); or, with --base-model, "
                   "a weight-store URL or directory; or a PolicyModule Lightning checkpoint (.ckpt)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (new or empty unless --overwrite)")
    p.add_argument("--policy", default="main", help="the policy to export (default: main)")
    p.add_argument("--version", type=int, default=None, help="the weight version (default: the newest published)")
    p.add_argument("--base-model", default=None, help="the HF directory the policy started from (default: the "
                   "run's summary.json model_path, or the checkpoint's model_path)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the dtype to write (default: the base model's)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed); main returns instead of exiting
        return int(e.code or 0)
    from astratk.models.export import export_hf

    try:
        out = export_hf(args.source, args.out_dir, policy_id=args.policy, version=args.version,
                        base_model=args.base_model, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        print(f"astratk export: {message}", file=sys.stderr)
        return 2
    print(f"exported policy {args.policy!r} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
