"""Retries through a connection cut mid-reply, against a real 2-rank group (issue 30).

One group, two tables made alike (same spec and seed: the same first rows). A client that
reaches every rank directly runs a sequence of sync pushes on "ref"; a second client, whose
connection to each rank goes through a CutProxy (tests/lib/cut_proxy.py), runs the same
sequence on "cut", with some pushes' connections cut just before the rank's reply (the push
is then applied by the group, and the client cannot know it): rank 1's, rank 0's, and one push
made with push_async, whose future retries on its own. Each cut push must come back OK after a
second attempt with replayed=True and the first attempt's grad_norm and num_unique, and at the
end the two tables must be equal bit for bit: every push applied exactly once. A lookup cut
the same way is retried transparently and returns the rows a direct lookup returns. The same for
push_features and lookup_features (feature batches), and for assign (rows written directly).

Needs the servers' retry window (server/group/rounds.c answering a retried push from it).
"""
import os
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))

import embps  # noqa: E402
import embps_servers as es  # noqa: E402
from cut_proxy import CutProxy  # noqa: E402

ROWS, WIDTH, BATCH = 64, 16, 24
STEPS = 8
CUT_AT = {1: (1, "sync"), 3: (0, "sync"), 5: (1, "async"), 6: (0, "async")}  # step: (rank, how)


def batch(step):
    """Step's tokens (duplicates and padding token 0 among them) and gradient rows."""
    rng = np.random.default_rng(1000 + step)
    tok = rng.integers(0, ROWS, BATCH)
    tok[3] = tok[7]  # a duplicate, summed by the servers
    grads = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    return tok, grads


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


class CutGroupTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = es.Group(2)
        host_ports = [a.rsplit(":", 1) for a in cls.group.addresses]
        cls.proxies = [CutProxy(h, int(p)) for h, p in host_ports]
        cls.direct = embps.Client(cls.group.addresses, timeout=30.0)
        cls.cut = embps.Client([p.address for p in cls.proxies], timeout=30.0)

    @classmethod
    def tearDownClass(cls):
        for c in (cls.direct, cls.cut):
            c.close()
        for p in cls.proxies:
            p.close()
        cls.group.close()

    def make(self, name):
        self.direct.create_table(name, rows=ROWS, emb_width=WIDTH, optimizer="adam", lr=0.01,
                                 seed=11)

    def test_push_applied_once(self):
        self.make("ref")
        self.make("cut")
        all_tokens = np.arange(ROWS)
        self.assertTrue(np.array_equal(bits(self.direct.lookup("ref", all_tokens)),
                                       bits(self.direct.lookup("cut", all_tokens))),
                        "tables made alike start alike")
        cuts0 = sum(p.cuts for p in self.proxies)
        for step in range(STEPS):
            tok, grads = batch(step)
            want = self.direct.push("ref", tok, grads)
            self.assertFalse(want.replayed)
            self.assertEqual(want.attempts, 1)
            rank, how = CUT_AT.get(step, (None, "sync"))
            p = self.proxies[rank] if rank is not None else None
            cuts = p.cuts if p else 0
            retries = self.cut.retries
            if p:
                p.cut_next_reply()
            if how == "async":
                fut = self.cut.push_async("cut", tok, grads)
                got = fut.result(timeout=60)
            else:
                got = self.cut.push("cut", tok, grads)
            what = "step %d (cut rank %s, %s): %s" % (step, rank, how, got)
            if p:
                self.assertEqual(p.cuts, cuts + 1, what)
                self.assertEqual(got.attempts, 2, what)
                self.assertEqual(self.cut.retries, retries + 1, what)
                self.assertTrue(got.replayed, what)
            else:
                self.assertEqual(got.attempts, 1, what)
                self.assertFalse(got.replayed, what)
            self.assertTrue(got.applied, what)
            self.assertEqual(got.grad_norm, want.grad_norm, what)
            self.assertEqual(got.num_unique, want.num_unique, what)
        ref = self.direct.lookup("ref", all_tokens)
        cut = self.direct.lookup("cut", all_tokens)
        self.assertTrue(np.array_equal(bits(ref), bits(cut)),
                        "a cut push was applied other than once: %d of %d rows differ"
                        % (int(np.any(bits(ref) != bits(cut), axis=1).sum()), ROWS))
        self.assertEqual(sum(p.cuts for p in self.proxies) - cuts0, len(CUT_AT))

    def test_assign_applied_once(self):
        """An assign whose reply is cut (sync, and async through its future) is retried with the
        same batch id and digest and answered from the retry window (replayed, attempts 2, the
        first answer's counts), and the table ends bitwise as the direct client's."""
        self.make("aref")
        self.make("acut")
        self.cut.lookup("acut", np.array([1, 2]))  # the cut client knows the table
        tok = np.array([4, 5, 6, 4] + [0] * 4)
        rows = np.random.default_rng(77).standard_normal((8, WIDTH)).astype(np.float32)
        want = self.direct.assign("aref", tok, rows)
        self.assertEqual((want.num_assigned, want.replayed, want.attempts), (3, False, 1))
        for rank, how in ((1, "sync"), (0, "async")):
            p = self.proxies[rank]
            cuts = p.cuts
            p.cut_next_reply()
            if how == "async":
                got = self.cut.assign_async("acut", tok, rows).result(timeout=60)
            else:
                got = self.cut.assign("acut", tok, rows)
            self.assertEqual(p.cuts, cuts + 1)
            self.assertEqual((got.num_assigned, got.replayed, got.attempts), (3, True, 2), how)
        all_tokens = np.arange(ROWS)
        self.assertTrue(np.array_equal(bits(self.direct.lookup("aref", all_tokens)),
                                       bits(self.direct.lookup("acut", all_tokens))))

    def test_lookup_retried(self):
        self.make("look")
        tok, grads = batch(99)
        self.direct.push("look", tok, grads)
        want = self.direct.lookup("look", tok)
        for rank in (0, 1):
            p = self.proxies[rank]
            cuts, retries = p.cuts, self.cut.retries
            p.cut_next_reply()
            got = self.cut.lookup("look", tok)
            self.assertEqual(p.cuts, cuts + 1)
            self.assertEqual(self.cut.retries, retries + 1)
            self.assertTrue(np.array_equal(bits(got), bits(want)), "rank %d cut" % rank)
            p.cut_next_reply()
            fut = self.cut.lookup_async("look", tok)
            self.assertTrue(np.array_equal(bits(fut.result(timeout=60)), bits(want)))
            self.assertEqual(fut.attempts, 2)
            self.assertEqual(p.cuts, cuts + 2)

    def test_push_features_applied_once(self):
        """push_features and lookup_features retry through the same attempts: a cut push
        comes back replayed after a second attempt (with no steps: the group keeps none for a
        feature batch), and the tables end bitwise as the direct client's."""
        self.make("fref")
        self.make("fcut")
        self.cut.lookup("fcut", np.array([1, 2]))  # the cut client knows the table
        lengths = [5, 0, 10, 3, 7, 5]  # 6 samples, 30 ids, an empty bag

        def features(table, rng):
            ids = rng.integers(0, ROWS, 30)
            return {"a": embps.Feature(table, ids, lengths, pooling="mean"),
                    "b": embps.Feature(table, ids[::-1].copy(), lengths, pooling="sum")}
        for step, rank in enumerate((None, 1, None, 0)):
            rng = np.random.default_rng(3000 + step)
            grads = {k: rng.standard_normal((6, WIDTH)).astype(np.float32) for k in "ab"}
            want = self.direct.push_features(features("fref", np.random.default_rng(step)),
                                             grads)
            self.assertEqual(len(want.steps), 1)
            if rank is not None:
                self.proxies[rank].cut_next_reply()
            got = self.cut.push_features(features("fcut", np.random.default_rng(step)), grads)
            what = "step %d (cut rank %s): %s" % (step, rank, got)
            if rank is None:
                self.assertEqual(got.attempts, 1, what)
                self.assertEqual((got.steps[0].grad_norm, got.steps[0].num_unique),
                                 (want.steps[0].grad_norm, want.steps[0].num_unique), what)
            else:
                self.assertEqual(got.attempts, 2, what)
                self.assertTrue(got.replayed, what)
        all_tokens = np.arange(ROWS)
        self.assertTrue(np.array_equal(bits(self.direct.lookup("fref", all_tokens)),
                                       bits(self.direct.lookup("fcut", all_tokens))),
                        "a cut feature push was applied other than once")
        feats = features("fref", np.random.default_rng(9))
        want = self.direct.lookup_features(feats)
        for rank in (0, 1):
            retries = self.cut.retries
            self.proxies[rank].cut_next_reply()
            got = self.cut.lookup_features(feats)
            self.assertEqual(self.cut.retries, retries + 1)
            for k in want:
                self.assertTrue(np.array_equal(bits(got[k]), bits(want[k])), k)

    def test_torch_backward_through_cut(self):
        """embps.torch needs nothing of its own: a backward whose push is cut is retried by the
        client, and the module's rows match a direct run's."""
        try:
            import torch
            import embps.torch as et
        except ImportError as e:
            self.skipTest("torch is not importable (%s): install python3-torch" % e)
        self.make("tref")
        self.make("tcut")
        tok = torch.tensor(batch(7)[0])
        for name, client, cut in (("tref", self.direct, False), ("tcut", self.cut, True)):
            emb = et.RemoteEmbedding(client, name, mode="sync")
            for step in range(3):
                out = emb(tok)
                if cut and step == 1:
                    self.proxies[1].cut_next_reply()  # after the forward's lookup
                (out * out).sum().backward()
                self.assertEqual(emb.last_push.attempts, 2 if cut and step == 1 else 1)
                if cut and step == 1:
                    self.assertTrue(emb.last_push.replayed)
        all_tokens = np.arange(ROWS)
        self.assertTrue(np.array_equal(bits(self.direct.lookup("tref", all_tokens)),
                                       bits(self.direct.lookup("tcut", all_tokens))))

    def test_push_cut_before_reply(self):
        """A connection reset as soon as the rank has the whole shard (CutProxy
        cut_after_request), before any answer: usually before the batch is ordered, so the rank
        withdraws the shard and the other rank's caller gets CANCELLED; sometimes after. Either
        way the retry leaves the table as one push does, and says replayed only in the second
        case."""
        self.make("eref")
        self.make("ecut")
        self.cut.lookup("ecut", np.array([1, 2]))  # the cut client knows the table: no ListTables
        seen = []
        for step, rank in enumerate((1, 0, 1, 0)):
            tok, grads = batch(50 + step)
            want = self.direct.push("eref", tok, grads)
            p = self.proxies[rank]
            cuts = p.cuts
            p.cut_after_request()
            got = self.cut.push("ecut", tok, grads)
            self.assertEqual(p.cuts, cuts + 1)
            self.assertEqual(got.attempts, 2, got)
            self.assertEqual((got.grad_norm, got.num_unique), (want.grad_norm, want.num_unique))
            seen.append(got.replayed)
        all_tokens = np.arange(ROWS)
        self.assertTrue(np.array_equal(bits(self.direct.lookup("eref", all_tokens)),
                                       bits(self.direct.lookup("ecut", all_tokens))),
                        "replayed: %s" % seen)
        if os.environ.get("EMBPS_TEST_VERBOSE"):
            print("cut before the reply, replayed:", seen, file=sys.stderr)

    def test_push_table_lookup_retried(self):
        """A client's first push to a table asks rank 0 for the table's shape first; that call
        is retried like the push when its reply is cut."""
        tok, grads = batch(3)
        with embps.Client([p.address for p in self.proxies], timeout=30.0) as c:
            self.make("fresh")  # after c listed the tables: c does not know it
            p = self.proxies[0]
            cuts = p.cuts
            p.cut_next_reply()
            got = c.push("fresh", tok, grads)
            self.assertEqual(p.cuts, cuts + 1)
            self.assertEqual(c.retries, 1)
            self.assertEqual(got.attempts, 1)  # the push itself went through at once
            self.assertTrue(got.applied)

    def test_retry_reconnects(self):
        """After a cut, the next calls go over a new connection through the proxy."""
        self.make("conn")
        tok, _ = batch(5)
        p = self.proxies[0]
        conns = p.connections
        p.cut_next_reply()
        self.cut.lookup("conn", tok)
        self.assertEqual(p.connections, conns + 1)
        self.assertGreaterEqual(p.live(), 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
