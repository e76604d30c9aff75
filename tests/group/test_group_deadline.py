"""Server-side deadlines on a 2-rank group: a shard's grpc-timeout (grpcio's `timeout=`) bounds its
batch before it is ordered. A shard sent to rank 0 with a short timeout while rank 1's shard comes
only after that deadline fails the batch with DEADLINE_EXCEEDED for both callers, on the group's
own expiry path (not the 10 s --batch-deadline-ms), and the table is unchanged. Timing is
generous: the short deadline is 300 ms, the late shard comes 1.5 s after it, and the batch
deadline (10 s) is far from both."""
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

DE = SC.DEADLINE_EXCEEDED
WIDTH = 8
CALLER_EXPIRED = "the deadline its caller set (grpc-timeout) passed before it was ordered"


class TwoRankDeadlineTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(2, "--batch-deadline-ms", "10000")
        cls.client = gl.RawClient(cls.group.addresses)
        cls.client.create("d", 64, WIDTH, "sgd", lr=0.5)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        codes = cls.group.close()
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes,
                                                                            cls.group.last_logs)

    def rows(self):
        return self.client.lookup("d", np.arange(64), WIDTH)

    def send(self, rank, kind, bid, tokens, timeout):
        tok = np.asarray(tokens, "<i8")
        stub = self.client.stubs[rank]
        common = dict(table="d", batch_id=bid, shard_index=rank, shard_count=2,
                      tokens_per_batch=2 * len(tok), tokens=tok.tobytes())
        if kind == "push":
            return stub.PushGradients.future(pb.PushGradientsRequest(
                dtype=pb.DTYPE_F32, gradients=np.ones((len(tok), WIDTH), "<f4").tobytes(),
                mode=pb.UPDATE_MODE_SYNC, **common), timeout=timeout)
        return stub.Lookup.future(pb.LookupRequest(**common), timeout=timeout)

    def late_sibling(self, kind):
        before = self.rows()
        bid = gl.next_batch_id()
        early = self.send(0, kind, bid, [1, 2, 3, 4], timeout=0.3)
        # The early caller gives up after 300 ms (grpcio ends it itself too); the server expires
        # the batch at its deadline and remembers it failed.
        e = gl.rpc_error(early.result)
        self.assertIsNotNone(e)
        self.assertEqual(e.code(), DE, e.details())
        time.sleep(1.5)
        start = time.monotonic()
        late = self.send(1, kind, bid, [40, 41, 42, 43], timeout=30)
        e = gl.rpc_error(late.result)
        took = time.monotonic() - start
        self.assertIsNotNone(e, "the late shard of an expired batch ran")
        self.assertEqual(e.code(), DE, e.details())
        # The group's own expiry, by the caller's deadline: not the batch deadline's message,
        # and long before the 10 s batch deadline would have passed.
        self.assertIn(CALLER_EXPIRED, e.details())
        self.assertIn("batch %d" % bid, e.details())
        self.assertLess(took, 8.0)
        np.testing.assert_array_equal(self.rows(), before)  # nothing of it ran on any rank

    def test_push_late_sibling_changes_nothing(self):
        self.late_sibling("push")

    def test_lookup_late_sibling(self):
        self.late_sibling("lookup")

    def test_deadline_ahead_runs(self):
        """Shards whose deadlines are still ahead when the batch is complete run as always."""
        before = self.rows()
        bid = gl.next_batch_id()
        futs = [self.send(0, "push", bid, [5, 6], timeout=20),
                self.send(1, "push", bid, [50, 51], timeout=20)]
        for f in futs:
            self.assertTrue(f.result().applied)
        after = self.rows()
        changed = sorted(set(np.nonzero((after != before).any(axis=1))[0]))
        self.assertEqual(changed, [5, 6, 50, 51])


if __name__ == "__main__":
    unittest.main()
