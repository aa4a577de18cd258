"""Running `sudu bench` in-process and reading the report it wrote."""
import argparse
import glob
import json

from sudu.bench import cli as bench_cli


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="sudu")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.register_cli(sub)
    args = parser.parse_args(["bench"] + argv)
    return args.func(args)


def read_report(out_dir, suite="*"):
    paths = sorted(glob.glob(str(out_dir / f"{suite}-*.json")))
    assert paths, "no JSON report written"
    with open(paths[-1]) as f:
        return paths[-1], json.load(f)
