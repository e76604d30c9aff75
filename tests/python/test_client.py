"""The Python library (python/embps) against real 1-, 2- and 4-rank groups, and offline.

Offline: address parsing, the hand-written wire codec against the protobuf classes, bf16
rounding against common/dtype.h's algorithm, token and gradient coercion, the descriptor cache
and its proto lookup, and the package as python/setup.py builds it, imported from outside the
tree.

Against groups (one of each size, started once; the 2- and 4-rank ones with a checkpoint
directory): every call (create_table, tables, table, stats, health, checkpoint, checkpoints,
lookup, push, lookup_async, push_async), checked against grouplib.RawClient, the raw-stub path
that splits batches by hand: lookups equal bitwise, and pushes to a twin table give the same
replies and leave bitwise the same rows. Every error: the shape errors word for word as the C
client says them (and the CLI, run on the same group), raised before anything is sent (the
servers' request counters do not move); unknown tables, tokens out of range, dtype mismatches,
ALREADY_EXISTS, deadlines, a wrong address list, a closed client. Futures: many calls in flight,
pushes and lookups pipelined on one client are applied in the order they were started (each
lookup sees exactly the pushes started before it), callbacks, wait/as_completed, threads
sharing one client. Padding, bf16 tables, torch tensors (when torch is installed).

Run: /usr/bin/python3 tests/python/test_client.py (ctest -L python)."""
import concurrent.futures
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

from testenv import PYTHON_DIR, ROOT, embps, gl  # noqa: E402

import grpc  # noqa: E402

from embps import _arrays, _stubs, _wire  # noqa: E402

SC = grpc.StatusCode
pbm = _stubs.messages()
WIDTH = 64  # a multiple of 4: every group size below splits it
ROWS = 1000

GROUPS = {}
CKPT_DIRS = {}


def setUpModule():
    GROUPS[1] = gl.Group(1)
    for n in (2, 4):
        CKPT_DIRS[n] = tempfile.mkdtemp(prefix="embps-pyclient-ckpt-")
        GROUPS[n] = gl.Group(n, "--checkpoint-dir", CKPT_DIRS[n])


def tearDownModule():
    bad = []
    for n, g in GROUPS.items():
        codes = g.close()
        if any(c != 0 for c in codes.values()):
            bad.append("%d-rank group exited with %s:\n%s" % (n, codes, g.last_logs))
    for d in CKPT_DIRS.values():
        shutil.rmtree(d, ignore_errors=True)
    if bad:
        raise AssertionError("\n".join(bad))


def bits(a):
    """An f32 array's bit patterns, so that equality is bitwise (and NaN-safe)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def bf16_reference(values):
    """common/dtype.h's embps_f32_to_bf16, one element at a time (Python ints)."""
    out = []
    for v in np.asarray(values, np.float32).ravel():
        u = struct.unpack("<I", struct.pack("<f", float(v)))[0]
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out.append((u >> 16) | 0x40)
        else:
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16)
    return np.array(out, np.uint16).reshape(np.shape(values))


def requests_per_rank(client):
    return [s.requests for s in client.stats()]


class FakeTensor:
    """Duck-types a CPU torch tensor for the core module (which never imports torch)."""

    def __init__(self, a):
        self.a = np.asarray(a)
        self.dtype = "fake." + str(self.a.dtype)

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a


# ---- offline -------------------------------------------------------------------------------------

class AddressTest(unittest.TestCase):
    def test_lists_and_env(self):
        self.assertEqual(embps.parse_servers("a:1, b.example:2 ,[::1]:3"),
                         ["a:1", "b.example:2", "[::1]:3"])
        self.assertEqual(embps.parse_servers(["10.0.0.1:7070"]), ["10.0.0.1:7070"])
        old = os.environ.get("EMBPS_SERVERS")
        try:
            os.environ["EMBPS_SERVERS"] = "h1:1,h2:2"
            self.assertEqual(embps.parse_servers(None), ["h1:1", "h2:2"])
            del os.environ["EMBPS_SERVERS"]
            self.assertEqual(embps.parse_servers(None), ["127.0.0.1:7070"])
        finally:
            if old is not None:
                os.environ["EMBPS_SERVERS"] = old

    def test_refusals_say_what_is_wrong(self):
        cases = {"a:1,,b:2": "empty server address in the list",
                 "localhost": "server address 'localhost' has no port (expected host:port)",
                 "h:0": "server address 'h:0' has a bad port (expected 1..65535)",
                 "h:70000": "has a bad port",
                 ":7070": "server address ':7070' has an empty host",
                 "::1:7070": "write IPv6 hosts as [addr]:port",
                 "[zz]:1": "'zz' is not an IPv6 address",
                 "h!st:1": "has a bad character '!' in its host",
                 "[::1]7070": "is not [ipv6]:port"}
        for text, fragment in cases.items():
            with self.assertRaises(ValueError, msg=text) as cm:
                embps.parse_servers(text)
            self.assertIn(fragment, str(cm.exception), text)
        with self.assertRaises(ValueError):
            embps.Client("nohost")

    def test_unreachable_is_unavailable(self):
        port = gl.free_ephemeral_port()
        with self.assertRaises(embps.Error) as cm:
            embps.Client("127.0.0.1:%d" % port, connect_timeout=5)
        self.assertEqual(cm.exception.code, SC.UNAVAILABLE)


