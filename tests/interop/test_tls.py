"""TLS between clients and embps-server (issue 12): grpcio's ssl_channel_credentials, the C CLI
with --tls-ca, the Python library with tls_ca=, mutual TLS, and every way of getting it wrong.

A throwaway CA, a second CA nobody trusts, a server certificate (DNS:localhost, IP:127.0.0.1),
a client certificate from each CA, and a mismatched key are made with the openssl CLI into a
temporary folder that is removed at the end. Three servers run on free loopback ports: TLS,
mutual TLS and cleartext. After every refused client the test checks that the server still
serves a good one and logged the refusal with the client's address.

Needs /usr/bin/python3 with grpcio and numpy, and the openssl CLI (skips with 77 without it).
Environment: EMBPS_SERVER_BIN, EMBPS_CLI_BIN."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

if not shutil.which("openssl"):
    print("SKIP: the openssl command-line tool is not installed (deploy/packages.sh installs it)")
    sys.exit(77)

import embps_testlib as lib  # noqa: E402
from embps_testlib import embps_pb2 as pb, embps_pb2_grpc as pbg  # noqa: E402
from embps_testlib import health_pb2, health_pb2_grpc  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLI = os.environ.get("EMBPS_CLI_BIN", os.path.join(ROOT, "build", "bin", "embps"))
WIDTH = 128


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=60)


def make_pki(d):
    """CA ca, CA other, server (signed by ca), client (ca), rogue client (other), and wrong.key."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "other"):
        openssl("req", "-x509", *ec, "-keyout", ca + ".key", "-out", ca + ".crt", "-days", "2",
                "-subj", "/CN=embps test " + ca, cwd=d)
    exts = {"server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            "client": "extendedKeyUsage=clientAuth\n", "rogue": "extendedKeyUsage=clientAuth\n"}
    for name, ext in exts.items():
        ca = "other" if name == "rogue" else "ca"
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext)
        openssl("req", *ec, "-keyout", name + ".key", "-out", name + ".csr", "-subj",
                "/CN=" + ("localhost" if name == "server" else "worker-" + name), cwd=d)
        openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".crt", "-CAkey", ca + ".key",
                "-CAcreateserial", "-out", name + ".crt", "-days", "2", "-extfile", name + ".ext",
                cwd=d)
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
            "wrong.key", cwd=d)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def wait_for(pred, seconds=10.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="embps-tls-")
        make_pki(cls.dir)
        p = cls.path
        cls.tls = lib.Server("--tls-cert", p("server.crt"), "--tls-key", p("server.key"),
                             "--stall-timeout-ms", "2000")
        cls.mtls = lib.Server("--tls-cert", p("server.crt"), "--tls-key", p("server.key"),
                              "--tls-client-ca", p("ca.crt"))
        cls.clear = lib.Server()
        cls.batch_id = 0

    @classmethod
    def tearDownClass(cls):
        try:
            for s in (cls.tls, cls.mtls, cls.clear):
                rc = s.close()
                assert rc == 0, "server exited with %s" % rc
        finally:
            shutil.rmtree(cls.dir)

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    # ---- helpers ----------------------------------------------------------------------------

    def secure(self, server, ca="ca.crt", cert=None, key=None, name=None):
        creds = grpc.ssl_channel_credentials(
            read(self.path(ca)), read(self.path(key)) if key else None,
            read(self.path(cert)) if cert else None)
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        if name:
            opts.append(("grpc.ssl_target_name_override", name))
        return grpc.secure_channel(server.address, creds, options=opts)

    def health(self, chan, timeout=10):
        return health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=timeout).status

    def assertServes(self, server, **kw):
        """The server is alive and a good client gets SERVING from it."""
        self.assertTrue(server.alive(), server.log_text())
        with (self.secure(server, **kw) if server is not self.clear
              else lib.channel(server.address)) as ch:
            self.assertEqual(self.health(ch), health_pb2.HealthCheckResponse.SERVING)

    def assertRefused(self, chan):
        with self.assertRaises(grpc.RpcError) as cm:
            self.health(chan, timeout=5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNAVAILABLE,
                         cm.exception.details())

    def assertLogged(self, server, *fragments):
        self.assertTrue(wait_for(lambda: all(f in server.log_text() for f in fragments)),
                        "%r not in the log:\n%s" % (fragments, server.log_text()))

    def cli(self, server, *args, env=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("EMBPS_")}
        e.update(env or {})
        return subprocess.run([CLI, "--servers", server.address, "--connect-timeout-ms", "5000",
                               *args], capture_output=True, text=True, timeout=60, env=e)

    def create(self, stub, name, rows=5000):
        spec = pb.TableSpec(name=name, rows=rows, emb_width=WIDTH, seed=11,
                            optimizer=pb.OptimizerConfig(kind=pb.OPTIMIZER_SGD, lr=0.5))
        stub.CreateTable(pb.CreateTableRequest(spec=spec), timeout=20)

    def lookup(self, stub, name, tokens):
        TlsTest.batch_id += 1
        tok = np.asarray(tokens, dtype="<i8")
        resp = stub.Lookup(pb.LookupRequest(table=name, batch_id=self.batch_id, shard_index=0,
                                            shard_count=1, tokens_per_batch=len(tok),
                                            tokens=tok.tobytes()), timeout=20)
        return np.frombuffer(resp.rows, dtype="<f4").reshape(len(tok), WIDTH)

    def push(self, stub, name, tokens, grads):
        TlsTest.batch_id += 1
        tok = np.asarray(tokens, dtype="<i8")
        return stub.PushGradients(pb.PushGradientsRequest(
            table=name, batch_id=self.batch_id, shard_index=0, shard_count=1,
            tokens_per_batch=len(tok), tokens=tok.tobytes(), dtype=pb.DTYPE_F32,
            gradients=np.asarray(grads, dtype="<f4").tobytes(), mode=pb.UPDATE_MODE_SYNC),
            timeout=20)

    # ---- grpcio ------------------------------------------------------------------------------

    def test_grpcio_create_lookup_push(self):
        """grpcio's stock TLS channel: create, a 4096-token lookup (2 MiB of rows, many TLS
        records) equal byte for byte to the same table's rows over cleartext, and a push whose
        effect the next lookup sees."""
        rng = np.random.default_rng(5)
        tokens = rng.integers(0, 5000, size=4096)
        with self.secure(self.tls) as ch, lib.channel(self.clear.address) as cch:
            stub, cstub = pbg.EmbeddingServiceStub(ch), pbg.EmbeddingServiceStub(cch)
            self.create(stub, "grpcio")
            self.create(cstub, "grpcio")
            rows = self.lookup(stub, "grpcio", tokens)
            np.testing.assert_array_equal(rows, self.lookup(cstub, "grpcio", tokens))
            self.assertTrue(np.any(rows != 0))
            g = np.ones((2, WIDTH), dtype=np.float32)
            r = self.push(stub, "grpcio", [3, 4], g)
            self.assertTrue(r.applied)
            after = self.lookup(stub, "grpcio", [3, 4])
            before = self.lookup(cstub, "grpcio", [3, 4])
            np.testing.assert_allclose(after, before - 0.5 * g, rtol=0, atol=1e-6)

    def test_grpcio_wrong_ca_is_refused(self):
        with self.secure(self.tls, ca="other.crt") as ch:
            self.assertRefused(ch)
        self.assertLogged(self.tls, "TLS handshake failed", "closing connection from 127.0.0.1:")
        self.assertServes(self.tls)

    def test_grpcio_name_override(self):
        """The certificate names localhost and 127.0.0.1; another name must not verify."""
        with self.secure(self.tls, name="not-the-server.example") as ch:
            self.assertRefused(ch)
        with self.secure(self.tls, name="localhost") as ch:
            self.assertEqual(self.health(ch), health_pb2.HealthCheckResponse.SERVING)

    # ---- mutual TLS ---------------------------------------------------------------------------

    def test_mtls_needs_a_client_certificate(self):
        with self.secure(self.mtls) as ch:
            self.assertRefused(ch)
        self.assertLogged(self.mtls, "peer did not return a certificate")
        with self.secure(self.mtls, cert="rogue.crt", key="rogue.key") as ch:
            self.assertRefused(ch)
        with self.secure(self.mtls, cert="client.crt", key="client.key") as ch:
            self.assertEqual(self.health(ch), health_pb2.HealthCheckResponse.SERVING)

    def test_mtls_cli(self):
        r = self.cli(self.mtls, "--tls-ca", self.path("ca.crt"), "health")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("UNAVAILABLE", r.stderr)
        r = self.cli(self.mtls, "--tls-ca", self.path("ca.crt"), "--tls-cert",
                     self.path("client.crt"), "--tls-key", self.path("client.key"), "health")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("SERVING", r.stdout)
        # The environment variables the CLI documents do the same.
        r = self.cli(self.mtls, "health", env={"EMBPS_TLS_CA": self.path("ca.crt"),
                                               "EMBPS_TLS_CLIENT_CERT": self.path("client.crt"),
                                               "EMBPS_TLS_CLIENT_KEY": self.path("client.key")})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    # ---- the C CLI ------------------------------------------------------------------------------

    def test_cli_health_and_bench(self):
        ca = self.path("ca.crt")
        r = self.cli(self.tls, "--tls-ca", ca, "health")
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "SERVING"), r.stderr)
        r = self.cli(self.tls, "health", env={"EMBPS_TLS_CA": ca})
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.cli(self.tls, "--tls-ca", ca, "create-table", "clibench", "--rows", "100000",
                     "--emb-width", str(WIDTH))
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.cli(self.tls, "--tls-ca", ca, "bench", "clibench", "--batch", "512",
                     "--duration", "1", "--warmup", "0", "--push-ratio", "0.5", "--pipeline", "2",
                     "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        res = json.loads(r.stdout)
        self.assertGreater(res["lookups"], 0, r.stdout)
        self.assertGreater(res["pushes"], 0, r.stdout)

    def test_cli_wrong_ca_and_wrong_name(self):
        r = self.cli(self.tls, "--tls-ca", self.path("other.crt"), "health")
        self.assertEqual(r.returncode, 1)
        self.assertIn("server certificate refused", r.stderr)
        r = self.cli(self.tls, "--tls-ca", self.path("ca.crt"), "--tls-server-name",
                     "not-the-server.example", "health")
        self.assertEqual(r.returncode, 1)
        self.assertIn("hostname mismatch", r.stderr)
        r = self.cli(self.tls, "--tls-ca", self.path("ca.crt"), "--tls-server-name", "localhost",
                     "health")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.cli(self.tls, "--tls-ca", self.path("missing.crt"), "health")
        self.assertEqual(r.returncode, 1)
        self.assertIn("missing.crt: cannot read it", r.stderr)
        self.assertServes(self.tls)

    def test_cleartext_client_against_tls(self):
        r = self.cli(self.tls, "health")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("UNAVAILABLE", r.stderr)
        with lib.channel(self.tls.address) as ch:
            self.assertRefused(ch)
        self.assertLogged(self.tls, "TLS handshake failed")
        self.assertServes(self.tls)

    def test_tls_client_against_cleartext(self):
        r = self.cli(self.clear, "--tls-ca", self.path("ca.crt"), "health")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("TLS handshake with %s" % self.clear.address, r.stderr)
        with self.secure(self.clear) as ch:
            self.assertRefused(ch)
        self.assertServes(self.clear)

    def test_alpn_must_be_h2(self):
        """A TLS client that offers only http/1.1 gets no_application_protocol; h2 is chosen
        when offered."""
        def s_client(alpn):
            return subprocess.run(
                ["openssl", "s_client", "-connect", self.tls.address, "-CAfile",
                 self.path("ca.crt"), "-alpn", alpn], stdin=subprocess.DEVNULL,
                capture_output=True, encoding="utf-8", errors="replace", timeout=30)
        r = s_client("http/1.1")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn("no application protocol", r.stdout + r.stderr)
        r = s_client("h2")
        self.assertIn("ALPN protocol: h2", r.stdout)
        self.assertRegex(r.stdout, r"TLSv1\.3")
        self.assertServes(self.tls)

    # ---- the Python library ------------------------------------------------------------------

    def test_python_library(self):
        code = r"""
import sys, numpy as np, embps
addr, ca, other = sys.argv[1:4]
with embps.Client(addr, tls_ca=ca) as c:
    c.create_table("pylib", rows=1000, emb_width=%d, optimizer="sgd", lr=0.5)
    t = np.arange(1, 9, dtype=np.int64)
    a = c.lookup("pylib", t)
    c.push("pylib", t, np.ones((8, %d), dtype=np.float32))
    b = c.lookup("pylib", t)
    assert np.allclose(b, a - 0.5, atol=1e-6), (a, b)
try:
    embps.Client(addr, tls_ca=other, connect_timeout=5)
    print("connected with the wrong CA")
    sys.exit(1)
except embps.Error as e:
    assert e.code.name == "UNAVAILABLE", e
print("ok")
""" % (WIDTH, WIDTH)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        r = subprocess.run(["/usr/bin/python3", "-c", code, self.tls.address,
                            self.path("ca.crt"), self.path("other.crt")], capture_output=True,
                           text=True, timeout=120, env=env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("ok", r.stdout)

    # ---- startup ------------------------------------------------------------------------------

    def test_startup_refuses_bad_files(self):
        p = self.path
        cases = [
            (["--tls-cert", p("server.crt")], "--tls-cert and --tls-key go together"),
            (["--tls-key", p("server.key")], "--tls-cert and --tls-key go together"),
            (["--tls-client-ca", p("ca.crt")], "--tls-client-ca needs --tls-cert"),
            (["--tls-cert", p("nothing.crt"), "--tls-key", p("server.key")],
             "--tls-cert %s: cannot read it: No such file or directory" % p("nothing.crt")),
            (["--tls-cert", p("server.crt"), "--tls-key", p("wrong.key")],
             "--tls-key %s does not match the certificate" % p("wrong.key")),
            (["--tls-cert", p("server.ext"), "--tls-key", p("server.key")],
             "not a PEM certificate chain"),
            (["--tls-cert", p("server.crt"), "--tls-key", p("server.key"), "--tls-client-ca",
              p("server.ext")], "--tls-client-ca %s: no PEM CA certificate" % p("server.ext")),
        ]
        for flags, message in cases:
            r = subprocess.run([lib.server_binary(), "--listen", "127.0.0.1:0", *flags],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, (flags, r.stderr))
            self.assertIn(message, r.stderr, flags)
            self.assertNotIn("listening on", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
