#!/usr/bin/python3
"""Incast on slow shaped links (issue 34): a group in network namespaces, each rank's link shaped
to --rate-mbit with a small queue (tbf: --queue-ms of latency, or netem where the kernel has it),
set up exactly as tests/plan/test_plan_netns.py does. For each server binary (--server-bin, may
be given twice; runs interleaved A, B, A, B ...) it runs a closed loop of lookups, then of pushes
(`embps bench`, --in-flight calls of --tokens-per-rank x N tokens), and prints per op the time by
Little's law, its ratio to `embps plan`'s lower bound, and the packets the shapers dropped
(`tc -s qdisc`, summed over every rank's egress and the hub's side of every link, which is the
rank's ingress: where its peers' frames converge). Medians over --repeat passes.

Needs root and tc (else exit 77). Example:
  tests/bench/incast_netns.py --ranks 4 --rate-mbit 20 --server-bin /tmp/before/embps-server \
      --server-bin build/bin/embps-server
"""
import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "plan"))
import planlib  # noqa: E402
import test_plan_netns as tpn  # noqa: E402


def drops(net):
    """Packets dropped so far by the shapers of the ranks' egress and of their ingress (the hub's
    side of each link), as a pair."""
    total = [0, 0]
    for r in range(net.n):
        for i, (ns, dev) in enumerate((("%s-r%d" % (tpn.TAG, r), "eth0"), (tpn.HUB, "v%d" % r))):
            out = tpn.sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
            total[i] += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
    return total


def tcp_counters(net):
    """The ranks' TCP counters so far (nstat in each rank's namespace, summed): segments sent,
    retransmitted, and tail loss probes (retransmissions that are not losses)."""
    names = ("TcpOutSegs", "TcpRetransSegs", "TcpExtTCPLossProbes")
    total = dict.fromkeys(names, 0)
    for r in range(net.n):
        out = tpn.sh("ip", "netns", "exec", "%s-r%d" % (tpn.TAG, r), "nstat", "-az",
                     *names).stdout
        for line in out.splitlines():
            f = line.split()
            if len(f) >= 2 and f[0] in total:
                total[f[0]] += int(f[1])
    return total


def one_run(binary, n, tokens, duration, in_flight, plan):
    os.environ["EMBPS_SERVER_BIN"] = binary
    net = tpn.Net(n)
    out = {}
    try:
        net.setup()
        net.start()
        net.cli("create-table", "t", "--rows", str(tpn.ROWS), "--emb-width", str(tpn.WIDTH),
                "--optimizer", "sgd")
        for kind, ratio in (("lookup", "0"), ("push", "1")):
            d0, c0 = drops(net), tcp_counters(net)
            b = json.loads(net.cli(
                "bench", "t", "--batch", str(tokens), "--duration", str(duration), "--warmup",
                "1", "--push-ratio", ratio, "--pipeline", str(in_flight), "--json",
                timeout=duration + 300))
            if b["errors"] or b["lookups"] + b["pushes"] == 0:
                raise RuntimeError("bench of %ss: %d errors" % (kind, b["errors"]))
            got = b["average"] / 1e9 / b["pipeline"]
            d1, c1 = drops(net), tcp_counters(net)
            print("  %s: %s" % (kind, ", ".join("%s %d" % (k, c1[k] - c0[k]) for k in c0)),
                  flush=True)
            out[kind] = (got, got / plan["step_time_s"][kind], d1[0] - d0[0], d1[1] - d0[1])
    finally:
        net.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server-bin", action="append", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rate-mbit", type=int, default=20)
    ap.add_argument("--queue-ms", type=int, default=50, help="tbf's latency (its queue)")
    ap.add_argument("--tokens-per-rank", type=int, default=1024)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--duration", type=float, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("SKIP: network namespaces need root")
        return 77
    tpn.RATE_MBIT = a.rate_mbit
    tpn.QDISC = "tbf"  # the rate alone: this kernel has no sch_netem; the plan gets no delay
    base_shaper = tpn.shaper

    def shaper(delay_ms):
        s = base_shaper(delay_ms)
        return s[:-1] + ["%dms" % a.queue_ms] if s[0] == "tbf" else s
    tpn.shaper = shaper
    n, tokens = a.ranks, a.tokens_per_rank * a.ranks
    plan = planlib.plan("--group-size", str(n), "--rows", str(tpn.ROWS), "--emb-width",
                        str(tpn.WIDTH), "--optimizer", "sgd", "--tokens-per-batch", str(tokens),
                        "--batches-in-flight", str(a.in_flight), "--link-gbit-s",
                        str(a.rate_mbit / 1e3), "--link-delay-ms", "0")
    res = {b: [] for b in a.server_bin}
    for i in range(a.repeat):
        for b in a.server_bin:
            r = one_run(b, n, tokens, a.duration, a.in_flight, plan)
            res[b].append(r)
            print("pass %d %s: " % (i, b) + ", ".join(
                "%s %.4f s (%.3fx bound, drops %d out %d in)" % (k, *v) for k, v in r.items()), flush=True)
    print("%d ranks, %d Mbit/s, tbf queue %d ms, %d tokens, %d in flight; medians of %d; drops "
          "at the ranks' egress / ingress per pass"
          % (n, a.rate_mbit, a.queue_ms, tokens, a.in_flight, a.repeat))
    for b in a.server_bin:
        for k in ("lookup", "push"):
            v = [r[k] for r in res[b]]
            print("  %-40s %-6s %.4f s  %.3fx bound  drops %s" % (
                b, k, statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
                " ".join("%d/%d" % (x[2], x[3]) for x in v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
