"""embps.Client with bearer tokens against a 2-rank group started with --auth-tokens-file: the
token (given, from token_file, or from EMBPS_TOKEN_FILE) goes with every call to every rank, so
create, lookup and push work for the roles that may make them, both blocking and pipelined;
without a token construction fails UNAUTHENTICATED; a reader's push is PERMISSION_DENIED and
changes nothing. Every rank checks the token on its own: a rank whose file lacks the worker's
token refuses that worker's shard, and the error names the rank."""
import os
import shutil
import tempfile
import unittest

import grpc
import numpy as np

from testenv import embps, gl

SC = grpc.StatusCode

ADMIN = "py-admin-token-7c1f0e2d9b8a"
WORKER = "py-worker-token-3e9d8c7b6a5f"
READER = "py-reader-token-5b4a3f2e1d0c"
OTHER_WORKER = "py-worker-token-only-rank0-x"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


class ClientAuthTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="embps-py-auth-")
        both = "admin %s\nworker %s\nreader %s\n" % (ADMIN, WORKER, READER)
        # rank 0 also knows OTHER_WORKER; rank 1 does not
        f0 = write(os.path.join(cls.dir, "tokens0"), both + "worker %s\n" % OTHER_WORKER)
        f1 = write(os.path.join(cls.dir, "tokens1"), both)
        cls.group = gl.Group(2, rank_flags={0: ["--auth-tokens-file", f0],
                                            1: ["--auth-tokens-file", f1]})
        with embps.Client(cls.group.servers, token=ADMIN, timeout=30) as admin:
            admin.create_table("t", rows=64, emb_width=8, optimizer="sgd", lr=1.0)

    @classmethod
    def tearDownClass(cls):
        codes = cls.group.close()
        logs = cls.group.last_logs
        shutil.rmtree(cls.dir, ignore_errors=True)
        assert all(c == 0 for c in codes.values()), "exit codes %s:\n%s" % (codes, logs)
        for t in (ADMIN, WORKER, READER, OTHER_WORKER):
            assert t not in logs, "a server log holds a token"

    def test_worker_pushes_and_reader_looks_up(self):
        tokens = np.array([1, 2, 3, 4], dtype=np.int64)
        grads = np.full((4, 8), 0.5, dtype=np.float32)
        with embps.Client(self.group.servers, token=READER, timeout=30) as reader, \
                embps.Client(self.group.servers, token_file=write(
                    os.path.join(self.dir, "worker.token"), WORKER + "\n"), timeout=30) as worker:
            before = reader.lookup("t", tokens)
            self.assertTrue(worker.push("t", tokens, grads).applied)
            np.testing.assert_array_equal(reader.lookup("t", tokens), before - np.float32(0.5))
            # pipelined: futures carry the token too
            f = worker.push_async("t", tokens, grads)
            g = worker.lookup_async("t", tokens)
            f.result()
            np.testing.assert_array_equal(g.result(), (before - np.float32(0.5)) - np.float32(0.5))
            with self.assertRaises(embps.Error) as cm:
                reader.push("t", tokens, grads)
            self.assertEqual(cm.exception.code, SC.PERMISSION_DENIED)
            self.assertIn("role 'reader' may not call PushGradients (needs 'worker')",
                          str(cm.exception))
            # Assign: a worker's (and an admin's), like a push
            with self.assertRaises(embps.Error) as cm:
                reader.assign("t", tokens, grads)
            self.assertEqual(cm.exception.code, SC.PERMISSION_DENIED)
            self.assertIn("role 'reader' may not call Assign (needs 'worker')", str(cm.exception))
            np.testing.assert_array_equal(reader.lookup("t", tokens),
                                          (before - np.float32(0.5)) - np.float32(0.5))
            np.testing.assert_array_equal(reader.lookup("t", tokens), (before - np.float32(0.5)) - np.float32(0.5))
            self.assertEqual(len(reader.stats()), 2)
            self.assertTrue(reader.health().serving)

    def test_token_file_from_the_environment(self):
        path = write(os.path.join(self.dir, "env.token"), "  %s\n" % READER)
        old = os.environ.get("EMBPS_TOKEN_FILE")
        os.environ["EMBPS_TOKEN_FILE"] = path
        try:
            with embps.Client(self.group.servers, timeout=30) as c:
                self.assertIn("t", [s.name for s in c.tables()])
        finally:
            if old is None:
                del os.environ["EMBPS_TOKEN_FILE"]
            else:
                os.environ["EMBPS_TOKEN_FILE"] = old

    def test_without_or_with_a_wrong_token(self):
        os.environ.pop("EMBPS_TOKEN_FILE", None)
        with self.assertRaises(embps.Error) as cm:
            embps.Client(self.group.servers, connect_timeout=30)
        self.assertEqual(cm.exception.code, SC.UNAUTHENTICATED)
        self.assertIn("missing authorization metadata: this server requires "
                      "'authorization: Bearer TOKEN'", str(cm.exception))
        with self.assertRaises(embps.Error) as cm:
            embps.Client(self.group.servers, token="py-not-a-known-token-000")
        self.assertEqual(cm.exception.code, SC.UNAUTHENTICATED)
        self.assertIn("the bearer token is not known to this server", str(cm.exception))
        with self.assertRaises(ValueError):
            embps.Client(self.group.servers, token=READER, token_file="x")
        with self.assertRaises(ValueError):
            embps.Client(self.group.servers, token="two words")
        with self.assertRaises(ValueError):
            embps.Client(self.group.servers,
                         token_file=write(os.path.join(self.dir, "empty.token"), "\n"))

    def test_every_rank_checks_on_its_own(self):
        # rank 0 knows OTHER_WORKER, rank 1 does not: construction (ListTables on every rank)
        # already fails, naming rank 1
        with self.assertRaises(embps.Error) as cm:
            embps.Client(self.group.servers, token=OTHER_WORKER, connect_timeout=30)
        self.assertEqual(cm.exception.code, SC.UNAUTHENTICATED)
        self.assertEqual(cm.exception.rank, 1)
        self.assertIn("the bearer token is not known to this server", str(cm.exception))
        # and rank 0 alone accepts it: a client of rank 0 alone gets past authentication to
        # the group size check
        with self.assertRaises(embps.Error) as cm:
            embps.Client(self.group.addresses[0], token=OTHER_WORKER, connect_timeout=30)
        self.assertEqual(cm.exception.code, SC.FAILED_PRECONDITION)


if __name__ == "__main__":
    unittest.main(verbosity=2)
