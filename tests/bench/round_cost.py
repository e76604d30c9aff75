#!/usr/bin/python3
"""The fixed cost of a round (issue 34): CPU each rank spends per lookup as the group grows.

For each group size N (--ranks, default 2,8,16,32) and each server binary (--server-bin, may be
given twice to compare A against B; runs are interleaved A, B, A, B ... in one pass so that both
see the same machine), starts N ranks on loopback (cpu backend, one engine thread each), creates
a table of 32 columns per rank, and runs the CLI's load generator (`embps bench --batch 64
--pipeline 8`, one thread: 8 lookups of 64 tokens in flight) for --duration seconds. Reads every
rank's utime+stime (/proc/PID/stat) before and after, and the leader's rounds and batches
(Prometheus), and prints per N and binary:

  cpu/lookup leader   the leader's CPU time per lookup (ms)
  cpu/lookup follower the median follower's CPU time per lookup (ms)
  cpu/lookup busiest  the busiest follower's (with control relays: a relay's)
  lookups/s, rounds/s and batches per round

--fanout 0,sqrt compares the leader's direct star (--control-fanout 0) with control relays in
groups of ceil(sqrt(N)) (a number: that --control-fanout; auto: the server's default), each
interleaved with the others and with every binary.
--batch and --pipeline change the lookups' shape (larger frames between the ranks).

Medians over --repeat passes. Example:
  tests/bench/round_cost.py --server-bin /tmp/before/embps-server \
      --server-bin build/bin/embps-server
  tests/bench/round_cost.py --ranks 8,16,32 --fanout 0,sqrt --repeat 3 --duration 3
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))
from embps_servers import Group, cli_binary, free_ephemeral_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def scrape(port, name):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        m = re.search(r"^%s (\S+)$" % re.escape(name), r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def fanout_flags(fanout, n):
    """The --control-fanout flag for one run (none: the server's default)."""
    if fanout is None:
        return []
    if fanout == "sqrt":
        k = 1
        while k * k < n:
            k += 1
        return ["--control-fanout", str(k)]
    return ["--control-fanout", fanout]


def one_run(binary, n, duration, cli, fanout=None, batch="64", pipeline="8"):
    port = free_ephemeral_port()
    for wait in (0, 20, 40, 60, 0):
        try:
            group = Group(n, "--device", "cpu", "--engine-threads", "1", *fanout_flags(fanout, n),
                          rank_flags={0: ["--metrics-listen", "127.0.0.1:%d" % port]},
                          binary=binary, ready_timeout=60 + 4 * n)
            break
        except RuntimeError as e:  # ports still in TIME_WAIT from the runs before: wait them out
            if "no free loopback ports" not in str(e) or not wait:
                raise
            time.sleep(wait)
    try:
        def run_cli(*args, timeout=120):
            r = subprocess.run([cli, "--servers", group.servers, "--deadline-ms", "60000", *args],
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError("embps %s: %s%s" % (args[0], r.stderr, r.stdout))
            return r.stdout
        run_cli("create-table", "t", "--rows", "100000", "--emb-width", str(32 * n))
        # Warm up outside the measured window (connections, first rounds).
        run_cli("bench", "t", "--batch", batch, "--pipeline", pipeline, "--duration", "0.5",
                "--warmup", "0")
        c0 = [cpu_s(p.pid) for p in group.procs]
        r0, b0 = scrape(port, "embps_rounds_total"), scrape(port, "embps_round_batches_total")
        out = json.loads(run_cli("bench", "t", "--batch", batch, "--pipeline", pipeline, "--duration",
                                 str(duration), "--warmup", "0", "--json", timeout=duration + 120))
        c1 = [cpu_s(p.pid) for p in group.procs]
        rounds = scrape(port, "embps_rounds_total") - r0
        nb = scrape(port, "embps_round_batches_total") - b0
    finally:
        codes = group.close()
    if any(c != 0 for c in codes.values()):
        raise RuntimeError("a rank exited badly: %s\n%s" % (codes, group.last_logs))
    lookups = out["lookups"]
    per = [(b - a) / lookups * 1e3 for a, b in zip(c0, c1)]
    return {"leader_ms": per[0], "follower_ms": statistics.median(per[1:]),
            "busiest_ms": max(per[1:]),
            "lookups_s": lookups / duration, "rounds_s": rounds / duration,
            "per_round": nb / max(rounds, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,8,16,32")
    ap.add_argument("--server-bin", action="append")
    ap.add_argument("--cli-bin", default=cli_binary())
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--fanout", default=None,
                    help="comma-separated --control-fanout values to compare (sqrt: ceil(sqrt(N)))")
    ap.add_argument("--batch", default="64", help="tokens a lookup (bench --batch)")
    ap.add_argument("--pipeline", default="8", help="lookups in flight (bench --pipeline)")
    a = ap.parse_args()
    bins = a.server_bin or [os.environ.get("EMBPS_SERVER_BIN",
                                           os.path.join(HERE, "..", "..", "build", "bin",
                                                        "embps-server"))]
    ranks = [int(x) for x in a.ranks.split(",")]
    fanouts = a.fanout.split(",") if a.fanout else [None]
    res = {}
    for n in ranks:
        for _ in range(a.repeat):
            for b in bins:
                for f in fanouts:
                    res.setdefault((n, b, f), []).append(one_run(b, n, a.duration, a.cli_bin, f,
                                                                       a.batch, a.pipeline))
    print("%-4s %-32s %-7s %10s %12s %12s %10s %9s %9s" % (
        "N", "server", "fanout", "leader ms", "follower ms", "busiest ms", "lookups/s",
        "rounds/s", "b/round"))
    for n in ranks:
        for b in bins:
            for f in fanouts:
                rs = res[(n, b, f)]
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                print("%-4d %-32s %-7s %10.3f %12.3f %12.3f %10.0f %9.0f %9.2f" % (
                    n, b[-32:], " ".join(fanout_flags(f, n))[17:] or "-", med["leader_ms"],
                    med["follower_ms"], med["busiest_ms"], med["lookups_s"], med["rounds_s"],
                    med["per_round"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
