"""Client authentication with a stock gRPC client (grpcio's standard per-call metadata) against
embps-server started with --auth-tokens-file: no token and an unknown token get UNAUTHENTICATED,
a role below the method's gets PERMISSION_DENIED, each with the message that says which; a
refused call changes nothing; admin reaches everything; health stays open without a token;
SIGHUP rereads the file (and keeps the old tokens when the new file is bad); a bad file stops
the server at startup; the log never holds a token; without the file every call is open."""
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import numpy as np
import grpc

import embps_testlib as lib
from embps_testlib import embps_pb2 as pb, embps_pb2_grpc as pbg
from embps_testlib import health_pb2, health_pb2_grpc

SC = grpc.StatusCode
ADMIN = "admin-token-5f0c2a1e9b7d4c36"
WORKER = "worker-token-8e1d3b7a2c9f4e05"
READER = "reader-token-1a6b9c3d7e2f5a48"
NEW_READER = "reader-token-added-on-sighup-77"
TOKENS = ("# roles of the test clients\nadmin %s\nworker %s  # trainers\nreader %s\n"
          % (ADMIN, WORKER, READER))
MISSING = ("missing authorization metadata: this server requires "
           "'authorization: Bearer TOKEN'")
UNKNOWN = "the bearer token is not known to this server"


def bearer(token):
    return (("authorization", "Bearer " + token),)


class AuthTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="embps-auth-")
        cls.tokens = os.path.join(cls.dir, "tokens")
        with open(cls.tokens, "w") as f:
            f.write(TOKENS)
        cls.ckpt = os.path.join(cls.dir, "ckpt")
        os.mkdir(cls.ckpt)
        cls.server = lib.Server("--device", "cpu", "--auth-tokens-file", cls.tokens,
                                "--checkpoint-dir", cls.ckpt)
        cls.chan = lib.channel(cls.server.address)
        cls.stub = pbg.EmbeddingServiceStub(cls.chan)
        cls.health = health_pb2_grpc.HealthStub(cls.chan)
        cls.server.wait_serving()  # without a token: health is open
        spec = pb.TableSpec(name="t", rows=16, emb_width=4, seed=3,
                            optimizer=pb.OptimizerConfig(kind=pb.OPTIMIZER_SGD, lr=0.5))
        cls.stub.CreateTable(pb.CreateTableRequest(spec=spec), metadata=bearer(ADMIN), timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.chan.close()
        log = cls.server.log_text()
        code = cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)
        assert code == 0, "server exited with %s:\n%s" % (code, log)
        for t in (ADMIN, WORKER, READER, NEW_READER):
            assert t not in log, "the server log holds a token:\n" + log

    def refused(self, fn, request, metadata, code, message):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(request, metadata=metadata, timeout=30)
        self.assertEqual(cm.exception.code(), code)
        self.assertEqual(cm.exception.details(), message)

    def rows(self, tokens):
        req = pb.LookupRequest(table="t", tokens=np.array(tokens, "<i8").tobytes())
        return np.frombuffer(self.stub.Lookup(req, metadata=bearer(READER), timeout=30).rows,
                             "<f4").reshape(len(tokens), 4).copy()

    def push_request(self, tokens, value):
        g = np.full((len(tokens), 4), value, "<f4")
        return pb.PushGradientsRequest(table="t", tokens=np.array(tokens, "<i8").tobytes(),
                                       gradients=g.tobytes())

    def test_no_token_and_unknown_token(self):
        ls = pb.ListTablesRequest()
        self.refused(self.stub.ListTables, ls, None, SC.UNAUTHENTICATED, MISSING)
        self.refused(self.stub.ListTables, ls, bearer("reader-token-1a6b9c3d7e2f5a49"),
                     SC.UNAUTHENTICATED, UNKNOWN)
        self.refused(self.stub.ListTables, ls, bearer(READER[:-1]), SC.UNAUTHENTICATED, UNKNOWN)
        self.refused(self.stub.ListTables, ls, (("authorization", "Basic " + READER),),
                     SC.UNAUTHENTICATED, "the authorization metadata is not 'Bearer TOKEN': "
                     "this server accepts bearer tokens only")
        self.refused(self.stub.ListTables, ls, bearer("x" * 2000), SC.UNAUTHENTICATED,
                     "the authorization metadata is longer than 1024 bytes")
        # an unknown method needs a token too, so it cannot be probed without one
        probe = self.chan.unary_unary("/embps.v1.EmbeddingService/Nope")
        self.refused(probe, b"", None, SC.UNAUTHENTICATED, MISSING)
        with self.assertRaises(grpc.RpcError) as cm:
            probe(b"", metadata=bearer(READER), timeout=30)
        self.assertEqual(cm.exception.code(), SC.UNIMPLEMENTED)
        self.assertTrue(self.server.alive())

    def test_health_is_open(self):
        r = self.health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)
        r = self.health.Check(health_pb2.HealthCheckRequest(), metadata=bearer("bogus-but-long-"
                                                                               "enough-123"),
                              timeout=30)
        self.assertEqual(r.status, health_pb2.HealthCheckResponse.SERVING)

    def test_roles(self):
        before = self.rows([1, 2])
        self.refused(self.stub.PushGradients, self.push_request([1, 2], 1.0), bearer(READER),
                     SC.PERMISSION_DENIED,
                     "role 'reader' may not call PushGradients (needs 'worker')")
        self.refused(self.stub.PushGradients, self.push_request([1, 2], 1.0), None,
                     SC.UNAUTHENTICATED, MISSING)
        np.testing.assert_array_equal(self.rows([1, 2]), before)  # refused: nothing changed
        spec = pb.TableSpec(name="w", rows=8, emb_width=4)
        self.refused(self.stub.CreateTable, pb.CreateTableRequest(spec=spec), bearer(WORKER),
                     SC.PERMISSION_DENIED,
                     "role 'worker' may not call CreateTable (needs 'admin')")
        self.refused(self.stub.Checkpoint, pb.CheckpointRequest(), bearer(WORKER),
                     SC.PERMISSION_DENIED, "role 'worker' may not call Checkpoint (needs 'admin')")
        names = [t.name for t in self.stub.ListTables(pb.ListTablesRequest(),
                                                      metadata=bearer(READER), timeout=30).tables]
        self.assertNotIn("w", names)
        self.stub.GetStats(pb.GetStatsRequest(), metadata=bearer(READER), timeout=30)
        self.stub.ListCheckpoints(pb.ListCheckpointsRequest(), metadata=bearer(READER),
                                  timeout=30)
        # a worker pushes (SGD: w - lr * g exactly) and looks up
        r = self.stub.PushGradients(self.push_request([3], 1.0), metadata=bearer(WORKER),
                                    timeout=30)
        self.assertTrue(r.applied)
        w3 = self.rows([3])
        r = self.stub.PushGradients(self.push_request([3], 1.0), metadata=bearer(WORKER),
                                    timeout=30)
        np.testing.assert_array_equal(self.rows([3]), w3 - np.float32(0.5))

    def test_admin_reaches_everything(self):
        md = bearer(ADMIN)
        spec = pb.TableSpec(name="a", rows=8, emb_width=4)
        self.stub.CreateTable(pb.CreateTableRequest(spec=spec), metadata=md, timeout=30)
        self.stub.PushGradients(pb.PushGradientsRequest(
            table="a", tokens=np.array([1], "<i8").tobytes(),
            gradients=np.ones(4, "<f4").tobytes()), metadata=md, timeout=30)
        self.stub.Lookup(pb.LookupRequest(table="a", tokens=np.array([1], "<i8").tobytes()),
                         metadata=md, timeout=30)
        self.stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=30)
        c = self.stub.Checkpoint(pb.CheckpointRequest(table="a"), metadata=md, timeout=60)
        self.assertGreater(c.round, 0)
        listed = self.stub.ListCheckpoints(pb.ListCheckpointsRequest(), metadata=md, timeout=30)
        self.assertIn(c.path, [x.path for x in listed.checkpoints])

    def test_sighup_rereads_the_file(self):
        ls = pb.ListTablesRequest()
        self.refused(self.stub.ListTables, ls, bearer(NEW_READER), SC.UNAUTHENTICATED, UNKNOWN)
        try:
            with open(self.tokens, "w") as f:
                f.write(TOKENS + "reader %s\n" % NEW_READER)
            os.kill(self.server.proc.pid, signal.SIGHUP)
            deadline = time.time() + 20
            while "client auth: reloaded" not in self.server.log_text():
                self.assertLess(time.time(), deadline, self.server.log_text())
                time.sleep(0.02)
            self.stub.ListTables(ls, metadata=bearer(NEW_READER), timeout=30)
            # a file that no longer parses keeps the tokens in force
            with open(self.tokens, "w") as f:
                f.write("superuser %s\n" % NEW_READER)
            os.kill(self.server.proc.pid, signal.SIGHUP)
            while "the tokens loaded before stay in force" not in self.server.log_text():
                self.assertLess(time.time(), deadline, self.server.log_text())
                time.sleep(0.02)
            self.stub.ListTables(ls, metadata=bearer(NEW_READER), timeout=30)
            self.assertTrue(self.server.alive())
        finally:
            with open(self.tokens, "w") as f:
                f.write(TOKENS)


