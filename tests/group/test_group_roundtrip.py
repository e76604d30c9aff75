"""Tables in and out, end to end (issue 33): `embps import` of a .npy array into a group of 1, 2
and 3 ranks, a checkpoint, then `embps export` of it offline and embps.checkpoint.open: bitwise
the array imported, for dense f32 and bf16 tables (rows 1.. of the array; row 0 is padding) and a
hash-keyed f32 table fed ids (its keys.npy holds exactly those keys, each with its row).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from testenv import gl  # noqa: E402

import embps.checkpoint as ckpt  # noqa: E402

WIDTH = 48  # 1, 2 and 3 ranks split it
ROWS = 700
KEYS = 300


def to_bf16_bits(a):
    u = np.asarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def cli(group, *args):
    r = subprocess.run([gl.cli_binary(), "--servers", ",".join(group.addresses), *args],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError("embps %s: exit %d\n%s%s" % (" ".join(args), r.returncode, r.stdout,
                                                          r.stderr))
    return r.stdout


class RoundTripTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="embps-roundtrip-")
        rng = np.random.default_rng(12)
        self.f32 = rng.normal(size=(ROWS, WIDTH)).astype("<f4")
        self.f32[0] = 0  # padding: import skips row 0
        self.bf16 = to_bf16_bits(rng.normal(size=(ROWS, WIDTH)))
        self.bf16[0] = 0
        keys = set()
        while len(keys) < KEYS:
            keys.add(int(rng.integers(1, 1 << 63, dtype=np.int64)) * (1 if len(keys) % 2 else -1))
        self.ids = np.array(sorted(keys), dtype="<i8")
        self.hrows = rng.normal(size=(KEYS, WIDTH)).astype("<f4")
        for name, arr in (("f32", self.f32), ("bf16", self.bf16), ("ids", self.ids),
                          ("hrows", self.hrows)):
            np.save(os.path.join(self.tmp, name + ".npy"), arr)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def one_size(self, n):
        d = os.path.join(self.tmp, "ckpt%d" % n)
        os.makedirs(d)
        group = gl.Group(n, "--checkpoint-dir", d)
        try:
            cli(group, "create-table", "dense", "--rows", str(ROWS), "--emb-width", str(WIDTH))
            cli(group, "create-table", "half", "--rows", str(ROWS), "--emb-width", str(WIDTH),
                "--dtype", "bf16")
            cli(group, "create-table", "keyed", "--capacity", str(2 * KEYS), "--emb-width",
                str(WIDTH))
            cli(group, "import", "dense", os.path.join(self.tmp, "f32.npy"), "--no-progress")
            cli(group, "import", "half", os.path.join(self.tmp, "bf16.npy"), "--no-progress")
            cli(group, "import", "keyed", os.path.join(self.tmp, "hrows.npy"), "--ids",
                os.path.join(self.tmp, "ids.npy"), "--no-progress")
            cli(group, "checkpoint")
        finally:
            group.close()
        out = {}
        for table in ("dense", "half", "keyed"):
            o = os.path.join(self.tmp, "out%d-%s" % (n, table))
            r = subprocess.run([gl.cli_binary(), "export", d, "--table", table, "--out", o],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            out[table] = {f[:-4]: np.load(os.path.join(o, f)) for f in os.listdir(o)
                          if f.endswith(".npy")}
        return d, out

    def test_import_then_export_is_bitwise_on_1_2_and_3_ranks(self):
        for n in (1, 2, 3):
            with self.subTest(ranks=n):
                d, out = self.one_size(n)
                self.assertEqual(out["dense"]["rows"].tobytes(), self.f32.tobytes())
                self.assertEqual(out["half"]["rows"].dtype, np.uint16)
                self.assertEqual(out["half"]["rows"].tobytes(), self.bf16.tobytes())
                keys, rows = out["keyed"]["keys"], out["keyed"]["rows"]
                order = np.argsort(keys)
                self.assertEqual(keys[order].tobytes(), self.ids.tobytes())
                self.assertEqual(rows[order].tobytes(), self.hrows.tobytes())
                with ckpt.open(d) as c:
                    self.assertEqual(np.asarray(c.tables["dense"].rows).tobytes(),
                                     self.f32.tobytes())
                    self.assertEqual(np.asarray(c.tables["half"].rows).tobytes(),
                                     self.bf16.tobytes())


if __name__ == "__main__":
    unittest.main()
