"""The relay of `cullama serve --replicas` alone, in front of one replica's port that is already serving (an A/B of
fronts with serve_load.py, on the same replica): no Ray, no refresh of the targets; Ctrl-C stops it.

    python benchmarks/relay_alone.py --port 8973 --replica http://127.0.0.1:30000/cullama [--loop uvloop|asyncio]

The replica's URL: its host, port and the application's route prefix (`ss -ltnp` shows a replica's port).
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's cullama

from cullama.replicas.front import LOOPS, Front  # noqa: E402
from cullama.replicas.relay import Relay, Target  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="where the relay listens (127.0.0.1)")
    parser.add_argument("--replica", required=True, help="the replica's URL, with its route prefix")
    parser.add_argument("--loop", choices=LOOPS, default=LOOPS[0], help="the front's event loop")
    args = parser.parse_args(argv)
    url = urlsplit(args.replica)
    relay = Relay(url.path or "/")
    relay.set_targets([Target("replica", url.hostname, url.port or 80)])
    sock = socket.create_server(("127.0.0.1", args.port), backlog=2048)
    try:
        Front(relay, 1.0, loop=args.loop).run(sock)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
