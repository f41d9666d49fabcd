"""``python -m hybridkv.tiers``: run a ``mooncake_master`` on loopback until Ctrl-C / SIGTERM.

Prints ``mooncake_master at 127.0.0.1:<port>`` once it listens (store clients take that
address); exits 0 after stopping it, 2 (one ``error:`` line) if it cannot start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from hybridkv.tiers.base import TierError
from hybridkv.tiers.master import LOOPBACK, MooncakeMaster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--rpc-port", type=int, default=None, help="RPC port (default: a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="metrics port (default: a free one)")
    args = parser.parse_args(argv)
    stopping: list[int] = []  # the handler only appends: a lock taken in a signal handler (Event.set) can
    # deadlock against the same thread waiting on it (seen: SIGTERM during Event.wait's re-acquire)
    signal.signal(signal.SIGTERM, lambda sig, _: stopping.append(sig))
    master = MooncakeMaster(rpc_port=args.rpc_port, metrics_port=args.metrics_port)
    try:
        master.start()
    except TierError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"mooncake_master at {master.address} (metrics {LOOPBACK}:{master.metrics_port}, log {master.log_path})")
    sys.stdout.flush()
    try:
        while master.running and not stopping:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
