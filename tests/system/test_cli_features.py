"""System tests of the CLI's feature batches: `embps lookup-features FILE` and `embps bench
--features SPEC [--per-table]`, against a real embps-server and a real 2-rank group started by
tests/lib/embps_servers.py, both with the same seeded tables (an f32 table of width 8 and a bf16
one of width 4).

- lookup-features prints one line per row; its pooled rows (sum, mean, weighted sum; padding id
  0 and empty bags) match a float64 pooling here of the rows `embps lookup` prints (within 1e-6
  relative), its rows of pooling none are `embps lookup`'s, exactly; --json carries the same
  values with emb_width and dtype; the features given as an object, from stdin, with default
  lengths and pooling, answer the same.
- On the 2-rank group a batch of 3 samples is refused with the error table's words and, with
  --pad, answers bitwise what the 1-rank server answers.
- Bad files are usage errors (exit 2) naming the file, the feature and the key, or jansson's
  line and column; what the library refuses (lengths that do not add up) and an unknown table
  fail with exit 1 naming the feature.
- bench --features runs both ways (one call per rank, and --per-table) with lookups and pushes,
  reports steps and samples per second without errors, and refuses a bad spec and --per-table
  without --features (exit 2).
Standard library only; every subprocess has a timeout.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
import embps_servers  # noqa: E402

CLI_BIN = embps_servers.cli_binary()
CMD_TIMEOUT = 60
TABLES = [("items", ["--rows", "200", "--emb-width", "8", "--optimizer", "sgd", "--seed", "5"]),
          ("cats", ["--rows", "100", "--emb-width", "4", "--dtype", "bf16", "--seed", "6"])]
WIDTH = {"items": 8, "cats": 4}

BATCH = {
    "batch_size": 4,
    "features": [
        {"name": "clicks", "table": "items", "pooling": "sum", "ids": [3, 5, 0, 7, 3, 11],
         "lengths": [2, 0, 3, 1]},
        {"name": "views", "table": "items", "pooling": "mean", "ids": [9, 0, 9, 4, 0],
         "lengths": [3, 1, 0, 1]},
        {"name": "cats", "table": "cats", "pooling": "weighted_sum", "ids": [7, 2, 0, 2],
         "lengths": [1, 2, 1, 0], "weights": [0.5, 2.0, 1.0, -1.5]},
        {"name": "raw", "table": "items", "ids": [13, 0, 14], "lengths": [1, 1, 0, 1]},
    ],
}


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def embps(servers, *args, stdin=None):
    env = dict(os.environ)
    env.pop("EMBPS_SERVERS", None)
    return subprocess.run([CLI_BIN, "--servers", servers] + list(args), capture_output=True,
                          text=True, env=env, input=stdin, timeout=CMD_TIMEOUT)


def parse_rows(text):
    """{feature: [(sample, id or None, [values])]} from lookup-features' text output."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        name = parts[0]
        if name == "raw":
            out.setdefault(name, []).append((int(parts[1]), int(parts[2]),
                                             [float(v) for v in parts[3:]]))
        else:
            out.setdefault(name, []).append((int(parts[1]), None, [float(v) for v in parts[2:]]))
    return out


class FeaturesCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = embps_servers.Server(prefix="embps-cli-features-")
        cls.group = embps_servers.Group(2)
        cls.dir = tempfile.mkdtemp(prefix="embps-cli-features-")
        for servers in (cls.server.address, cls.group.servers):
            for name, flags in TABLES:
                r = embps(servers, "create-table", name, *flags)
                assert r.returncode == 0, r.stderr
        for t in ("b0", "b1"):
            r = embps(cls.server.address, "create-table", t, "--rows", "5000", "--emb-width", "16",
                      "--optimizer", "rowwise_adagrad")
            assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        cls.server.close()
        cls.group.close()
        for f in os.listdir(cls.dir):
            os.unlink(os.path.join(cls.dir, f))
        os.rmdir(cls.dir)

    def write(self, name, obj):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj))
        return path

    def ok(self, servers, *args, stdin=None):
        r = embps(servers, *args, stdin=stdin)
        self.assertEqual(r.returncode, 0, "embps %s:\n%s%s" % (" ".join(args), r.stdout, r.stderr))
        return r.stdout

    def fails(self, code, fragments, servers, *args, stdin=None):
        r = embps(servers, *args, stdin=stdin)
        self.assertEqual(r.returncode, code, "embps %s: %s%s" % (" ".join(args), r.stdout,
                                                                 r.stderr))
        for frag in fragments:
            self.assertIn(frag, r.stderr)

    def rows_of(self, table, ids):
        """{id: [f32 values]} from `embps lookup`."""
        out = self.ok(self.server.address, "lookup", table, "--tokens",
                      ",".join(str(i) for i in ids))
        rows = {}
        for line in out.splitlines():
            parts = line.split()
            rows[int(parts[0])] = [f32(float(v)) for v in parts[1:]]
        return rows

    def test_rows_against_lookup(self):
        path = self.write("batch.json", BATCH)
        got = parse_rows(self.ok(self.server.address, "lookup-features", path))
        for feat in BATCH["features"]:
            table, ids, lengths = feat["table"], feat["ids"], feat["lengths"]
            rows = self.rows_of(table, sorted(set(ids)))
            pooling = feat.get("pooling", "none")
            lines = got[feat["name"]]
            if pooling == "none":
                self.assertEqual(len(lines), len(ids))
                samples = [s for s, n in enumerate(lengths) for _ in range(n)]
                for (s, i, vals), want_s, want_i in zip(lines, samples, ids):
                    self.assertEqual((s, i), (want_s, want_i))
                    self.assertEqual([f32(v) for v in vals], rows[want_i])
                continue
            self.assertEqual([s for s, _, _ in lines], list(range(BATCH["batch_size"])))
            at = 0
            for s, n in enumerate(lengths):
                want = [0.0] * WIDTH[table]
                nz = 0
                for k in range(at, at + n):
                    if ids[k] == 0:
                        continue
                    nz += 1
                    w = feat["weights"][k] if "weights" in feat else 1.0
                    want = [a + w * b for a, b in zip(want, rows[ids[k]])]
                if pooling == "mean" and nz:
                    want = [a / nz for a in want]
                for g, wv in zip(lines[s][2], want):
                    self.assertAlmostEqual(g, wv, delta=1e-6 * abs(wv) + 1e-7,
                                           msg="%s sample %d" % (feat["name"], s))
                if nz == 0:
                    self.assertEqual(lines[s][2], [0.0] * WIDTH[table])
                at += n
        # --json: the same numbers, with the shape
        js = json.loads(self.ok(self.server.address, "lookup-features", "--json", path))
        self.assertEqual(js["batch_size"], 4)
        by_name = {f["name"]: f for f in js["features"]}
        self.assertEqual(by_name["cats"]["emb_width"], 4)
        self.assertEqual(by_name["cats"]["dtype"], "f32")  # pooled rows are f32
        self.assertEqual(by_name["raw"]["dtype"], "f32")
        self.assertEqual(by_name["raw"]["pooling"], "none")
        for name, lines in got.items():
            self.assertEqual([vals for _, _, vals in lines], by_name[name]["rows"])

    def test_object_form_stdin_and_defaults(self):
        path = self.write("batch.json", BATCH)
        want = self.ok(self.server.address, "lookup-features", path)
        obj = {"batch_size": 4, "features": {
            f["name"]: {k: v for k, v in f.items() if k != "name"} for f in BATCH["features"]}}
        self.assertEqual(self.ok(self.server.address, "lookup-features", "-",
                                 stdin=json.dumps(obj)), want)
        # no lengths: a bag of one id per id; no pooling: none; no batch_size: the ids' count
        got = self.ok(self.server.address, "lookup-features", "-", stdin=json.dumps(
            {"features": [{"name": "r", "table": "items", "ids": [3, 0, 5]}]}))
        rows = self.rows_of("items", [3, 5])
        lines = [line.split() for line in got.splitlines()]
        self.assertEqual([(int(p[1]), int(p[2])) for p in lines], [(0, 3), (1, 0), (2, 5)])
        self.assertEqual([f32(float(v)) for v in lines[2][3:]], rows[5])
        self.assertEqual([float(v) for v in lines[1][3:]], [0.0] * 8)  # id 0 reads zeros

    def test_group_split_and_padding(self):
        three = {"features": [dict(f) for f in BATCH["features"]]}
        for f in three["features"]:  # the first 3 samples
            n = sum(f["lengths"][:3])
            f["lengths"], f["ids"] = f["lengths"][:3], f["ids"][:n]
            if "weights" in f:
                f["weights"] = f["weights"][:n]
        path = self.write("three.json", three)
        self.fails(1, ["batch_size=3 does not shard evenly over the 2-rank communicator: pad the "
                       "batch to 4 samples (a multiple of 2) with empty bags"],
                   self.group.servers, "lookup-features", path)
        one = self.ok(self.server.address, "lookup-features", path)
        padded = self.ok(self.group.servers, "--pad", "lookup-features", path)
        self.assertEqual(padded, one)
        four = self.write("four.json", BATCH)
        self.assertEqual(self.ok(self.group.servers, "lookup-features", four),
                         self.ok(self.server.address, "lookup-features", four))

    def test_bad_files(self):
        s = self.server.address
        cases = [
            ('{"features": [{"name": "a", "table": "items", "ids": [1,', 2,
             ["line ", "column"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1], "colour": 2}]}', 2,
             ["feature 'a': unknown key \"colour\""]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1.5]}]}', 2,
             ["feature 'a': \"ids\"[0] is not a whole number"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1], "lengths": [-1]}]}', 2,
             ["\"lengths\"[0] is not a whole number in [0, 4294967295]"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1], "pooling": "max"}]}', 2,
             ["\"pooling\" must be"]),
            ('{"features": [{"table": "items", "ids": [1]}]}', 2, ["feature 0 has no \"name\""]),
            ('{"features": []}', 2, ["\"features\" must be a non-empty"]),
            ('{"feature": []}', 2, ["unknown key \"feature\""]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1, 2], "weights": [1]}]}', 2,
             ["\"weights\" holds 1 numbers for 2 ids"]),
            ('{"batch_size": 3, "features": [{"name": "a", "table": "items", "ids": [1]}]}', 2,
             ["\"lengths\" holds 1 bags for a batch of 3 samples"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1, 2], "lengths": [3, 0]}]}',
             1, ["INVALID_ARGUMENT", "feature 'a': its 2 lengths add up to 3 ids"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [1], "weights": [2]}]}', 1,
             ["feature 'a': weights are taken with pooling weighted_sum only"]),
            ('{"features": [{"name": "a", "table": "nope", "ids": [1]}]}', 1,
             ["NOT_FOUND", "feature 'a'", "'nope'"]),
            ('{"features": [{"name": "a", "table": "items", "ids": [200]}]}', 1,
             ["INVALID_ARGUMENT", "feature 'a': id 200"]),
        ]
        for i, (text, code, frags) in enumerate(cases):
            path = self.write("bad%d.json" % i, text)
            self.fails(code, frags + ([path] if code == 2 else []), s, "lookup-features", path)
        self.fails(2, ["No such file"], s, "lookup-features", os.path.join(self.dir, "missing"))

    def test_bench_features(self):
        s = self.server.address
        for extra in ([], ["--per-table"]):
            out = self.ok(s, "bench", "b0,b1", "--features", "3x1,1x6:sum,2x3:mean,1x2:none,"
                          "1x2:weighted_sum", "--batch", "32", "--duration", "0.5", "--warmup",
                          "0.2", "--push-ratio", "0.5", "--pipeline", "2", "--json", *extra)
            j = json.loads(out)
            self.assertEqual(j["mode"], "per_table" if extra else "features")
            self.assertEqual(j["feature_count"], 8)
            self.assertEqual(j["ids_per_sample"], 3 + 6 + 6 + 2 + 2)
            self.assertEqual(j["calls_per_step"], 2 if extra else 1)
            self.assertEqual(j["errors"], 0)
            self.assertGreater(j["lookups"], 0)
            self.assertGreater(j["pushes"], 0)
            self.assertAlmostEqual(j["samples_per_s"], j["batches_per_s"] * 32, delta=1)
        text = self.ok(s, "bench", "b0", "--features", "2x4", "--batch", "8", "--duration", "0.3",
                       "--warmup", "0")
        self.assertIn("one call per rank, pooled on the servers", text)
        self.assertIn("samples/s", text)
        self.fails(2, ["--features: item 1 is not COUNTxBAG"], s, "bench", "b0", "--features",
                   "3y1", "--batch", "8")
        self.fails(2, ["--per-table runs a --features bench"], s, "bench", "b0", "--per-table",
                   "--batch", "8")
        self.fails(2, ["no --mix, no --rate"], s, "bench", "b0", "--features", "1x1", "--batch",
                   "8", "--rate", "10")
        self.fails(1, ["batch_size=3 does not shard evenly over the 2-rank communicator"],
                   self.group.servers, "bench", "items", "--features", "1x1", "--batch", "3")


if __name__ == "__main__":
    unittest.main()
