"""Feature batches on real groups, through raw gRPC (issue 32; docs/design.md, "Feature batches").

- LookupTest: LookupFeatures with every pooling mode (sum, mean, weighted sum, none), padding id 0
  inside bags, empty bags, two features on one table, dense f32 and bf16 tables and a
  hash-keyed one: pooled rows within 1e-5 of a float64 numpy reference pooling the table's rows
  (read by Lookup), rows of pooling none bitwise Lookup's, and every answer bitwise the same on
  1, 2 and 4 ranks.
- PushTest: PushFeatures on 1 and 2 ranks against one PushGradients per table whose shard r holds,
  feature after feature, shard r's ids with their gradients expanded by hand (times the weight,
  over the bag's nonzero ids, rounded to bf16 for a bf16 table) and padded with id 0: the same
  step figures and bitwise the same tables afterwards, features sharing a table included; and on
  4 ranks, with the row statistics combined by owner, bitwise what 1 rank holds.
- BadInputTest: each bad request of the design's list is refused with its status and a message
  naming the feature, and nothing changes on any rank.
"""
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

POOL = {"none": pb.POOLING_NONE, "sum": pb.POOLING_SUM, "mean": pb.POOLING_MEAN,
        "weighted_sum": pb.POOLING_WEIGHTED_SUM}
B = 12  # samples: 1, 2 and 4 ranks split it evenly
TABLES = {  # name: (rows or -capacity, width, dtype, optimizer)
    "dense": (400, 64, "f32", "rowwise_adagrad"),
    "half": (300, 32, "bf16", "adagrad"),
    "keys": (-50, 64, "f32", "sgd"),
}
FEATURES = [  # name, table, pooling
    ("clicks", "dense", "sum"),
    ("views", "dense", "mean"),
    ("cats", "half", "weighted_sum"),
    ("raw", "dense", "none"),
    ("users", "keys", "sum"),
    ("halfraw", "half", "none"),
]


def create_tables(client):
    for name, (rows, width, dtype, opt) in TABLES.items():
        spec = gl.table_spec(name, max(rows, 0), width, opt, seed=11,
                             dtype=pb.DTYPE_BF16 if dtype == "bf16" else None)
        if rows < 0:
            spec.capacity = -rows
        client.stubs[0].CreateTable(pb.CreateTableRequest(spec=spec), timeout=gl.CALL_TIMEOUT)


def make_batch(seed, with_grads=False):
    """{feature: (table, pooling, ids, lengths, weights, grads)} for B samples."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(1, 1 << 62, size=30, dtype=np.int64) * rng.choice([-1, 1], size=30)
    out = {}
    for name, table, pooling in FEATURES:
        rows, width, dtype, _ = TABLES[table]
        lengths = rng.integers(0, 6, size=B).astype(np.uint32)
        lengths[3] = 0  # an empty bag
        n = int(lengths.sum())
        ids = keys[rng.integers(0, len(keys), size=n)] if rows < 0 else \
            rng.integers(0, rows, size=n, dtype=np.int64)
        if n:
            ids[0] = 0  # padding inside a bag
        weights = rng.normal(size=n).astype(np.float32) if pooling == "weighted_sum" else None
        grads = None
        if with_grads:
            m = B if pooling != "none" else n
            g = rng.normal(size=(m, width)).astype(np.float32)
            grads = g if pooling != "none" or dtype == "f32" else to_bf16(g)
        out[name] = (table, pooling, ids, lengths, weights, grads)
    return out


def to_bf16(x):
    """f32 -> bf16 bit patterns, round to nearest even (finite values)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(h):
    return (np.asarray(h, dtype=np.uint32) << 16).view(np.float32)


