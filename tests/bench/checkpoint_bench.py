"""Checkpoint benchmark (issue 9): prints figures, asserts nothing about speed.

On one filesystem (--dir, default a fresh directory under /var/tmp):
  - the disk's sequential write and read bandwidth with dd (write: conv=fsync; read: after
    dropping the page cache when this process may), measured right before and after each
    checkpoint and right before each restore, since the disk's speed swings between runs;
    ratios are medians of the pairs (and, for checkpoints, of the pairs where dd held steady);
  - a full checkpoint of a ROWS x 128 f32 rowwise_adagrad table (one rank): its bytes and GB/s,
    median of --repeat;
  - restore of it into a fresh server (time from start to SERVING, and the restore time the server
    logs), GB/s, median of --repeat, with the page cache dropped first when allowed;
  - an incremental checkpoint after --pushes pushes of 4096 zipf-distributed tokens: bytes, time;
  - the longest pause a concurrent lookup+push loop sees while a checkpoint is taken, against
    the longest it sees without one for as long in the same run (and their p99 and p50);
  - how fast the machine fills fresh memory (the restore's other ceiling).

Run: /usr/bin/python3 tests/bench/checkpoint_bench.py [--rows 1000000] [--repeat 3]
(the build's embps-server is found as in tests/group/grouplib.py: EMBPS_SERVER_BIN or build/)."""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "group"))
import grouplib as gl  # noqa: E402
from grouplib import pb  # noqa: E402

WIDTH = 128


def drop_caches():
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dd_write(d, mib, name="dd.bin"):
    """GB/s of a sequential write of mib MiB with fsync into file `name` of d, which is left (the
    default one for dd_read). A checkpoint always writes new files, and on this VM's disk a new
    file's blocks write at a third of the speed of a file rewritten in place (fresh blocks of a
    thin disk), so the reference for a checkpoint is a new file too."""
    path = os.path.join(d, name)
    out = subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=4M", "count=%d" % (mib // 4),
                          "conv=fsync"], capture_output=True, text=True).stderr
    return parse_dd(out)


def dd_read(d):
    """GB/s of a sequential read of dd_write's file (page cache dropped first when allowed)."""
    drop_caches()
    out = subprocess.run(["dd", "if=" + os.path.join(d, "dd.bin"), "of=/dev/null", "bs=4M"],
                         capture_output=True, text=True).stderr
    return parse_dd(out)


def parse_dd(text):
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", text)
    return int(m.group(1)) / float(m.group(2)) / 1e9 if m else float("nan")


def call_pauses(client, rows, stop, out):
    """A bench loop of lookups and pushes of 256 tokens spread over the table (a push writes
    rows, so under a copy-on-write capture it pays for the blocks it touches); out gets every
    call's seconds."""
    rng = np.random.default_rng(1)
    grads = np.full((256, WIDTH), 1e-3, np.float32)
    while not stop.is_set():
        tokens = rng.integers(1, rows, size=256)
        t0 = time.perf_counter()
        client.lookup_bytes("bench", tokens)
        client.push("bench", tokens, grads)
        out.append(time.perf_counter() - t0)


