"""`astratk` command line. `astratk run --config tutorials/quickstart.yaml [--rollout.group_size 4 ...]`.

Subcommands: `run` (a whole local job). `deploy`, `train fit` and `status` (cluster jobs) arrive with issue 7.
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
    print(f"astratk: unknown command {command!r}; choose one of ['run'] (see `astratk --help`)", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
