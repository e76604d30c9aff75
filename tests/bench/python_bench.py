"""The Python library (python/embps) against the C client's `embps bench`, on the same server.

Lookups and pushes of BATCH x WIDTH f32 (default 4096 x 128) tokens drawn uniformly from
[1, ROWS) (as `embps bench` draws them with its default --zipf 0), closed loop, for one stream
and for two: a stream is one thread with its own client (the C bench's --concurrency: one
thread and one client per stream) doing one call at a time; `--pipeline 2` adds rows where each
stream keeps two calls in flight (lookup_async/push_async against the C bench's --pipeline 2).
Every configuration runs the C bench and the Python loop back to back, alternating which goes
first, --repeat times; the table shows the medians of rows/s and the median of the per-repeat
ratios Python/C (the target is >= 0.70).

Each measurement warms up for --warmup seconds and counts the calls that start after the warmup
and end before the deadline, as `embps bench` does. --profile runs the Python lookup and push
loops under cProfile once and prints where the time goes.

Run: /usr/bin/python3 tests/bench/python_bench.py [--ranks 1] [--duration 3] [--repeat 5]
     [--servers H:P,...  (an existing group; a table is created on it)]
The build's binaries are found as the group tests find them (EMBPS_SERVER_BIN, EMBPS_CLI_BIN,
else build/bin/)."""
import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from testenv import embps, gl  # noqa: E402


def c_bench(servers, table, op, streams, pipeline, batch, duration, warmup):
    """rows/s of `embps bench` (JSON)."""
    cmd = [gl.cli_binary(), "--servers", servers, "bench", table, "--batch", str(batch),
           "--duration", str(duration), "--warmup", str(warmup), "--concurrency", str(streams),
           "--pipeline", str(pipeline), "--push-ratio", "1" if op == "push" else "0", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + warmup + 120)
    if r.returncode != 0:
        raise RuntimeError("embps bench failed: %s\n%s" % (" ".join(cmd), r.stderr))
    j = json.loads(r.stdout)
    return j["push_rows_per_s" if op == "push" else "lookup_rows_per_s"]


class Stream:
    """One Python stream: its own client, token pool and gradients (made before the clock)."""

    def __init__(self, servers, table, rows, width, batch, seed, reuse_out):
        self.client = embps.Client(servers, padding=True)
        self.table, self.batch = table, batch
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(1, rows, max(16 * batch, 1 << 20))
        self.grads = np.full((batch, width), 1e-4, np.float32)
        self.outs = [np.empty((batch, width), np.float32) for _ in range(4)] if reuse_out else None
        self.count = 0

    def tokens(self):
        off = int(self.rng.integers(0, len(self.pool) - self.batch + 1))
        return self.pool[off:off + self.batch]

    def run(self, op, pipeline, t_measure, t_end):
        """Closed loop until t_end; counts calls that start at/after t_measure and end by t_end."""
        c, table = self.client, self.table
        count = 0
        k = 0
        if pipeline == 1:
            while True:
                start = time.perf_counter()
                if start >= t_end:
                    break
                tok = self.tokens()
                if op == "lookup":
                    c.lookup(table, tok, out=self.outs[0] if self.outs else None)
                else:
                    c.push(table, tok, self.grads)
                if start >= t_measure and time.perf_counter() <= t_end:
                    count += 1
        else:
            inflight = collections.deque()
            while True:
                now = time.perf_counter()
                while len(inflight) < pipeline and now < t_end:
                    tok = self.tokens()
                    if op == "lookup":
                        out = self.outs[k % len(self.outs)] if self.outs else None
                        f = c.lookup_async(table, tok, out=out)
                    else:
                        f = c.push_async(table, tok, self.grads)
                    k += 1
                    inflight.append((now, f))
                    now = time.perf_counter()
                if not inflight:
                    break
                start, f = inflight.popleft()
                f.result()
                if start >= t_measure and time.perf_counter() <= t_end:
                    count += 1
        self.count = count

    def close(self):
        self.client.close()


