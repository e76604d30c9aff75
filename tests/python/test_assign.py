"""Assign and import (issue 33): rows written directly, from Python, against 1-, 2- and 3-rank
groups.

Every test runs on each group size (one group of each, made once). Assign: a lookup after it
reads the rows given bit for bit (f32, and bf16 bits, NaN payloads included), a token given
twice takes its last row, padding token 0 stays zeros; reset_state puts the optimizer state back
(the next Adagrad step equals a fresh table's, bitwise) and its absence keeps it (the step
equals that of a table that was only pushed, to rounding, and differs from the fresh one); a
hash-keyed table inserts without admission (admit_after 3), evicts by LRU when full (the
evicted keys read their initial rows again, the counters say so) and refuses the keys of a batch
that holds more than its capacity. Ordering: a client's pushes and assigns pipelined on one
connection apply in order, and while other threads push to other rows, every sync assign is seen
by the next lookup of another client. A retried assign (the same batch sent again, attempt 1,
after a push changed its row) is answered from the retry window (replayed) and not written
again. Bad input is refused with a message naming the field, and nothing is written on any rank:
a dtype other than the table's, rows of the wrong size, a token outside a dense table's rows
(on one rank's shard only). Import: import_array then lookup equals the array bitwise for f32
and bf16, dense and hash-keyed, created by the import or there before; start resumes; a wrong
width, dtype or id is refused before anything is written.
Run: /usr/bin/python3 tests/python/test_assign.py (ctest -L python)."""
import threading
import unittest
import warnings

import numpy as np

from testenv import embps, gl  # noqa: E402
from embps import _arrays, _batch, _digest  # noqa: E402

SC = gl.SC
GROUPS = {}
SIZES = (1, 2, 3)
W = 12  # divides over 1, 2 and 3 ranks


def setUpModule():
    for n in SIZES:
        GROUPS[n] = gl.Group(n, "--batch-deadline-ms", "3000")


def tearDownModule():
    bad = {}
    for n, g in GROUPS.items():
        codes = g.close()
        if any(c != 0 for c in codes.values()):
            bad[n] = (codes, g.last_logs)
    if bad:
        raise AssertionError("groups exited with %s" % bad)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def rng_rows(seed, n, w=W):
    return np.random.default_rng(seed).standard_normal((n, w)).astype(np.float32)


class Base(unittest.TestCase):
    def each(self, body):
        """body(client, n, name) on every group size, a fresh table name each time."""
        for n in SIZES:
            with self.subTest(group=n):
                with embps.Client(GROUPS[n].addresses, padding=True, timeout=30) as c:
                    body(c, n, "%s_%d" % (self._testMethodName[5:], n))


