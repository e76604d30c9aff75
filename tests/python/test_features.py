"""Feature batches from Python: Client.lookup_features / push_features and
embps.torch.RemoteEmbeddingBagCollection (docs/design.md, "Feature batches"; docs/python.md).

Offline (no server): the digest against bytes laid out here from the definition (hashed by the
xxhash module, and by the xxhsum tool where it is installed); the split by samples (shard r gets samples [r P/N, (r+1) P/N), P = B padded with
empty bags), the encoded requests (parsed back with protobuf), a retry's attempt field, the
joins of replies (padding samples dropped, bf16 rows converted) and every refusal made before
sending, each naming the feature.

Against 1-, 2- and 4-rank groups: lookups of features of every pooling mode (weights, empty
bags, padding id 0 inside bags, a bag of padding only, ids repeated across two features that
share a table) over dense and hash-keyed tables, f32 and bf16, equal to a float64 numpy
reference pooled from the tables' rows (read with lookup). A pooled push is bitwise the
expanded token-by-token PushGradients per table (shard r: feature after feature, shard r's ids
with their expanded gradients, padded with id 0 to equal shards) over several steps with
different optimizers: the final rows compared bytewise against twin tables (same spec and
seed), with each TableStep's grad_norm and num_unique equal to the PushResult's. Bad input
(the design's list): a clear error naming the feature, and no table changed.

With torch: a DLRM-shaped model (4 pooled features over 2 tables, one shared by two features,
a bottom and a top MLP) trains through RemoteEmbeddingBagCollection (dict input and
KeyedJaggedTensor-style keys/values/lengths) to the same losses (rtol 1e-4 over 25 steps) as a
local reference with F.embedding_bag tables (padding_idx=0) and the same optimizers (SGD for one
table, Adagrad for the other), one LookupFeatures and one PushFeatures per step; plus prefetch
and async mode. The torch tests skip where torch is not importable.
Run: /usr/bin/python3 tests/python/test_features.py (ctest -R python_test_features)."""
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import xxhash

from testenv import embps, gl  # noqa: E402
from embps import _features, _wire  # noqa: E402
from embps._names import pb  # noqa: E402

try:
    import torch
except ImportError:  # Debian's python3-torch (deploy/packages.sh)
    torch = None

GROUPS = {}
SIZES = (1, 2, 4)
POOL = {"none": 0, "sum": 1, "mean": 2, "weighted_sum": 3}
_counter = iter(range(10 ** 6))


def setUpModule():
    # A shard a rank refuses leaves the others' shards to expire at the batch deadline: keep it
    # short, so that the refusals below are answered in seconds.
    for n in SIZES:
        GROUPS[n] = gl.Group(n, "--batch-deadline-ms", "3000")


def tearDownModule():
    bad = []
    for n, g in GROUPS.items():
        codes = g.close()
        if any(c != 0 for c in codes.values()):
            bad.append("%d-rank group exited with %s:\n%s" % (n, codes, g.last_logs))
    if bad:
        raise AssertionError("\n".join(bad))


def fresh(prefix):
    return "%s_%d" % (prefix, next(_counter))


# ---- the digest, from the definition ------------------------------------------------------------

def layout(batch_size, feats):
    """The digest's input written out from docs/design.md (not from _digest.py). feats: (name,
    table, pooling name, ids, lengths (all batch_size of them), weights or None)."""
    out = b"embps-features-v1" + struct.pack("<II", batch_size, len(feats))
    for name, table, pooling, ids, lengths, weights in feats:
        for s in (name, table):
            b = s.encode("utf-8")
            out += struct.pack("<I", len(b)) + b
        out += struct.pack("<I", POOL[pooling]) + struct.pack("<Q", len(ids))
        out += struct.pack("<%dq" % len(ids), *ids)
        out += struct.pack("<%dI" % len(lengths), *lengths)
        if pooling == "weighted_sum":
            out += struct.pack("<%df" % len(weights), *weights)
    return out


def xxh3(data):
    return xxhash.xxh3_64(data, seed=0).intdigest() or 1


def batch_of(features, n, pad=True, keyed=lambda t: False):
    return _features.Batch(features, "lookup features", n, pad, keyed)


DIGEST_CASES = [
    # (group size, {name: Feature}) and the layout's features (lengths padded to P)
    (2, {"a": embps.Feature("t", [1, 2, 3, 0, 5], [2, 0, 3], pooling="sum"),
         "b": embps.Feature("u", [7, 8, 9], weights=[1.0, 0.5, -2.0], pooling="weighted_sum")},
     4, [("a", "t", "sum", [1, 2, 3, 0, 5], [2, 0, 3, 0], None),
         ("b", "u", "weighted_sum", [7, 8, 9], [1, 1, 1, 0], [1.0, 0.5, -2.0])]),
    (1, {"ñame": embps.Feature("tâble", [-5, 2 ** 62, 4], [3], pooling="mean")},
     1, [("ñame", "tâble", "mean", [-5, 2 ** 62, 4], [3], None)]),
    (4, {"x": embps.Feature("t", [], [0, 0, 0, 0, 0], pooling="sum"),
         "y": embps.Feature("t", [1, 1, 1, 1, 1], pooling="none")},
     8, [("x", "t", "sum", [], [0] * 8, None), ("y", "t", "none", [1] * 5, [1] * 5 + [0] * 3,
                                                None)]),
]