class StartupTest(unittest.TestCase):
    def start(self, text):
        with tempfile.NamedTemporaryFile("w", prefix="embps-tokens-", delete=False) as f:
            if text is not None:
                f.write(text)
        if text is None:
            os.unlink(f.name)
        try:
            return subprocess.run([lib.server_binary(), "--listen", "127.0.0.1:0", "--device",
                                   "cpu", "--auth-tokens-file", f.name],
                                  capture_output=True, text=True, timeout=60)
        finally:
            if text is not None:
                os.unlink(f.name)

    def test_bad_files_stop_the_server(self):
        for text, want in ((None, "No such file or directory"),
                           ("", "holds no tokens"),
                           ("# nothing\n", "holds no tokens"),
                           ("root " + ADMIN + "\n", "line 1: unknown role 'root'"),
                           (ADMIN + " admin\n", "line 1: the first word is not a role"),
                           ("admin short\n", "line 1: the token is 5 characters")):
            r = self.start(text)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("embps-server: --auth-tokens-file: ", r.stderr)
            self.assertIn(want, r.stderr)
            self.assertNotIn(ADMIN, r.stderr)

    def test_without_the_file_everything_is_open(self):
        server = lib.Server("--device", "cpu")
        try:
            self.assertIn("client auth is off", server.log_text())
            server.wait_serving()
            with lib.channel(server.address) as ch:
                stub = pbg.EmbeddingServiceStub(ch)
                stub.CreateTable(pb.CreateTableRequest(spec=pb.TableSpec(
                    name="open", rows=4, emb_width=2)), timeout=30)
                stub.ListTables(pb.ListTablesRequest(), metadata=bearer("anything-at-all-1234"),
                                timeout=30)
        finally:
            self.assertEqual(server.close(), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