class AssignTest(Base):
    def test_rows_read_back_bitwise(self):
        def body(c, n, name):
            for dtype in ("f32", "bf16"):
                t = name + dtype
                c.create_table(t, rows=100, emb_width=W, dtype=dtype, optimizer="adagrad")
                tok = np.array([5, 7, 5, 0, 9, 11, 63], np.int64)
                rows = rng_rows(1, len(tok))
                if dtype == "bf16":
                    rows = _arrays.f32_to_bf16(rows)
                    rows[1, 3] = 0x7FC1  # a NaN with a payload: kept as given
                else:
                    rows.view(np.uint32)[1, 3] = 0x7FC00001
                r = c.assign(t, tok, rows)
                self.assertEqual((r.num_assigned, r.num_refused, r.replayed), (5, 0, False))
                look = [5, 7, 9, 11, 63, 0]
                got = c.lookup(t, look, dtype=dtype)
                want = {5: rows[2], 7: rows[1], 9: rows[4], 11: rows[5], 63: rows[6]}
                for i, k in enumerate(look):
                    exp = want[k] if k else np.zeros(W, rows.dtype)
                    self.assertTrue(np.array_equal(bits(got[i]), bits(exp)), (dtype, k))
        self.each(body)

    def test_f32_rows_into_bf16_table_round(self):
        def body(c, n, name):
            c.create_table(name, rows=10, emb_width=W, dtype="bf16")
            rows = rng_rows(2, 3)
            c.assign(name, [1, 2, 3], rows)
            got = c.lookup(name, [1, 2, 3], dtype="bf16")
            self.assertTrue(np.array_equal(got, _arrays.f32_to_bf16(rows)))
        self.each(body)

    def test_reset_state(self):
        """Adagrad, initial accumulator 0.1: after a push, an assign with reset_state leaves the
        row's next step a fresh table's (bitwise); without it, the step of a table that was only
        pushed (to rounding), which differs."""
        def body(c, n, name):
            kw = dict(rows=16, emb_width=W, optimizer="adagrad", lr=0.5, initial_accumulator=0.1,
                      seed=3)
            for t in ("reset", "keep", "fresh", "pushed"):
                c.create_table(name + t, **kw)
            tok = np.array([3, 4, 5], np.int64)
            g = np.full((3, W), 2.0, np.float32)
            v = rng_rows(4, 3)
            for t in ("reset", "keep", "pushed"):
                c.push(name + t, tok, g)
            c.assign(name + "reset", tok, v, reset_state=True)
            c.assign(name + "keep", tok, v, reset_state=False)
            c.assign(name + "fresh", tok, v)
            before = {t: c.lookup(name + t, tok) for t in ("reset", "keep", "fresh", "pushed")}
            for t in ("reset", "keep", "fresh"):
                self.assertTrue(np.array_equal(bits(before[t]), bits(v)), t)
            for t in before:
                c.push(name + t, tok, g)
            step = {t: c.lookup(name + t, tok) - before[t] for t in before}
            self.assertTrue(np.array_equal(bits(c.lookup(name + "reset", tok)),
                                           bits(c.lookup(name + "fresh", tok))))
            np.testing.assert_allclose(step["keep"], step["pushed"], rtol=1e-4)
            self.assertFalse(np.allclose(step["keep"], step["fresh"], rtol=1e-2))
        self.each(body)

    def test_hash_insert_evict_refuse(self):
        def body(c, n, name):
            t = name + "h"
            c.create_table(t, capacity=8, emb_width=W, admit_after=3, sketch_width=64, seed=5)
            c.create_table(t + "ref", capacity=8, emb_width=W, admit_after=3, sketch_width=64,
                           seed=5)
            keys = np.array([2**40 + i for i in range(8)], np.int64)
            keys[3] = -17  # any int64 id is a key
            rows = rng_rows(5, 8)
            r = c.assign(t, keys, rows)  # no admission count: stored at once
            self.assertEqual((r.num_assigned, r.num_refused), (8, 0))
            self.assertTrue(np.array_equal(bits(c.lookup(t, keys)), bits(rows)))
            # 4 new keys into a full table: LRU evicts 4 (all of the first step are equally
            # recent, so the least keys, as unsigned numbers, go first)
            new = np.array([7, 8, 9, 10], np.int64)
            nrows = rng_rows(6, 4)
            r = c.assign(t, new, nrows)
            self.assertEqual((r.num_assigned, r.num_refused), (4, 0))
            self.assertTrue(np.array_equal(bits(c.lookup(t, new)), bits(nrows)))
            order = sorted(range(8), key=lambda i: int(keys[i]) & (2**64 - 1))
            evicted, kept = order[:4], order[4:]
            initial = c.lookup(t + "ref", keys[evicted])  # never stored: initial rows
            self.assertTrue(np.array_equal(bits(c.lookup(t, keys[evicted])), bits(initial)))
            self.assertTrue(np.array_equal(bits(c.lookup(t, keys[kept])), bits(rows[kept])))
            st = [s for s in c.stats()[0].tables if s.name == t][0]
            self.assertEqual((st.keys, st.keys_admitted, st.keys_evicted, st.gradients_dropped),
                             (8, 12, 4, 0))
            # a batch of 10 distinct keys into 8 slots: 2 refused, the rest written
            big = np.arange(100, 110, dtype=np.int64)
            r = c.assign(t, big, rng_rows(7, 10))
            self.assertEqual((r.num_assigned, r.num_refused), (8, 2))
        self.each(body)

    def test_pipelined_order_on_one_connection(self):
        def body(c, n, name):
            c.create_table(name, rows=32, emb_width=W, optimizer="sgd", lr=0.5)
            tok = np.array([1, 2, 3], np.int64)
            g = np.ones((3, W), np.float32)
            v = rng_rows(8, 3)
            futs = [c.push_async(name, tok, g), c.assign_async(name, tok, v),
                    c.push_async(name, tok, g), c.lookup_async(name, tok)]
            got = futs[-1].result()
            for f in futs[:-1]:
                f.result()
            self.assertTrue(np.array_equal(bits(got), bits(v - np.float32(0.5))))
            futs = [c.push_async(name, tok, g), c.assign_async(name, tok, v),
                    c.lookup_async(name, tok)]
            self.assertTrue(np.array_equal(bits(futs[-1].result()), bits(v)))
        self.each(body)

    def test_assign_during_concurrent_pushes(self):
        """Threads push to rows 40..59 while the main thread assigns rows 1..30 and another
        client looks them up after each assign: every lookup sees its assign, and the pushed
        rows moved (the pushes ran between the assigns)."""
        def body(c, n, name):
            c.create_table(name, rows=64, emb_width=W, optimizer="sgd", lr=0.01)
            stop = threading.Event()
            errors = []

            def pusher(seed):
                try:
                    with embps.Client(GROUPS[n].addresses, padding=True, timeout=30) as p:
                        rng = np.random.default_rng(seed)
                        while not stop.is_set():
                            tok = rng.integers(40, 60, 6)
                            p.push(name, tok, np.ones((6, W), np.float32))
                except Exception as e:  # noqa: BLE001 (reported by the main thread)
                    errors.append(e)
            threads = [threading.Thread(target=pusher, args=(s,)) for s in (1, 2)]
            pushed0 = c.lookup(name, np.arange(40, 60))
            for th in threads:
                th.start()
            try:
                with embps.Client(GROUPS[n].addresses, padding=True, timeout=30) as reader:
                    for k in range(15):
                        tok = np.random.default_rng(k).choice(np.arange(1, 31), 6, replace=False)
                        v = rng_rows(100 + k, 6)
                        self.assertEqual(c.assign(name, tok, v).num_assigned, 6)
                        self.assertTrue(np.array_equal(bits(reader.lookup(name, tok)), bits(v)),
                                        "assign %d not seen by the next lookup" % k)
            finally:
                stop.set()
                for th in threads:
                    th.join(60)
            self.assertEqual(errors, [])
            self.assertFalse(np.array_equal(c.lookup(name, np.arange(40, 60)), pushed0))
        self.each(body)

    def test_retried_assign_applied_once(self):
        """The same assign sent again (attempt 1, same batch id and digest) after a push changed
        its row is answered replayed, with the first answer's counts, and writes nothing."""
        def body(c, n, name):
            c.create_table(name, rows=16, emb_width=W, optimizer="sgd", lr=1.0)
            tok = np.array([2, 3, 0] + [0] * ((-3) % n), np.int64)
            v = rng_rows(9, len(tok))
            plan = _batch.Plan(len(tok), n, False)
            bid = c._next_batch_id()
            digest = _digest.digest(name, tok, plan.tokens_per_batch)
            reqs = _batch.assign_requests(name, tok, v, plan, n, bid, True, c.client_id, digest)
            first = _batch.join_assign(bid, c._calls.results(
                c._calls.send("assign", reqs, True, 30)), c._calls.internal)
            self.assertEqual((first.num_assigned, first.replayed), (2, False))
            c.push(name, [2, 3], np.ones((2, W), np.float32))
            after_push = c.lookup(name, [2, 3])
            retry = [embps._wire.with_attempt(q, "assign", 1) for q in reqs]
            again = _batch.join_assign(bid, c._calls.results(
                c._calls.send("assign", retry, True, 30)), c._calls.internal)
            self.assertEqual((again.num_assigned, again.replayed), (2, True))
            self.assertTrue(np.array_equal(bits(c.lookup(name, [2, 3])), bits(after_push)))
        self.each(body)

    def test_forgotten_retry_refused(self):
        """With --retry-window 2, a client's third assign forgets its first: a retry of the
        first is refused with design.md's message and writes nothing."""
        g = gl.Group(1, "--retry-window", "2")
        try:
            with embps.Client(g.addresses, timeout=30) as c:
                c.create_table("t", rows=16, emb_width=W, optimizer="sgd")
                tok = np.array([1, 2], np.int64)
                plan = _batch.Plan(2, 1, False)
                digest = _digest.digest("t", tok, 2)
                first = None
                for k in range(3):
                    bid = c._next_batch_id()
                    reqs = _batch.assign_requests("t", tok, rng_rows(30 + k, 2), plan, 1, bid,
                                                  True, c.client_id, digest)
                    c._calls.results(c._calls.send("assign", reqs, True, 30))
                    first = first or (bid, reqs)
                before = c.lookup("t", tok)
                retry = [embps._wire.with_attempt(q, "assign", 1) for q in first[1]]
                with self.assertRaises(embps.Error) as cm:
                    c._calls.results(c._calls.send("assign", retry, True, 30))
                self.assertEqual(cm.exception.code, SC.FAILED_PRECONDITION)
                want = gl.design_message("a retried assign the window forgot", B=first[0],
                                         C="0x%x" % c.client_id, N=2)
                self.assertEqual(cm.exception.details, want)
                self.assertTrue(np.array_equal(bits(c.lookup("t", tok)), bits(before)))
        finally:
            codes = g.close()
            self.assertEqual(codes, {0: 0}, g.last_logs)

    def test_bad_input_writes_nothing(self):
        def body(c, n, name):
            c.create_table(name, rows=20, emb_width=W, optimizer="sgd")
            all_rows = np.arange(20)
            before = c.lookup(name, all_rows)
            with self.assertRaises(embps.ShapeError) as cm:
                c.assign(name, [1, 2], rng_rows(1, 2, W + 1))
            self.assertIn("rows has %d columns, but table '%s' has emb_width=%d"
                          % (W + 1, name, W), str(cm.exception))
            # a raw request whose dtype is not the table's (f32 table, bf16 rows)
            tok = np.arange(1, n + 1, dtype=np.int64)
            plan = _batch.Plan(n, n, False)
            bf = _arrays.f32_to_bf16(rng_rows(2, n))
            reqs = _batch.assign_requests(name, tok, bf, plan, n, c._next_batch_id(), True,
                                          c.client_id, _digest.digest(name, tok, n))
            with self.assertRaises(embps.Error) as cm:
                c._calls.results(c._calls.send("assign", reqs, True, 30))
            self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
            self.assertIn("dtype mismatch: table '%s' stores f32, the request carries bf16"
                          % name, str(cm.exception))
            # rows of the wrong size
            short = _batch.assign_requests(name, tok, rng_rows(3, n, W - 1), plan, n,
                                           c._next_batch_id(), True, c.client_id,
                                           _digest.digest(name, tok, n))
            with self.assertRaises(embps.Error) as cm:
                c._calls.results(c._calls.send("assign", short, True, 30))
            self.assertIn("rows hold %d bytes, but 1 tokens of emb_width=%d f32 need %d"
                          % ((W - 1) * 4, W, W * 4), str(cm.exception))
            # a token outside the rows, in the last rank's shard only
            tok = np.arange(1, 2 * n + 1, dtype=np.int64)
            tok[-1] = 20
            with self.assertRaises(embps.Error) as cm:
                c.assign(name, tok, rng_rows(4, 2 * n))
            self.assertIn("token 20 at position 1 is outside [0, 20) of table '%s'" % name,
                          str(cm.exception))
            self.assertTrue(np.array_equal(bits(c.lookup(name, all_rows)), bits(before)))
        self.each(body)


