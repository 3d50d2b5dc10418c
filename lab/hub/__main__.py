"""`python -m lab.hub`: the lab hub as its own process; prints its addresses as a JSON line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from lab.hub.server import HubServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.hub", description="Serve lab repos as a Hugging Face hub."
    )
    parser.add_argument("--repos", type=Path, required=True, help="repos_dir/<org>/<name>/")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1000, help="tree entries per page")
    parser.add_argument(
        "--storage-host", help="the storage host's address (LFS downloads); default --host"
    )
    parser.add_argument("--storage-port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.repos.is_dir():
        parser.error(f"--repos {args.repos}: not a directory")
    hub = HubServer(
        args.repos,
        args.host,
        args.port,
        page_size=args.page_size,
        storage_host=args.storage_host,
        storage_port=args.storage_port,
    ).start()
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    print(
        json.dumps({"url": hub.url, "storage_url": hub.storage_url, "pid": os.getpid()}),
        flush=True,
    )
    stopping.wait()
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
