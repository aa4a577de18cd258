"""`sudu cache info|clear`: what the context cache's disk tier holds, per namespace, and emptying it."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from sudu.cache.disk_store import default_dir, scan
from sudu.errors import SuduError


def _root(args) -> Path:
    return Path(args.disk_cache_dir).expanduser() if args.disk_cache_dir else default_dir()


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _cmd_info(args: argparse.Namespace) -> int:
    root = _root(args)
    spaces = scan(root) if root.is_dir() else []
    if args.json:
        print(json.dumps({"dir": str(root), "namespaces": spaces,
                          "blocks": sum(s["blocks"] for s in spaces), "bytes": sum(s["bytes"] for s in spaces)}))
        return 0
    if not spaces:
        print(f"{root}: no disk KV cache")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"disk KV cache: {root}")
    for col in ("namespace", "model", "weights", "KV", "block", "blocks", "size"):
        table.add_column(col, justify="right" if col in ("block", "blocks", "size") else "left")
    for s in spaces:
        d = s["description"]
        table.add_row(s["namespace"][:12], str(d.get("model", "?")), str(d.get("weight_format", "?")),
                      f"{d.get('kv_cache_dtype', '?')}/{d.get('dtype', '?')}", str(d.get("block_size", "?")),
                      f"{s['blocks']:,}", _size(s["bytes"]))
    table.add_row("all", "", "", "", "", f"{sum(s['blocks'] for s in spaces):,}", _size(sum(s["bytes"] for s in spaces)))
    Console().print(table)
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    root = _root(args)
    spaces = scan(root) if root.is_dir() else []
    if args.namespace:
        spaces = [s for s in spaces if s["namespace"].startswith(args.namespace)]
        if not spaces:
            raise SuduError(f"no namespace starting with {args.namespace!r} under {root}")
    for s in spaces:
        shutil.rmtree(root / s["namespace"], ignore_errors=True)
    print(f"removed {sum(s['blocks'] for s in spaces):,} blocks ({_size(sum(s['bytes'] for s in spaces))}) "
          f"in {len(spaces)} namespace(s) from {root}")
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("cache", help="the context cache's disk tier: info | clear",
                              description="Inspect or empty the disk tier of the KV context cache.")
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for name, func, text in (("info", _cmd_info, "namespaces (model, formats), blocks and bytes on disk"),
                             ("clear", _cmd_clear, "delete cached blocks (all, or one namespace)")):
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("--disk-cache-dir", default=None, help=f"the cache's directory (default: {default_dir()})")
        if name == "info":
            q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        else:
            q.add_argument("--namespace", default=None, help="only this namespace (a prefix of its hex id)")
        q.set_defaults(func=func)