def first_touch_gbps(nbytes):
    """How fast this machine fills memory it has not touched yet (a restore writes every byte
    of a fresh table): the ceiling a restore meets before the disk's."""
    t0 = time.perf_counter()
    a = np.empty(nbytes, np.uint8)
    a.fill(1)
    took = time.perf_counter() - t0
    del a
    return nbytes / took / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1000000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pushes", type=int, default=1000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="embps-ckpt-bench-", dir="/var/tmp")
    table_bytes = args.rows * WIDTH * 4 + args.rows * 4
    try:
        mib = max(256, table_bytes >> 20)
        # This disk's speed swings between runs, so dd runs right before each checkpoint and
        # each restore, and the figures are medians of the pairs' ratios.
        ck = os.path.join(base, "ckpt")
        os.mkdir(ck)
        group = gl.Group(1, "--checkpoint-dir", ck, "--checkpoint-keep", "0",
                         "--checkpoint-full-every", "1000")
        client = gl.RawClient(group.addresses)
        writes, paths = [], []
        try:
            client.create("bench", args.rows, WIDTH, "rowwise_adagrad")
            dd_ws = []
            for _ in range(args.repeat):
                before = dd_write(base, mib, "dd-%d-before.bin" % len(writes))
                # a checkpoint of one table does not move the chain: every one here is full
                t0 = time.perf_counter()
                resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(table="bench"),
                                                  timeout=600)
                writes.append((time.perf_counter() - t0, resp.bytes))
                paths.append(resp.path)
                # and right after: this VM's disk switches between about 0.4 and 1.6 GB/s for
                # seconds at a time, so each checkpoint is set against the mean of the two
                dd_ws.append((before, dd_write(base, mib, "dd-%d-after.bin" % len(paths))))
            wt = statistics.median(w[0] for w in writes)
            ratios = [w[1] / w[0] / 1e9 / ((a + b) / 2) for w, (a, b) in zip(writes, dd_ws)]
            # the pairs where the disk held its speed (dd before and after within 25%)
            steady = [r for r, (a, b) in zip(ratios, dd_ws) if max(a, b) <= 1.25 * min(a, b)]
            print("full checkpoint: %d bytes, median %.3f s of %d = %.2f GB/s; dd write "
                  "(conv=fsync, new files) before/after each: %s GB/s; checkpoint/dd median %.0f%% (%s); "
                  "where the disk held its speed (%d of %d): median %s" %
                  (writes[0][1], wt, len(writes), writes[0][1] / wt / 1e9,
                   " ".join("%.2f/%.2f" % d for d in dd_ws), 100 * statistics.median(ratios),
                   "/".join("%.0f%%" % (100 * r) for r in ratios), len(steady), len(ratios),
                   "%.0f%%" % (100 * statistics.median(steady)) if steady else "-"))
            # pauses: the same lookup loop with a checkpoint in the middle, then without one
            # for as long (the longest of more calls is longer by itself)
            window = None
            for label, take in (("checkpoint", True), ("no checkpoint", False)):
                stop, calls = threading.Event(), []
                th = threading.Thread(target=call_pauses, args=(client, args.rows, stop, calls))
                t0 = time.perf_counter()
                th.start()
                time.sleep(0.5)
                if take:
                    client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=600)
                    time.sleep(0.3)
                    window = time.perf_counter() - t0
                else:
                    time.sleep(window)
                stop.set()
                th.join()
                calls.sort()
                print("lookup+push (256 tokens) during %s, %.1f s: longest %.1f ms, p99 %.1f ms, "
                      "p50 %.1f ms of %d calls" %
                      (label, window, calls[-1] * 1e3, calls[int(0.99 * (len(calls) - 1))] * 1e3,
                       calls[len(calls) // 2] * 1e3, len(calls)))
            # incremental after pushes of 4096 zipf tokens, and nothing else: a checkpoint first
            # takes the rows the pause loop wrote
            client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=600)
            rng = np.random.default_rng(2)
            z = np.minimum(rng.zipf(1.1, size=(args.pushes, 4096)), args.rows - 1)
            g = np.ones((4096, WIDTH), np.float32) * 0.01
            t0 = time.perf_counter()
            for i in range(args.pushes):
                client.push("bench", z[i], g)
            tp = time.perf_counter() - t0
            t0 = time.perf_counter()
            resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=600)
            ti = time.perf_counter() - t0
            print("incremental checkpoint after %d pushes of 4096 zipf(1.1) tokens (%.1f s of "
                  "pushes, %d distinct rows): %d bytes in %.3f s (a full one: %d bytes)" %
                  (args.pushes, tp, len(np.unique(z)), resp.bytes, ti, writes[0][1]))
        finally:
            client.close()
            group.close()
        restores, dd_rs = [], []
        for _ in range(args.repeat):
            if not dd_rs:
                dd_write(base, mib)
            dd_rs.append(dd_read(base))
            cold = drop_caches()
            t0 = time.perf_counter()
            g2 = gl.Group(1, "--restore", paths[-1])
            took = time.perf_counter() - t0
            m = re.search(r"restored .* in ([\d.]+) ms", g2.logs())
            restores.append((took, float(m.group(1)) / 1e3 if m else float("nan")))
            g2.close()
        rt = statistics.median(r[1] for r in restores)
        ratios = [writes[0][1] / r[1] / 1e9 / d for r, d in zip(restores, dd_rs)]
        print("restore (%s): median %.3f s in the server (%.2f GB/s), %.3f s from start to "
              "SERVING; dd read just before each: %s GB/s; restore/dd median %.0f%% (%s)" %
              ("page cache dropped" if cold else "page cache NOT dropped", rt,
               writes[0][1] / rt / 1e9, statistics.median(r[0] for r in restores),
               "/".join("%.2f" % d for d in dd_rs), 100 * statistics.median(ratios),
               "/".join("%.0f%%" % (100 * r) for r in ratios)))
        ft = statistics.median(first_touch_gbps(writes[0][1]) for _ in range(3))
        print("first touch of %d bytes of fresh memory: %.2f GB/s (a restore fills a fresh "
              "table: %.0f%% of this)" % (writes[0][1], ft, 100 * writes[0][1] / rt / 1e9 / ft))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
