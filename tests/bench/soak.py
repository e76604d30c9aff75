"""Soak benchmark: a shard group under steady mixed load for a long time, with one rank killed and
the group restarted from its checkpoints midway (what Kubernetes' liveness probes do).

1. Starts --ranks ranks on loopback with a checkpoint directory and periodic checkpoints, and
   creates one table (--rows x --width f32, rowwise Adagrad).
2. Calibrates: --clients client processes (python/embps, one call at a time each) run lookups
   and pushes in the --push-ratio mix closed loop for --calibrate-s seconds; their total calls/s
   is the measured throughput.
3. Soaks for --minutes at --load (0.8) of it, open loop: each client has a schedule of intended
   start times and latency counts from the intended start, so a stall shows in the percentiles
   instead of being hidden by a client that waited (coordinated omission). Errors are counted
   by gRPC status, and the loop goes on after them.
4. At --kill-at (a fraction of the soak; 0.5) the last rank gets SIGKILL. The others go
   NOT_SERVING; the script then stops them (SIGTERM) and restarts every rank on the same ports
   with --restore auto, as a restart of the whole group under Kubernetes does, and measures the
   outage from the kill until every rank serves again.
5. Samples every rank's resident memory (VmRSS) every --rss-every-s seconds.

Prints, per minute: calls, errors by status, latency p50/p99/p99.9/max of lookups and pushes
(ms), and each rank's RSS (MB, the minute's largest sample); then totals. --json FILE writes the
same figures. Every wait is bounded; the script exits non-zero when the group cannot start or
restart, or when no call succeeded after the restart.

Run: tests/bench/soak.sh [--minutes 30] [--ranks 2] [--clients 4] ...   (/usr/bin/python3)
The build's binaries are found as the group tests find them (EMBPS_SERVER_BIN, else build/bin/)."""
import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

TABLE = "soak"


def client_main(idx, servers, args, rate, t_start, t_end, out_q):
    """One client process. rate None: closed loop (calibration); else open loop at rate calls/s
    starting at t_start. Sends back arrays of (intended start, latency s, op, status name)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    import embps  # the library alone: no stubs of the tests' own are needed here
    import grpc
    rng = np.random.default_rng(1000 + idx)
    client = embps.Client(servers, padding=True, timeout=30.0, connect_timeout=30.0)
    grads = np.full((args.batch, args.width), 1e-3, np.float32)
    starts, lats, ops, codes = [], [], [], []
    i = 0
    while True:
        intended = time.time() if rate is None else t_start + i / rate
        if intended >= t_end:
            break
        delay = intended - time.time()
        if delay > 0:
            time.sleep(delay)
        tokens = rng.integers(1, args.rows, args.batch)
        push = rng.random() < args.push_ratio
        code = "OK"
        try:
            if push:
                client.push(TABLE, tokens, grads)
            else:
                client.lookup(TABLE, tokens)
        except embps.Error as e:
            code = e.code.name if isinstance(e.code, grpc.StatusCode) else str(e.code)
        starts.append(intended)
        lats.append(time.time() - intended)
        ops.append(1 if push else 0)
        codes.append(code)
        i += 1
    client.close()
    out_q.put((idx, np.array(starts), np.array(lats), np.array(ops, np.int8), codes))


def run_clients(servers, args, rate_each, t_start, t_end):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=client_main, args=(i, servers, args, rate_each, t_start, t_end, q))
             for i in range(args.clients)]
    for p in procs:
        p.start()
    return procs, q


def collect(procs, q, deadline):
    res = []
    for _ in procs:
        res.append(q.get(timeout=max(1.0, deadline - time.time())))
    for p in procs:
        p.join(timeout=30)
    return res


def rss_mb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class SoakGroup:
    """The ranks, restartable on the same ports (grouplib.Group picks new ports on each start)."""

    def __init__(self, gl, n, flags):
        self.gl, self.n, self.flags = gl, n, flags
        self.ports, self.offset = gl.pick_ports(n)
        self.addresses = ["127.0.0.1:%d" % p for p in self.ports]
        self.procs = []
        self.logs = []

    def start(self, extra, timeout=180.0):
        gl = self.gl
        peers = ",".join(self.addresses)
        self.procs = [gl.Proc(["--rank", str(r), "--peers", peers, "--peer-port-offset",
                               str(self.offset), *self.flags, *extra]) for r in range(self.n)]
        deadline = time.time() + timeout
        for r, a in enumerate(self.addresses):
            ok = gl.wait_for(lambda: gl.health(a) == gl.SERVING or not self.procs[r].alive(),
                             deadline - time.time(), interval=0.1)
            if not ok or not self.procs[r].alive():
                raise RuntimeError("rank %d did not serve:\n%s" % (r, self.procs[r].text()[-3000:]))

    def stop(self, timeout=30.0):
        """One SIGTERM to every rank still running (a second one would make it exit at once),
        then a bounded wait; returns {rank: exit code} (negative: killed by that signal)."""
        codes = {}
        for r, p in enumerate(self.procs):
            if p.alive():
                os.kill(p.pid, signal.SIGTERM)
        for r, p in enumerate(self.procs):
            if p.wait(timeout) is None:
                p.kill()
                codes[r] = "hung on SIGTERM (killed)"
            else:
                codes[r] = p.proc.returncode
            self.logs.append(p.text())
            p.cleanup()
        return codes

    def restored(self):
        """Rank 0's line saying what it restored, or None."""
        for line in self.procs[0].text().splitlines():
            if "restored" in line:
                return line.strip()
        return None


