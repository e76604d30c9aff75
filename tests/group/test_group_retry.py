"""A batch's identity, cancellation and retries on groups of 2 and 3 ranks, with raw grpcio shards
that carry a client id, a digest and an attempt as the client libraries send them:

- shards whose digests differ (one without a digest too) fail INVALID_ARGUMENT for every caller,
  naming the ranks that disagree, and change nothing;
- a parked shard whose caller cancels (grpcio future.cancel()) before its siblings come is
  withdrawn: the siblings' callers get CANCELLED, nothing is applied, the withdrawn and cancelled
  counters move, and a retry of the batch id with attempt + 1 and other tokens applies exactly the
  retry's data (rows compared bitwise with numpy);
- a sync push retried with the same client id, batch id and digest is answered replayed=true with
  the first answer's figures and applied once (rows bitwise as after one push); another digest is
  refused; a batch id the window (--retry-window 2) forgot is refused FAILED_PRECONDITION;
- a caller's deadline that passes while its shard is parked counts as an expired batch.

No rank logs a warning or an error for any of it (callers that are gone included). The words of
every refusal are docs/design.md's (its error table)."""
import random
import re
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

ROWS = 66  # every row in one lookup on 2 and 3 ranks
WIDTH = 6  # shards evenly over 2 and 3 ranks
LR = 0.5  # sgd: w - 0.5 * g, exact in f32 for the small integer gradients used here
WAIT = 20.0  # bound on every wait for the server to act (generous: a loaded machine)
# A warning or an error line, but for the one every rank without a group secret logs at start.
NOISE = re.compile(r"^\S+Z (warn|error) (?!.*no --group-secret-file).*$", re.M)


def metrics(stub):
    """The rank's Prometheus text as {series: value}, series with their labels as written."""
    text = stub.GetStats(pb.GetStatsRequest(prometheus=True),
                         timeout=gl.CALL_TIMEOUT).prometheus_text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def counter(stub, name):
    return metrics(stub).get(name, 0.0)


def started(stub, method):
    key = ('grpc_server_started_total{grpc_type="unary",grpc_service="embps.v1.EmbeddingService",'
           'grpc_method="%s"}' % method)
    return metrics(stub).get(key, 0.0)


def hex64(v):
    return "0x%016x" % v


