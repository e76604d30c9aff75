"""Hash-keyed tables from Python (python/embps), the CLI and embps.torch.

Offline (no server): create_table's request for each kind (every hash-keyed setting in its
TableSpec field, rows 0), what it refuses before sending (neither or both of rows and capacity,
a hash-keyed option beside rows, an unknown eviction), the TableSpec and TableStats built from
replies (kind, settings, counters), and token coercion: a hash-keyed table takes any int64 id
(negative ones, and uint64 ones beyond int64 as their int64 bits), a dense table keeps its
refusal of negative ids, and the kind is asked of the group only when a token needs it.
Against a 2-rank group: Python and the CLI create hash-keyed tables, look up and push random
64-bit ids, and see the counters in stats on both ranks; a model whose ids are random 64-bit
keys trains through RemoteEmbedding to the same losses (rtol 1e-4 over 40 SGD steps) as the same
model on a dense table with the ids remapped by hand to rows 1..U in first-appearance order,
whose rows were first set to the hash table's initial rows (one SGD push of (w_dense - w_hash)
/ lr, exact to a few ulps), and the loss falls. The torch test skips where torch is not
importable.
Run: /usr/bin/python3 tests/python/test_hash_tables.py (ctest -L python)."""
import json
import unittest

import numpy as np

from testenv import embps, gl  # noqa: E402
from embps import _admin, _arrays, _stubs  # noqa: E402

try:
    import torch
except ImportError:  # Debian's python3-torch (deploy/packages.sh)
    torch = None

pbm = _stubs.messages()
GROUP = None


def setUpModule():
    global GROUP
    GROUP = gl.Group(2)


def tearDownModule():
    codes = GROUP.close()
    if any(c != 0 for c in codes.values()):
        raise AssertionError("the group exited with %s:\n%s" % (codes, GROUP.last_logs))


class FakeHost(_admin.TableAdmin):
    """TableAdmin over a recorded _unary: create_table's request, answered with its own spec."""

    def __init__(self, group_size=2):
        self.group_size = group_size
        self._tables, self._keyed, self.sent = {}, {}, []

    def _unary(self, method, request, ranks, timeout=None):
        self.sent.append((method, request))
        if method == "CreateTable":
            return [pbm.CreateTableResponse(spec=request.spec)]
        return [pbm.ListTablesResponse(tables=list(self.listed))]


