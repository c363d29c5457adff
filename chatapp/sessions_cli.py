"""`chatapp sessions ...`: list, export, rename and delete saved conversations; the prefix store."""

from __future__ import annotations

import argparse
import json
import sys

from .config import load_config


def build_sessions_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatapp sessions", description="Saved conversations.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", help="where conversations and snapshots are stored")
    common.add_argument("--config", metavar="FILE", help="a config.toml that overrides the user file")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("list", parents=[common], help="list saved conversations, the latest first")
    ls.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    ex = sub.add_parser("export", parents=[common], help="write one conversation as Markdown or JSON")
    ex.add_argument("id", help="conversation id, or 'latest'")
    ex.add_argument("--format", choices=["markdown", "json"], default="markdown")
    ex.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    se = sub.add_parser("search", parents=[common], help="find messages in every saved conversation (full text)")
    se.add_argument("text", nargs="+", help="words to find (all of them; the last may be the start of a word)")
    se.add_argument("--limit", type=int, default=50, help="most matches shown (default 50)")
    se.add_argument("--json", action="store_true", help="one JSON array instead of lines")
    rn = sub.add_parser("rename", parents=[common], help="give a conversation a new name")
    rn.add_argument("id", help="conversation id, or 'latest'")
    rn.add_argument("name", nargs="+", help="the new name")
    rm = sub.add_parser("delete", parents=[common], help="delete a conversation and its snapshot")
    rm.add_argument("id", help="conversation id, or 'latest'")
    px = sub.add_parser("prefixes", parents=[common], help="list (or --clear) the shared-prefix KV store")
    px.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    px.add_argument("--clear", action="store_true", help="remove every stored prefix")
    return p


def sessions_main(argv: list[str]) -> int:
    """`chatapp sessions list|search|export|rename|delete|prefixes`: no model, no MLX."""
    import time

    from .store import NotFound, StoreBusy, StoreError, export, resolve_data_dir
    from .store.db import ChatStore
    from .textsafe import printable

    args = build_sessions_parser().parse_args(argv)
    overrides = {"data.dir": args.data_dir} if args.data_dir else {}
    config = load_config(args.config, overrides)
    data_dir = resolve_data_dir(config)
    try:
        if args.command == "prefixes":
            return _prefixes_command(data_dir, config.data.prefix_cap_mb, clear=args.clear, as_json=args.json)
        with ChatStore.open(data_dir, write=False) as store:
            if args.command == "list":
                convs = store.list_conversations()
                if args.json:
                    print(json.dumps([c.to_json() for c in convs], ensure_ascii=False, indent=2))
                elif not convs:
                    print(f"no saved conversations in {data_dir}")
                else:
                    rows = [("ID", "UPDATED", "MSGS", "SNAPSHOT", "MODEL", "TITLE")]
                    for c in convs:
                        snap = f"{c.snapshot_bytes / (1 << 20):.1f} MiB" if c.snapshot_bytes else "-"
                        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
                        rows.append((str(c.id), when, str(c.messages), snap, printable(c.model_id),
                                     printable(c.title.replace("\n", " "))))
                    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
                    for r in rows:
                        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
                return 0
            if args.command == "search":
                return _search_command(store, " ".join(args.text), args.limit, args.json)
            cid = store.resolve(args.id)
            if args.command == "export":
                text = export(store, cid, args.format)
                if args.output:
                    with open(args.output, "w", encoding="utf-8", newline="") as f:
                        f.write(text)
                else:
                    sys.stdout.write(printable(text) if sys.stdout.isatty() else text)
                    sys.stdout.flush()
                return 0
        # rename / delete change the store: they need the data directory's lock
        with ChatStore.open(data_dir, write=True) as store:
            if args.command == "rename":
                store.rename(cid, " ".join(args.name))
                print(f"renamed conversation {cid}")
            else:
                store.delete(cid)
                print(f"deleted conversation {cid}")
        return 0
    except StoreBusy as e:
        print(f"chatapp: error: {e}: try again when it has exited", file=sys.stderr)
        return 1
    except (NotFound, StoreError) as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"chatapp: error: {data_dir}: {e.strerror or e}", file=sys.stderr)
        return 2


def _search_command(store, text: str, limit: int, as_json: bool) -> int:
    """`chatapp sessions search TEXT`: one line per match (conversation, date, title, the matching line)."""
    import time

    from .store.search import SearchError
    from .textsafe import printable

    if limit < 1:
        print("chatapp: error: --limit must be at least 1", file=sys.stderr)
        return 2
    try:
        hits = store.search(text, limit)
    except SearchError as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([h.to_json() for h in hits], ensure_ascii=False, indent=2))
        return 0
    if not hits:
        print(f"no saved message holds {text!r}")
        return 0
    who = {"user": "you", "assistant": "assistant", "system": "system"}
    for h in hits:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(h.updated))
        title = printable((h.title or "(untitled)").replace("\n", " "))
        print(f"{h.conversation_id:>4}  {when}  {title}  · {who.get(h.role, h.role)}: {printable(h.line)}")
    return 0


def _prefixes_command(data_dir, cap_mb: int, clear: bool, as_json: bool) -> int:
    """`chatapp sessions prefixes [--clear] [--json]`: what the shared-prefix KV store holds.
    ``--clear`` takes the data directory's lock (StoreBusy and OSError go to sessions_main's handlers)."""
    import time

    from .store.lock import DataDirLock
    from .store.paths import prefix_dir
    from .store.prefixes import BlockInfo, PrefixStore, stored_prefixes
    from .textsafe import printable

    store = PrefixStore(prefix_dir(data_dir), cap_mb << 20, writable=False)
    if clear:
        if not store.dir.is_dir():
            print(f"no prefix store in {data_dir}")
            return 0
        with DataDirLock.acquire(data_dir):
            n, size = store.clear()
        print(f"removed {n} prefix blocks ({size / (1 << 20):.1f} MiB) from {store.dir}")
        return 0
    blocks = store.blocks()
    infos = [b for b in blocks if isinstance(b, BlockInfo)]
    unreadable = len(blocks) - len(infos)
    prefixes = stored_prefixes(infos)
    total = sum(b.size for b in infos)
    if as_json:
        print(json.dumps({"dir": str(store.dir), "cap_bytes": store.cap_bytes, "bytes": total, "blocks": len(infos),
                          "unreadable_blocks": unreadable, "prefixes": [p.to_json() for p in prefixes]}, indent=2))
        return 0
    if not blocks:
        print(f"no stored prefixes in {store.dir}")
        return 0
    rows = [("ID", "LAST USED", "TOKENS", "BLOCKS", "MiB", "FORMAT", "MODEL")]
    for p in prefixes:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used))
        rows.append((p.id[:12] + ("" if p.complete else " (unreachable)"), when, str(p.tokens), str(p.blocks),
                     f"{p.bytes / (1 << 20):.1f}", printable(p.prompt_format), printable(p.model_id)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    print(f"{len(infos)} blocks, {total / (1 << 20):.1f} MiB of {cap_mb} MiB (data.prefix_cap_mb)"
          + (f"; {unreadable} unreadable (removed when next met)" if unreadable else ""))
    return 0
