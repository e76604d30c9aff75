"""Server-side deadlines on groups of 2 and 3 ranks: a shard's grpc-timeout (grpcio's `timeout=`)
bounds its batch before it is ordered. Shards sent to every rank but the last with a short
timeout while the last rank's shard comes only after that deadline fail the batch with
DEADLINE_EXCEEDED for every caller, on the group's own expiry path (not the 10 s
--batch-deadline-ms), and the table is unchanged. Timing is generous: the short deadline is
300 ms, the late shard comes 1.5 s after it, and the batch deadline (10 s) is far from both."""
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

DE = SC.DEADLINE_EXCEEDED
WIDTH = 12  # splits over 2 and 3 ranks
CALLER_EXPIRED = "the deadline its caller set (grpc-timeout) passed before it was ordered"


class DeadlineCases:
    """The cases, on a group of N ranks: every rank but the last gets its shard early, the last
    rank late."""
    N = 2

    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(cls.N, "--batch-deadline-ms", "10000")
        cls.client = gl.RawClient(cls.group.addresses)
        cls.client.create("d", 64, WIDTH, "sgd", lr=0.5)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        codes = cls.group.close()
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes,
                                                                            cls.group.last_logs)

    def rows(self):
        # 64 rows and two padding tokens: 66 split over 2 and 3 ranks alike
        return self.client.lookup("d", np.r_[np.arange(64), 0, 0], WIDTH)[:64]

    def send(self, rank, kind, bid, tokens, timeout):
        tok = np.asarray(tokens, "<i8")
        stub = self.client.stubs[rank]
        common = dict(table="d", batch_id=bid, shard_index=rank, shard_count=self.N,
                      tokens_per_batch=self.N * len(tok), tokens=tok.tobytes())
        if kind == "push":
            return stub.PushGradients.future(pb.PushGradientsRequest(
                dtype=pb.DTYPE_F32, gradients=np.ones((len(tok), WIDTH), "<f4").tobytes(),
                mode=pb.UPDATE_MODE_SYNC, **common), timeout=timeout)
        return stub.Lookup.future(pb.LookupRequest(**common), timeout=timeout)

    def late_sibling(self, kind):
        before = self.rows()
        bid = gl.next_batch_id()
        early = [self.send(r, kind, bid, [1 + 4 * r, 2 + 4 * r, 3 + 4 * r, 4 + 4 * r], timeout=0.3)
                 for r in range(self.N - 1)]
        # The early callers give up after 300 ms (grpcio ends them itself too); the server
        # expires the batch at its deadline and remembers it failed.
        for f in early:
            e = gl.rpc_error(f.result)
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), DE, e.details())
        time.sleep(1.5)
        start = time.monotonic()
        late = self.send(self.N - 1, kind, bid, [40, 41, 42, 43], timeout=30)
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
        futs = [self.send(r, "push", bid, [5 + 10 * r, 6 + 10 * r], timeout=20)
                for r in range(self.N)]
        for f in futs:
            self.assertTrue(f.result().applied)
        after = self.rows()
        changed = sorted(set(np.nonzero((after != before).any(axis=1))[0]))
        self.assertEqual(changed, sorted(t for r in range(self.N) for t in (5 + 10 * r,
                                                                           6 + 10 * r)))


class TwoRankDeadlineTest(DeadlineCases, unittest.TestCase):
    N = 2


class ThreeRankDeadlineTest(DeadlineCases, unittest.TestCase):
    N = 3

if __name__ == "__main__":
    unittest.main()
