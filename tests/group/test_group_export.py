"""Exports from checkpoints, offline (issue 33): `embps export` and embps.checkpoint.open.

- Checkpoints written by 1, 2 and 4 ranks, a chain of three (full, incremental, incremental):
  for each of them, every table's `embps export` output, loaded with numpy.load, is bitwise the
  rows the group answered to lookups right after that checkpoint (dense f32 and bf16 tables of
  three optimizers, one of several blocks per file; hash-keyed f32 and bf16 tables, one evicting,
  whose keys.npy holds exactly the keys stored), and embps.checkpoint.open gives the same arrays
  (rows, keys, state); --state's adagrad accumulators are what the pushes made them; --f32 widens
  bf16 exactly; --round picks an older checkpoint of the directory.
- Bad input: a flipped byte in a block, and a file cut inside a block, fail both readers with a
  message naming the file and the block; a checkpoint without its manifest, and a directory
  holding no complete checkpoint, fail clearly; nothing is left under the output's names.
- The progress meter goes to stderr only when it is a terminal.
"""
import glob
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from testenv import gl  # noqa: E402  (the library embps beside grouplib's stubs: see there)

import embps.checkpoint as ckpt  # noqa: E402

pb = gl.pb

WIDTH = 64  # every group size here splits it
ROWS = 3000
BIG_ROWS = 20000  # several 1 MiB blocks per slice file on every group size
KEYS = 2000
DENSE = {  # name: (rows, dtype, optimizer, settings)
    "d_f32_adam": (ROWS, pb.DTYPE_F32, "adam", dict(lr=0.01, b1=0.9, b2=0.999)),
    "d_bf16_rw": (ROWS, pb.DTYPE_BF16, "rowwise_adagrad", dict(lr=0.05, wd=0.001)),
    "d_f32_ada": (ROWS, pb.DTYPE_F32, "adagrad", dict(lr=0.05, init_acc=0.1)),
    "big": (BIG_ROWS, pb.DTYPE_F32, "sgd", dict(lr=0.05)),
}
HASH = {  # name: (capacity, dtype, optimizer, settings)
    "h_f32": (512, pb.DTYPE_F32, "adam", dict(lr=0.01, b1=0.9, b2=0.999)),  # evicts
    "h_bf16": (4096, pb.DTYPE_BF16, "sgd", dict(lr=0.05)),  # holds every key
}
T = 64  # tokens per push: divisible by 1, 2 and 4


def key_space():
    rng = np.random.default_rng(77)
    keys = set()
    while len(keys) < KEYS:
        keys.add(int(rng.integers(1, 1 << 63, dtype=np.int64)) * (1 if len(keys) % 2 else -1))
    return np.array(sorted(keys), dtype=np.int64)


def to_bf16_bits(a):
    u = np.asarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def create_tables(client):
    for name, (rows, dtype, opt, kw) in DENSE.items():
        client.create(name, rows, WIDTH, opt, seed=5, dtype=dtype, **kw)
    for name, (cap, dtype, opt, kw) in HASH.items():
        spec = gl.table_spec(name, 0, WIDTH, opt, seed=9, dtype=dtype, **kw)
        spec.capacity = cap
        client.stubs[0].CreateTable(pb.CreateTableRequest(spec=spec), timeout=gl.CALL_TIMEOUT)