class ImportTest(Base):
    def test_round_trip(self):
        def body(c, n, name):
            rng = np.random.default_rng(n)
            for dtype in ("f32", "bf16"):
                a = rng.standard_normal((257, W)).astype(np.float32)
                a[0] = 0
                if dtype == "bf16":
                    a = _arrays.f32_to_bf16(a)
                # dense, created by the import (rows 257), small batches (the last one short)
                t = "%s_%s_dense" % (name, dtype)
                r = c.import_array(t, a, batch_rows=50, progress=False)
                self.assertEqual((r.rows, r.num_assigned, r.created, r.next_start),
                                 (257, 256, True, 257))
                spec = c.table(t)
                self.assertEqual((spec.rows, spec.emb_width, spec.dtype), (257, W, dtype))
                got = c.lookup(t, np.arange(257), dtype=dtype)
                self.assertTrue(np.array_equal(bits(got), bits(a)), t)
                # hash-keyed, created by the import (capacity 257), random 64-bit ids
                ids = rng.integers(-2**63, 2**63 - 1, 257, dtype=np.int64)
                ids[ids == 0] = 1
                th = "%s_%s_hash" % (name, dtype)
                r = c.import_array(th, a, ids=ids, batch_rows=64, progress=False)
                self.assertEqual((r.num_assigned, r.num_refused, r.created), (257, 0, True))
                self.assertEqual(c.table(th).capacity, 257)
                got = c.lookup(th, ids, dtype=dtype)
                self.assertTrue(np.array_equal(bits(got), bits(a)), th)
            # f32 array into an existing bf16 table: rounded as push rounds
            t = name + "_into_bf16"
            c.create_table(t, rows=300, emb_width=W, dtype="bf16")
            a = rng.standard_normal((100, W)).astype(np.float32)
            a[0] = 0
            c.import_array(t, a, progress=False)
            self.assertTrue(np.array_equal(c.lookup(t, np.arange(1, 100), dtype="bf16"),
                                           _arrays.f32_to_bf16(a[1:])))
        self.each(body)

    def test_start_resumes(self):
        def body(c, n, name):
            c.create_table(name, rows=100, emb_width=W, optimizer="sgd")
            before = c.lookup(name, np.arange(100))
            a = rng_rows(11, 100)
            a[0] = 0
            r = c.import_array(name, a, start=60, batch_rows=7, progress=False)
            self.assertEqual((r.rows, r.num_assigned, r.next_start), (40, 40, 100))
            got = c.lookup(name, np.arange(100))
            self.assertTrue(np.array_equal(bits(got[60:]), bits(a[60:])))
            self.assertTrue(np.array_equal(bits(got[:60]), bits(before[:60])))
        self.each(body)

    def test_refusals_write_nothing(self):
        def body(c, n, name):
            c.create_table(name, rows=50, emb_width=W, optimizer="sgd")
            before = c.lookup(name, np.arange(50))
            with self.assertRaises(embps.ShapeError) as cm:
                c.import_array(name, np.zeros((10, W + 3), np.float32), progress=False)
            self.assertIn("the array's rows hold %d values, but table '%s' has emb_width=%d"
                          % (W + 3, name, W), str(cm.exception))
            with self.assertRaises(TypeError) as cm:
                c.import_array(name, np.zeros((10, W), np.float64), progress=False)
            self.assertIn("float64", str(cm.exception))
            with self.assertRaises(embps.ShapeError):
                c.import_array(name, np.ones((51, W), np.float32), progress=False)
            ids = np.arange(1, 11)
            ids[7] = 50
            with self.assertRaises(ValueError) as cm:
                c.import_array(name, np.ones((10, W), np.float32), ids=ids, progress=False)
            self.assertIn("ids[7] = 50 is outside [0, 50) of table '%s': nothing was written"
                          % name, str(cm.exception))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                c.import_array(name, np.ones((2, W), np.float32), start=2, progress=False)
                self.assertEqual(caught, [])
            self.assertTrue(np.array_equal(bits(c.lookup(name, np.arange(50))), bits(before)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                c.import_array(name, np.ones((2, W), np.float32), progress=False)
            self.assertTrue(any("row 0 of the array is not zeros" in str(w.message)
                                for w in caught))
        self.each(body)


class CheckpointTest(unittest.TestCase):
    """Rows an assign writes are marked for incremental checkpoints: a full checkpoint, then
    assigns (dense and hash-keyed, some keys evicting others), then an incremental one, restored
    onto 1 and 3 ranks, reads back every row bitwise."""

    def test_incremental_checkpoint_holds_assigned_rows(self):
        import shutil
        import tempfile
        d = tempfile.mkdtemp(prefix="embps-assign-ckpt-")
        try:
            group = gl.Group(2, "--checkpoint-dir", d, "--checkpoint-full-every", "3",
                             "--checkpoint-keep", "10")
            try:
                with embps.Client(group.addresses, padding=True, timeout=30) as c:
                    c.create_table("d", rows=1000, emb_width=W, optimizer="adam")
                    c.create_table("h", capacity=64, emb_width=W, optimizer="adagrad")
                    c.assign("h", np.arange(1, 65), rng_rows(20, 64))
                    full = c.checkpoint()
                    c.assign("d", [3, 500, 999], rng_rows(21, 3))
                    c.assign("h", np.arange(100, 110), rng_rows(22, 10))  # evicts 10 keys
                    incr = c.checkpoint()
                    want_d = c.lookup("d", np.arange(1000))
                    hkeys = np.arange(1, 110)
                    want_h = c.lookup("h", hkeys)
                    listed = {k.round: k for k in c.checkpoints()}
                    self.assertEqual(listed[incr.round].base_round, full.round)
            finally:
                group.close_checked(self)
            for m in (1, 3):
                with self.subTest(readers=m):
                    g2 = gl.Group(m, "--restore", incr.path)
                    try:
                        with embps.Client(g2.addresses, padding=True, timeout=30) as c2:
                            self.assertTrue(np.array_equal(
                                bits(c2.lookup("d", np.arange(1000))), bits(want_d)))
                            self.assertTrue(np.array_equal(bits(c2.lookup("h", hkeys)),
                                                           bits(want_h)))
                    finally:
                        g2.close_checked(self)
        finally:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