class RetryBase:
    """The tests, on a group of N ranks (a subclass sets N)."""
    N = 0

    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(cls.N, "--retry-window", "2", "--batch-deadline-ms", "10000")
        cls.client = gl.RawClient(cls.group.addresses)
        cls.client.create("r", ROWS, WIDTH, "sgd", lr=LR)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        codes = cls.group.close()
        logs = cls.group.last_logs
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes, logs)
        noise = NOISE.search(logs)
        assert noise is None, "a rank logged %r:\n%s" % (noise.group(0), logs)

    def setUp(self):
        self.cid = random.getrandbits(63) | 1
        self.stubs = self.client.stubs

    # ---- shards -------------------------------------------------------------------------------

    def rows(self):
        return self.client.lookup("r", np.arange(ROWS), WIDTH)

    def shard(self, rank, bid, tokens, digest, attempt, grads=None, mode=pb.UPDATE_MODE_SYNC,
              timeout=gl.CALL_TIMEOUT):
        """Sends rank its shard (tokens: the whole batch) of push batch bid (or a lookup when
        grads is None); returns the future."""
        tok = np.asarray(tokens, "<i8")
        s = len(tok) // self.N
        common = dict(table="r", batch_id=bid, shard_index=rank, shard_count=self.N,
                      tokens_per_batch=len(tok), tokens=tok[rank * s:(rank + 1) * s].tobytes(),
                      client_id=self.cid, digest=digest, attempt=attempt)
        if grads is None:
            return self.stubs[rank].Lookup.future(pb.LookupRequest(**common), timeout=timeout)
        g = np.asarray(grads, "<f4")[rank * s:(rank + 1) * s]
        return self.stubs[rank].PushGradients.future(pb.PushGradientsRequest(
            dtype=pb.DTYPE_F32, gradients=g.tobytes(), mode=mode, **common), timeout=timeout)

    def push(self, bid, tokens, grads, digest, attempt, mode=pb.UPDATE_MODE_SYNC, digests=None):
        """Every rank's shard; returns the futures. digests[r], when given, is rank r's."""
        return [self.shard(r, bid, tokens, digests[r] if digests else digest, attempt, grads,
                           mode) for r in range(self.N)]

    def batch(self, first, k=None):
        """k (2N by default) distinct tokens from first on, and integer gradients for them."""
        k = k or 2 * self.N
        tokens = np.arange(first, first + k)
        grads = np.arange(1, k * WIDTH + 1, dtype=np.float32).reshape(k, WIDTH) % 7 + 1
        return tokens, grads

    @staticmethod
    def applied(before, tokens, grads):
        """The rows after one sgd step of (tokens, grads) on before (distinct tokens)."""
        want = before.copy()
        want[tokens] = before[tokens] - np.float32(LR) * grads.astype(np.float32)
        return want

    def wait_counter(self, rank, name, at_least):
        ok = gl.wait_for(lambda: counter(self.stubs[rank], name) >= at_least, WAIT)
        self.assertTrue(ok, "rank %d's %s never reached %d:\n%s" % (rank, name, at_least,
                                                                    self.group.logs()))

    # ---- (a) digests ---------------------------------------------------------------------------

    def test_digests_that_differ_fail_everywhere(self):
        before = self.rows()
        odd = self.N - 1
        tokens, grads = self.batch(1)
        d, other = random.getrandbits(64) | 1, random.getrandbits(64) | 1
        bid = gl.next_batch_id()
        futs = self.push(bid, tokens, grads, d, 0,
                         digests=[other if r == odd else d for r in range(self.N)])
        want = gl.design_message("shards whose digests differ", B=bid, C="0x%x" % self.cid, r=0,
                                 D=hex64(d), R=odd)
        for r, f in enumerate(futs):
            e = gl.rpc_error(f.result)
            self.assertIsNotNone(e, "rank %d's shard ran" % r)
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertTrue(e.details().startswith(want), "%r\n%r" % (e.details(), want))
        # A lookup whose rank 0 sends no digest, the others one.
        bid = gl.next_batch_id()
        futs = [self.shard(r, bid, tokens, 0 if r == 0 else d, 0) for r in range(self.N)]
        want = gl.design_message("shards with and without a digest", B=bid,
                                 C="0x%x" % self.cid, r=0,
                                 R=",".join(str(r) for r in range(1, self.N)))
        for f in futs:
            e = gl.rpc_error(f.result)
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertTrue(e.details().startswith(want), "%r\n%r" % (e.details(), want))
        np.testing.assert_array_equal(self.rows(), before)
        # Equal digests run.
        futs = self.push(gl.next_batch_id(), tokens, grads, d, 0)
        self.assertTrue(all(f.result().applied for f in futs))

    # ---- (b) cancellation ----------------------------------------------------------------------

    def cancel_then_retry(self, cancelled):
        stub = self.stubs[cancelled]
        before = self.rows()
        withdrawn0 = counter(stub, "embps_group_shards_withdrawn_total")
        cancelled0 = counter(self.stubs[0], "embps_group_batches_cancelled_total")
        calls0 = started(stub, "PushGradients")
        tokens, grads = self.batch(1)
        d = random.getrandbits(64) | 1
        bid = gl.next_batch_id()
        parked = self.shard(cancelled, bid, tokens, d, 0, grads, timeout=60)
        # The server has the call (it reached the group) before the client cancels it.
        self.assertTrue(gl.wait_for(lambda: started(stub, "PushGradients") > calls0, WAIT))
        self.assertTrue(parked.cancel())
        self.wait_counter(cancelled, "embps_group_shards_withdrawn_total", withdrawn0 + 1)
        self.wait_counter(0, "embps_group_batches_cancelled_total", cancelled0 + 1)
        # The siblings come after: each caller hears the batch was cancelled, and why.
        want = gl.design_message("a shard's caller cancelled before ordering", B=bid,
                                 r=cancelled)
        for r in range(self.N):
            if r == cancelled:
                continue
            e = gl.rpc_error(self.shard(r, bid, tokens, d, 0, grads).result)
            self.assertIsNotNone(e, "rank %d's shard of a cancelled batch ran" % r)
            self.assertEqual(e.code(), SC.CANCELLED, e.details())
            self.assertEqual(e.details(), want)
        np.testing.assert_array_equal(self.rows(), before)  # nothing of it ran on any rank
        # The retry: the same batch id, attempt 1, other tokens (so another digest).
        rtokens, rgrads = self.batch(1 + 4 * self.N)
        rgrads = rgrads * 2
        futs = self.push(bid, rtokens, rgrads, d ^ 0xff, 1)
        for f in futs:
            resp = f.result()
            self.assertTrue(resp.applied)
            self.assertFalse(resp.replayed)
        np.testing.assert_array_equal(self.rows(), self.applied(before, rtokens, rgrads))

    def test_cancel_on_the_leader(self):
        self.cancel_then_retry(0)

    def test_cancel_on_another_rank(self):
        self.cancel_then_retry(self.N - 1)

    # ---- (c) retries ---------------------------------------------------------------------------

    def test_retried_push_applied_once(self):
        before = self.rows()
        dedup0 = [counter(s, "embps_group_retries_deduplicated_total") for s in self.stubs]
        tokens, grads = self.batch(1 + 8 * self.N)
        d = random.getrandbits(64) | 1
        bid = gl.next_batch_id()
        first = [f.result() for f in self.push(bid, tokens, grads, d, 0)]
        self.assertTrue(all(r.applied and not r.replayed for r in first))
        once = self.applied(before, tokens, grads)
        np.testing.assert_array_equal(self.rows(), once)
        # The same batch again, attempt 1 (say its connection broke before the answer came).
        again = [f.result() for f in self.push(bid, tokens, grads, d, 1)]
        for a, b in zip(first, again):
            self.assertTrue(b.replayed)
            self.assertTrue(b.applied)
            self.assertEqual(b.grad_norm, a.grad_norm)
            self.assertEqual(b.num_unique, a.num_unique)
            self.assertEqual(b.batch_id, bid)
        np.testing.assert_array_equal(self.rows(), once)  # applied once, bitwise
        for r, s in enumerate(self.stubs):
            self.assertEqual(counter(s, "embps_group_retries_deduplicated_total"),
                             dedup0[r] + 1, "rank %d" % r)
        # An async retry is answered from the window too, with the first figures.
        again = [f.result() for f in self.push(bid, tokens, grads, d, 2,
                                               mode=pb.UPDATE_MODE_ASYNC)]
        self.assertTrue(all(a.replayed and a.applied for a in again))
        # The same batch id with other content is refused on every rank, and changes nothing.
        other = d ^ 1
        want = gl.design_message("a retried push with another digest", B=bid,
                                 C="0x%x" % self.cid, D1=hex64(d), D2=hex64(other))
        for f in self.push(bid, tokens, grads * 3, other, 3):
            e = gl.rpc_error(f.result)
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.INVALID_ARGUMENT, e.details())
            self.assertEqual(e.details(), want)
        np.testing.assert_array_equal(self.rows(), once)

    def test_forgotten_retry_refused(self):
        """With --retry-window 2, a client's third push forgets its first: a retry of the first
        is refused (its fate unknown), and is not applied again."""
        tokens, grads = self.batch(1)
        d = random.getrandbits(64) | 1
        bids = [gl.next_batch_id() for _ in range(3)]
        for bid in bids:
            self.assertTrue(all(f.result().applied for f in self.push(bid, tokens, grads, d, 0)))
        before = self.rows()
        want = gl.design_message("a retried push the window forgot", B=bids[0],
                                 C="0x%x" % self.cid, N=2)
        for f in self.push(bids[0], tokens, grads, d, 1):
            e = gl.rpc_error(f.result)
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.FAILED_PRECONDITION, e.details())
            self.assertEqual(e.details(), want)
        again = [f.result() for f in self.push(bids[2], tokens, grads, d, 1)]  # still held
        self.assertTrue(all(a.replayed for a in again))
        np.testing.assert_array_equal(self.rows(), before)

    def test_pushes_without_digest_apply_each_time(self):
        """A push without a digest (as raw callers send) keeps today's rules: sent twice, it is
        applied twice."""
        before = self.rows()
        tokens, grads = self.batch(1 + 12 * self.N)
        for _ in range(2):
            resp = [f.result() for f in self.push(gl.next_batch_id(), tokens, grads, 0, 0)]
            self.assertTrue(all(r.applied and not r.replayed for r in resp))
        np.testing.assert_array_equal(self.rows(),
                                      self.applied(self.applied(before, tokens, grads), tokens,
                                                   grads))

    # ---- (d) counters --------------------------------------------------------------------------

    def test_expired_counted(self):
        """A shard whose caller's deadline passes while it is parked: its batch expires
        (DEADLINE_EXCEEDED, counted by the leader), and its shard is not counted withdrawn."""
        expired0 = counter(self.stubs[0], "embps_group_batches_expired_total")
        withdrawn0 = counter(self.stubs[self.N - 1], "embps_group_shards_withdrawn_total")
        tokens, grads = self.batch(1)
        lone = self.shard(self.N - 1, gl.next_batch_id(), tokens, 5, 0, grads, timeout=0.3)
        e = gl.rpc_error(lone.result)
        self.assertIsNotNone(e)
        self.assertEqual(e.code(), SC.DEADLINE_EXCEEDED, e.details())
        self.wait_counter(0, "embps_group_batches_expired_total", expired0 + 1)
        self.assertEqual(counter(self.stubs[self.N - 1], "embps_group_shards_withdrawn_total"),
                         withdrawn0)


class TwoRanks(RetryBase, unittest.TestCase):
    N = 2


class ThreeRanks(RetryBase, unittest.TestCase):
    N = 3


if __name__ == "__main__":
    unittest.main()