def push_phase(client, rng, keys, ada_acc, pushed, steps):
    """steps pushes to every table; ada_acc (the adagrad table's accumulators) and pushed (the
    keys pushed to the hash-keyed tables) follow them."""
    for _ in range(steps):
        for name, (rows, dtype, _, _) in DENSE.items():
            tokens = rng.integers(0, rows if name != "big" else BIG_ROWS, size=T)
            tokens[1] = tokens[2]  # a duplicate
            grads = rng.normal(size=(T, WIDTH)).astype(np.float32)
            if name == "d_f32_ada":
                summed = np.zeros((rows, WIDTH), np.float32)
                np.add.at(summed, tokens, grads)
                for t in np.unique(tokens[tokens != 0]):  # token 0 is padding: never pushed
                    ada_acc[t] += summed[t] * summed[t]
            client.push(name, tokens, to_bf16_bits(grads) if dtype == pb.DTYPE_BF16 else grads)
        for name, (_, dtype, _, _) in HASH.items():
            tokens = keys[rng.integers(0, KEYS, size=4 * T)]
            pushed[name].update(int(k) for k in tokens)
            grads = rng.normal(size=(4 * T, WIDTH)).astype(np.float32)
            client.push(name, tokens, to_bf16_bits(grads) if dtype == pb.DTYPE_BF16 else grads)


def lookup_all(client, name, tokens, per=1000):
    tokens = np.asarray(tokens, dtype=np.int64)
    pad = (-len(tokens)) % per
    toks = np.concatenate([tokens, np.zeros(pad, np.int64)])
    got = b"".join(client.lookup_bytes(name, toks[i:i + per]) for i in range(0, len(toks), per))
    return got[:len(got) * len(tokens) // len(toks)] if len(toks) else got


def key_count(client, name):
    for t in client.stubs[0].GetStats(pb.GetStatsRequest(), timeout=gl.CALL_TIMEOUT).tables:
        if t.name == name:
            return t.keys
    raise AssertionError("no stats for " + name)


def snapshot(client, keys):
    """{table: rows bytes} (dense: every row; hash: every key of the key space) and key counts."""
    out = {name: lookup_all(client, name, np.arange(spec[0])) for name, spec in DENSE.items()}
    for name in HASH:
        out[name] = lookup_all(client, name, keys)
        out[name + ":keys"] = key_count(client, name)
    return out


def export(path, table, out, *flags, stderr=subprocess.PIPE):
    return subprocess.run([gl.cli_binary(), "export", path, "--table", table, "--out", out,
                           *flags], stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120)


def rows_bytes(a):
    return np.ascontiguousarray(a).tobytes()


def slice_blocks(path):
    """(offset, first row, rows, payload bytes) of every block of a slice file."""
    with open(path, "rb") as f:
        data = f.read()
    hlen = struct.unpack_from("<I", data, 12)[0]
    blocks = struct.unpack_from("<Q", data, 56)[0]
    out, off = [], hlen
    for _ in range(blocks):
        first, n, nbytes, _ = struct.unpack_from("<QIII", data, off)
        out.append((off, first, n, nbytes))
        off += 20 + nbytes
    return out


def flip(path, at, bit):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ bit]))


class Written(gl.TmpDirs):
    """Groups of 1, 2 and 4 ranks, each writing a chain of three checkpoints, made once."""
    tmp_prefix = "embps-export-"
    made = {}

    @classmethod
    def written(cls, n):
        if n in cls.made:
            return cls.made[n]
        import tempfile
        d = tempfile.mkdtemp(prefix="embps-export-ckpt-")
        keys = key_space()
        group = gl.Group(n, "--checkpoint-dir", d, "--checkpoint-full-every", "3",
                         "--checkpoint-keep", "10")
        client = gl.RawClient(group.addresses)
        rng = np.random.default_rng(100 + n)
        ada_acc = np.full((ROWS, WIDTH), 0.1, np.float32)
        pushed = {name: set() for name in HASH}
        out = []
        try:
            create_tables(client)
            for phase in range(3):
                push_phase(client, rng, keys, ada_acc, pushed, 3 if phase == 0 else 2)
                resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=gl.CALL_TIMEOUT)
                snap = snapshot(client, keys)
                for name in HASH:
                    snap[name + ":pushed"] = np.array(sorted(pushed[name]), dtype=np.int64)
                out.append((resp.path, snap, ada_acc.copy()))
        finally:
            client.close()
            codes = group.close()
        assert all(c == 0 for c in codes.values()), codes
        cls.made[n] = (d, keys, out)
        return cls.made[n]



