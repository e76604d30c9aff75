#!/usr/bin/python3
"""Prints two free loopback client ports P0, P1 (P1 = P0 + 1) and a peer-port offset O such that
P0 + O and P1 + O are free as well: what a 2-rank group on one host needs (its ranks talk to
each other on their client port plus --peer-port-offset). Used by the quickstart and the
benchmarks."""
import random
import socket


def free(port):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


for _ in range(1000):
    offset = random.randrange(1000, 10000)
    p0 = random.randrange(20000, 65535 - offset - 1)
    if all(free(p) for p in (p0, p0 + 1, p0 + offset, p0 + 1 + offset)):
        print(p0, p0 + 1, offset)
        break
else:
    raise SystemExit("no free ports found")