def py_bench(streams, op, pipeline, duration, warmup):
    """rows/s of the Python streams run together."""
    t0 = time.perf_counter() + 0.05
    t_measure, t_end = t0 + warmup, t0 + warmup + duration
    threads = [threading.Thread(target=s.run, args=(op, pipeline, t_measure, t_end))
               for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(s.count for s in streams) * streams[0].batch / duration


def profile(stream, duration):
    for op in ("lookup", "push"):
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        stream.run(op, 1, t0, t0 + duration)
        prof.disable()
        calls = stream.count
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print("\n---- cProfile: %s, one stream, %d calls in %.1f s (%.3f ms a call) ----"
              % (op, calls, duration, duration / max(calls, 1) * 1e3))
        print("\n".join(s.getvalue().splitlines()[6:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", help="an existing group (default: start --ranks servers)")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1000000)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--streams", default="1,2", help="stream counts to run (default 1,2)")
    ap.add_argument("--pipeline", default="1", help="calls in flight per stream, e.g. 1,2")
    ap.add_argument("--ops", default="lookup,push")
    ap.add_argument("--reuse-out", action="store_true",
                    help="lookups fill a reused array (out=) as the C bench's buffers are")
    ap.add_argument("--profile", action="store_true", help="also cProfile the Python loops")
    a = ap.parse_args()

    group = None
    if a.servers:
        servers = a.servers
    else:
        group = gl.Group(a.ranks)
        servers = group.servers
    try:
        setup = embps.Client(servers)
        table = "pybench_%d" % os.getpid()
        setup.create_table(table, a.rows, a.width, optimizer="rowwise_adagrad", lr=0.01)
        ranks = setup.group_size
        setup.close()
        streams_list = [int(x) for x in a.streams.split(",")]
        pipelines = [int(x) for x in a.pipeline.split(",")]
        ops = a.ops.split(",")
        streams = [Stream(servers, table, a.rows, a.width, a.batch, 100 + i, a.reuse_out)
                   for i in range(max(streams_list))]
        print("embps python_bench: %d-rank group %s, table %d x %d f32 rowwise_adagrad, batch %d "
              "uniform tokens, %.1f s + %.1f s warmup per run, %d repeats, %d CPUs here"
              % (ranks, servers, a.rows, a.width, a.batch, a.duration, a.warmup, a.repeat,
                 os.cpu_count()))
        configs = [(op, s, p) for op in ops for s in streams_list for p in pipelines]
        results = {cfg: ([], []) for cfg in configs}
        for rep in range(a.repeat):
            for i, (op, s, p) in enumerate(configs):
                runs = [("c", lambda: c_bench(servers, table, op, s, p, a.batch, a.duration,
                                              a.warmup)),
                        ("py", lambda: py_bench(streams[:s], op, p, a.duration, a.warmup))]
                if (rep + i) % 2:
                    runs.reverse()
                got = {k: fn() for k, fn in runs}
                results[(op, s, p)][0].append(got["c"])
                results[(op, s, p)][1].append(got["py"])
                print("  repeat %d %-6s streams %d pipeline %d: C %.3g rows/s, Python %.3g rows/s"
                      " (%.2f)" % (rep + 1, op, s, p, got["c"], got["py"], got["py"] / got["c"]),
                      flush=True)
        print("\n%-7s %7s %8s %16s %16s %9s %10s" % ("op", "streams", "pipeline", "C rows/s",
                                                   "Python rows/s", "ratio", "target"))
        for (op, s, p), (cs, ps) in results.items():
            ratio = statistics.median(pv / cv for cv, pv in zip(cs, ps))
            print("%-7s %7d %8d %16.4g %16.4g %9.3f %10s"
                  % (op, s, p, statistics.median(cs), statistics.median(ps), ratio,
                     "ok" if ratio >= 0.7 else "short"))
        if a.profile:
            profile(streams[0], a.duration)
        for st in streams:
            st.close()
    finally:
        if group is not None:
            group.close()


if __name__ == "__main__":
    main()
