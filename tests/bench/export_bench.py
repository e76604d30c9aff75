"""Export benchmark (issue 33): prints figures, asserts nothing about speed.

On one filesystem (--dir, default a fresh directory under /var/tmp):
  - writes a full checkpoint of a ROWS x 128 f32 table (sgd: the files hold the rows alone) from a
    group of --ranks ranks;
  - the disk's sequential read bandwidth over exactly the checkpoint's slice files: dd (bs=4M) of
    each, cold: their pages dropped from the page cache first (posix_fadvise DONTNEED on the
    fsynced files, which needs no privilege; /proc/sys/vm/drop_caches too when this process may);
  - `embps export` of the table, cold the same way, writing rows.npy on the same filesystem (or in
    --out: a table larger than the page cache's dirty limit then writes at the disk's write speed,
    which bounds the export): rows/s, and GB/s of checkpoint bytes read, against dd's;
  - embps.checkpoint.open and a pass over every row (Rows.chunks, verifying every block), cold:
    rows/s and GB/s, and np.asarray of the whole when --whole;
each --repeat times, dd right before each measurement (this disk's speed swings); ratios are
medians of the pairs.

Run: /usr/bin/python3 tests/bench/export_bench.py [--rows 2000000] [--ranks 1] [--repeat 3]
(the build's embps-server and embps are found as in tests/group/grouplib.py)."""
import argparse
import gc
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from testenv import gl  # noqa: E402

import embps.checkpoint as ckpt  # noqa: E402

pb = gl.pb
WIDTH = 128


def drop(paths):
    """Drops the files' pages from the page cache (they are fsynced: clean)."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_read(paths):
    """GB/s of reading the files one after another, cold."""
    drop(paths)
    total, t0 = 0, time.monotonic()
    for p in paths:
        out = subprocess.run(["dd", "if=" + p, "of=/dev/null", "bs=4M"], capture_output=True,
                             text=True).stderr
        m = re.search(r"^(\d+) bytes", out, re.M)
        total += int(m.group(1))
    return total / (time.monotonic() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000000)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--whole", action="store_true", help="also time np.asarray of the whole")
    ap.add_argument("--out", default=None,
                    help="where export writes (default: beside the checkpoint, the same disk)")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="embps-export-bench-", dir="/var/tmp")
    ckdir = os.path.join(base, "ckpt")
    os.makedirs(ckdir, exist_ok=True)
    try:
        group = gl.Group(args.ranks, "--checkpoint-dir", ckdir)
        client = gl.RawClient(group.addresses)
        try:
            client.create("t", args.rows, WIDTH, "sgd", seed=3)
            path = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=600).path
        finally:
            client.close()
            group.close()
        files = sorted(glob.glob(os.path.join(path, "r*-t.embps")))
        nbytes = sum(os.path.getsize(p) for p in files)
        print("checkpoint: %d x %d f32 on %d rank(s): %d files, %.2f GB, in %s"
              % (args.rows, WIDTH, args.ranks, len(files), nbytes / 1e9, path))
        ex, py, whole = [], [], []
        for _ in range(args.repeat):
            out = os.path.join(args.out or base, "embps-export-bench-out")
            shutil.rmtree(out, ignore_errors=True)
            d1 = dd_read(files)
            drop(files)
            t0 = time.monotonic()
            r = subprocess.run([gl.cli_binary(), "export", path, "--table", "t", "--out", out],
                               capture_output=True, text=True)
            dt = time.monotonic() - t0
            if r.returncode:
                raise SystemExit(r.stderr)
            ex.append((args.rows / dt, nbytes / dt / 1e9, d1))
            shutil.rmtree(out, ignore_errors=True)
            d2 = dd_read(files)
            drop(files)
            t0 = time.monotonic()
            with ckpt.open(path) as ck:
                s = 0.0
                for _, chunk in ck["t"].rows.chunks():
                    s += float(chunk[:, 0].sum())
            dt = time.monotonic() - t0
            gc.collect()
            py.append((args.rows / dt, nbytes / dt / 1e9, d2))
            if args.whole:
                d3 = dd_read(files)
                drop(files)
                t0 = time.monotonic()
                with ckpt.open(path) as ck:
                    assert np.asarray(ck["t"].rows).shape == (args.rows, WIDTH)
                dt = time.monotonic() - t0
                gc.collect()
                whole.append((args.rows / dt, nbytes / dt / 1e9, d3))
        for name, runs in (("embps export", ex), ("checkpoint.open, chunks", py),
                           ("checkpoint.open, np.asarray", whole)):
            if not runs:
                continue
            print("%-28s %s" % (name, "  ".join("%.2fM rows/s %.2f GB/s (dd %.2f GB/s)"
                                                 % (a / 1e6, b, c) for a, b, c in runs)))
            print("%-28s median %.2fM rows/s, %.0f%% of dd's cold read (median of the pairs)"
                  % ("", statistics.median(a for a, _, _ in runs) / 1e6,
                     100 * statistics.median(b / c for _, b, c in runs)))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
