"""Batch ids are scoped by client: a client sends its client_id (LookupRequest.client_id,
PushGradientsRequest.client_id) with every shard, and the group names a batch by (client_id,
batch_id). Two clients that use one batch_id at the same time both succeed, each batch joined
across the ranks from its own shards; one client that reuses an id still in flight still gets
"batch_id X is already in flight"; requests without a client id share one scope, as before.

Shards are sent by hand (RawClient with order=[rank]), so one client's batch stays parked on
rank 0 while the other client's batch of the same id runs."""
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC

WIDTH = 4
ROWS = 64
ID = 4242


class BatchScopeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(2)
        cls.ref = gl.RawClient(cls.group.addresses)  # client id 0: the reference reads
        cls.ref.create("t", ROWS, WIDTH, opt="sgd", lr=1.0)

    @classmethod
    def tearDownClass(cls):
        cls.ref.close()
        codes = cls.group.close()
        if any(c != 0 for c in codes.values()):
            raise AssertionError("exit codes on SIGTERM %s:\n%s" % (codes, cls.group.last_logs))

    def clients(self, *ids):
        cs = [gl.RawClient(self.group.addresses, client_id=i) for i in ids]
        for c in cs:
            self.addCleanup(c.close)
        return cs

    def test_two_clients_one_batch_id(self):
        """Client A parks shard 0 of batch ID; client B runs a whole lookup and a whole push of
        batch ID meanwhile (today's servers refuse B on rank 0); then A's batch completes with
        its own tokens."""
        a, b = self.clients(0x1111222233334444, 0xfedcba9876543210)
        tok_a, tok_b = np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8])
        want_a = self.ref.lookup("t", tok_a, WIDTH)
        _, fa = a.lookup_async("t", tok_a, batch_id=ID, order=[0])
        _, fb = b.lookup_async("t", tok_b, batch_id=ID)
        np.testing.assert_array_equal(b.rows_of(fb, WIDTH), self.ref.lookup("t", tok_b, WIDTH))
        _, fp = b.push_async("t", tok_b, np.ones((4, WIDTH), "f4"), batch_id=ID + 1)
        _, fa2 = a.push_async("t", [9, 10, 11, 12], np.ones((4, WIDTH), "f4"), batch_id=ID + 1,
                              order=[1])
        for f in fp:
            self.assertTrue(f.result().applied)
        self.assertFalse(fa[0].done() or fa2[1].done())  # still waiting for their other shards
        a.lookup_async("t", tok_a, batch_id=ID, order=[1])[1][1].result()
        np.testing.assert_array_equal(np.frombuffer(fa[0].result().rows, "<f4").reshape(-1, WIDTH),
                                      want_a[:2])
        a.push_async("t", [9, 10, 11, 12], np.ones((4, WIDTH), "f4"), batch_id=ID + 1,
                     order=[0])[1][0].result()
        self.assertTrue(fa2[1].result().applied)

    def test_reuse_in_flight_id_still_refused(self):
        """One client sending a second shard 0 of an id in flight gets the existing error; the
        first batch still completes."""
        (a,) = self.clients(0x5555)
        _, f1 = a.lookup_async("t", [1, 2], batch_id=ID + 10, order=[0])
        _, f2 = a.lookup_async("t", [3, 4], batch_id=ID + 10, order=[0])
        e = gl.rpc_error(f2[0].result)
        self.assertIsNotNone(e)
        self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
        self.assertIn("batch_id %d is already in flight on rank 0" % (ID + 10), e.details())
        a.lookup_async("t", [1, 2], batch_id=ID + 10, order=[1])[1][1].result()
        self.assertEqual(len(f1[0].result().rows), 1 * WIDTH * 4)

    def test_without_client_id_one_scope(self):
        """Requests without a client id behave as before: two clients' batches of one id meet."""
        a, b = self.clients(0, 0)
        _, fa = a.lookup_async("t", [1, 2], batch_id=ID + 20, order=[0])
        _, fb = b.lookup_async("t", [3, 4], batch_id=ID + 20, order=[0])
        e = gl.rpc_error(fb[0].result)
        self.assertIsNotNone(e)
        self.assertIn("batch_id %d is already in flight" % (ID + 20), e.details())
        a.lookup_async("t", [1, 2], batch_id=ID + 20, order=[1])[1][1].result()
        fa[0].result()


if __name__ == "__main__":
    unittest.main(verbosity=2)
