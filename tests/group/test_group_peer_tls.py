"""TLS between ranks (--peer-tls-cert, --peer-tls-key, --peer-tls-ca; issue 12).

A throwaway CA, a second CA the group does not trust, and rank certificates (DNS:localhost,
IP:127.0.0.1, for both TLS roles) are made with the openssl CLI into a temporary folder. Then:
2- and 3-rank groups with peer TLS run lookups and pushes whose results are bitwise those of a
single server, and every rank logs one TLS handshake per peer connection (so a build that
silently talks cleartext fails); a rank whose certificate another CA signed is refused at
bootstrap and both ranks say why; a rank with peer TLS facing one without fails at once with a
message naming the peer, whichever of the two connects; a certificate that does not name the
peer host is refused; half the options, or an unreadable file, stop the server at startup.
That the bytes on the wire are ciphertext is tests/unit/group/test_peer_tls.c's check.

Needs /usr/bin/python3 with grpcio and numpy, and the openssl CLI (skips with 77 without it)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

if not shutil.which("openssl"):
    print("SKIP: the openssl command-line tool is not installed (deploy/packages.sh installs it)")
    sys.exit(77)

import numpy as np  # noqa: E402

import grouplib as gl  # noqa: E402

ROWS, WIDTH = 66, 12  # rows, tokens (12) and columns shard over 2 and 3 ranks
BOOT_MS = "6000"  # bootstrap timeout of the groups that must fail (bounds each test)


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=60)


def make_pki(d):
    """CAs ca and other; rank (signed by ca), rogue (signed by other), and elsewhere (signed by
    ca, naming another host)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "other"):
        openssl("req", "-x509", *ec, "-keyout", ca + ".key", "-out", ca + ".crt", "-days", "2",
                "-subj", "/CN=embps peer test " + ca, cwd=d)
    both = "extendedKeyUsage=serverAuth,clientAuth\n"
    certs = {"rank": ("ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\n" + both),
             "rogue": ("other", "subjectAltName=DNS:localhost,IP:127.0.0.1\n" + both),
             "elsewhere": ("ca", "subjectAltName=DNS:rank.example,IP:10.1.2.3\n" + both)}
    for name, (ca, ext) in certs.items():
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext)
        openssl("req", *ec, "-keyout", name + ".key", "-out", name + ".csr", "-subj",
                "/CN=embps-" + name, cwd=d)
        openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".crt", "-CAkey", ca + ".key",
                "-CAcreateserial", "-out", name + ".crt", "-days", "2", "-extfile", name + ".ext",
                cwd=d)


def workload(client, out):
    """Creates a table and runs lookups and pushes; out["seen"] collects every result."""
    rng = np.random.default_rng(3)
    client.create("t", ROWS, WIDTH, opt="adagrad")
    seen = []
    for step in range(6):
        tokens = rng.integers(0, ROWS, size=12)
        seen.append(client.lookup_bytes("t", tokens))
        grads = rng.standard_normal((12, WIDTH)).astype(np.float32)
        client.push("t", tokens, grads)
    seen.append(client.lookup_bytes("t", np.arange(ROWS)))
    out["seen"] = seen


class PeerTlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="embps-peertls-")
        make_pki(cls.dir.name)
        cls.reference = gl.run_on_group(1, workload)["seen"]

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def setUp(self):
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            p.cleanup()

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def tls_flags(self, cert="rank", ca="ca"):
        return ["--peer-tls-cert", self.path(cert + ".crt"), "--peer-tls-key",
                self.path(cert + ".key"), "--peer-tls-ca", self.path(ca + ".crt")]

    def start(self, rank, ports, offset, *flags):
        addrs = ",".join("127.0.0.1:%d" % p for p in ports)
        p = gl.Proc(["--rank", str(rank), "--peers", addrs, "--peer-port-offset", str(offset),
                     "--bootstrap-timeout-ms", BOOT_MS, *flags])
        self.procs.append(p)
        return p

    def check_group(self, n):
        out = gl.run_on_group(n, workload, "--log-level", "debug", *self.tls_flags())
        self.assertEqual(out["exit_codes"], {r: 0 for r in range(n)}, out["logs"])
        self.assertEqual(len(out["seen"]), len(self.reference))
        for got, want in zip(out["seen"], self.reference):
            self.assertEqual(got, want, "a %d-rank group with peer TLS differs from one server" % n)
        # Every rank ran a TLS handshake on each of its 2 (control, data) connections per peer.
        for r, log in enumerate(re.split(r"---- rank \d+ \(pid \d+\) ----\n", out["logs"])[1:]):
            shakes = re.findall(r"rank %d: peer TLS with .*: TLSv1\.[23]" % r, log)
            self.assertEqual(len(shakes), 2 * (n - 1), log)

    def test_two_ranks_match_one_server(self):
        self.check_group(2)

    def test_three_ranks_match_one_server(self):
        self.check_group(3)

    def failed(self, p, *patterns):
        self.assertIsNotNone(p.wait(30), p.text())
        self.assertNotEqual(p.proc.returncode, 0, p.text())
        for pat in patterns:
            self.assertRegex(p.text(), pat)

    def test_certificate_from_another_ca_refused(self):
        ports, offset = gl.pick_ports(2)
        rank0 = self.start(0, ports, offset, *self.tls_flags())
        rank1 = self.start(1, ports, offset, *self.tls_flags(cert="rogue"))
        # The rogue rank fails at once, naming rank 0 and what it refused...
        self.failed(rank1, r"rank 0 at 127\.0\.0\.1:\d+ refused this rank's TLS certificate")
        # ...and rank 0, which logged why, fails with it when its bootstrap deadline passes.
        self.failed(rank0, r"a peer at 127\.0\.0\.1:\d+ presented a TLS certificate this rank "
                           r"does not accept")
        self.assertNotIn("the group is up", rank0.text() + rank1.text())

    def test_tls_rank_facing_cleartext_rank(self):
        for tls_rank in (0, 1):  # the TLS one accepts, then the TLS one connects
            with self.subTest(tls_rank=tls_rank):
                ports, offset = gl.pick_ports(2)
                flags = {tls_rank: self.tls_flags(), 1 - tls_rank: []}
                rank0 = self.start(0, ports, offset, *flags[0])
                rank1 = self.start(1, ports, offset, *flags[1])
                # The connecting rank fails at once: well before the bootstrap deadline.
                self.assertIsNotNone(rank1.wait(float(BOOT_MS) / 2000), rank1.text())
                if tls_rank == 0:
                    self.failed(rank1, r"rank 0 refused rank 1: rank 0 requires TLS on peer "
                                       r"connections and rank 1 connected in cleartext")
                    self.failed(rank0, r"rank 1 at 127\.0\.0\.1:\d+ connected in cleartext, but "
                                       r"this rank requires peer TLS")
                else:
                    self.failed(rank1, r"rank 0 at 127\.0\.0\.1:\d+ does not speak TLS on its "
                                       r"peer port")
                    self.failed(rank0, r"a peer at 127\.0\.0\.1:\d+ opened a TLS connection, but "
                                       r"rank 0 is started without peer TLS")

    def test_certificate_naming_another_host_refused(self):
        for bad_rank in (0, 1):  # checked by the connector, then by the acceptor
            with self.subTest(bad_rank=bad_rank):
                ports, offset = gl.pick_ports(2)
                flags = {bad_rank: self.tls_flags(cert="elsewhere"), 1 - bad_rank:
                         self.tls_flags()}
                rank0 = self.start(0, ports, offset, *flags[0])
                rank1 = self.start(1, ports, offset, *flags[1])
                # Both ranks dial each other (control and data links), so which one checks the
                # certificate first depends on timing (under ASan rank 0's dial came first and
                # rank 1 saw only the closed connection): the reason must be in one of the logs.
                self.failed(rank1)
                self.failed(rank0)
                self.assertRegex(rank0.text() + rank1.text(),
                                 r"IP address mismatch|does not name its peer host '127\.0\.0\.1'")

    def test_bad_options_stop_the_server(self):
        cases = [
            (["--peer-tls-cert", self.path("rank.crt")], "go together"),
            (["--peer-tls-cert", self.path("rank.crt"), "--peer-tls-key", self.path("rank.key"),
              "--peer-tls-ca", self.path("nope.crt")], "--peer-tls-ca .*nope.crt: cannot read it"),
            (["--peer-tls-cert", self.path("rank.crt"), "--peer-tls-key", self.path("rogue.key"),
              "--peer-tls-ca", self.path("ca.crt")], "--peer-tls-key .* does not match"),
        ]
        for flags, why in cases:
            port = gl.free_ephemeral_port()
            p = gl.Proc(["--listen", "127.0.0.1:%d" % port, *flags])
            self.procs.append(p)
            self.assertEqual(p.wait(20), 2, p.text())
            self.assertRegex(p.text(), why)
            self.assertNotIn("listening on", p.text())

    def test_bad_files_stop_a_rank_before_its_group_forms(self):
        """Every file a flag names is read before the group starts forming: a rank given one that
        is unusable exits 2 within seconds, naming the flag and the file, without a step of
        bootstrap, and the rank waiting for it never sees a group formed."""
        junk = self.path("junk.pem")
        with open(junk, "w") as f:
            f.write("this is not a PEM file, nor a token list\n" * 2)
        crt, key, ca = self.path("rank.crt"), self.path("rank.key"), self.path("ca.crt")
        cases = [
            (["--tls-cert", crt, "--tls-key", junk], "--tls-key %s: not a PEM private key" % junk),
            (["--tls-cert", junk, "--tls-key", key], "--tls-cert %s: not a PEM certificate" % junk),
            (["--tls-cert", crt, "--tls-key", key, "--tls-client-ca", junk],
             "--tls-client-ca %s: no PEM CA certificate" % junk),
            (["--peer-tls-cert", crt, "--peer-tls-key", junk, "--peer-tls-ca", ca],
             "--peer-tls-key %s" % junk),
            (["--peer-tls-cert", crt, "--peer-tls-key", key, "--peer-tls-ca", junk],
             "--peer-tls-ca %s" % junk),
            (["--auth-tokens-file", junk], "--auth-tokens-file"),
            (["--group-secret-file", self.path("missing")], "--group-secret-file"),
        ]
        ports, offset = gl.pick_ports(2)
        addrs = ",".join("127.0.0.1:%d" % p for p in ports)
        rank0 = gl.Proc(["--rank", "0", "--peers", addrs, "--peer-port-offset", str(offset),
                         "--bootstrap-timeout-ms", "120000", "--log-level", "debug"])
        self.procs.append(rank0)
        self.assertTrue(gl.wait_for(lambda: "listening for peers" in rank0.text()
                                    or not rank0.alive(), 30), rank0.text())
        for flags, why in cases:
            started = time.monotonic()
            rank1 = gl.Proc(["--rank", "1", "--peers", addrs, "--peer-port-offset", str(offset),
                             "--bootstrap-timeout-ms", "120000", *flags])
            self.procs.append(rank1)
            self.assertEqual(rank1.wait(20), 2, rank1.text())
            self.assertLess(time.monotonic() - started, 10, rank1.text())
            self.assertIn(why, rank1.text(), flags)
            self.assertNotIn("listening for peers", rank1.text(), flags)
        self.assertTrue(rank0.alive(), rank0.text())
        self.assertNotEqual(gl.health("127.0.0.1:%d" % ports[0]), gl.SERVING)
        # Rank 0 logs each rank that joins (debug) and the group once up: neither happened.
        self.assertNotRegex(rank0.text(), r"rank 1 joined|the group is up|the group is ready")
        self.assertEqual(rank0.stop(), 0, rank0.text())


if __name__ == "__main__":
    unittest.main(verbosity=2)