def percentiles(lat_s):
    if len(lat_s) == 0:
        return None
    ms = np.asarray(lat_s) * 1e3
    p = np.percentile(ms, [50, 99, 99.9])
    return {"p50": round(float(p[0]), 2), "p99": round(float(p[1]), 2),
            "p999": round(float(p[2]), 2), "max": round(float(ms.max()), 2), "count": int(len(ms))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--push-ratio", type=float, default=0.5)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--calibrate-s", type=float, default=15.0)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the soak; <0: no kill")
    ap.add_argument("--checkpoint-interval-s", type=int, default=60)
    ap.add_argument("--rss-every-s", type=float, default=5.0)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    from testenv import embps, gl
    ckpt = tempfile.mkdtemp(prefix="embps-soak-", dir="/var/tmp")
    flags = ["--checkpoint-dir", ckpt, "--checkpoint-interval-s", str(args.checkpoint_interval_s)]
    group = SoakGroup(gl, args.ranks, flags)
    report = {"args": vars(args), "minutes": [], "events": []}
    try:
        group.start([])
        servers = ",".join(group.addresses)
        with embps.Client(servers) as c:
            c.create_table(TABLE, args.rows, args.width)

        t0 = time.time() + 2.0
        procs, q = run_clients(servers, args, None, t0, t0 + args.calibrate_s)
        cal = collect(procs, q, t0 + args.calibrate_s + 120)
        n_ok = sum(sum(1 for c in r[4] if c == "OK") for r in cal)
        measured = n_ok / args.calibrate_s
        if n_ok == 0:
            print("FAIL: no call succeeded during calibration: %s" %
                  dict(collections.Counter(sum((list(r[4]) for r in cal), []))), file=sys.stderr)
            return 1
        rate_each = args.load * measured / args.clients
        print("calibration: %.0f calls/s closed loop with %d clients; soaking at %.0f calls/s "
              "(%.0f%%) for %.1f min" % (measured, args.clients, rate_each * args.clients,
                                         100 * args.load, args.minutes), flush=True)
        report["calibrated_calls_per_s"] = measured
        report["rate_calls_per_s"] = rate_each * args.clients

        t_start = time.time() + 3.0
        t_end = t_start + args.minutes * 60
        t_kill = t_start + args.kill_at * (t_end - t_start) if args.kill_at >= 0 else None
        procs, q = run_clients(servers, args, rate_each, t_start, t_end)
        rss = []  # (t, rank, MB)
        outage = None
        while time.time() < t_end:
            now = time.time()
            for r, p in enumerate(group.procs):
                m = rss_mb(p.pid)
                if m is not None:
                    rss.append((now, r, m))
            if t_kill is not None and now >= t_kill:
                t_kill = None
                victim = args.ranks - 1
                group.procs[victim].kill()
                report["events"].append({"t_s": round(now - t_start, 1),
                                         "event": "SIGKILL rank %d" % victim})
                print("%.0f s: SIGKILL rank %d" % (now - t_start, victim), flush=True)
                # The survivors see the broken group; then the whole group restarts, as
                # liveness probes restart it under Kubernetes.
                gl.wait_for(lambda: all(gl.health(a) != gl.SERVING
                                        for a in group.addresses[:victim]), 60, interval=0.2)
                codes = group.stop()
                group.start([])
                outage = time.time() - now
                report["events"].append({"t_s": round(time.time() - t_start, 1),
                                         "event": "group serving again", "outage_s": outage,
                                         "exit_codes": codes, "restore": group.restored()})
                print("%.0f s: group serving again after %.1f s (exit codes %s)\n  %s" %
                      (time.time() - t_start, outage, codes, group.restored()), flush=True)
                continue
            time.sleep(min(args.rss_every_s, max(0.0, t_end - time.time())))
        results = collect(procs, q, t_end + 600)
    finally:
        codes = group.stop()
        report["final_exit_codes"] = codes
        shutil.rmtree(ckpt, ignore_errors=True)

    starts = np.concatenate([r[1] for r in results])
    lats = np.concatenate([r[2] for r in results])
    ops = np.concatenate([r[3] for r in results])
    codes = np.array(sum((list(r[4]) for r in results), []))
    minute = ((starts - t_start) // 60).astype(int)
    print("\nminute  calls  errors                     lookup p50/p99/p99.9/max ms       "
          "push p50/p99/p99.9/max ms         RSS MB per rank")
    for m in range(int(np.ceil(args.minutes))):
        sel = minute == m
        errs = collections.Counter(codes[sel & (codes != "OK")])
        lk = percentiles(lats[sel & (ops == 0) & (codes == "OK")])
        pu = percentiles(lats[sel & (ops == 1) & (codes == "OK")])
        per_rank = []
        for r in range(args.ranks):
            v = [mb for (t, rr, mb) in rss if rr == r and int((t - t_start) // 60) == m]
            per_rank.append(round(max(v), 1) if v else None)
        row = {"minute": m, "calls": int(sel.sum()), "errors": dict(errs), "lookup": lk,
               "push": pu, "rss_mb": per_rank}
        report["minutes"].append(row)
        fmt = lambda d: ("%.1f/%.1f/%.1f/%.1f" % (d["p50"], d["p99"], d["p999"], d["max"])
                         if d else "-")
        print("%6d %6d  %-26s %-33s %-33s %s" % (m, row["calls"],
                                                ",".join("%s:%d" % kv for kv in errs.items()) or "0",
                                                fmt(lk), fmt(pu), per_rank))
    total_err = collections.Counter(codes[codes != "OK"])
    report["totals"] = {"calls": int(len(codes)), "ok": int((codes == "OK").sum()),
                        "errors": dict(total_err),
                        "lookup": percentiles(lats[(ops == 0) & (codes == "OK")]),
                        "push": percentiles(lats[(ops == 1) & (codes == "OK")]),
                        "outage_s": outage}
    print("\ntotal: %d calls, %d ok, errors %s; outage %s; lookup %s; push %s; exit codes %s" % (
        len(codes), report["totals"]["ok"], dict(total_err) or "none",
        "%.1f s" % outage if outage is not None else "none (no kill)",
        report["totals"]["lookup"], report["totals"]["push"], report["final_exit_codes"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    after = (starts > t_start + args.kill_at * (t_end - t_start) + (outage or 0)) & (codes == "OK")
    if args.kill_at >= 0 and not after.any():
        print("FAIL: no call succeeded after the restart", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
