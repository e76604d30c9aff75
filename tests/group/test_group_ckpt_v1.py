"""Checkpoints of format version 1, written by the previous release, still restore.

tests/fixtures/ckpt-v1 holds a checkpoint that release's server wrote (its README says how) and
the rows its CLI looked up just before. This build, which writes format version 2 (table specs
carry the hash-keyed settings), restores it onto 1 and 2 ranks: the table's spec is the dense one
it was (capacity 0), every row bitwise what the old server returned. A push after the restore
applies, and the checkpoint taken next is of version 2 and restores to the same rows, so a group
moves from the old format to the new one without a gap."""
import os
import shutil
import struct
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

FIXTURE = os.path.join(os.path.dirname(gl.HERE), "fixtures", "ckpt-v1")
CKPT = "ckpt-00000000000000000005"
ROWS, WIDTH = 16, 8


def old_rows():
    """The rows the previous release's CLI printed, as float32 (9 digits parse back exactly)."""
    out = np.zeros((ROWS, WIDTH), dtype="<f4")
    with open(os.path.join(FIXTURE, "rows.txt")) as f:
        for line in f:
            cells = line.split()
            out[int(cells[0])] = np.array([np.float32(c) for c in cells[1:]], dtype="<f4")
    return out


def format_version(path):
    with open(path, "rb") as f:
        head = f.read(12)
    return struct.unpack_from("<I", head, 8)[0]


class CheckpointV1Test(gl.TmpDirs, unittest.TestCase):
    tmp_prefix = "embps-ckptv1-"

    def fixture_copy(self):
        """The fixture in a directory of its own: a server never writes next to the source."""
        d = self.tmpdir()
        shutil.copytree(os.path.join(FIXTURE, CKPT), os.path.join(d, CKPT))
        return os.path.join(d, CKPT)

    def test_fixture_is_version_1(self):
        path = os.path.join(FIXTURE, CKPT)
        self.assertEqual(format_version(os.path.join(path, "MANIFEST")), 1)
        self.assertEqual(format_version(os.path.join(path, "r0-emb.embps")), 1)

    def test_restores_onto_1_and_2_ranks(self):
        want = old_rows()
        tokens = np.arange(ROWS, dtype=np.int64)
        for m in (1, 2):
            with self.subTest(ranks=m):
                src = self.fixture_copy()
                dest = self.tmpdir()
                group = gl.Group(m, "--restore", src, "--checkpoint-dir", dest)
                client = gl.RawClient(group.addresses)
                try:
                    tables = client.stubs[0].ListTables(pb.ListTablesRequest(),
                                                        timeout=gl.CALL_TIMEOUT).tables
                    self.assertEqual([t.name for t in tables], ["emb"])
                    spec = tables[0]
                    self.assertEqual((spec.rows, spec.emb_width, spec.seed), (ROWS, WIDTH, 31))
                    self.assertEqual(spec.optimizer.kind, pb.OPTIMIZER_ADAGRAD)
                    self.assertEqual(spec.capacity, 0)  # dense, as version 1 tables all are
                    self.assertEqual((spec.admit_after, spec.eviction, spec.sketch_width),
                                     (0, 0, 0))
                    got = client.lookup("emb", tokens, WIDTH)
                    self.assertEqual(got.tobytes(), want.tobytes(),
                                     "the restored rows differ from the old server's")

                    grads = np.full((2, WIDTH), 0.5, dtype="<f4")
                    res = client.push("emb", [4, 9], grads)
                    self.assertTrue(all(r.applied for r in res))
                    after = client.lookup("emb", tokens, WIDTH)
                    self.assertFalse(np.array_equal(after[4], want[4]))
                    resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(),
                                                      timeout=gl.CALL_TIMEOUT)
                    self.assertEqual(format_version(os.path.join(resp.path, "MANIFEST")), 2)
                finally:
                    client.close()
                    group.close_checked(self)

                group = gl.Group(m, "--restore", resp.path, "--checkpoint-dir", self.tmpdir())
                client = gl.RawClient(group.addresses)
                try:
                    got = client.lookup("emb", tokens, WIDTH)
                    self.assertEqual(got.tobytes(), after.tobytes(),
                                     "the version 2 checkpoint taken after a version 1 restore "
                                     "differs")
                finally:
                    client.close()
                    group.close_checked(self)


if __name__ == "__main__":
    unittest.main(verbosity=2)
