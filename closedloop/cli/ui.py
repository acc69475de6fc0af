"""``closedloop ui``: the local web viewer over the run store (:mod:`closedloop.ui`).

It binds to loopback by default; another address is refused unless ``--allow-remote`` says so,
because the viewer shows every recorded message and has no login.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``; anything else (0.0.0.0, a LAN address, a name) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def handle(args: argparse.Namespace) -> int:
    if not is_loopback(args.host) and not args.allow_remote:
        print(f"error: --host {args.host} is not a loopback address; the viewer shows every recorded message "
              "without a login. Add --allow-remote to serve it to other hosts anyway.", file=sys.stderr)
        return 2
    from closedloop.config import default_store_path

    path = Path(args.store).expanduser() if args.store else default_store_path()
    if not path.is_file():
        print(f"error: no run store at {path}; give --store PATH (a runs.duckdb written by closedloop)", file=sys.stderr)
        return 2
    import uvicorn

    from closedloop.store import StoreVersionError
    from closedloop.ui.app import LOOPBACK_HOSTS, UISettings, create_app

    settings = UISettings(store=str(path), tokenizer=args.tokenizer, poll_ms=args.poll_ms,
                          allowed_hosts=["*"] if args.allow_remote else list(LOOPBACK_HOSTS))
    try:
        app = create_app(settings)
    except StoreVersionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"closedloop ui: http://{shown}:{args.port}/  (store {app.state.store.path}; Ctrl-C stops)", flush=True)
    if args.allow_remote:
        print("warning: serving to other hosts: anyone who can reach this port can read every run", file=sys.stderr)
    uvicorn.run(app, host=args.host.strip("[]"), port=args.port, log_level="warning")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="local web viewer: runs, traces, token views, evaluations, training curves",
                       description="Serve a web viewer over the run store. Pages refresh themselves while runs are "
                                   "written; reading never holds the store for more than one short query.")
    p.add_argument("--store", default=None, metavar="PATH",
                   help="DuckDB file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --allow-remote)")
    p.add_argument("--port", type=int, default=8780, help="port (default 8780)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host and any Host header (no login: anyone who reaches it reads every run)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or model directory for token text (default: the run's local model directory)")
    p.add_argument("--poll-ms", type=int, default=2000, help="how often live pages check for new writes (ms)")
    p.set_defaults(func=handle)