def tearDownModule():
    for d, _, _ in Written.made.values():
        shutil.rmtree(d, ignore_errors=True)
    Written.made.clear()


class ExportTest(Written, unittest.TestCase):
    def check_table(self, path, name, snap, keys, ada_acc, out):
        r = export(path, name, out, "--state")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")  # no progress meter into a pipe
        self.assertIn("exported table '%s'" % name, r.stdout)
        with open(os.path.join(out, "table.json")) as f:
            meta = json.load(f)
        rows = np.load(os.path.join(out, "rows.npy"))
        self.assertFalse(glob.glob(os.path.join(out, "*.tmp")))
        with ckpt.open(path) as ck:
            t = ck[name]
            self.assertEqual(t.step, meta["step"])
            got = np.asarray(t.rows)
            self.assertEqual(got.dtype, rows.dtype)
            self.assertTrue(np.array_equal(got, rows), name)
            piece, ckpt._PIECE_BYTES = ckpt._PIECE_BYTES, 3000  # many pieces, on threads
            try:
                self.assertTrue(np.array_equal(np.asarray(t.rows), rows), name)
                for s, arr in t.state.items():
                    self.assertTrue(np.array_equal(np.asarray(arr), np.load(
                        os.path.join(out, s + ".npy"))), (name, s))
            finally:
                ckpt._PIECE_BYTES = piece
            for s, arr in t.state.items():
                exported = np.load(os.path.join(out, s + ".npy"))
                self.assertEqual(exported.shape, arr.shape, (name, s))
                self.assertTrue(np.array_equal(np.asarray(arr), exported), (name, s))
            if name in HASH:
                k = np.load(os.path.join(out, "keys.npy"))
                self.assertEqual(k.dtype, np.int64)
                self.assertTrue(np.array_equal(t.keys, k), name)
                self.assertEqual(len(k), snap[name + ":keys"], name)
                self.assertEqual(len(np.unique(k)), len(k))
                where = np.searchsorted(keys, k)
                self.assertTrue(np.array_equal(keys[where], k), "a key never pushed")
                rb = len(snap[name]) // len(keys)
                want = b"".join(snap[name][i * rb:(i + 1) * rb] for i in where)
                self.assertTrue(rows_bytes(rows) == want, "%s: rows differ" % name)
                self.assertEqual(meta["kind"], "hash")
                if name == "h_bf16":  # it holds every key ever pushed
                    self.assertTrue(np.array_equal(np.sort(k), snap[name + ":pushed"]))
                else:  # full, having evicted
                    self.assertEqual(len(k), HASH[name][0])
                    self.assertLess(len(k), len(snap[name + ":pushed"]))
                # the view's lazy reads agree with the whole
                pick = np.array([len(k) - 1, 0, len(k) // 2])
                self.assertTrue(np.array_equal(t.rows[pick], got[pick]))
            else:
                self.assertEqual(rows.shape, (DENSE[name][0], WIDTH))
                self.assertTrue(rows_bytes(rows) == snap[name], "%s: rows differ" % name)
                self.assertTrue(np.array_equal(t.rows[17:1234], got[17:1234]))
                self.assertTrue(np.array_equal(t.rows[[2999, 5, 5, -1]], got[[2999, 5, 5, -1]]))
                self.assertTrue(np.array_equal(t.rows[100:900:7, 3], got[100:900:7, 3]))
            if name == "d_f32_ada":
                acc = np.load(os.path.join(out, "accumulators.npy"))
                np.testing.assert_allclose(acc, ada_acc, rtol=2e-5)
            if name == "d_bf16_rw":
                self.assertEqual(rows.dtype, np.uint16)
                self.assertEqual(np.load(os.path.join(out, "accumulators.npy")).shape, (ROWS,))
                out32 = out + "-f32"
                r = export(path, name, out32, "--f32")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertTrue(np.array_equal(np.load(os.path.join(out32, "rows.npy")),
                                               ckpt.bf16_to_float32(rows)))
            if name == "d_f32_adam":
                self.assertTrue((np.load(os.path.join(out, "v.npy")) >= 0).all())

    def run_size(self, n):
        d, keys, cks = self.written(n)
        out = self.tmpdir()
        for i, (path, snap, ada_acc) in enumerate(cks):
            m = ckpt.open(path)
            self.assertEqual(m.group_size, n)
            self.assertEqual(bool(m.base_round), i > 0, path)  # full, incremental, incremental
            for name in list(DENSE) + list(HASH):
                with self.subTest(ranks=n, checkpoint=i, table=name):
                    self.check_table(path, name, snap, keys, ada_acc,
                                     os.path.join(out, "%d-%s" % (i, name)))
        # The directory itself: the newest checkpoint; --round R an older one.
        r = export(d, "big", os.path.join(out, "newest"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(rows_bytes(np.load(os.path.join(out, "newest", "rows.npy")))
                        == cks[-1][1]["big"])
        rnd = int(os.path.basename(cks[1][0])[5:])
        r = export(d, "big", os.path.join(out, "older"), "--round", str(rnd))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(rows_bytes(np.load(os.path.join(out, "older", "rows.npy")))
                        == cks[1][1]["big"])
        newest = sorted(glob.glob(os.path.join(d, "ckpt-*")))[-1]  # the drain's, at the stop
        self.assertEqual(ckpt.open(d).round, int(os.path.basename(newest)[5:]))
        self.assertTrue(np.array_equal(np.asarray(ckpt.open(d, round=rnd)["big"].rows),
                                       np.load(os.path.join(out, "older", "rows.npy"))))

    def test_one_rank(self):
        self.run_size(1)

    def test_two_ranks(self):
        self.run_size(2)

    def test_four_ranks(self):
        self.run_size(4)


class BadInputTest(Written, unittest.TestCase):
    def copy(self):
        d, _, cks = self.written(2)
        dst = os.path.join(self.tmpdir(), "ckpts")
        shutil.copytree(d, dst)
        return dst, [os.path.join(dst, os.path.basename(p)) for p, _, _ in cks]

    def expect_failure(self, path, table, *fragments):
        out = os.path.join(self.tmpdir(), "out")
        r = export(path, table, out)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        for f in fragments:
            self.assertIn(f, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "rows.npy")))
        self.assertFalse(glob.glob(os.path.join(out, "*.tmp")))
        return r.stderr

    def expect_python_failure(self, path, table, file=None, block=None, *fragments):
        with self.assertRaises(ckpt.CheckpointError) as cm:
            with ckpt.open(path) as ck:
                np.asarray(ck[table].rows)
        e = cm.exception
        if file is not None:
            self.assertEqual(e.file, file, str(e))
        self.assertEqual(e.block, block, str(e))
        for f in fragments:
            self.assertIn(f, str(e))
        return e

    def test_corrupt_byte_in_a_block(self):
        d, paths = self.copy()
        victim = os.path.join(paths[0], "r1-big.embps")
        off, first, n, nbytes = slice_blocks(victim)[1]
        flip(victim, off + 20 + nbytes // 2, 0x10)
        msg = "block 1 (rows %d..%d) fails its crc32" % (first, first + n - 1)
        # through the chain of the newest checkpoint, and the full one alone
        self.expect_failure(paths[2], "big", victim, msg)
        self.expect_failure(paths[0], "big", victim, msg)
        self.expect_python_failure(paths[0], "big", victim, 1, victim, msg)
        with ckpt.open(paths[0]) as ck:  # rows of the other blocks still read, verified
            self.assertEqual(ck["big"].rows[:first].shape, (first, WIDTH))
            with self.assertRaises(ckpt.CheckpointError):
                ck.verify()
        with self.assertRaises(ckpt.CheckpointError) as cm:
            ckpt.open(paths[0], verify=True)
        self.assertEqual((cm.exception.file, cm.exception.block), (victim, 1))
        # an incremental slice's block
        victim = os.path.join(paths[1], "r0-d_f32_ada.embps")
        off, first, n, nbytes = slice_blocks(victim)[0]
        flip(victim, off + 20, 0x01)
        self.expect_failure(paths[2], "d_f32_ada", victim, "block 0 (rows %d..%d)"
                            % (first, first + n - 1))
        self.expect_python_failure(paths[2], "d_f32_ada", victim, 0, "block 0")

    def test_truncated_file(self):
        d, paths = self.copy()
        victim = os.path.join(paths[0], "r0-big.embps")
        off, first, n, nbytes = slice_blocks(victim)[2]
        os.truncate(victim, off + 20 + nbytes // 3)
        msg = "it ends in block 2, rows %d..%d" % (first, first + n - 1)
        self.expect_failure(paths[0], "big", victim, "truncated", msg)
        self.expect_failure(paths[2], "big", victim, "truncated", msg)  # through the chain
        self.expect_python_failure(paths[0], "big", victim, 2, "truncated", msg)

    def test_missing_manifest(self):
        d, paths = self.copy()
        os.unlink(os.path.join(paths[2], "MANIFEST"))
        self.expect_failure(paths[2], "big", paths[2], "not a complete checkpoint",
                            "no manifest")
        e = self.expect_python_failure(paths[2], "big", None, None, "no manifest")
        self.assertEqual(e.code, gl.SC.NOT_FOUND)
        # The directory: the newest complete one is another.
        out = os.path.join(self.tmpdir(), "o")
        r = export(d, "big", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("round %s " % os.path.basename(paths[2])[5:].lstrip("0"), r.stdout)
        every = sorted(glob.glob(os.path.join(d, "ckpt-*")))
        for p in every:
            if p != paths[2]:
                os.unlink(os.path.join(p, "MANIFEST"))
        self.expect_failure(d, "big", "holds no complete checkpoint",
                            "%d checkpoint directories" % len(every))
        self.expect_python_failure(d, "big", None, None, "holds no complete checkpoint")
        # --round of one without a manifest
        r = export(d, "big", out, "--round", os.path.basename(paths[1])[5:])
        self.assertEqual(r.returncode, 1)
        self.assertIn("no manifest", r.stderr)

    def test_other_inputs(self):
        d, paths = self.copy()
        self.expect_failure(paths[0], "nope", "holds no table 'nope'")
        self.expect_failure(os.path.join(d, "absent"), "big", "is not a directory")
        with self.assertRaises(ckpt.CheckpointError) as cm:
            ckpt.open(paths[0])["nope"]
        self.assertIn("holds no table 'nope'", str(cm.exception))
        # a base of the chain gone: the chain is broken, named
        shutil.rmtree(paths[0])
        self.expect_failure(paths[2], "big", "applies on round")
        with self.assertRaises(ckpt.CheckpointError) as cm:
            ckpt.open(paths[2])
        self.assertIn("applies on round", str(cm.exception))
        # usage: --table and --out are required
        r = subprocess.run([gl.cli_binary(), "export", paths[1], "--table", "big"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--out is required", r.stderr)


class ProgressTest(Written, unittest.TestCase):
    def test_progress_on_a_terminal_only(self):
        _, _, cks = self.written(1)
        master, slave = pty.openpty()
        try:
            r = export(cks[0][0], "big", os.path.join(self.tmpdir(), "o"), stderr=slave)
            os.close(slave)
            slave = None
            text = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                text += chunk
        finally:
            if slave is not None:
                os.close(slave)
            os.close(master)
        self.assertEqual(r.returncode, 0, text)
        self.assertIn(b"export big: 100% 20000/20000 rows", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