class OfflineTest(unittest.TestCase):
    def test_create_requests(self):
        h = FakeHost()
        spec = h.create_table("keys", capacity=4096, emb_width=8, admit_after=3, eviction="lfu",
                              half_life_steps=100, sketch_width=512, seed=9)
        method, req = h.sent[-1]
        self.assertEqual(method, "CreateTable")
        s = req.spec
        self.assertEqual((s.rows, s.capacity, s.emb_width, s.admit_after, s.eviction,
                          s.half_life_steps, s.ttl_steps, s.sketch_width, s.seed),
                         (0, 4096, 8, 3, pbm.enum("embps.v1.Eviction")["EVICTION_LFU"], 100, 0,
                          512, 9))
        self.assertEqual((spec.kind, spec.capacity, spec.rows, spec.eviction, spec.admit_after,
                          spec.half_life_steps, spec.sketch_width), ("hash", 4096, 0, "lfu", 3,
                                                                     100, 512))
        self.assertTrue(h._keyed["keys"])
        h.create_table("ttl", capacity=10, emb_width=8, eviction="ttl", ttl_steps=2**62)
        s = h.sent[-1][1].spec
        self.assertEqual((s.eviction, s.ttl_steps), (3, 2**62))
        h.create_table("lru", capacity=10, emb_width=8)
        self.assertEqual(h.sent[-1][1].spec.eviction, 0)  # the server's default, lru
        dense = h.create_table("dense", 100, 8)  # positional rows, emb_width as before
        s = h.sent[-1][1].spec
        self.assertEqual((s.rows, s.capacity, s.admit_after, s.eviction), (100, 0, 0, 0))
        self.assertEqual((dense.kind, dense.capacity), ("dense", 0))
        self.assertFalse(h._keyed["dense"])

    def test_create_refusals_send_nothing(self):
        h = FakeHost()
        cases = [
            (dict(emb_width=8), "give rows (a dense table) or capacity"),
            (dict(rows=10, capacity=10, emb_width=8), "exactly one of them"),
            (dict(capacity=10), "emb_width is required"),
            (dict(capacity=10, emb_width=8, eviction="fifo"), "unknown eviction 'fifo'"),
            (dict(rows=10, emb_width=8, admit_after=2),
             "admit_after=2 is an option of hash-keyed tables, and rows=10 makes a dense one: "
             "give capacity instead of rows, or leave admit_after out"),
            (dict(rows=10, emb_width=8, eviction="lru"), "eviction='lru' is an option"),
            (dict(rows=10, emb_width=8, ttl_steps=4), "ttl_steps=4 is an option"),
            (dict(rows=10, emb_width=8, half_life_steps=4), "half_life_steps=4 is an option"),
            (dict(rows=10, emb_width=8, sketch_width=4), "sketch_width=4 is an option"),
        ]
        for kw, msg in cases:
            with self.assertRaises(ValueError) as cm:
                h.create_table("t", **kw)
            self.assertIn(msg, str(cm.exception), kw)
        with self.assertRaises(embps.ShapeError):
            h.create_table("t", capacity=10, emb_width=7)
        self.assertEqual(h.sent, [])

    def test_values_from_replies(self):
        ts = pbm.TableSpec(name="k", capacity=64, emb_width=4, eviction=2, half_life_steps=5,
                           admit_after=2)
        spec = embps.values.TableSpec.from_pb(ts)
        self.assertEqual((spec.kind, spec.capacity, spec.eviction, spec.half_life_steps,
                          spec.admit_after), ("hash", 64, "lfu", 5, 2))
        self.assertEqual(embps.values.TableSpec.from_pb(pbm.TableSpec(name="d", rows=3)).kind,
                         "dense")
        m = pbm.GetStatsResponse(rank=1, group_size=2, tables=[pbm.TableStats(
            name="k", capacity=64, keys=10, keys_admitted=12, keys_evicted=1, keys_expired=1,
            keys_refused=3, gradients_dropped=4)])
        t = embps.values.RankStats.from_pb(m, "a:1").tables[0]
        self.assertEqual((t.kind, t.capacity, t.keys, t.keys_admitted, t.keys_evicted,
                          t.keys_expired, t.keys_refused, t.gradients_dropped),
                         ("hash", 64, 10, 12, 1, 1, 3, 4))

    def test_tokens_of_each_kind(self):
        asked = []

        def keyed():
            asked.append(1)
            return True
        keys = [2**63 - 1, -5, -(2**63), 1]
        a = _arrays.as_tokens(keys, "lookup", keyed)
        self.assertEqual(a.tolist(), keys)
        self.assertEqual(a.dtype, np.dtype("<i8"))
        self.assertEqual(len(asked), 1)  # asked once, for the negative ones
        _arrays.as_tokens([1, 2, 3], "lookup", keyed)
        self.assertEqual(len(asked), 1)  # not asked: every token fits any table
        u = np.array([2**64 - 1, 2**63, 7], np.uint64)
        self.assertEqual(_arrays.as_tokens(u, "push", True).tolist(), [-1, -(2**63), 7])
        self.assertEqual(_arrays.as_tokens([2**64 - 1, 3], "push", True).tolist(), [-1, 3])
        self.assertEqual(_arrays.as_tokens(np.array([-3, 2**62]), "push", True).tolist(),
                         [-3, 2**62])
        # a dense table keeps its refusals
        with self.assertRaisesRegex(ValueError, r"push: token -4 at position 2 is negative: "
                                                r"token ids lie in \[0, rows\)"):
            _arrays.as_tokens([1, 2, -4], "push", lambda: False)
        with self.assertRaisesRegex(ValueError, "beyond int64"):
            _arrays.as_tokens(u, "lookup", False)
        with self.assertRaisesRegex(ValueError, "beyond 64 bits"):
            _arrays.as_tokens([2**64, 1], "lookup", True)
        with self.assertRaises(TypeError):
            _arrays.as_tokens(np.array([1.5, 2.0]), "lookup", True)


