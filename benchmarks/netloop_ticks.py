"""What a network loop's ticks cost as its connections grow: every connection looked at every tick (as the loop
did before c70fd34) against only those whose deadline is due (`NetworkLoop._housekeep_due`).

A fleet worker's network loop (edgefil/netloop.py) ticks every TICK_S; at each tick it looked at every connection's
deadlines (keepalive, CONNACK, close), most of which had none due: yappi put 2.8 % of a 10,000-device fleet's
workers' profiled CPU there (3334 devices a worker; the profiler inflates short Python calls many times over, so
this measures it without one), and its cost a device grew with the round's length, so with the fleet. Here
`--connections` real paho clients (not connected: a loop's look at one whose keepalive is due runs paho's own check,
which finds no socket and returns) with a keepalive of `--keepalive` s are
held by a loop whose thread is stopped, and its ticks are driven on a clock of their own over `--seconds` s: the
CPU us a second of ticks, both ways, best of 3.

    .venv/bin/python benchmarks/netloop_ticks.py [--connections 500,3334,33334] [--keepalive 60] [--seconds 60]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from edgefil.netloop import TICK_S, NetworkLoop, _Connection  # noqa: E402


def loop_of(connections: int, keepalive: int) -> NetworkLoop:
    """A stopped loop holding `connections` connected-looking clients, their first keepalive looks spread over a
    period (as connections made over a fleet's start are)."""
    network = NetworkLoop()
    network.stop()
    for k in range(connections):
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"c{k}")
        client.connect_async("127.0.0.1", 1, keepalive=keepalive)
        conn = _Connection(client, f"c{k}", sock=object(), keepalive_at=k * keepalive / connections)
        network._connections[client] = conn
        network._plan_housekeeping(conn)
    return network


def every_tick(network: NetworkLoop, seconds: float) -> float:
    """CPU s of `seconds` of ticks, each looking at every connection (the loop before c70fd34)."""
    started = time.process_time()
    for tick in range(int(seconds / TICK_S)):
        now = tick * TICK_S
        for conn in list(network._connections.values()):
            network._housekeep(conn, now)
    return time.process_time() - started


def when_due(network: NetworkLoop, seconds: float) -> float:
    """CPU s of `seconds` of ticks, each looking at the connections whose deadline is due."""
    started = time.process_time()
    for tick in range(int(seconds / TICK_S)):
        network._housekeep_due(tick * TICK_S)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", default="500,3334,33334")
    parser.add_argument("--keepalive", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    print(f"a network loop's ticks (every {TICK_S} s), CPU us a second of ticks, best of 3; keepalive "
          f"{args.keepalive} s over {args.seconds:.0f} s")
    print(f"{'connections':>11} {'every connection':>16} {'those due':>10} {'ratio':>7}")
    for connections in (int(n) for n in args.connections.split(",")):
        every = min(every_tick(loop_of(connections, args.keepalive), args.seconds) for _ in range(3))
        due = min(when_due(loop_of(connections, args.keepalive), args.seconds) for _ in range(3))
        print(f"{connections:>11} {every / args.seconds * 1e6:>16.0f} {due / args.seconds * 1e6:>10.0f} "
              f"{every / due:>6.1f}x")


if __name__ == "__main__":
    main()