class OfflineTest(unittest.TestCase):
    def test_digest_from_the_definition(self):
        for n, feats, p, lay in DIGEST_CASES:
            b = batch_of(feats, n, keyed=lambda t: True)
            self.assertEqual(b.batch_size, p)
            self.assertEqual(b.digest, xxh3(layout(p, lay)), lay)
        # a known value, so that the layout here cannot drift with the code
        b = batch_of({"f": embps.Feature("items", [1, 2, 3, 4], [1, 3], pooling="sum")}, 2)
        data = layout(2, [("f", "items", "sum", [1, 2, 3, 4], [1, 3], None)])
        self.assertEqual(len(data), 17 + 8 + 5 + 9 + 4 + 8 + 32 + 8)
        self.assertEqual(b.digest, xxh3(data))

    @unittest.skipUnless(shutil.which("xxhsum"), "xxhsum (Debian package xxhash) is not "
                         "installed: the digest is not compared with the reference tool")
    def test_digest_against_xxhsum(self):
        for n, feats, p, lay in DIGEST_CASES:
            with tempfile.NamedTemporaryFile(suffix=".bin") as f:
                f.write(layout(p, lay))
                f.flush()
                out = subprocess.run(["xxhsum", "-H3", f.name], check=True, capture_output=True,
                                     text=True, timeout=30).stdout
            word = out.split("=")[-1].split()[0] if "=" in out else out.split()[0]
            self.assertEqual(batch_of(feats, n, keyed=lambda t: True).digest,
                             int(word, 16) or 1)

    def test_digest_depends_on_everything(self):
        base = {"a": embps.Feature("t", [1, 2, 3], [1, 2], weights=[1, 2, 3],
                                   pooling="weighted_sum")}
        d = batch_of(base, 2).digest
        variants = [
            {"b": base["a"]},
            {"a": embps.Feature("u", [1, 2, 3], [1, 2], weights=[1, 2, 3],
                                pooling="weighted_sum")},
            {"a": embps.Feature("t", [1, 2, 4], [1, 2], weights=[1, 2, 3],
                                pooling="weighted_sum")},
            {"a": embps.Feature("t", [1, 2, 3], [2, 1], weights=[1, 2, 3],
                                pooling="weighted_sum")},
            {"a": embps.Feature("t", [1, 2, 3], [1, 2], weights=[1, 2, 3.5],
                                pooling="weighted_sum")},
            {"a": embps.Feature("t", [1, 2, 3], [1, 2], pooling="sum")},
        ]
        for v in variants:
            self.assertNotEqual(batch_of(v, 2).digest, d, v)
        self.assertNotEqual(batch_of(base, 4).digest, d)  # B padded to 4: other lengths

    def test_split_by_samples(self):
        ids = np.arange(1, 16, dtype=np.int64)
        lengths = [3, 0, 4, 1, 2, 5]  # 6 samples, 15 ids
        w = np.linspace(0.5, 2, 15, dtype=np.float32)
        feats = {"s": embps.Feature("t", ids, lengths, pooling="sum"),
                 "w": embps.Feature("u", ids[::-1].copy(), lengths, weights=w,
                                    pooling="weighted_sum"),
                 "o": embps.Feature("t", [9, 8, 7, 6, 5, 4], pooling="none")}
        for n, want_p in ((1, 6), (2, 6), (4, 8)):
            b = batch_of(feats, n)
            self.assertEqual((b.samples, b.batch_size, b.shard_samples), (6, want_p, want_p // n))
            reqs = [pb.LookupFeaturesRequest.FromString(q) for q in b.lookup_requests(77, 5)]
            lens = np.array(lengths + [0] * (want_p - 6))
            off = np.concatenate([[0], np.cumsum(lens)])
            for r, m in enumerate(reqs):
                self.assertEqual((m.batch_id, m.shard_index, m.shard_count, m.batch_size,
                                  m.client_id, m.digest, m.attempt),
                                 (77, r, n, want_p, 5, b.digest, 0))
                s0, s1 = r * want_p // n, (r + 1) * want_p // n
                self.assertEqual([f.name for f in m.features], ["s", "w", "o"])
                for f, src, srcw in zip(m.features, (ids, ids[::-1], None), (None, w, None)):
                    if f.name == "o":
                        sel = np.arange(6)[s0:min(s1, 6)]
                        np.testing.assert_array_equal(np.frombuffer(f.ids, "<i8"),
                                                      [9, 8, 7, 6, 5, 4][s0:s1])
                        self.assertEqual(np.frombuffer(f.lengths, "<u4").tolist(),
                                         [1] * len(sel) + [0] * (s1 - s0 - len(sel)))
                        self.assertEqual(f.pooling, 0)
                        continue
                    np.testing.assert_array_equal(np.frombuffer(f.ids, "<i8"),
                                                  src[off[s0]:off[s1]])
                    self.assertEqual(np.frombuffer(f.lengths, "<u4").tolist(),
                                     lens[s0:s1].tolist())
                    if srcw is None:
                        self.assertEqual(f.weights, b"")
                    else:
                        np.testing.assert_array_equal(np.frombuffer(f.weights, "<f4"),
                                                      srcw[off[s0]:off[s1]])
                    self.assertEqual(f.gradients, b"")
            # a retry differs by its attempt only
            for q in b.lookup_requests(77, 5):
                m = pb.LookupFeaturesRequest.FromString(
                    _wire.with_attempt(q, "lookup_features", 3))
                self.assertEqual(m.attempt, 3)
                m.attempt = 0
                self.assertEqual(m, pb.LookupFeaturesRequest.FromString(q))

    def test_push_requests(self):
        feats = {"p": embps.Feature("t", [1, 2, 3, 4, 5], [2, 0, 3], pooling="mean"),
                 "n": embps.Feature("b16", [6, 7, 8], [1, 1, 1], pooling="none")}
        b = batch_of(feats, 2)  # 3 samples -> 4
        gp = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
        gn = np.full((3, 4), 1.00390625, np.float32)  # rounds to bf16 1.0 (to even)
        g = b.fit_grads({"p": gp, "n": gn}, {"t": (1, 4), "b16": (2, 4)}, "push features")
        self.assertEqual((g[0].dtype, g[1].dtype), (np.float32, np.uint16))
        reqs = [pb.PushFeaturesRequest.FromString(q) for q in
                b.push_requests(9, 1, g, 1)]
        self.assertEqual([m.mode for m in reqs], [1, 1])
        p0, p1 = reqs[0].features[0], reqs[1].features[0]
        np.testing.assert_array_equal(np.frombuffer(p0.gradients, "<f4").reshape(2, 4), gp[:2])
        got = np.frombuffer(p1.gradients, "<f4").reshape(2, 4)
        np.testing.assert_array_equal(got[0], gp[2])
        np.testing.assert_array_equal(got[1], 0)  # the padding sample's row
        n0, n1 = reqs[0].features[1], reqs[1].features[1]
        self.assertEqual(np.frombuffer(n0.gradients, "<u2").tolist(), [0x3f80] * 8)
        self.assertEqual(len(n1.gradients), 1 * 4 * 2)
        m = pb.PushFeaturesRequest.FromString(
            _wire.with_attempt(b.push_requests(9, 1, g, 1)[1], "push_features", 2))
        self.assertEqual((m.attempt, m.mode, m.digest), (2, 1, b.digest))

    def test_join_lookup(self):
        feats = {"p": embps.Feature("t", [1, 2, 3, 4, 5], [2, 0, 3], pooling="sum"),
                 "n": embps.Feature("b16", [6, 7, 8], pooling="none")}
        b = batch_of(feats, 2)
        pooled = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
        bf = np.array([[0x3f80, 0x4000], [0x4040, 0x4080], [0xbf80, 0]], np.uint16)
        replies = []
        for r in range(2):
            rows_n = bf[:2] if r == 0 else bf[2:]
            replies.append(pb.LookupFeaturesResponse(batch_id=9, shard_index=r, features=[
                pb.FeatureRows(name="p", emb_width=2, dtype=1,
                               rows=pooled[2 * r:2 * r + 2].tobytes()),
                pb.FeatureRows(name="n", emb_width=2, dtype=2, rows=rows_n.tobytes())
            ]).SerializeToString())
        tables = {}

        def internal(r, what):
            return embps.Error(None, what)
        out = b.join_lookup(9, replies, internal, tables)
        np.testing.assert_array_equal(out["p"], pooled[:3])  # the padding sample dropped
        np.testing.assert_array_equal(out["n"], [[1, 2], [3, 4], [-1, 0]])
        self.assertEqual(out["n"].dtype, np.float32)
        self.assertEqual(tables, {"b16": (2, 2)})
        bad = list(replies)
        bad[1] = pb.LookupFeaturesResponse(batch_id=9, shard_index=1, features=[
            pb.FeatureRows(name="p", emb_width=2, dtype=1, rows=b"\0" * 8),
            pb.FeatureRows(name="n", emb_width=2, dtype=2, rows=b"")]).SerializeToString()
        with self.assertRaisesRegex(embps.Error, "bytes of rows for feature 'p'"):
            b.join_lookup(9, bad, internal, {})

    def test_join_push(self):
        def step(t, applied=True, skipped=False):
            return pb.TableStep(table=t, applied=applied, skipped=skipped, grad_norm=2.5,
                                num_unique=7)
        replies = [pb.PushFeaturesResponse(batch_id=3, shard_index=r,
                                           steps=[step("a"), step("b", r == 0, r == 1)])
                   for r in range(2)]
        res = _features.join_push(3, replies, lambda r, w: embps.Error(None, w), 2)
        self.assertEqual([s.table for s in res.steps], ["a", "b"])
        self.assertEqual((res.step("a").applied, res.step("b").applied, res.step("b").skipped),
                         (True, False, True))
        self.assertEqual((res.applied, res.skipped, res.attempts, res.step("a").num_unique),
                         (False, True, 2, 7))

    def test_refusals_name_the_feature(self):
        good = embps.Feature("t", [1, 2, 3, 4], [2, 2], pooling="sum")
        cases = [
            ({"g": good, "bad": embps.Feature("t", [1, 2, 3], [1, 1], pooling="sum")},
             embps.ShapeError, "feature 'bad': lengths add up to 2 ids, but ids holds 3"),
            ({"g": good, "bad": embps.Feature("t", [1, 2], [1, 1], weights=[1, 2],
                                              pooling="mean")},
             ValueError, "feature 'bad': weights are given with pooling 'mean': per-id weights "
                         "go with pooling 'weighted_sum' only"),
            ({"g": good, "bad": embps.Feature("t", [1, 2], [1, 1], weights=[1, 2, 3],
                                              pooling="weighted_sum")},
             embps.ShapeError, r"feature 'bad': weights must hold one weight per id, shape "
                               r"\(2,\)"),
            ({"g": good, "bad": embps.Feature("t", [1, 2], [1, 1], pooling="weighted_sum")},
             ValueError, "feature 'bad': pooling 'weighted_sum' needs weights"),
            ({"g": good, "bad": embps.Feature("t", [1, 2], [1, 1], pooling="max")},
             ValueError, "feature 'bad': pooling 'max' is not one of 'none', 'sum', 'mean', "
                         "'weighted_sum'"),
            ({"g": good, "bad": embps.Feature("t", [1, 2, 3], [1, 1, 1], pooling="sum")},
             embps.ShapeError, "feature 'bad': 3 samples .bag lengths., but feature 'g' has 2"),
            ({"g": good, "bad": embps.Feature("t", [1, -2], [1, 1], pooling="sum")},
             ValueError, "feature 'bad': ids: token -2 at position 1 is negative"),
            ({"g": good, "bad": embps.Feature("t", [1.5, 2], [1, 1], pooling="sum")},
             TypeError, "feature 'bad': ids: tokens must be integers"),
            ({"g": good, "bad": embps.Feature("t", [1, 2], [3, -1], pooling="sum")},
             ValueError, r"feature 'bad': lengths\[1\] is -1"),
            ({"g": good, "bad": embps.Feature("", [1, 2], [1, 1])},
             ValueError, "feature 'bad': table must be a non-empty str"),
            ({"g": good, "bad": [1, 2]}, TypeError, "feature 'bad' must be an embps.Feature"),
            ({}, ValueError, "no features"),
            ({"g": embps.Feature("t", [], [])}, ValueError, "the batch has no samples"),
        ]
        for feats, exc, msg in cases:
            with self.assertRaisesRegex(exc, msg):
                batch_of(feats, 2)
        # the sample split, in the servers' words, without padding
        with self.assertRaises(embps.ShapeError) as cm:
            batch_of({"g": embps.Feature("t", [1, 2, 3], pooling="sum")}, 2, pad=False)
        self.assertEqual(str(cm.exception),
                         "batch_size=3 does not shard evenly over the 2-rank communicator: pad "
                         "the batch to 4 samples (a multiple of 2) with empty bags")
        self.assertIn("padding=True", cm.exception.remedy)
        # gradients
        b = batch_of({"p": good, "n": embps.Feature("t", [5, 6], pooling="none")}, 2)
        infos = {"t": (1, 4)}
        for grads, exc, msg in [
                ({"p": np.zeros((2, 4))}, ValueError, "feature 'n': no gradient rows"),
                ({"p": np.zeros((4, 4)), "n": np.zeros((2, 4))}, embps.ShapeError,
                 r"feature 'p': grads must hold one row per sample \(pooled\), shape \(2, "),
                ({"p": np.zeros((2, 4)), "n": np.zeros((1, 4))}, embps.ShapeError,
                 r"feature 'n': grads must hold one row per id \(pooling none\), shape \(2, "),
                ({"p": np.zeros((2, 3)), "n": np.zeros((2, 4))}, embps.ShapeError,
                 "feature 'p': grads has 3 columns, but table 't' has emb_width=4"),
                ({"p": np.zeros((2, 4)), "n": np.zeros((2, 4)), "x": np.zeros((1, 4))},
                 ValueError, "grads names 'x', which is not a feature"),
                ({"p": np.zeros((2, 4), np.int32), "n": np.zeros((2, 4))}, TypeError,
                 "feature 'p': grads must be floating point")]:
            with self.assertRaisesRegex(exc, msg):
                b.fit_grads(grads, infos, "push features")


# ---- the references ---------------------------------------------------------------------------

def pool_reference(rows_of, ids, lengths, weights, pooling):
    """float64 pooling of one feature: rows_of(ids) gives each id's row (float64)."""
    rows = rows_of(ids)
    if pooling == "none":
        return rows
    out = np.zeros((len(lengths), rows.shape[1]))
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        start += n
        real = ids[sl] != 0
        r = rows[sl][real]
        if pooling == "weighted_sum":
            r = r * np.asarray(weights, np.float64)[sl][real][:, None]
        s = r.sum(0) if len(r) else np.zeros(rows.shape[1])
        if pooling == "mean" and real.sum():
            s = s / real.sum()
        out[i] = s
    return out


def random_bags(rng, samples, high, max_len=5, keys=None, pad_frac=0.15):
    """(ids, lengths) with empty bags, padding ids inside bags and a bag of padding only."""
    lengths = rng.integers(0, max_len + 1, size=samples)
    lengths[rng.integers(samples)] = 0
    n = int(lengths.sum())
    if keys is None:
        ids = rng.integers(1, high, size=n)
    else:
        ids = rng.choice(keys, size=n)
    ids[rng.random(n) < pad_frac] = 0
    if samples > 2 and lengths[1] == 0:
        lengths[1] = 1
        start = int(lengths[:1].sum())
        ids = np.insert(ids, start, 0)  # a bag of padding only
    return ids.astype(np.int64), lengths.astype(np.int64)


class GroupBase:
    N = 1
    ROWS = 60
    WIDTH = 16  # 4 columns a rank on 4 ranks

    @classmethod
    def setUpClass(cls):
        cls.client = embps.Client(GROUPS[cls.N].servers, timeout=60, padding=True)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def make_tables(self, prefix, optimizers=("adagrad", "rowwise_adagrad", "adam", "sgd")):
        """A dense f32, a dense bf16, a hash-keyed f32 and a hash-keyed bf16 table."""
        c = self.client
        names = {k: fresh("%s%d_%s" % (prefix, self.N, k)) for k in ("d32", "d16", "h32", "h16")}
        c.create_table(names["d32"], self.ROWS, self.WIDTH, optimizer=optimizers[0], lr=0.05,
                       seed=3)
        c.create_table(names["d16"], self.ROWS, self.WIDTH, "bf16", optimizer=optimizers[1],
                       lr=0.05, seed=4)
        c.create_table(names["h32"], capacity=128, emb_width=self.WIDTH,
                       optimizer=optimizers[2], lr=0.05, seed=5)
        c.create_table(names["h16"], capacity=128, emb_width=self.WIDTH, dtype="bf16",
                       optimizer=optimizers[3], lr=0.05, seed=6)
        return names

    def rows(self, table, ids):
        """The rows of ids (float64), looked up plainly (padded to the group size)."""
        ids = np.asarray(ids, np.int64)
        if not len(ids):
            return np.zeros((0, self.WIDTH))
        return self.client.lookup(table, ids).astype(np.float64)

    def raw_rows(self, table, ids, bf16):
        """The stored bits of ids' rows."""
        out = self.client.lookup(table, ids, dtype="bf16" if bf16 else None)
        return out.tobytes()

    def batch(self, names, rng, samples, keys):
        """Features of every pooling mode over the four tables; f_sum and f_mean share d32."""
        feats = {}
        ids, ln = random_bags(rng, samples, self.ROWS)
        feats["f_sum"] = embps.Feature(names["d32"], ids, ln, pooling="sum")
        ids2, ln2 = random_bags(rng, samples, self.ROWS)
        ids2[:3] = ids[:3]  # ids repeated across two features of one table
        feats["f_mean"] = embps.Feature(names["d32"], ids2, ln2, pooling="mean")
        ids3, ln3 = random_bags(rng, samples, self.ROWS)
        w3 = rng.uniform(-2, 2, size=len(ids3)).astype(np.float32)
        feats["f_wsum"] = embps.Feature(names["d16"], ids3, ln3, weights=w3,
                                        pooling="weighted_sum")
        ids4 = rng.choice(keys, size=samples)
        ids4[0] = 0
        feats["f_none"] = embps.Feature(names["h32"], ids4, pooling="none")
        ids5, ln5 = random_bags(rng, samples, 0, keys=keys)
        feats["f_hmean"] = embps.Feature(names["h32"], ids5, ln5, pooling="mean")
        ids6, ln6 = random_bags(rng, samples, 0, keys=keys)
        feats["f_h16"] = embps.Feature(names["h16"], ids6, ln6, pooling="sum")
        ids7, ln7 = random_bags(rng, samples, self.ROWS)
        feats["f_none16"] = embps.Feature(names["d16"], ids7, ln7, pooling="none")
        return feats

    def keys(self, rng):
        k = rng.integers(-2 ** 63, 2 ** 63 - 1, size=40, dtype=np.int64, endpoint=True)
        return k[k != 0]

    # ---- lookups ----

    def test_lookup_matches_reference(self):
        names = self.make_tables("lk")
        rng = np.random.default_rng(100 + self.N)
        keys = self.keys(rng)
        for samples in (1, 7, 8, 13):
            feats = self.batch(names, rng, samples, keys)
            got = self.client.lookup_features(feats)
            self.assertEqual(list(got), list(feats))
            for name, f in feats.items():
                want = pool_reference(lambda i, t=f.table: self.rows(t, i), f.ids,
                                      np.ones(len(f.ids), int) if f.lengths is None
                                      else f.lengths, f.weights, f.pooling)
                g = got[name]
                self.assertEqual(g.dtype, np.float32, name)
                self.assertEqual(g.shape, want.shape, name)
                np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6, err_msg=name)
                if f.pooling != "none":
                    empty = np.asarray(f.lengths) == 0
                    np.testing.assert_array_equal(g[empty], 0)
        # async, the same answer
        feats = self.batch(names, rng, 9, keys)
        fut = self.client.lookup_features_async(feats)
        got = fut.result(timeout=60)
        again = self.client.lookup_features(feats)
        for name in feats:
            np.testing.assert_array_equal(got[name], again[name])

    def test_weighted_ids_on_one_rank_only(self):
        """A weighted_sum feature whose ids all sit in rank 0's samples: the other ranks' shards
        carry no weights (empty on the wire) and must still take part in the weights'
        all-gather (a group broke on it)."""
        names = self.make_tables("w1")
        feats = {"w": embps.Feature(names["d32"], [3, 4, 0], [3] + [0] * (self.N - 1),
                                    weights=[0.5, -2.0, 7.0], pooling="weighted_sum"),
                 "s": embps.Feature(names["d16"], [5] * self.N, pooling="sum")}
        got = self.client.lookup_features(feats)
        r = self.rows(names["d32"], [3, 4])
        np.testing.assert_allclose(got["w"][0], 0.5 * r[0] - 2.0 * r[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["w"][1:], 0)
        res = self.client.push_features(feats, {"w": np.ones((self.N, self.WIDTH)),
                                                "s": np.ones((self.N, self.WIDTH))})
        self.assertTrue(res.applied, res)
        self.assertEqual((res.step(names["d32"]).num_unique, res.step(names["d16"]).num_unique),
                         (2, 1))

    # ---- pushes: bitwise the expanded token-by-token pushes ----

    def expanded(self, feats, grads, table, bf16):
        """(tokens, grads) of the PushGradients the design says a push_features equals for
        table: shard r holds, feature after feature, shard r's ids with their expanded
        gradients, padded with id 0 to equal shards."""
        n = self.N
        f0 = next(iter(feats.values()))
        samples = len(f0.ids) if f0.lengths is None else len(f0.lengths)
        p = -(-samples // n) * n
        s = p // n
        shards = []
        for r in range(n):
            tok, g = [], []
            for name, f in feats.items():
                if f.table != table:
                    continue
                gr = grads[name]
                if f.lengths is not None:
                    ln = np.concatenate([f.lengths, np.zeros(p - samples, np.int64)])
                    off = np.concatenate([[0], np.cumsum(ln)])
                    a, b = off[r * s], off[(r + 1) * s]
                    ids = f.ids[a:b]
                if f.lengths is None:
                    ln = np.concatenate([np.ones(samples, np.int64),
                                         np.zeros(p - samples, np.int64)])
                    off = np.concatenate([[0], np.cumsum(ln)])
                    a, b = off[r * s], off[(r + 1) * s]
                    ids = f.ids[a:b]
                if f.pooling == "none":
                    rows = gr[a:b].astype(np.float32)
                else:
                    bag = np.repeat(np.arange(r * s, (r + 1) * s), ln[r * s:(r + 1) * s])
                    gp = np.concatenate([gr, np.zeros((p - samples, gr.shape[1]), np.float32)])
                    rows = gp[bag].astype(np.float32)
                    if f.pooling == "weighted_sum":
                        rows = rows * np.asarray(f.weights, np.float32)[a:b, None]
                    elif f.pooling == "mean":
                        cnt = np.array([np.count_nonzero(f.ids[off[k]:off[k + 1]])
                                        for k in bag], np.float32)
                        rows = rows / np.maximum(cnt, 1)[:, None]
                    rows = np.where((ids != 0)[:, None], rows, np.float32(0))
                tok.append(ids)
                g.append(rows.astype(np.float32))
            shards.append((np.concatenate(tok) if tok else np.zeros(0, np.int64),
                           np.concatenate(g) if g else np.zeros((0, self.WIDTH), np.float32)))
        longest = max(len(t) for t, _ in shards)
        tokens, rows = [], []
        for t, g in shards:
            k = longest - len(t)
            tokens.append(np.concatenate([t, np.zeros(k, np.int64)]))
            rows.append(np.concatenate([g, np.zeros((k, self.WIDTH), np.float32)]))
        return np.concatenate(tokens), np.concatenate(rows)

    def test_pooled_push_is_bitwise_the_expanded_push(self):
        a = self.make_tables("pa")
        b = self.make_tables("pb")
        rng = np.random.default_rng(200 + self.N)
        keys = self.keys(rng)
        touched = {k: set() for k in a}
        for step in range(4):
            feats = self.batch(a, rng, 7 + step, keys)
            grads = {}
            for name, f in feats.items():
                rows = len(f.ids) if f.pooling == "none" else len(f.lengths)
                grads[name] = rng.standard_normal((rows, self.WIDTH)).astype(np.float32)
            res = self.client.push_features(feats, grads)
            self.assertEqual([s.table for s in res.steps],
                             list(dict.fromkeys(f.table for f in feats.values())))
            self.assertTrue(res.applied, res)
            for kind in a:
                twin = {n: embps.Feature(b[kind] if f.table == a[kind] else f.table, f.ids,
                                         f.lengths, f.weights, f.pooling)
                        for n, f in feats.items() if f.table == a[kind]}
                tok, rows = self.expanded(twin, grads, b[kind], kind.endswith("16"))
                ref = self.client.push(b[kind], tok, rows)
                st = res.step(a[kind])
                self.assertEqual((st.num_unique, st.grad_norm), (ref.num_unique, ref.grad_norm),
                                 (kind, step))
                for f in twin.values():
                    touched[kind].update(int(i) for i in f.ids)
        for kind in a:
            bf16 = kind.endswith("16")
            ids = np.array(sorted(touched[kind] | {1, 2, 3}), np.int64)
            if kind.startswith("d"):
                ids = np.arange(self.ROWS)
            got, want = self.raw_rows(a[kind], ids, bf16), self.raw_rows(b[kind], ids, bf16)
            self.assertEqual(got, want, "table %s differs from the expanded pushes" % kind)
            init = self.client.lookup(fresh_table_like(self.client, a[kind]), ids)
            self.assertFalse(np.array_equal(init, self.client.lookup(a[kind], ids)),
                             "nothing was trained: the test proves nothing")

    def test_async_push_and_replay(self):
        names = self.make_tables("as")
        rng = np.random.default_rng(300 + self.N)
        feats = self.batch(names, rng, 5, self.keys(rng))
        grads = {n: np.ones((len(f.ids) if f.pooling == "none" else 5, self.WIDTH), np.float32)
                 for n, f in feats.items()}
        before = self.client.lookup_features(feats)
        res = self.client.push_features_async(feats, grads, mode="async").result(timeout=60)
        self.assertTrue(res.ordered)
        self.assertEqual(res.steps, ())
        after = self.client.lookup_features(feats)  # sees the async push
        self.assertFalse(np.array_equal(before["f_sum"], after["f_sum"]))


def fresh_table_like(client, name):
    """A new table with name's spec (its initial rows), for 'did anything change' checks."""
    s = client.table(name)
    new = fresh("init")
    if s.capacity:
        client.create_table(new, capacity=s.capacity, emb_width=s.emb_width, dtype=s.dtype,
                            optimizer=s.optimizer, seed=s.seed)
    else:
        client.create_table(new, s.rows, s.emb_width, s.dtype, optimizer=s.optimizer,
                            seed=s.seed)
    return new


class OneRank(GroupBase, unittest.TestCase):
    N = 1


class TwoRanks(GroupBase, unittest.TestCase):
    N = 2

    def snapshot(self, names):
        return {k: self.client.lookup(t, np.arange(1, 9) if k[0] == "d" else
                                      np.array([5, -7, 11, 13]), dtype="bf16"
                                      if k.endswith("16") else None).tobytes()
                for k, t in names.items()}

    def test_bad_input_names_the_feature_and_applies_nothing(self):
        c = self.client
        names = self.make_tables("bad")
        good = embps.Feature(names["d32"], [1, 2, 3, 4], [2, 2], pooling="sum")
        gkey = embps.Feature(names["h32"], [5, -7, 11, 13], [1, 3], pooling="mean")
        g2 = np.ones((2, self.WIDTH), np.float32)
        before = self.snapshot(names)

        def check(fn, code, *fragments):
            with self.assertRaises(embps.Error if code else Exception) as cm:
                fn()
            if code is not None:
                self.assertEqual(cm.exception.code, code, str(cm.exception))
            for f in fragments:
                self.assertIn(f, str(cm.exception))
            self.assertEqual(self.snapshot(names), before, "a refused push changed a table")
            return cm.exception

        SC = gl.SC
        # through the client: refused before sending (ShapeError / ValueError)
        check(lambda: c.push_features({"g": good, "k": gkey, "bad": embps.Feature(
            names["d32"], [1, 2, 3], [1, 1], pooling="sum")},
            {"g": g2, "k": g2, "bad": g2}), SC.INVALID_ARGUMENT, "feature 'bad'",
            "lengths add up to 2 ids")
        check(lambda: c.push_features({"g": good, "bad": embps.Feature(
            names["d16"], [1, 2], [1, 1], weights=[1, 1], pooling="sum")},
            {"g": g2, "bad": g2}), None, "feature 'bad'", "weights are given with pooling")
        check(lambda: c.push_features({"g": good, "bad": embps.Feature(
            names["d16"], [1, 2], [1, 1], weights=[1, 1, 1], pooling="weighted_sum")},
            {"g": g2, "bad": g2}), SC.INVALID_ARGUMENT, "feature 'bad'", "one weight per id")
        check(lambda: c.push_features({"g": good, "bad": embps.Feature(
            names["d16"], [1, 2], [1, 1], pooling="max")}, {"g": g2, "bad": g2}), None,
            "feature 'bad'", "pooling 'max'")
        check(lambda: c.push_features({"g": good, "bad": embps.Feature(
            names["d16"], [1, 2], [1, 1], pooling="sum")},
            {"g": g2, "bad": np.ones((3, self.WIDTH))}), SC.INVALID_ARGUMENT,
            "feature 'bad'", "grads must hold one row per sample")
        with embps.Client(GROUPS[2].servers, timeout=60) as strict:  # padding off
            check(lambda: strict.push_features(
                {"g": embps.Feature(names["d32"], [1, 2, 3], pooling="sum")},
                {"g": np.ones((3, self.WIDTH))}), SC.INVALID_ARGUMENT,
                "batch_size=3 does not shard evenly over the 2-rank communicator")
        # by the servers
        check(lambda: c.push_features({"g": good, "lost": embps.Feature(
            "no_such_table", [1, 2], [1, 1], pooling="sum")}, {"g": g2, "lost": g2}),
            SC.NOT_FOUND, "lost")
        check(lambda: c.push_features({"g": good, "far": embps.Feature(
            names["d32"], [1, self.ROWS + 5], [1, 1], pooling="sum")}, {"g": g2, "far": g2}),
            SC.INVALID_ARGUMENT, "far")
        check(lambda: c.lookup_features({"g": good, "far": embps.Feature(
            names["d32"], [1, self.ROWS], [1, 1], pooling="sum")}), SC.INVALID_ARGUMENT, "far")
        # raw requests that the client would refuse, every rank's shard bad
        for name, shard, fragment in self.raw_cases(names):
            def send(shards=shard):
                bid = c._next_batch_id()
                reqs = []
                for r in range(2):
                    feats = [pb.FeatureShard(name="g", table=names["d32"], pooling=1,
                                             ids=np.array([1, 2], "<i8").tobytes(),
                                             lengths=np.array([2], "<u4").tobytes(),
                                             gradients=np.ones(self.WIDTH, "<f4").tobytes())]
                    feats += shards(r)
                    reqs.append(pb.PushFeaturesRequest(
                        batch_id=bid, shard_index=r, shard_count=2, batch_size=2,
                        features=feats, client_id=c.client_id).SerializeToString())
                calls = c._calls.send("push_features", reqs, True, 30)
                c._calls.results(calls)
            check(send, fragment[0], *fragment[1:])

    def raw_cases(self, names):
        w = self.WIDTH
        t = names["d32"]

        def fs(name="bad", table=t, pooling=1, ids=(1, 2), lengths=(2,), weights=None,
               grad_rows=1):
            m = pb.FeatureShard(name=name, table=table, pooling=pooling,
                                ids=np.array(ids, "<i8").tobytes(),
                                lengths=np.array(lengths, "<u4").tobytes(),
                                gradients=np.ones(grad_rows * w, "<f4").tobytes())
            if weights is not None:
                m.weights = np.array(weights, "<f4").tobytes()
            return m
        SC = gl.SC
        return [
            ("twice", lambda r: [fs(name="g")], (SC.INVALID_ARGUMENT, "'g'")),
            ("lengths count", lambda r: [fs(lengths=(1, 1))], (SC.INVALID_ARGUMENT, "'bad'")),
            ("lengths sum", lambda r: [fs(lengths=(3,))], (SC.INVALID_ARGUMENT, "'bad'")),
            ("weights beside sum", lambda r: [fs(weights=(1, 1))],
             (SC.INVALID_ARGUMENT, "'bad'")),
            ("weights beside mean", lambda r: [fs(pooling=2, weights=(1, 1))],
             (SC.INVALID_ARGUMENT, "'bad'")),
            ("weights count", lambda r: [fs(pooling=3, weights=(1,))],
             (SC.INVALID_ARGUMENT, "'bad'")),
            ("unknown pooling", lambda r: [fs(pooling=9)], (SC.INVALID_ARGUMENT, "'bad'")),
            ("gradient size", lambda r: [fs(grad_rows=2)], (SC.INVALID_ARGUMENT, "'bad'")),
            ("unknown table", lambda r: [fs(table="nope")], (SC.NOT_FOUND, "'bad'")),
            ("dense range", lambda r: [fs(ids=(1, self.ROWS))], (SC.INVALID_ARGUMENT, "'bad'")),
        ]


class FourRanks(GroupBase, unittest.TestCase):
    N = 4


# ---- torch: a DLRM-shaped model ---------------------------------------------------------------

if torch is not None:
    import embps.torch as et

    class DLRM(torch.nn.Module):
        """Dense features through a bottom MLP, 4 pooled sparse features, concatenated into a
        top MLP. emb: a callable features -> {name: (B, D)} (the remote collection or the
        local reference)."""

        def __init__(self, emb, dense_in, width, seed):
            super().__init__()
            self.emb = emb
            torch.manual_seed(seed)
            self.bottom = torch.nn.Sequential(torch.nn.Linear(dense_in, width),
                                              torch.nn.ReLU())
            self.top = torch.nn.Sequential(torch.nn.Linear(5 * width, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 1))

        def forward(self, dense, sparse):
            e = self.emb(sparse)
            x = torch.cat([self.bottom(dense)] + [e[k] for k in ("f1", "f2", "f3", "f4")], 1)
            return self.top(x).squeeze(-1)


@unittest.skipIf(torch is None, "torch is not importable: install python3-torch")
class TorchTest(unittest.TestCase):
    STEPS, B, W, ROWS_A, ROWS_B = 25, 11, 8, 40, 30
    LR_A, LR_B = 0.5, 0.1

    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        cls.client = embps.Client(GROUPS[2].servers, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    FEATURES = {"f1": ("a", "sum"), "f2": ("a", "mean"), "f3": ("b", "weighted_sum"),
                "f4": ("b", "sum")}

    def data(self, seed):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(self.STEPS):
            sparse = {}
            for name, (tab, _pool) in self.FEATURES.items():
                high = self.ROWS_A if tab == "a" else self.ROWS_B
                if name == "f4":
                    ids = rng.integers(0, high, size=self.B)
                    sparse[name] = (ids, np.ones(self.B, np.int64))
                    continue
                ids, ln = random_bags(rng, self.B, high)
                if name == "f3":
                    sparse[name] = (ids, ln, rng.uniform(0.2, 2, len(ids)).astype(np.float32))
                else:
                    sparse[name] = (ids, ln)
            dense = rng.standard_normal((self.B, 4)).astype(np.float32)
            y = (rng.random(self.B) < 0.4).astype(np.float32)
            out.append((dense, sparse, y))
        return out

    def tables(self):
        c = self.client
        a, b = fresh("dlrm_a"), fresh("dlrm_b")
        c.create_table(a, self.ROWS_A, self.W, optimizer="sgd", lr=self.LR_A, seed=21)
        c.create_table(b, self.ROWS_B, self.W, optimizer="adagrad", lr=self.LR_B, eps=1e-8,
                       seed=22)
        return a, b

    def reference(self, wa, wb):
        """Local tables (F.embedding_bag, padding_idx=0) and their optimizers."""
        pa = torch.nn.Parameter(torch.tensor(wa))
        pb_ = torch.nn.Parameter(torch.tensor(wb))
        tabs = {"a": pa, "b": pb_}

        def emb(sparse):
            out = {}
            for name, v in sparse.items():
                tab, pool = self.FEATURES[name]
                ids = torch.as_tensor(v[0])
                ln = torch.as_tensor(v[1])
                offsets = torch.cat([torch.zeros(1, dtype=torch.long), ln.cumsum(0)[:-1]])
                w = torch.as_tensor(v[2]) if len(v) > 2 else None
                mode = "mean" if pool == "mean" else "sum"
                out[name] = torch.nn.functional.embedding_bag(
                    ids, tabs[tab], offsets, mode=mode, per_sample_weights=w, padding_idx=0)
            return out
        opts = [torch.optim.SGD([pa], lr=self.LR_A),
                torch.optim.Adagrad([pb_], lr=self.LR_B, eps=1e-8)]
        return emb, opts, tabs

    def train(self, model, opts, data, feed):
        losses = []
        dense_opt = torch.optim.SGD(list(model.bottom.parameters())
                                    + list(model.top.parameters()), lr=0.1)
        for dense, sparse, y in data:
            out = model(torch.from_numpy(dense), feed(sparse))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(out,
                                                                        torch.from_numpy(y))
            dense_opt.zero_grad()
            for o in opts:
                o.zero_grad()
            loss.backward()
            dense_opt.step()
            for o in opts:
                o.step()
            losses.append(loss.item())
        return losses

    def run_case(self, feed_kind):
        a, b = self.tables()
        wa = self.client.lookup(a, np.arange(self.ROWS_A))
        wb = self.client.lookup(b, np.arange(self.ROWS_B))
        data = self.data(7)
        ref_emb, ref_opts, ref_tabs = self.reference(wa, wb)
        ref = DLRM(ref_emb, 4, self.W, seed=1)
        ref_losses = self.train(ref, ref_opts, data, lambda s: s)
        ebc = et.RemoteEmbeddingBagCollection(
            self.client, {n: ({"a": a, "b": b}[t], p) for n, (t, p) in self.FEATURES.items()})
        model = DLRM(ebc, 4, self.W, seed=1)
        self.assertEqual(len(list(ebc.parameters())), 0)
        calls = {"lookup_features": 0, "push_features": 0}
        for m in calls:
            def counted(*args, _m=m, _f=getattr(self.client, m), **kw):
                calls[_m] += 1
                return _f(*args, **kw)
            setattr(self.client, m, counted)
        self.addCleanup(lambda: [self.client.__dict__.pop(m, None) for m in list(calls)])
        lookups = self.table_counter(a, "lookups")

        def feed(sparse):
            if feed_kind == "dict":
                return {k: tuple(torch.from_numpy(np.asarray(x)) for x in v)
                        for k, v in sparse.items()}
            keys = list(sparse)
            values = torch.from_numpy(np.concatenate([v[0] for v in sparse.values()]))
            lengths = torch.from_numpy(np.concatenate([v[1] for v in sparse.values()]))
            weights = torch.from_numpy(np.concatenate(
                [v[2] if len(v) > 2 else np.ones(len(v[0]), np.float32)
                 for v in sparse.values()]))
            return KJT(keys, values, lengths, weights)
        losses = self.train(model, [], data, feed)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
        self.assertLess(np.mean(losses[-5:]), np.mean(losses[:5]))
        self.assertEqual(ebc.pushes, self.STEPS)
        # one LookupFeatures per forward and one PushFeatures per backward, whatever the
        # features (the servers count a lookup per feature that reads the table: two of a's)
        self.assertEqual(calls, {"lookup_features": self.STEPS, "push_features": self.STEPS})
        self.assertEqual(self.table_counter(a, "lookups") - lookups, 2 * self.STEPS)
        np.testing.assert_allclose(self.client.lookup(a, np.arange(self.ROWS_A)),
                                   ref_tabs["a"].detach().numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(self.client.lookup(b, np.arange(self.ROWS_B)),
                                   ref_tabs["b"].detach().numpy(), rtol=1e-4, atol=1e-5)
        print("  DLRM (%s input): loss %.4f -> %.4f, worst relative difference %.1e"
              % (feed_kind, losses[0], losses[-1],
                 np.max(np.abs(np.array(losses) - ref_losses) / np.abs(ref_losses))),
              file=sys.stderr)

    def table_counter(self, table, field):
        """rank 0's counter field of table."""
        for t in self.client.stats()[0].tables:
            if t.name == table:
                return getattr(t, field)
        return 0

    def test_dlrm_trains_like_embedding_bags(self):
        self.run_case("dict")

    def test_dlrm_from_keyed_jagged_tensors(self):
        self.run_case("kjt")

    def test_prefetch_async_and_no_grad(self):
        a, b = self.tables()
        ebc = et.RemoteEmbeddingBagCollection(self.client, {"x": a, "y": (b, "mean"),
                                                            "z": (a, "none")},
                                              mode="async", max_pending=1)
        feats = {"x": torch.tensor([[1, 2], [3, 0], [0, 0]]),
                 "y": (torch.tensor([4, 5, 6]), torch.tensor([0, 2, 1])),
                 "z": torch.tensor([7, 8, 9])}
        with torch.no_grad():
            out = ebc(feats)
        self.assertEqual({k: tuple(v.shape) for k, v in out.items()},
                         {"x": (3, self.W), "y": (3, self.W), "z": (3, self.W)})
        np.testing.assert_array_equal(out["x"][2].numpy(), 0)
        np.testing.assert_array_equal(out["y"][0].numpy(), 0)
        self.assertEqual(ebc.pushes, 0)
        ebc.prefetch(feats)
        out = ebc(feats)
        self.assertEqual((ebc.prefetch_hits, ebc.prefetch_misses), (1, 0))
        (out["x"].sum() + out["y"].sum()).backward()  # z takes no part: left out of the push
        ebc.flush()
        self.assertEqual(ebc.pushes, 1)
        self.assertTrue(ebc.last_push.ordered)
        after = ebc(feats)
        self.assertFalse(torch.equal(after["x"], out["x"]))
        np.testing.assert_array_equal(after["z"].detach().numpy(), out["z"].detach().numpy())
        with self.assertRaisesRegex(ValueError, "'q' is not a feature of this module"):
            ebc({"q": torch.tensor([1])})


class KJT:
    """What embps.torch reads of TorchRec's KeyedJaggedTensor."""

    def __init__(self, keys, values, lengths, weights=None):
        self._k, self._v, self._l, self._w = keys, values, lengths, weights

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return self._w


if __name__ == "__main__":
    unittest.main()
