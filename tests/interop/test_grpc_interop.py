"""Interop: a stock gRPC client (Python grpcio, stubs generated from proto/) calls embps-server,
looks up and pushes, and checks the rows against a numpy reference of each optimizer; then it
sends every kind of bad input and checks the status, the message, that the table did not change
and that the server keeps serving."""
import socket
import struct
import time
import unittest

import numpy as np

import embps_testlib as lib
from embps_testlib import embps_pb2 as pb, embps_pb2_grpc as pbg
from embps_testlib import health_pb2, health_pb2_grpc

OPT = {"sgd": pb.OPTIMIZER_SGD, "adagrad": pb.OPTIMIZER_ADAGRAD,
       "rowwise_adagrad": pb.OPTIMIZER_ROWWISE_ADAGRAD, "adam": pb.OPTIMIZER_ADAM}


def to_bf16_bits(x):
    """f32 -> bf16 bits with round-to-nearest-even (as the server stores them)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from_bf16_bits(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class Reference:
    """The optimizers of kernels/embps_kernels.h in numpy, f32 math, starting from given rows."""

    def __init__(self, rows, kind, lr, eps, half_life=0.0, init_acc=0.0, wd=0.0, b1=0.9, b2=0.999,
                 bf16=False):
        self.w = {}
        self.initial = rows  # dict token -> f32 row
        self.kind, self.lr, self.eps, self.wd = kind, np.float32(lr), np.float32(eps), np.float32(wd)
        self.decay = np.float32(np.exp(-np.log(2.0) / half_life)) if half_life > 0 else np.float32(1)
        self.init_acc, self.b1, self.b2 = np.float32(init_acc), np.float32(b1), np.float32(b2)
        self.state = {}
        self.step = 0
        self.bf16 = bf16

    def row(self, t):
        if t == 0:
            return None
        return self.w.get(t, self.initial[t]).astype(np.float32)

    def push(self, tokens, grads):
        sums = {}
        for t, g in zip(tokens, grads):
            if t == 0:
                continue
            sums[t] = sums.get(t, np.zeros_like(g, dtype=np.float32)) + g.astype(np.float32)
        if not all(np.all(np.isfinite(g)) for g in sums.values()):
            return False, 0.0
        norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in sums.values())))
        self.step += 1
        for t in sorted(sums):
            w = self.row(t)
            g = sums[t] + self.wd * w
            w, self.state[t] = lib.optimizer_update(self.kind, w, g, self.state.get(t), self.lr,
                                                    self.eps, self.decay, self.init_acc, self.b1,
                                                    self.b2, self.step)
            w = w.astype(np.float32)
            if self.bf16:
                w = from_bf16_bits(to_bf16_bits(w))
            self.w[t] = w
        return True, norm


class InteropTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = lib.Server("--max-message-bytes", "8M", "--stall-timeout-ms", "500")
        cls.chan = lib.channel(cls.server.address)
        cls.stub = pbg.EmbeddingServiceStub(cls.chan)
        cls.batch_id = 0

    @classmethod
    def tearDownClass(cls):
        cls.chan.close()
        rc = cls.server.close()
        assert rc == 0, "server exited with %s" % rc

    def create(self, name, rows=1000, width=16, dtype=pb.DTYPE_F32, opt="rowwise_adagrad", **kw):
        o = pb.OptimizerConfig(kind=OPT[opt], lr=kw.get("lr", 0.05), eps=kw.get("eps", 1e-6),
                               half_life=kw.get("half_life", 0.0),
                               initial_accumulator=kw.get("init_acc", 0.0),
                               weight_decay=kw.get("wd", 0.0))
        spec = pb.TableSpec(name=name, rows=rows, emb_width=width, dtype=dtype, seed=kw.get("seed", 7),
                            optimizer=o)
        return self.stub.CreateTable(pb.CreateTableRequest(spec=spec))

    def lookup(self, table, tokens, dtype=pb.DTYPE_F32, width=16):
        InteropTest.batch_id += 1
        tok = np.asarray(tokens, dtype="<i8")
        resp = self.stub.Lookup(pb.LookupRequest(table=table, batch_id=self.batch_id, shard_index=0,
                                                 shard_count=1, tokens_per_batch=len(tok),
                                                 tokens=tok.tobytes()))
        self.assertEqual(resp.batch_id, self.batch_id)
        if dtype == pb.DTYPE_F32:
            return np.frombuffer(resp.rows, dtype="<f4").reshape(len(tok), width)
        return from_bf16_bits(np.frombuffer(resp.rows, dtype="<u2")).reshape(len(tok), width)

    def push(self, table, tokens, grads, dtype=pb.DTYPE_F32, mode=pb.UPDATE_MODE_SYNC):
        InteropTest.batch_id += 1
        tok = np.asarray(tokens, dtype="<i8")
        g = np.asarray(grads, dtype=np.float32)
        gbytes = g.astype("<f4").tobytes() if dtype == pb.DTYPE_F32 else to_bf16_bits(g).tobytes()
        return self.stub.PushGradients(pb.PushGradientsRequest(
            table=table, batch_id=self.batch_id, shard_index=0, shard_count=1,
            tokens_per_batch=len(tok), tokens=tok.tobytes(), dtype=dtype, gradients=gbytes,
            mode=mode))

    def assertStatus(self, fn, code, *fragments):
        with self.assertRaises(lib.grpc.RpcError) as cm:
            fn()
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        for f in fragments:
            self.assertIn(f, cm.exception.details())
        return cm.exception.details()

    # ---- the happy paths -------------------------------------------------------------------

    def test_health(self):
        h = health_pb2_grpc.HealthStub(self.chan)
        r = h.Check(health_pb2.HealthCheckRequest(service=""))
        self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)
        r = h.Check(health_pb2.HealthCheckRequest(service="embps.v1.EmbeddingService"))
        self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)

    def run_optimizer(self, opt, dtype=pb.DTYPE_F32, steps=25, **kw):
        rng = np.random.default_rng(abs(hash((opt, dtype))) % (1 << 32))
        name = "interop_%s_%d" % (opt, dtype)
        width, rows = 16, 200
        self.create(name, rows=rows, width=width, dtype=dtype, opt=opt, **kw)
        all_tokens = np.arange(rows)
        initial = self.lookup(name, all_tokens, dtype, width)
        self.assertTrue(np.all(initial[0] == 0), "padding row 0 must read zero")
        self.assertGreater(np.abs(initial[1:]).max(), 0)
        ref = Reference({int(t): initial[t].copy() for t in all_tokens}, opt,
                        kw.get("lr", 0.05), kw.get("eps", 1e-6), kw.get("half_life", 0.0),
                        kw.get("init_acc", 0.0), kw.get("wd", 0.0), bf16=(dtype == pb.DTYPE_BF16))
        for step in range(steps):
            n = 64
            tokens = rng.integers(0, 30, size=n)  # heavy duplication, padding (0) included
            grads = rng.normal(size=(n, width)).astype(np.float32)
            if dtype == pb.DTYPE_BF16:
                grads = from_bf16_bits(to_bf16_bits(grads))
            mode = pb.UPDATE_MODE_ASYNC if step % 3 == 2 else pb.UPDATE_MODE_SYNC
            resp = self.push(name, tokens, grads, dtype, mode)
            applied, norm = ref.push(tokens.tolist(), grads)
            if mode == pb.UPDATE_MODE_SYNC:
                self.assertTrue(resp.applied)
                self.assertFalse(resp.skipped)
                self.assertEqual(resp.num_unique, len(set(t for t in tokens.tolist() if t != 0)))
                self.assertAlmostEqual(resp.grad_norm, norm, delta=1e-4 * max(1.0, norm))
            else:
                self.assertTrue(resp.ordered)
        got = self.lookup(name, all_tokens, dtype, width)
        want = np.stack([ref.row(int(t)) if t else np.zeros(width, np.float32) for t in all_tokens])
        if dtype == pb.DTYPE_F32:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        else:
            # bf16 storage: one rounding step apart at most where f32 math rounds differently.
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3)
        self.assertTrue(np.all(got[0] == 0))
        # Rows never pushed are unchanged.
        untouched = np.arange(30, rows)
        np.testing.assert_array_equal(got[untouched], initial[untouched])

    def test_sgd(self):
        self.run_optimizer("sgd", wd=0.01)

    def test_adagrad(self):
        self.run_optimizer("adagrad", half_life=10.0, init_acc=0.1)

    def test_rowwise_adagrad(self):
        self.run_optimizer("rowwise_adagrad", half_life=5.0, wd=0.001)

    def test_adam(self):
        self.run_optimizer("adam", lr=0.01)

    def test_rowwise_adagrad_bf16(self):
        self.run_optimizer("rowwise_adagrad", dtype=pb.DTYPE_BF16)

    def test_lookup_reply_in_chunks(self):
        """A lookup reply larger than the engine's 1 MiB chunk leaves chunk by chunk while the
        rest is gathered; grpcio reads three such replies at once on one connection, each equal
        to the same rows looked up in small single-chunk batches."""
        width, rows = 64, 4096
        self.create("interop_chunks", rows=rows, width=width)
        rng = np.random.default_rng(13)
        batches = [rng.integers(0, rows, size=14000 + 777 * i) for i in range(3)]  # 3.6-4.2 MB
        futures = []
        for tok in batches:
            InteropTest.batch_id += 1
            t = np.asarray(tok, dtype="<i8")
            futures.append(self.stub.Lookup.future(pb.LookupRequest(
                table="interop_chunks", batch_id=self.batch_id, shard_index=0, shard_count=1,
                tokens_per_batch=len(t), tokens=t.tobytes())))
        reference = np.concatenate([self.lookup("interop_chunks", np.arange(a, a + 512), width=width)
                                    for a in range(0, rows, 512)])
        for tok, fut in zip(batches, futures):
            resp = fut.result(timeout=60)
            got = np.frombuffer(resp.rows, dtype="<f4").reshape(len(tok), width)
            np.testing.assert_array_equal(got, reference[tok])

    def test_list_and_stats(self):
        self.create("interop_list", rows=10, width=8)
        r = self.stub.ListTables(pb.ListTablesRequest())
        names = {t.name: t for t in r.tables}
        self.assertIn("interop_list", names)
        self.assertEqual(names["interop_list"].emb_width, 8)
        self.assertEqual(names["interop_list"].optimizer.kind, pb.OPTIMIZER_ROWWISE_ADAGRAD)
        self.assertEqual(r.group_size, 1)
        self.lookup("interop_list", [1, 2, 3], width=8)
        s = self.stub.GetStats(pb.GetStatsRequest())
        self.assertEqual(s.backend, "cpu")
        self.assertEqual(s.group_size, 1)
        t = {t.name: t for t in s.tables}["interop_list"]
        self.assertEqual(t.lookups, 1)
        self.assertEqual(t.rows_looked_up, 3)
        self.assertGreater(s.requests, 0)

    def test_nonfinite_push_is_skipped(self):
        self.create("interop_nan", rows=50, width=16)
        before = self.lookup("interop_nan", np.arange(50))
        for bad in (np.nan, np.inf, -np.inf):
            g = np.ones((4, 16), np.float32)
            g[2, 5] = bad
            r = self.push("interop_nan", [3, 4, 5, 3], g)
            self.assertFalse(r.applied)
            self.assertTrue(r.skipped)
        np.testing.assert_array_equal(self.lookup("interop_nan", np.arange(50)), before)
        # A NaN in a padding token's gradient is ignored.
        g = np.ones((2, 16), np.float32)
        g[1, 0] = np.nan
        r = self.push("interop_nan", [3, 0], g)
        self.assertTrue(r.applied)

    # ---- bad input -----------------------------------------------------------------------------

    def test_bad_input(self):
        IA = lib.grpc.StatusCode.INVALID_ARGUMENT
        self.create("interop_bad", rows=100, width=16)
        before = self.lookup("interop_bad", np.arange(100))
        tok = np.asarray([1, 2], "<i8").tobytes()
        g = np.ones((2, 16), "<f4").tobytes()
        P = pb.PushGradientsRequest
        cases = [
            (lambda: self.stub.Lookup(pb.LookupRequest(table="nope", tokens=tok)),
             lib.grpc.StatusCode.NOT_FOUND, ["table 'nope' not found"]),
            (lambda: self.lookup("interop_bad", [1, 100]), IA, ["token 100", "outside [0, 100)"]),
            (lambda: self.lookup("interop_bad", [-1]), IA, ["token -1"]),
            (lambda: self.stub.Lookup(pb.LookupRequest(table="interop_bad", tokens=b"\x01\x02\x03")),
             IA, ["not a whole number of int64 tokens"]),
            (lambda: self.stub.Lookup(pb.LookupRequest(table="interop_bad", tokens=tok,
                                                       dtype=pb.DTYPE_BF16)),
             IA, ["dtype mismatch", "stores f32"]),
            (lambda: self.stub.Lookup(pb.LookupRequest(table="interop_bad", tokens=tok,
                                                       tokens_per_batch=3)),
             IA, ["tokens_per_batch=3"]),
            (lambda: self.stub.Lookup(pb.LookupRequest(table="interop_bad", tokens=tok,
                                                       shard_count=2)),
             IA, ["shard_count=2 does not match the 1-rank group"]),
            (lambda: self.stub.PushGradients(P(table="interop_bad", tokens=tok, gradients=g[:-4])),
             IA, ["gradients hold 124 bytes", "need 128"]),
            (lambda: self.stub.PushGradients(P(table="interop_bad", tokens=tok, gradients=g,
                                               dtype=pb.DTYPE_BF16)),
             IA, ["dtype mismatch"]),
            (lambda: self.stub.PushGradients(P(table="interop_bad", tokens=np.asarray(
                [1, 500], "<i8").tobytes(), gradients=g)), IA, ["token 500"]),
            (lambda: self.create("interop_bad", rows=10, width=8),
             lib.grpc.StatusCode.ALREADY_EXISTS, ["table 'interop_bad' already exists"]),
            (lambda: self.create("w0", rows=10, width=0), IA, ["emb_width=0"]),
            (lambda: self.create("r0", rows=0, width=8), IA, ["rows=0"]),
            (lambda: self.create("huge", rows=1 << 39, width=65536),
             lib.grpc.StatusCode.RESOURCE_EXHAUSTED, ["--max-memory-bytes"]),
            (lambda: self.create("wide", rows=10, width=1 << 20), IA, ["emb_width=1048576"]),
            (lambda: self.create("bad name", rows=10, width=8), IA, ["table name"]),
            (lambda: self.stub.CreateTable(pb.CreateTableRequest()), IA, ["no spec"]),
            (lambda: self.stub.Checkpoint(pb.CheckpointRequest()),
             lib.grpc.StatusCode.FAILED_PRECONDITION, ["--checkpoint-dir"]),
            (lambda: self.stub.ListCheckpoints(pb.ListCheckpointsRequest()),
             lib.grpc.StatusCode.FAILED_PRECONDITION, ["--checkpoint-dir"]),
        ]
        for fn, code, frags in cases:
            self.assertStatus(fn, code, *frags)
        np.testing.assert_array_equal(self.lookup("interop_bad", np.arange(100)), before)
        self.assertNotIn("w0", [t.name for t in self.stub.ListTables(pb.ListTablesRequest()).tables])

    def test_unknown_method_and_malformed_message(self):
        call = self.chan.unary_unary("/embps.v1.EmbeddingService/Frobnicate",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        self.assertStatus(lambda: call(b""), lib.grpc.StatusCode.UNIMPLEMENTED, "Frobnicate")
        call = self.chan.unary_unary("/nope.Service/X", request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        self.assertStatus(lambda: call(b""), lib.grpc.StatusCode.UNIMPLEMENTED)
        raw = self.chan.unary_unary("/embps.v1.EmbeddingService/Lookup",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        self.assertStatus(lambda: raw(b"\xff\xff\xff\xff"), lib.grpc.StatusCode.INVALID_ARGUMENT,
                          "malformed LookupRequest")

    def test_oversized_message(self):
        self.create("interop_big", rows=10, width=8)
        tok = np.ones(2 << 20, "<i8").tobytes()  # 16 MiB > the 8 MiB limit
        self.assertStatus(lambda: self.stub.Lookup(pb.LookupRequest(table="interop_big", tokens=tok)),
                          lib.grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertEqual(self.lookup("interop_big", [1, 2], width=8).shape, (2, 8))

    def test_garbage_and_stalled_connections(self):
        host, port = "127.0.0.1", self.server.port
        g = socket.create_connection((host, port), timeout=5)
        g.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 4)
        g.settimeout(5)
        try:
            while g.recv(4096):
                pass  # the server closes the connection after a protocol error
        except (ConnectionResetError, socket.timeout):
            pass
        g.close()
        stalled = socket.create_connection((host, port), timeout=5)
        stalled.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # preface, then nothing
        # Meanwhile other clients are served.
        self.create("interop_after_garbage", rows=10, width=8)
        self.assertEqual(self.lookup("interop_after_garbage", [1], width=8).shape, (1, 8))
        # The stalled connection is closed by the server after --stall-timeout-ms.
        stalled.settimeout(10)
        t0 = time.time()
        closed = False
        try:
            while time.time() - t0 < 10:
                if not stalled.recv(4096):
                    closed = True
                    break
        except ConnectionResetError:
            closed = True
        stalled.close()
        self.assertTrue(closed, "a stalled connection must be closed")
        self.assertTrue(self.server.alive())


if __name__ == "__main__":
    unittest.main(verbosity=2)