class GroupTest(unittest.TestCase):
    """Against the 2-rank group."""

    def setUp(self):
        self.client = embps.Client(GROUP.servers)

    def tearDown(self):
        self.client.close()

    def create(self, name, **kw):
        return self.client.create_table(name, **kw)

    def test_python_lookup_push_stats(self):
        c = self.client
        spec = self.create("py_hash", capacity=256, emb_width=8, optimizer="sgd", lr=1.0,
                           seed=3)
        self.assertEqual((spec.kind, spec.capacity, spec.eviction), ("hash", 256, "lru"))
        self.assertIn(spec, c.tables())
        rng = np.random.default_rng(31)
        keys = rng.integers(-2**63, 2**63 - 1, size=64, dtype=np.int64, endpoint=True)
        keys = np.unique(keys[keys != 0])[:64]
        keys = keys[:len(keys) - len(keys) % 2]
        before = c.lookup("py_hash", keys)
        self.assertEqual(len(np.unique(before, axis=0)), len(keys))  # every key its own row
        np.testing.assert_array_equal(c.lookup("py_hash", keys[::-1]), before[::-1])
        # a fresh client, which knows nothing of the table, takes the negative ids too
        with embps.Client(GROUP.servers) as fresh:
            np.testing.assert_array_equal(fresh.lookup("py_hash", keys), before)
        r = c.push("py_hash", keys, np.full((len(keys), 8), 0.5, np.float32))
        self.assertTrue(r.applied)
        self.assertEqual(r.num_unique, len(keys))
        after = c.lookup("py_hash", keys)
        np.testing.assert_array_equal(after, (before - np.float32(0.5)).astype(np.float32))
        # uint64 keys beyond int64 are the same keys as their int64 bits
        np.testing.assert_array_equal(c.lookup("py_hash", keys.view(np.uint64)), after)
        for rank in c.stats():
            t = [t for t in rank.tables if t.name == "py_hash"][0]
            self.assertEqual((t.kind, t.capacity, t.keys, t.keys_admitted, t.keys_evicted,
                              t.keys_refused, t.gradients_dropped),
                             ("hash", 256, len(keys), len(keys), 0, 0, 0))

    def test_dense_tables_keep_their_range_check(self):
        self.client.create_table("py_dense_rc", 100, 8)
        with self.assertRaisesRegex(ValueError, "negative"):
            self.client.lookup("py_dense_rc", [1, -2])

    def test_cli_on_the_group(self):
        r = gl.run_cli(GROUP, "create-table", "cli_hash2", "--capacity", "16", "--emb-width", "8",
                       "--optimizer", "sgd", "--eviction", "lru")
        self.assertEqual(r.returncode, 0, r.stderr)
        tokens = ",".join(str(k) for k in (-1, 2**63 - 1, 77, -(2**62)))
        r = gl.run_cli(GROUP, "push", "cli_hash2", "--tokens", tokens, "--grad-value", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = gl.run_cli(GROUP, "bench", "cli_hash2", "--batch", "64", "--duration", "0.3",
                       "--warmup", "0", "--push-ratio", "1", "--key-space", "1000", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        ranks = json.loads(gl.run_cli(GROUP, "stats", "--json").stdout)
        self.assertEqual(len(ranks), 2)
        seen = [[t for t in rank["tables"] if t["name"] == "cli_hash2"][0] for rank in ranks]
        self.assertEqual(seen[0], dict(seen[1], bytes=seen[0]["bytes"]))  # the same index
        self.assertEqual((seen[0]["kind"], seen[0]["capacity"], seen[0]["keys"]), ("hash", 16, 16))
        self.assertGreater(seen[0]["keys_evicted"], 0)
        spec = self.client.table("cli_hash2")
        self.assertEqual((spec.kind, spec.capacity), ("hash", 16))


@unittest.skipIf(torch is None, "torch is not importable: install python3-torch")
class TorchTest(unittest.TestCase):
    """RemoteEmbedding over random 64-bit ids against the same model on a dense table with the
    ids remapped by hand."""
    STEPS, LR, WIDTH, UNIQUE, BATCH = 40, 2.0, 8, 40, 32

    def test_same_losses_as_remapped_dense(self):
        import embps.torch as et
        client = embps.Client(GROUP.servers)
        self.addCleanup(client.close)
        client.create_table("torch_hash", capacity=64, emb_width=self.WIDTH, optimizer="sgd",
                            lr=self.LR, seed=5)
        client.create_table("torch_dense", self.UNIQUE + 1, self.WIDTH, optimizer="sgd",
                            lr=self.LR, seed=6)
        rng = np.random.default_rng(7)
        keys = rng.integers(-2**63, 2**63 - 1, size=self.UNIQUE, dtype=np.int64, endpoint=True)
        self.assertEqual(len(np.unique(keys)), self.UNIQUE)
        batches = [rng.choice(keys, self.BATCH) for _ in range(self.STEPS)]
        target = dict(zip(keys.tolist(), rng.standard_normal(self.UNIQUE).tolist()))
        labels = [np.array([target[int(k)] for k in b], np.float32) for b in batches]
        # by hand: each key its row, 1..U in order of first appearance
        remap = {}
        for b in batches:
            for k in b:
                remap.setdefault(int(k), len(remap) + 1)
        order = np.array(sorted(remap, key=remap.get), np.int64)
        rows = np.array([remap[int(k)] for k in order], np.int64)
        # the dense rows start as the hash table's: one SGD step of (w_dense - w_hash) / lr
        pad = -len(order) % 2
        w_hash = client.lookup("torch_hash", np.concatenate([order, np.zeros(pad, np.int64)]))
        w_dense = client.lookup("torch_dense", np.concatenate([rows, np.zeros(pad, np.int64)]))
        client.push("torch_dense", np.concatenate([rows, np.zeros(pad, np.int64)]),
                    (w_dense - w_hash) / np.float32(self.LR))
        w_dense = client.lookup("torch_dense", np.concatenate([rows, np.zeros(pad, np.int64)]))
        np.testing.assert_allclose(w_dense[:len(order)], w_hash[:len(order)], rtol=0, atol=1e-6)
        # a lookup stored nothing: the table is still empty before training
        st = [t for t in client.stats()[0].tables if t.name == "torch_hash"][0]
        self.assertEqual(st.keys, 0)

        def train(table, ids_of):
            torch.manual_seed(0)
            emb = et.RemoteEmbedding(client, table)
            head = torch.nn.Linear(self.WIDTH, 1)
            opt = torch.optim.SGD(head.parameters(), lr=0.1)
            losses = []
            for b, y in zip(batches, labels):
                out = head(emb(torch.from_numpy(ids_of(b)))).squeeze(-1)
                loss = torch.nn.functional.mse_loss(out, torch.from_numpy(y))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses
        hashed = train("torch_hash", lambda b: b)
        dense = train("torch_dense", lambda b: np.array([remap[int(k)] for k in b], np.int64))
        np.testing.assert_allclose(hashed, dense, rtol=1e-4)
        self.assertLess(np.mean(hashed[-5:]), np.mean(hashed[:5]))
        st = [t for t in client.stats()[0].tables if t.name == "torch_hash"][0]
        self.assertEqual((st.keys, st.keys_evicted, st.gradients_dropped),
                         (len(remap), 0, 0))


if __name__ == "__main__":
    unittest.main()
