"""The `sudu` command: serve | generate | bench | models | roofline | cache. Each subcommand's flags and body live in
commands/ (bench's in bench/cli.py, models' in weights/catalog.py); this file only wires them and turns user errors into one line + exit code."""
from __future__ import annotations

import argparse
import sys

from sudu.errors import SuduError


def build_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: `sudu --help` and a CLI error should not pay for torch's import
    from sudu.bench import cli as bench_cli
    from sudu.commands import cache as cache_cli
    from sudu.commands import generate, roofline
    from sudu.commands import serve as server_cli
    from sudu.weights import catalog

    parser = argparse.ArgumentParser(
        prog="sudu",
        description="sudu: speed-first LLM inference and an honest benchmark for OpenAI-compatible endpoints.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    server_cli.register_cli(sub)
    generate.register_cli(sub)
    bench_cli.register_cli(sub)
    catalog.register_cli(sub)
    roofline.register_cli(sub)
    cache_cli.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except SuduError as exc:
        print(f"sudu: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # config validation
        print(f"sudu: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sudu: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