class WireTest(unittest.TestCase):
    """The hand-written codec (_wire.py) says what the protobuf classes say."""

    def test_lookup_request(self):
        tok = np.array([5, 0, 2**40, 7], "<i8")
        for pad, dtype in ((0, 0), (3, 2)):
            b = _wire.lookup_request(_wire.table_field("tä"), 2**63 + 5, 3, 4, 16, tok, pad * 8,
                                     dtype)
            m = pbm.LookupRequest.FromString(b)
            self.assertEqual((m.table, m.batch_id, m.shard_index, m.shard_count,
                              m.tokens_per_batch, m.dtype), ("tä", 2**63 + 5, 3, 4, 16, dtype))
            self.assertEqual(np.frombuffer(m.tokens, "<i8").tolist(), tok.tolist() + [0] * pad)

    def test_push_request(self):
        tok = np.array([1, 2], "<i8")
        g = np.arange(6, dtype="<f4").reshape(2, 3)
        for pad, mode in ((0, 0), (2, 1)):
            b = _wire.push_request(_wire.table_field("t"), 9, 1, 2, 8, tok, pad, g, 12, 1, mode)
            m = pbm.PushGradientsRequest.FromString(b)
            self.assertEqual((m.table, m.batch_id, m.shard_index, m.shard_count,
                              m.tokens_per_batch, m.dtype, m.mode), ("t", 9, 1, 2, 8, 1, mode))
            self.assertEqual(np.frombuffer(m.tokens, "<i8").tolist(), [1, 2] + [0] * pad)
            want = np.concatenate([g, np.zeros((pad, 3), "<f4")])
            np.testing.assert_array_equal(np.frombuffer(m.gradients, "<f4").reshape(-1, 3), want)

    def test_client_id(self):
        """The client id follows the fields when set, and is absent (0) when not."""
        tok = np.array([1, 2], "<i8")
        g = np.zeros((2, 3), "<f4")
        for cid in (0, 1, 2**64 - 1):
            m = pbm.LookupRequest.FromString(_wire.lookup_request(
                _wire.table_field("t"), 9, 0, 2, 4, tok, 0, 0, cid))
            self.assertEqual((m.client_id, m.batch_id), (cid, 9))
            m = pbm.PushGradientsRequest.FromString(_wire.push_request(
                _wire.table_field("t"), 9, 0, 2, 4, tok, 0, g, 12, 1, 1, cid))
            self.assertEqual((m.client_id, m.batch_id, m.mode), (cid, 9, 1))

    def test_lookup_response(self):
        rows = np.arange(8, dtype="<f4").tobytes()
        for bid, shard in ((0, 0), (2**64 - 1, 3)):
            m = pbm.LookupResponse(batch_id=bid, shard_index=shard, emb_width=4, dtype=1,
                                   rows=rows)
            self.assertEqual(_wire.parse_lookup_response(m.SerializeToString())[:4],
                             (bid, shard, 4, 1))
            self.assertEqual(bytes(_wire.parse_lookup_response(m.SerializeToString())[4]), rows)
        # unknown fields of every wire type are skipped
        extra = (_wire.varint(99 << 3 | 0) + _wire.varint(300) + _wire.varint(98 << 3 | 1) +
                 b"\0" * 8 + _wire.varint(97 << 3 | 2) + _wire.varint(2) + b"xy" +
                 _wire.varint(96 << 3 | 5) + b"\0" * 4)
        m = pbm.LookupResponse(batch_id=7, emb_width=2, rows=b"\1" * 8).SerializeToString()
        self.assertEqual(_wire.parse_lookup_response(extra + m)[0], 7)
        for bad in (m[:-1], b"\x80", m[:3]):
            with self.assertRaises(_wire.WireError):
                _wire.parse_lookup_response(bad)


class ArraysTest(unittest.TestCase):
    def test_bf16_rounding_is_dtype_h(self):
        f = np.array([0.0, -0.0, 1.0, 1.00390625, 1.005859375, 1.0078125 + 2**-9, 3.4e38,
                      -3.4e38, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-45, 0.1, -2.5,
                      65504.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32)
        f = np.concatenate([f, np.random.default_rng(5).standard_normal(4000).astype(np.float32)
                            * np.float32(1e3)])
        got = _arrays.f32_to_bf16(f)
        np.testing.assert_array_equal(got, bf16_reference(f))
        # back to f32 is the high half, exactly
        np.testing.assert_array_equal(bits(_arrays.bf16_to_f32(got)),
                                      got.astype(np.uint32) << 16)

    def test_tokens(self):
        want = [3, 0, 7]
        for t in (want, np.array(want, np.int32), np.array(want, np.uint8),
                  np.array(want, np.uint64), np.array(want, ">i8"), FakeTensor(want),
                  np.array([3, 9, 0, 9, 7])[::2]):
            a = _arrays.as_tokens(t, "lookup")
            self.assertEqual(a.dtype, np.dtype("<i8"))
            self.assertTrue(a.flags.c_contiguous)
            self.assertEqual(a.tolist(), want)
        arr = np.array(want, np.int64)
        self.assertIs(_arrays.as_tokens(arr, "x"), arr)  # no copy when it is already right
        self.assertEqual(_arrays.as_tokens([], "x").shape, (0,))
        with self.assertRaises(embps.ShapeError) as cm:
            _arrays.as_tokens(np.zeros((2, 2), np.int64), "lookup")
        self.assertIn("lookup: tokens must be a 1-D array of token ids, not an array of shape "
                      "(2, 2)", str(cm.exception))
        with self.assertRaisesRegex(TypeError, "lookup: tokens must be integers, not float32"):
            _arrays.as_tokens(np.ones(3, np.float32), "lookup")
        with self.assertRaisesRegex(ValueError, r"push: token -4 at position 2 is negative"):
            _arrays.as_tokens([1, 2, -4], "push")
        with self.assertRaisesRegex(ValueError, "token 18446744073709551615 at position 1 is "
                                                "beyond int64"):
            _arrays.as_tokens(np.array([1, 2**64 - 1], np.uint64), "lookup")

    def test_grads(self):
        g = _arrays.as_grads([[1, 2], [3, 4]], 2, "push")
        self.assertEqual((g.dtype, g.shape), (np.dtype("<f4"), (2, 2)))
        self.assertEqual(_arrays.as_grads(np.ones((2, 3), np.float64), 2, "p").dtype,
                         np.dtype("<f4"))
        self.assertEqual(_arrays.as_grads(np.ones((2, 3), np.uint16), 2, "p").dtype,
                         np.dtype("<u2"))
        f = np.ones((4, 6), np.float32)[:, ::2]
        self.assertTrue(_arrays.as_grads(f, 4, "p").flags.c_contiguous)
        with self.assertRaisesRegex(embps.ShapeError, r"push: grads must hold one row per "
                                                      r"token, shape \(3, emb_width\), not "
                                                      r"\(2, 4\)"):
            _arrays.as_grads(np.ones((2, 4), np.float32), 3, "push")
        with self.assertRaises(embps.ShapeError):
            _arrays.as_grads(np.ones(8, np.float32), 2, "push")
        with self.assertRaisesRegex(TypeError, "floating point"):
            _arrays.as_grads(np.ones((2, 2), np.int32), 2, "push")


def _run_python(code, env, cwd=None):
    e = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "EMBPS_PROTO_DIR", "EMBPS_CACHE_DIR", "XDG_CACHE_HOME")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=cwd or tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=120)