def shards(batch, n, push):
    """Every rank's FeatureShard list: samples [r B/n, (r+1) B/n) of each feature."""
    s = B // n
    out = []
    for r in range(n):
        fs = []
        for name, (table, pooling, ids, lengths, weights, grads) in batch.items():
            starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            a, b = starts[r * s], starts[(r + 1) * s]
            f = pb.FeatureShard(name=name, table=table, pooling=POOL[pooling],
                                ids=ids[a:b].astype("<i8").tobytes(),
                                lengths=lengths[r * s:(r + 1) * s].astype("<u4").tobytes())
            if weights is not None:
                f.weights = weights[a:b].astype("<f4").tobytes()
            if push:
                g = grads[r * s:(r + 1) * s] if pooling != "none" else grads[a:b]
                f.gradients = g.tobytes()
            fs.append(f)
        out.append(fs)
    return out


def call(client, batch, push=False, mode=pb.UPDATE_MODE_SYNC, edit=None):
    """Sends the batch's shards to every rank at once; returns the replies (or raises the first
    error). edit(r, request) may spoil a shard's request."""
    n = client.n
    bid = gl.next_batch_id()
    futs = []
    for r, fs in enumerate(shards(batch, n, push)):
        if push:
            req = pb.PushFeaturesRequest(batch_id=bid, shard_index=r, shard_count=n,
                                         batch_size=B, features=fs, mode=mode)
        else:
            req = pb.LookupFeaturesRequest(batch_id=bid, shard_index=r, shard_count=n,
                                           batch_size=B, features=fs)
        if edit:
            edit(r, req)
        stub = client.stubs[r]
        futs.append((stub.PushFeatures if push else stub.LookupFeatures).future(
            req, timeout=gl.CALL_TIMEOUT))
    return [f.result() for f in futs]


def lookup_answers(replies):
    """{feature: bytes of every rank's rows, joined in rank order}."""
    out = {}
    for rep in replies:
        for fr in rep.features:
            out[fr.name] = out.get(fr.name, b"") + fr.rows
    return out


def table_rows(client, table, ids):
    """The rows of ids (any count) as float64, by Lookup in batches every size splits."""
    rows, width, dtype, _ = TABLES[table]
    ids = np.asarray(ids, dtype=np.int64)
    pad = (-len(ids)) % 4
    toks = np.concatenate([ids, np.zeros(pad + 4, dtype=np.int64)])
    raw = client.lookup_bytes(table, toks)
    if dtype == "bf16":
        vals = from_bf16(np.frombuffer(raw, dtype="<u2"))
    else:
        vals = np.frombuffer(raw, dtype="<f4")
    return vals.reshape(-1, width)[:len(ids)].astype(np.float64)


def reference(client, batch):
    """Each pooled feature's rows pooled in float64 from the tables' rows."""
    out = {}
    for name, (table, pooling, ids, lengths, weights, _) in batch.items():
        if pooling == "none":
            continue
        rows = table_rows(client, table, ids)
        pooled = np.zeros((B, rows.shape[1]))
        at = 0
        for b, ln in enumerate(lengths):
            for i in range(at, at + ln):
                if ids[i] != 0:
                    pooled[b] += rows[i] * (weights[i] if weights is not None else 1.0)
            nz = int(np.count_nonzero(ids[at:at + ln]))
            if pooling == "mean" and nz:
                pooled[b] /= nz
            at += ln
        out[name] = pooled
    return out


class LookupTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.res = {}
        batch = make_batch(3)
        for n in (1, 2, 4):
            group = gl.Group(n)
            client = gl.RawClient(group.addresses)
            try:
                create_tables(client)
                got = lookup_answers(call(client, batch))
                ref = reference(client, batch) if n == 1 else None
                raw = {name: client.lookup_bytes(t, np.concatenate(
                    [batch[name][2], np.zeros((-len(batch[name][2])) % n, dtype=np.int64)]))
                       for name, t, p in FEATURES if p == "none"}
                cls.res[n] = (got, ref, raw)
            finally:
                client.close()
                group.close()
        cls.batch = batch

    def test_pooled_rows_match_the_reference(self):
        got, ref, _ = self.res[1]
        for name, table, pooling in FEATURES:
            if pooling == "none":
                continue
            width = TABLES[table][1]
            rows = np.frombuffer(got[name], dtype="<f4").reshape(B, width)
            np.testing.assert_allclose(rows, ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
            self.assertTrue(np.all(rows[3] == 0), "an empty bag pools to zeros")
            if pooling == "sum":
                self.assertTrue(np.any(rows != 0), name)

    def test_rows_without_pooling_are_lookups(self):
        for n in (1, 2, 4):
            got, _, raw = self.res[n]
            for name, table, pooling in FEATURES:
                if pooling == "none":
                    _, width, dtype, _ = TABLES[table]
                    rb = width * (2 if dtype == "bf16" else 4)
                    ids = self.batch[name][2]
                    self.assertEqual(got[name], raw[name][:len(ids) * rb], (n, name))

    def test_large_batches_pool_alike_on_worker_threads(self):
        """512 samples: the cpu backend's worker threads pool a rank's bags in shares (64 bags or
        more each): the rows match the reference and are the same bits on 1 and 2 ranks."""
        global B
        saved, B = B, 512
        got = {}
        try:
            batch = make_batch(4)
            for n in (1, 2):
                group = gl.Group(n)
                client = gl.RawClient(group.addresses)
                try:
                    create_tables(client)
                    got[n] = lookup_answers(call(client, batch))
                    if n == 1:
                        ref = reference(client, batch)
                finally:
                    client.close()
                    group.close()
            for name, table, pooling in FEATURES:
                self.assertEqual(got[2][name], got[1][name], name)
                if pooling != "none":
                    rows = np.frombuffer(got[1][name], dtype="<f4").reshape(B, TABLES[table][1])
                    np.testing.assert_allclose(rows, ref[name], rtol=1e-5, atol=1e-6,
                                               err_msg=name)
        finally:
            B = saved

    def test_every_group_size_answers_the_same_bits(self):
        for n in (2, 4):
            for name, *_ in FEATURES:
                self.assertEqual(self.res[n][0][name], self.res[1][0][name], (n, name))


def expanded_pushes(batch, n):
    """{table: (per-rank token shards, per-rank gradient shards)} of the equivalent
    PushGradients: shard r holds, feature after feature, shard r's ids with their gradients
    expanded by hand, padded with id 0 to the largest shard."""
    s = B // n
    out = {}
    for table in TABLES:
        width, dtype = TABLES[table][1], TABLES[table][2]
        toks, grads = [[] for _ in range(n)], [[] for _ in range(n)]
        for name, (t, pooling, ids, lengths, weights, g) in batch.items():
            if t != table:
                continue
            starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            for r in range(n):
                for b in range(r * s, (r + 1) * s):
                    for i in range(starts[b], starts[b + 1]):
                        toks[r].append(ids[i])
                        if pooling == "none":
                            row = g[i]
                        else:
                            gb = g[b]
                            nz = np.float32(np.count_nonzero(ids[starts[b]:starts[b + 1]]))
                            row = (gb * weights[i] if pooling == "weighted_sum" else
                                   gb / nz if pooling == "mean" else gb).astype(np.float32)
                            if dtype == "bf16":
                                row = to_bf16(row)
                        if ids[i] == 0:
                            row = np.zeros(width, dtype=np.uint16 if dtype == "bf16" else
                                           np.float32)
                        grads[r].append(row)
        if not any(toks):
            continue
        most = max(len(t) for t in toks)
        for r in range(n):
            while len(toks[r]) < most:
                toks[r].append(0)
                grads[r].append(np.zeros(width, dtype=np.uint16 if dtype == "bf16"
                                         else np.float32))
        out[table] = (toks, grads)
    return out


def push_expanded(client, table, toks, grads):
    n = client.n
    bid = gl.next_batch_id()
    T = n * len(toks[0])
    bf16 = grads[0][0].dtype == np.uint16
    futs = [client.stubs[r].PushGradients.future(pb.PushGradientsRequest(
        table=table, batch_id=bid, shard_index=r, shard_count=n, tokens_per_batch=T,
        tokens=np.asarray(toks[r], dtype="<i8").tobytes(),
        dtype=pb.DTYPE_BF16 if bf16 else pb.DTYPE_F32,
        gradients=np.stack(grads[r]).tobytes()), timeout=gl.CALL_TIMEOUT) for r in range(n)]
    return [f.result() for f in futs]


def all_rows(client):
    out = {}
    for table, (rows, width, dtype, _) in TABLES.items():
        ids = np.arange(max(rows, 0)) if rows > 0 else np.unique(
            np.concatenate([make_batch(s, True)[f][2] for s in (5, 6) for f, t, _ in FEATURES
                            if t == table]))
        pad = (-len(ids)) % 4
        out[table] = client.lookup_bytes(table, np.concatenate([ids, np.zeros(pad, np.int64)]))
    return out


class PushTest(unittest.TestCase):
    def run_both(self, n):
        group = gl.Group(n)
        a = gl.RawClient(group.addresses)
        steps_f, steps_g = [], []
        try:
            create_tables(a)
            for seed in (5, 6):
                batch = make_batch(seed, True)
                reps = call(a, batch, push=True)
                steps_f.append([(s.table, s.applied, s.skipped, s.grad_norm, s.num_unique)
                                for s in reps[0].steps])
                for rep in reps[1:]:
                    self.assertEqual([(s.table, s.grad_norm, s.num_unique) for s in rep.steps],
                                     [(x[0], x[3], x[4]) for x in steps_f[-1]])
            rows_f = all_rows(a)
        finally:
            a.close()
            group.close()
        group = gl.Group(n)
        c = gl.RawClient(group.addresses)
        try:
            create_tables(c)
            for seed in (5, 6):
                batch = make_batch(seed, True)
                got = []
                for table, (toks, grads) in expanded_pushes(batch, n).items():
                    r = push_expanded(c, table, toks, grads)[0]
                    got.append((table, r.applied, r.skipped, r.grad_norm, r.num_unique))
                steps_g.append(got)
            rows_g = all_rows(c)
        finally:
            c.close()
            group.close()
        return steps_f, steps_g, rows_f, rows_g

    def test_large_batches_equal_expanded_pushes_bitwise(self):
        """512 samples: a rank's bags are expanded by the cpu backend's worker threads in shares
        (64 bags or more each), which must give the one thread's bits."""
        global B
        saved, B = B, 512
        try:
            steps_f, steps_g, rows_f, rows_g = self.run_both(2)
        finally:
            B = saved
        self.assertEqual(steps_f, steps_g)
        for table in TABLES:
            self.assertEqual(rows_f[table], rows_g[table], table)

    def test_pooled_pushes_equal_expanded_pushes_bitwise(self):
        for n in (1, 2):
            steps_f, steps_g, rows_f, rows_g = self.run_both(n)
            self.assertEqual(steps_f, steps_g, n)
            self.assertTrue(all(s[1] for st in steps_f for s in st), steps_f)
            self.assertEqual([s[0] for s in steps_f[0]], ["dense", "half", "keys"])
            for table in TABLES:
                self.assertEqual(rows_f[table], rows_g[table], (n, table))


    def test_pushes_by_owner_equal_one_rank_bitwise(self):
        """A 256-wide rowwise Adagrad table on 4 ranks, whose row statistics are combined by owner
        (server/engine/round_cost.h: 2 partials a row), and a feature batch whose ids do not
        split evenly over the ranks: the pooled pushes equal the expanded ones, and their step
        figures and the table are bitwise those of 1 rank."""
        global TABLES, FEATURES
        saved = TABLES, FEATURES
        TABLES = {"wide": (200, 256, "f32", "rowwise_adagrad")}
        FEATURES = [("wsum", "wide", "sum"), ("wraw", "wide", "none")]
        try:
            res = {n: self.run_both(n) for n in (1, 4)}
        finally:
            TABLES, FEATURES = saved
        for n, (steps_f, steps_g, rows_f, rows_g) in res.items():
            self.assertEqual(steps_f, steps_g, n)
            self.assertTrue(all(s[1] for st in steps_f for s in st), steps_f)
            self.assertEqual(rows_f["wide"], rows_g["wide"], n)
        self.assertEqual(res[4][0], res[1][0])
        self.assertEqual(res[4][2]["wide"], res[1][2]["wide"])


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(2)
        cls.client = gl.RawClient(cls.group.addresses)
        create_tables(cls.client)
        cls.before = all_rows(cls.client)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.group.close()

    def refused(self, code, fragments, edit, push=True):
        batch = make_batch(9, True)
        with self.assertRaises(gl.grpc.RpcError) as cm:
            call(self.client, batch, push=push, edit=edit)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        for frag in fragments:
            self.assertIn(frag, cm.exception.details())

    def test_each_bad_request(self):
        SC = gl.SC

        def feat(req, name):
            return next(f for f in req.features if f.name == name)

        def unknown_table(r, req):
            feat(req, "views").table = "nope"

        def twice(r, req):
            feat(req, "views").name = "clicks"

        def lengths_off(r, req):
            f = feat(req, "clicks")
            f.lengths = (np.frombuffer(f.lengths, "<u4") + 1).astype("<u4").tobytes()

        def lengths_count(r, req):
            feat(req, "clicks").lengths += b"\0\0\0\0"

        def weights_count(r, req):
            feat(req, "cats").weights += b"\0\0\0\0"

        def weights_on_sum(r, req):
            f = feat(req, "clicks")
            f.weights = np.ones(len(f.ids) // 8, "<f4").tobytes()

        def bad_mode(r, req):
            feat(req, "views").pooling = 7

        def grads_size(r, req):
            feat(req, "views").gradients += b"\0\0\0\0"

        def out_of_range(r, req):
            f = feat(req, "raw")
            ids = np.frombuffer(f.ids, "<i8").copy()
            if len(ids):
                ids[-1] = 10 ** 6
            f.ids = ids.tobytes()

        def bad_split(r, req):
            req.batch_size = B + 1

        cases = [
            (SC.NOT_FOUND, ["feature 'views'", "nope"], unknown_table),
            (SC.INVALID_ARGUMENT, ["feature 'clicks'", "used by two features"], twice),
            (SC.INVALID_ARGUMENT, ["feature 'clicks'", "lengths add up to"], lengths_off),
            (SC.INVALID_ARGUMENT, ["feature 'clicks'", "lengths holds"], lengths_count),
            (SC.INVALID_ARGUMENT, ["feature 'cats'", "weights holds"], weights_count),
            (SC.INVALID_ARGUMENT, ["feature 'clicks'", "weighted_sum only"], weights_on_sum),
            (SC.INVALID_ARGUMENT, ["feature 'views'", "pooling 7"], bad_mode),
            (SC.INVALID_ARGUMENT, ["feature 'views'", "gradients hold"], grads_size),
            (SC.INVALID_ARGUMENT, ["feature 'raw'", "outside [0, 400)"], out_of_range),
            (SC.INVALID_ARGUMENT, ["batch_size=13 does not shard evenly over the 2-rank "
                                   "communicator: pad the batch to 14 samples"], bad_split),
        ]
        for code, frags, edit in cases:
            with self.subTest(frags[-1]):
                self.refused(code, frags, edit)
        self.assertEqual(all_rows(self.client), self.before, "a refused push changed a table")


if __name__ == "__main__":
    unittest.main()