class PackagingTest(unittest.TestCase):
    """Where the .proto files and the descriptors come from (embps/_stubs.py)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="embps-pyclient-pkg-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_cache_is_per_proto_version(self):
        proto = os.path.join(self.tmp, "proto")
        shutil.copytree(os.path.join(ROOT, "proto"), proto)
        cache = os.path.join(self.tmp, "cache")
        code = ("import embps, embps._stubs as s; print(s.descriptor_name(s.proto_hash("
                "s.proto_dir())))")
        env = {"PYTHONPATH": PYTHON_DIR, "EMBPS_PROTO_DIR": proto, "EMBPS_CACHE_DIR": cache}
        r = _run_python(code, env)
        self.assertEqual(r.returncode, 0, r.stderr)
        first = r.stdout.strip()
        self.assertEqual(os.listdir(cache), [first])  # one file, no temporaries left
        r = _run_python(code, env)  # read from the cache this time
        self.assertEqual((r.returncode, r.stdout.strip()), (0, first), r.stderr)
        with open(os.path.join(proto, "embps/v1/embps.proto"), "a") as f:
            f.write("\n// a change\n")
        r = _run_python(code, env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotEqual(r.stdout.strip(), first)
        self.assertEqual(sorted(os.listdir(cache)), sorted([first, r.stdout.strip()]))

    def test_missing_proto_says_where_it_looked(self):
        r = _run_python("import embps", {"PYTHONPATH": PYTHON_DIR,
                                          "EMBPS_PROTO_DIR": os.path.join(self.tmp, "none")})
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError: embps: cannot find embps/v1/embps.proto", r.stderr)
        self.assertIn("set EMBPS_PROTO_DIR", r.stderr)

    def test_built_package_needs_no_source_tree(self):
        build, egg = os.path.join(self.tmp, "build"), os.path.join(self.tmp, "egg")
        os.makedirs(egg)  # setuptools' egg-info goes there, not into the source tree
        r = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", egg,
                            "build", "--build-base", build],
                           cwd=PYTHON_DIR, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        lib = os.path.join(self.tmp, "site")
        shutil.copytree(os.path.join(build, "lib"), lib)
        shipped = os.listdir(os.path.join(lib, "embps", "_proto"))
        self.assertIn("embps", shipped)
        self.assertTrue([f for f in shipped if f.endswith(".desc")], shipped)
        # No source tree, no writable cache: the shipped copy is all it has.
        r = _run_python("import embps, embps._stubs as s; print(embps.__file__, s.proto_dir())",
                        {"PYTHONPATH": lib, "EMBPS_CACHE_DIR": "/proc/no-such-dir",
                         "XDG_CACHE_HOME": "/proc/no-such-dir"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(r.stdout.startswith(os.path.join(lib, "embps")), r.stdout)


# ---- against groups ------------------------------------------------------------------------------

class GroupTests:
    """Everything a worker does, against the N-rank group GROUPS[N]."""
    N = None

    @classmethod
    def setUpClass(cls):
        cls.group = GROUPS[cls.N]
        cls.client = embps.Client(cls.group.servers)
        cls.raw = gl.RawClient(cls.group.addresses)
        cls.names = 0

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.raw.close()

    def name(self, what="t"):
        type(self).names += 1
        return "%s_%s_%d" % (what, self._testMethodName[5:], self.names)

    def twin(self, opt="rowwise_adagrad", dtype="f32", width=WIDTH, **kw):
        """Two tables of one spec: one for the library, one for RawClient."""
        a, b = self.name("lib"), self.name("raw")
        for t in (a, b):
            self.client.create_table(t, ROWS, width, dtype=dtype, optimizer=opt, seed=11, **kw)
        return a, b

    def tokens(self, n, seed=0):
        """n tokens with duplicates and padding tokens among them."""
        t = np.random.default_rng(seed).integers(0, 40, n)
        t[::7] = 0
        return t

    def grads(self, n, seed=1, width=WIDTH):
        return (np.random.default_rng(seed).standard_normal((n, width)) * 0.1).astype(np.float32)

    def assertTablesEqual(self, a, b, width=WIDTH):
        everything = np.arange(ROWS)
        np.testing.assert_array_equal(bits(self.client.lookup(a, everything)),
                                      bits(self.raw.lookup(b, everything, width)))

    def assertNothingSent(self, fn, exc, fragment, lists=0):
        """fn raises exc (with fragment) and no request reaches any rank: GetStats' requests
        counters move by the same amount with and without it (except for `lists` ListTables
        asked of rank 0, which a push makes to learn a table's width and dtype)."""
        c = self.client
        # The baseline is what one GetStats round adds, read until two rounds agree: a rank may
        # still be counting a shard of an earlier call whose error the client already raised
        # from another rank (a window that ThreadSanitizer's slower servers widen).
        r0, r1 = requests_per_rank(c), requests_per_rank(c)
        for _ in range(20):
            r2 = requests_per_rank(c)
            if [b - a for a, b in zip(r0, r1)] == [b - a for a, b in zip(r1, r2)]:
                break
            r0, r1 = r1, r2
            time.sleep(0.05)
        r0, r1 = r1, r2
        with self.assertRaises(exc) as cm:
            fn()
        self.assertIn(fragment, str(cm.exception))
        r2 = requests_per_rank(c)
        want = [b - a for a, b in zip(r0, r1)]
        want[0] += lists
        self.assertEqual([b - a for a, b in zip(r1, r2)], want)
        return cm.exception

    # -- admin --

    def test_health_and_stats(self):
        h = self.client.health()
        self.assertTrue(h)
        self.assertEqual(h.statuses, ("SERVING",) * self.N)
        self.assertEqual(h.message, "")
        stats = self.client.stats()
        self.assertEqual([s.rank for s in stats], list(range(self.N)))
        self.assertEqual([s.address for s in stats], self.group.addresses)
        for s in stats:
            self.assertEqual((s.group_size, s.backend, s.ready, s.mesh),
                             (self.N, "cpu", True, "shard=%d" % self.N))
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        self.client.lookup(t, np.arange(2 * self.N))
        for s in self.client.stats():
            (ts,) = [x for x in s.tables if x.name == t]
            self.assertEqual((ts.rows, ts.emb_width, ts.lookups, ts.rows_looked_up),
                             (ROWS, WIDTH, 1, 2))
        self.assertEqual(self.client.group_size, self.N)
        self.assertEqual(list(self.client.addresses), self.group.addresses)

    def test_create_and_list_tables(self):
        t = self.name()
        spec = self.client.create_table(t, ROWS, WIDTH)
        self.assertEqual((spec.name, spec.rows, spec.emb_width, spec.dtype, spec.optimizer),
                         (t, ROWS, WIDTH, "f32", "rowwise_adagrad"))
        self.assertAlmostEqual(spec.lr, 0.01, places=6)
        self.assertAlmostEqual(spec.init_scale, 1 / math.sqrt(WIDTH), places=6)
        self.assertEqual(self.client.table(t), spec)
        self.assertIn(spec, self.client.tables())
        # what raw protobuf reads back is the same
        raw = self.raw.stubs[0].ListTables(gl.pb.ListTablesRequest(), timeout=30)
        (rs,) = [s for s in raw.tables if s.name == t]
        self.assertEqual((rs.rows, rs.emb_width, rs.optimizer.lr), (spec.rows, spec.emb_width,
                                                                    spec.lr))
        t2 = self.name()
        s2 = self.client.create_table(t2, 10, WIDTH, dtype="bf16", optimizer="adam", lr=0.5,
                                      beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=0.25,
                                      half_life=0, seed=3, init_scale=0.125)
        self.assertEqual((s2.dtype, s2.optimizer, s2.lr, s2.beta1, s2.seed, s2.init_scale,
                          s2.weight_decay), ("bf16", "adam", 0.5, np.float32(0.8), 3, 0.125,
                                             0.25))
        with self.assertRaises(embps.Error) as cm:
            self.client.create_table(t, ROWS, WIDTH)
        self.assertEqual(cm.exception.code, SC.ALREADY_EXISTS)
        with self.assertRaises(embps.Error) as cm:
            self.client.create_table(self.name(), 0, WIDTH)
        self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
        with self.assertRaises(embps.Error) as cm:
            self.client.table("no_such_table")
        self.assertEqual(cm.exception.code, SC.NOT_FOUND)
        for kw, msg in (({"dtype": "f16"}, "dtype 'f16' is neither f32 nor bf16"),
                        ({"optimizer": "lamb"}, "unknown optimizer 'lamb'")):
            with self.assertRaisesRegex(ValueError, msg):
                self.client.create_table(self.name(), ROWS, WIDTH, **kw)
        with self.assertRaisesRegex(ValueError, "no table name"):
            self.client.create_table("", ROWS, WIDTH)

    def test_drop_table(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH, optimizer="sgd")
        self.client.lookup(t, np.arange(4))
        # rows x (WIDTH / N) f32 values on each rank, sgd keeps no state
        self.assertEqual(self.client.drop_table(t), ROWS * (WIDTH // self.N) * 4)
        self.assertNotIn(t, [s.name for s in self.client.tables()])
        with self.assertRaises(embps.Error) as cm:
            self.client.lookup(t, np.arange(4))
        self.assertEqual(cm.exception.code, SC.NOT_FOUND)
        with self.assertRaises(embps.Error) as cm:
            self.client.drop_table(t)
        self.assertEqual(cm.exception.code, SC.NOT_FOUND)
        # The name again, at another width: the library forgot the old one's shape.
        self.client.create_table(t, ROWS, 2 * WIDTH, optimizer="sgd")
        self.assertEqual(self.client.lookup(t, np.arange(4)).shape, (4, 2 * WIDTH))
        self.client.drop_table(t)
        with self.assertRaisesRegex(ValueError, "no table name"):
            self.client.drop_table("")

    def test_emb_width_shape_error(self):
        if self.N == 1:
            self.skipTest("every emb_width splits over one rank")
        d = 2 * self.N + 1
        e = self.assertNothingSent(lambda: self.client.create_table(self.name(), ROWS, d),
                                   embps.ShapeError, "emb_width=%d" % d)
        want = ("emb_width=%d does not shard evenly over the %d-rank communicator: choose an "
                "emb_width that is a multiple of %d, or change the mesh" % (d, self.N, self.N))
        self.assertEqual(str(e), want)
        self.assertTrue(str(e).startswith(gl.design_message("D % N", D=d, N=self.N)))
        self.assertIsInstance(e, ValueError)
        self.assertEqual(e.code, SC.INVALID_ARGUMENT)
        self.assertEqual(e.remedy, "choose an emb_width that is a multiple of %d, or change the "
                                   "mesh" % self.N)
        r = gl.run_cli(self.group, "create-table", self.name(), "--rows", "10", "--emb-width",
                       str(d))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(want, r.stderr)

    def test_checkpoints(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        if self.N not in CKPT_DIRS:
            with self.assertRaises(embps.Error) as cm:
                self.client.checkpoint()
            self.assertEqual(cm.exception.code, SC.FAILED_PRECONDITION)
            return
        info = self.client.checkpoint()
        self.assertGreater(info.round, 0)
        self.assertGreater(info.bytes, 0)
        self.assertTrue(info.path.startswith(CKPT_DIRS[self.N]), info.path)
        self.assertEqual(info.scope, "")
        one = self.client.checkpoint(t)
        self.assertEqual(one.scope, t)
        self.assertGreater(one.round, info.round)
        listed = {c.round: c for c in self.client.checkpoints()}
        self.assertIn(info.round, listed)
        c = listed[info.round]
        self.assertEqual((c.path, c.bytes, c.group_size, c.scope), (info.path, info.bytes,
                                                                   self.N, ""))
        self.assertIn(t, c.tables)
        self.assertGreater(c.time_unix_ms, 0)
        with self.assertRaises(embps.Error) as cm:
            self.client.checkpoint("no_such_table")
        self.assertEqual(cm.exception.code, SC.NOT_FOUND)

    # -- lookups --

    def test_client_id_scopes_batch_ids(self):
        """Every Client sends its own non-zero client id, so its batch ids never meet another
        client's: a batch of the same id parked by a client without one (RawClient's id 0) does
        not stop it."""
        with embps.Client(self.group.servers) as other:
            self.assertNotEqual(other.client_id, 0)
            self.assertNotEqual(other.client_id, self.client.client_id)
            if self.N == 1:
                return  # one shard is a whole batch: nothing stays parked
            t = self.name()
            self.client.create_table(t, ROWS, WIDTH, seed=5)
            tok = self.tokens(2 * self.N)
            want = self.raw.lookup(t, tok, WIDTH)
            bid = 7 << 40
            _, parked = self.raw.lookup_async(t, tok, batch_id=bid, order=[0])
            other._batch_id = bid
            np.testing.assert_array_equal(bits(other.lookup(t, tok)), bits(want))
            # Kept: grpcio cancels a call whose future is garbage-collected, and a shard
            # cancelled before it is sent leaves the parked batch waiting for it.
            _, rest = self.raw.lookup_async(t, tok, batch_id=bid, order=range(1, self.N))
            np.testing.assert_array_equal(
                np.frombuffer(parked[0].result().rows, "<f4").reshape(-1, WIDTH), want[:2])
            for f in rest[1:]:  # rank 0's entry is None: its shard went with the first call
                f.result()

    def test_lookup_equals_raw(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH, seed=5)
        tok = self.tokens(8 * self.N)
        want = self.raw.lookup(t, tok, WIDTH)
        got = self.client.lookup(t, tok)
        self.assertEqual((got.dtype, got.shape), (np.dtype(np.float32), (len(tok), WIDTH)))
        self.assertTrue(got.flags.c_contiguous and got.flags.writeable)
        np.testing.assert_array_equal(bits(got), bits(want))
        np.testing.assert_array_equal(got[tok == 0], 0)
        self.assertTrue(np.any(got[tok != 0] != 0))
        for form in (tok.tolist(), tok.astype(np.int32), tok.astype(np.uint16),
                     tok.astype(np.uint64), FakeTensor(tok),
                     np.repeat(tok, 2)[::2]):
            np.testing.assert_array_equal(bits(self.client.lookup(t, form)), bits(want))
        out = np.full((len(tok), WIDTH), 7.0, np.float32)
        self.assertIs(self.client.lookup(t, tok, out=out), out)
        np.testing.assert_array_equal(bits(out), bits(want))
        with self.assertRaises(embps.ShapeError):
            self.client.lookup(t, tok, out=np.empty((len(tok), WIDTH), np.float64))
        self.assertEqual(self.client.lookup(t, []).shape, (0, WIDTH))

    def test_lookup_errors(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        prefix = "rank 0 (%s): " % self.group.addresses[0] if self.N > 1 else ""
        with self.assertRaises(embps.Error) as cm:
            self.client.lookup("no_such_table", np.arange(self.N))
        e = cm.exception
        self.assertEqual(e.code, SC.NOT_FOUND)
        self.assertEqual(e.details, "table 'no_such_table' not found")
        self.assertEqual(str(e), prefix + e.details)
        self.assertEqual((e.rank, e.address), (0, self.group.addresses[0]))
        with self.assertRaises(embps.Error) as cm:
            self.client.lookup(t, [ROWS] + [1] * (self.N - 1))
        self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
        self.assertIn("token %d at position 0 is outside [0, %d) of table '%s'" % (ROWS, ROWS, t),
                      str(cm.exception))
        with self.assertRaises(embps.Error) as cm:
            self.client.lookup(t, np.arange(self.N), dtype="bf16")
        self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
        self.assertIn("dtype mismatch: table '%s' stores f32, the request carries bf16" % t,
                      str(cm.exception))
        for bad, exc in ((np.zeros((self.N, 2), np.int64), embps.ShapeError),
                         (np.arange(self.N, dtype=np.float64), TypeError),
                         (-np.arange(1, self.N + 1), ValueError)):
            self.assertNothingSent(lambda: self.client.lookup(t, bad), exc, "lookup: ")
        with self.assertRaisesRegex(ValueError, "no table name"):
            self.client.lookup("", [1])
        with self.assertRaisesRegex(ValueError, "neither f32 nor bf16"):
            self.client.lookup(t, [1], dtype="f64")
        # the group still serves
        self.assertTrue(self.client.health())
        self.assertEqual(self.client.lookup(t, np.arange(self.N)).shape, (self.N, WIDTH))

    def test_tokens_per_batch_shape_error(self):
        if self.N == 1:
            self.skipTest("every batch splits over one rank")
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        n = 2 * self.N + 1
        padded = 3 * self.N
        want = ("tokens_per_batch=%d does not shard evenly over the %d-rank communicator: pad the "
                "batch to %d tokens (a multiple of %d) with padding token 0"
                % (n, self.N, padded, self.N))
        calls = [lambda: self.client.lookup(t, np.arange(n)),
                 lambda: self.client.lookup_async(t, np.arange(n)),
                 lambda: self.client.push(t, np.arange(n), self.grads(n)),
                 lambda: self.client.push_async(t, np.arange(n), self.grads(n), mode="async")]
        for fn in calls:
            e = self.assertNothingSent(fn, embps.ShapeError, "tokens_per_batch=")
            self.assertEqual(str(e), want)
            self.assertEqual(e.code, SC.INVALID_ARGUMENT)
            self.assertIsInstance(e, ValueError)
            self.assertIn("padding=True", e.remedy)
        self.assertTrue(want.startswith(gl.design_message("T % N", T=n, N=self.N)))
        r = gl.run_cli(self.group, "lookup", t, "--tokens", ",".join(map(str, range(1, n + 1))))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(want, r.stderr)

    def test_padding(self):
        t, u = self.twin(opt="sgd", lr=0.5)
        n = 3 * self.N + 1 if self.N > 1 else 5
        tok = self.tokens(n, seed=3)
        tok[-1] = 17  # a real token in the last shard, next to the padding
        padded_n = -(-n // self.N) * self.N
        padded = np.concatenate([tok, np.zeros(padded_n - n, np.int64)])
        with embps.Client(self.group.servers, padding=True) as c:
            got = c.lookup(t, tok)
            self.assertEqual(got.shape, (n, WIDTH))
            np.testing.assert_array_equal(bits(got), bits(self.raw.lookup(u, padded, WIDTH)[:n]))
            g = self.grads(n)
            res = c.push(t, tok, g)
            rraw = self.raw.push(u, padded, np.concatenate(
                [g, np.zeros((padded_n - n, WIDTH), np.float32)]))
            self.assertEqual((res.applied, res.grad_norm, res.num_unique),
                             (True, rraw[0].grad_norm, rraw[0].num_unique))
            got = c.lookup_async(t, tok).result()
            np.testing.assert_array_equal(bits(got), bits(self.raw.lookup(u, padded, WIDTH)[:n]))
        self.assertTablesEqual(t, u)
        self.client.padding = True
        try:
            self.assertEqual(self.client.lookup(t, np.arange(1, n + 1)).shape, (n, WIDTH))
        finally:
            self.client.padding = False

    # -- pushes --

    def test_sync_push_equals_raw(self):
        t, u = self.twin()
        for step in range(3):
            tok = self.tokens(4 * self.N, seed=step)
            g = self.grads(len(tok), seed=10 + step)
            res = self.client.push(t, tok, g)
            rr = self.raw.push(u, tok, g)
            self.assertEqual((res.applied, res.skipped, res.ordered), (True, False, False))
            self.assertTrue(all(r.applied for r in rr))
            self.assertEqual(res.grad_norm, rr[0].grad_norm)
            self.assertEqual(res.num_unique, rr[0].num_unique)
            self.assertEqual(res.num_unique, len(set(tok.tolist()) - {0}))
            self.assertGreater(res.grad_norm, 0)
            self.assertIsInstance(res, embps.PushResult)
        self.assertTablesEqual(t, u)

    def test_async_push_equals_raw(self):
        t, u = self.twin(opt="adagrad", lr=0.1)
        for step in range(3):
            tok = self.tokens(4 * self.N, seed=20 + step)
            g = self.grads(len(tok), seed=30 + step)
            res = self.client.push(t, tok, g, mode="async")
            rr = self.raw.push(u, tok, g, mode=gl.pb.UPDATE_MODE_ASYNC)
            self.assertEqual((res.applied, res.ordered, res.skipped), (False, True, False))
            self.assertTrue(all(r.ordered for r in rr))
            # DESIGN.md: a lookup after an async push sees it
            np.testing.assert_array_equal(bits(self.client.lookup(t, tok)),
                                          bits(self.raw.lookup(u, tok, WIDTH)))
        self.assertTablesEqual(t, u)

    def test_push_errors_and_gate(self):
        t, u = self.twin(opt="sgd", lr=1.0)
        tok = np.arange(1, 2 * self.N + 1)
        before = self.client.lookup(t, np.arange(ROWS))
        g = self.grads(len(tok))
        g[1, 3] = np.nan
        res = self.client.push(t, tok, g)
        self.assertEqual((res.applied, res.skipped), (False, True))
        self.assertEqual(res.skipped, self.raw.push(u, tok, g)[0].skipped)
        np.testing.assert_array_equal(bits(self.client.lookup(t, np.arange(ROWS))), bits(before))
        cases = [(lambda: self.client.push(t, tok, np.ones((len(tok), WIDTH + 1), np.float32)),
                  embps.ShapeError, "push: grads has %d columns, but table '%s' has "
                                    "emb_width=%d" % (WIDTH + 1, t, WIDTH), 1),
                 (lambda: self.client.push(t, tok, np.ones((len(tok) - 1, WIDTH))),
                  embps.ShapeError, "push: grads must hold one row per token", 0),
                 (lambda: self.client.push(t, tok, np.ones((len(tok), WIDTH), np.int64)),
                  TypeError, "push: grads must be floating point", 0),
                 (lambda: self.client.push(t, tok, self.grads(len(tok)), mode="later"),
                  ValueError, "push: mode 'later' is neither sync nor async", 0)]
        for fn, exc, fragment, lists in cases:
            self.assertNothingSent(fn, exc, fragment, lists)
        with self.assertRaises(embps.Error) as cm:
            self.client.push("no_such_table", tok, self.grads(len(tok)))
        self.assertEqual(cm.exception.code, SC.NOT_FOUND)
        with self.assertRaises(embps.Error) as cm:
            self.client.push(t, [ROWS + 5] * self.N, self.grads(self.N))
        self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
        self.assertIn("is outside [0, %d)" % ROWS, str(cm.exception))
        np.testing.assert_array_equal(bits(self.client.lookup(t, np.arange(ROWS))), bits(before))

    # -- bf16 --

    def test_bf16(self):
        t, u = self.twin(dtype="bf16", opt="rowwise_adagrad", lr=0.05)
        tok = self.tokens(4 * self.N, seed=4)
        raw_bits = np.frombuffer(self.raw.lookup_bytes(u, tok), "<u2").reshape(-1, WIDTH)
        got = self.client.lookup(t, tok)
        self.assertEqual(got.dtype, np.float32)
        np.testing.assert_array_equal(bits(got), raw_bits.astype(np.uint32) << 16)
        got16 = self.client.lookup(t, tok, dtype="bf16")
        self.assertEqual(got16.dtype, np.uint16)
        np.testing.assert_array_equal(got16, raw_bits)
        np.testing.assert_array_equal(bits(self.client.lookup_async(t, tok).result()), bits(got))
        for step in range(2):  # f32 gradients are rounded to bf16 as common/dtype.h does
            g = self.grads(len(tok), seed=40 + step)
            res = self.client.push(t, tok, g)
            rr = self.raw.push(u, tok, bf16_reference(g))
            self.assertEqual((res.applied, res.grad_norm, res.num_unique),
                             (True, rr[0].grad_norm, rr[0].num_unique))
        g16 = bf16_reference(self.grads(len(tok), seed=50))  # bf16 bits go as they are
        self.assertEqual(self.client.push(t, tok, g16).grad_norm,
                         self.raw.push(u, tok, g16)[0].grad_norm)
        everything = np.arange(ROWS)
        np.testing.assert_array_equal(
            self.client.lookup(t, everything, dtype="bf16"),
            np.frombuffer(self.raw.lookup_bytes(u, everything), "<u2").reshape(-1, WIDTH))
        # bf16 bits pushed to an f32 table are widened exactly
        f, v = self.twin(opt="sgd", lr=1.0)
        self.client.push(f, tok, g16)
        self.raw.push(v, tok, (g16.astype(np.uint32) << 16).view(np.float32))
        self.assertTablesEqual(f, v)

    # -- futures and order --

    def test_pipelined_calls_keep_their_order(self):
        """Pushes and lookups started back to back without waiting: lookup i sees exactly the
        i+1 pushes started before it (sgd with lr 1 and a power-of-two gradient is exact)."""
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH, optimizer="sgd", lr=1.0)
        tok = np.arange(1, 8 * self.N + 1)
        w = self.client.lookup(t, tok)
        g = np.full((len(tok), WIDTH), 0.0625, np.float32)
        pushes, lookups, now = [], [], {}
        for i in range(24):
            mode = "async" if i % 2 else "sync"
            pushes.append(self.client.push_async(t, tok, g, mode=mode))
            lookups.append(self.client.lookup_async(t, tok))
            if i % 6 == 5:  # a blocking lookup in the middle of the pipeline sees it too
                now[i] = self.client.lookup(t, tok)
        for i, (p, lk) in enumerate(zip(pushes, lookups)):
            w = (w - g).astype(np.float32)
            res = p.result(timeout=60)
            self.assertEqual(res.applied if i % 2 == 0 else res.ordered, True)
            np.testing.assert_array_equal(bits(lk.result(timeout=60)), bits(w),
                                          "lookup %d saw another number of pushes" % i)
            if i in now:
                np.testing.assert_array_equal(bits(now[i]), bits(w))
        ids = [f.batch_id for pair in zip(pushes, lookups) for f in pair]
        self.assertEqual(ids, sorted(ids))
        self.assertEqual(len(set(ids)), len(ids))

    def test_future_api(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        sets = [np.random.default_rng(s).integers(0, ROWS, 4 * self.N) for s in range(32)]
        futs = [self.client.lookup_async(t, s) for s in sets]  # all in flight at once
        self.assertTrue(all(isinstance(f, concurrent.futures.Future) for f in futs))
        done, not_done = concurrent.futures.wait(futs, timeout=60)
        self.assertEqual((len(done), len(not_done)), (32, 0))
        for f, s in zip(futs, sets):
            self.assertTrue(f.done())
            np.testing.assert_array_equal(bits(f.result()), bits(self.raw.lookup(t, s, WIDTH)))
        seen = []
        ev = threading.Event()
        f = self.client.push_async(t, sets[0], self.grads(len(sets[0])))
        f.add_done_callback(lambda x: (seen.append(x), ev.set()))
        self.assertTrue(ev.wait(60))
        self.assertIs(seen[0], f)
        self.assertTrue(f.result().applied)
        self.assertFalse(f.cancel())  # too late
        later = []
        f.add_done_callback(later.append)  # runs at once on a finished future
        self.assertEqual(later, [f])
        bad = self.client.lookup_async("no_such_table", np.arange(self.N))
        e = bad.exception(timeout=60)
        self.assertIsInstance(e, embps.Error)
        self.assertEqual(e.code, SC.NOT_FOUND)
        with self.assertRaises(embps.Error):
            bad.result()
        fs = [self.client.lookup_async(t, s) for s in sets[:4]]
        self.assertEqual(set(concurrent.futures.as_completed(fs, timeout=60)), set(fs))

    def test_threads_share_a_client(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH, optimizer="sgd", lr=1.0)
        w0 = self.client.lookup(t, np.arange(ROWS))
        g = np.full((2 * self.N, WIDTH), 0.125, np.float32)
        errors = []

        def work(k):
            tok = np.arange(1 + k * 2 * self.N, 1 + (k + 1) * 2 * self.N)  # disjoint rows
            try:
                for _ in range(10):
                    self.client.push(t, tok, g)
                    self.client.lookup_async(t, tok).result(timeout=60)
            except BaseException as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        self.assertEqual(errors, [])
        want = w0.copy()
        for _ in range(10):
            want[1:1 + 8 * self.N] = (want[1:1 + 8 * self.N] - np.float32(0.125)).astype(
                np.float32)
        np.testing.assert_array_equal(bits(self.client.lookup(t, np.arange(ROWS))), bits(want))

    # -- the client itself --

    def test_deadline(self):
        """A rank that does not answer in time: DEADLINE_EXCEEDED (the last rank is stopped
        with SIGSTOP for the call), and the group serves again once it runs."""
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        pid = self.group.procs[-1].pid
        with embps.Client(self.group.servers, timeout=0.3) as c:
            os.kill(pid, signal.SIGSTOP)
            try:
                with self.assertRaises(embps.Error) as cm:
                    c.lookup(t, np.arange(self.N))
                f = c.push_async(t, np.arange(self.N), self.grads(self.N))
                self.assertEqual(f.exception(timeout=60).code, SC.DEADLINE_EXCEEDED)
            finally:
                os.kill(pid, signal.SIGCONT)
            self.assertEqual(cm.exception.code, SC.DEADLINE_EXCEEDED)
            self.assertEqual(cm.exception.rank, 0)  # every rank waits: the first in rank order
            c.timeout = 60
            self.assertEqual(c.lookup(t, np.arange(self.N)).shape, (self.N, WIDTH))

    def test_addresses_and_close(self):
        t = self.name()
        self.client.create_table(t, ROWS, WIDTH)
        if self.N > 1:
            with self.assertRaises(embps.Error) as cm:
                embps.Client(self.group.addresses[:1])
            self.assertEqual(cm.exception.code, SC.FAILED_PRECONDITION)
            self.assertEqual(str(cm.exception),
                             "%s belongs to a group of %d ranks but 1 address was given: list "
                             "every rank's host:port in rank order"
                             % (self.group.addresses[0], self.N))
            with embps.Client(list(reversed(self.group.addresses))) as c:  # wrong rank order
                with self.assertRaises(embps.Error) as cm:
                    c.lookup(t, np.arange(self.N))
                self.assertEqual(cm.exception.code, SC.INVALID_ARGUMENT)
                self.assertIn("was sent to rank", str(cm.exception))
        old = os.environ.get("EMBPS_SERVERS")
        os.environ["EMBPS_SERVERS"] = self.group.servers
        try:
            with embps.Client() as c:
                self.assertEqual(c.group_size, self.N)
                self.assertIn(t, [s.name for s in c.tables()])
        finally:
            if old is None:
                del os.environ["EMBPS_SERVERS"]
            else:
                os.environ["EMBPS_SERVERS"] = old
        c.close()
        c.close()
        # calls in flight when the client closes finish (CANCELLED, or done), none hangs
        c = embps.Client(self.group.servers)
        f = c.lookup_async(t, np.arange(ROWS - ROWS % self.N))
        g = c.lookup_async(t, np.arange(ROWS - ROWS % self.N))
        cancelled = g.cancel()
        self.assertEqual(g.cancelled(), cancelled)
        if cancelled:
            with self.assertRaises(concurrent.futures.CancelledError):
                g.result(timeout=60)
        c.close()
        e = f.exception(timeout=60)
        self.assertTrue(e is None or e.code == SC.CANCELLED, repr(e))
        with self.assertRaisesRegex(ValueError, "closed"):
            c.lookup(t, np.arange(self.N))
        self.assertIn("closed", repr(c))

    def test_torch_tensors(self):
        if self.N != 2:
            self.skipTest("once is enough")
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed")
        t, u = self.twin(dtype="bf16", opt="sgd", lr=1.0)
        tok = self.tokens(4 * self.N, seed=9)
        tt = torch.tensor(tok)
        np.testing.assert_array_equal(bits(self.client.lookup(t, tt)),
                                      bits(self.client.lookup(t, tok)))
        g = torch.tensor(self.grads(len(tok)), requires_grad=True) * 2  # not a leaf
        self.client.push(t, tt, g)
        self.raw.push(u, tok, bf16_reference(g.detach().numpy()))
        gb = torch.tensor(self.grads(len(tok), seed=8)).to(torch.bfloat16)
        self.client.push(t, tt.to(torch.int32), gb)
        self.raw.push(u, tok, gb.view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(self.client.lookup(t, np.arange(ROWS), dtype="bf16"),
                                      np.frombuffer(self.raw.lookup_bytes(u, np.arange(ROWS)),
                                                    "<u2").reshape(-1, WIDTH))
        out = torch.from_numpy(self.client.lookup(t, tt))  # writable: no warning, no copy
        self.assertEqual(tuple(out.shape), (len(tok), WIDTH))


class OneRankTest(GroupTests, unittest.TestCase):
    N = 1


class TwoRankTest(GroupTests, unittest.TestCase):
    N = 2


class FourRankTest(GroupTests, unittest.TestCase):
    N = 4


if __name__ == "__main__":
    unittest.main(verbosity=2)
