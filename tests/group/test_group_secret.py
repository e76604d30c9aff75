"""The group secret (--group-secret-file): ranks prove to each other at bootstrap that they hold
it, by challenge-response over the peer port.

An impostor that speaks the hello exactly as a rank does, with the configuration a rank would
present (version and mesh are public in GetStats, the rest is the command line), is refused
before it counts as rank 1: rank 0 logs that rank 1 at its address failed the group secret
check, never reports SERVING, and still forms the group with the real rank 1 that comes later.
A rank with another secret is refused, and both ranks say why. Unusable secret files stop the
server before it listens; a file others may read, and a group without a secret, get a warning.
"""
import os
import re
import socket
import struct
import tempfile
import time
import unittest

import grouplib as gl
from grouplib import pb

TIMEOUT = 10.0  # bound on every socket wait of the impostor


def control_version():
    """The control protocol's version, as the server declares it (server/group/control.h)."""
    with open(os.path.join(gl.lib.ROOT, "server", "group", "control.h")) as f:
        m = re.search(r"#define EMBPS__CONTROL_VERSION (\d+)", f.read())
    assert m, "server/group/control.h declares no EMBPS__CONTROL_VERSION"
    return int(m.group(1))


CONTROL_VERSION = control_version()


def write_secret(directory, name, data, mode=0o600):
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return path


def control_fanout():
    """The control relays' fanout a 2-rank server resolves (--control-fanout, which the servers
    here read from EMBPS_CONTROL_FANOUT when set): auto is none below 16 ranks, 0 and 1 none."""
    flag = os.environ.get("EMBPS_CONTROL_FANOUT", "auto")
    return 0 if flag in ("", "auto") or int(flag) < 2 else int(flag)


def identity(peers, mesh, version, secret=True):
    """The configuration a rank presents in its hello (server/main.c builds the same lines)."""
    return ("version=%s\ncontrol=%d\nmesh=%s\ntable_axis=shard\ndata_axis=shard\npeers=%s\n"
            "control_fanout=%d\ngroup_secret=%s\ncheckpoints=off\nincremental=0\nrestore=0\n" %
            (version, CONTROL_VERSION, mesh, peers, control_fanout(),
             "hmac-sha256" if secret else "none")).encode()


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed after %d of %d bytes" % (len(out), n))
        out += chunk
    return out


def impostor(peer_port, ident, rank=1, size=2, kind=0):
    """Joins as `rank` with today's hello and a made-up answer to any challenge. Returns what
    the acceptor answered: [(verdict byte, message bytes), ...]."""
    answers = []
    with socket.create_connection(("127.0.0.1", peer_port), timeout=TIMEOUT) as s:
        s.settimeout(TIMEOUT)
        s.sendall(b"EMBPS1" + struct.pack("<BIII", kind, rank, size, len(ident)) + ident)
        for _ in range(2):  # the answer to the hello, then the one to the forged proof
            verdict, length = struct.unpack("<BH", recv_exact(s, 3))
            answers.append((verdict, recv_exact(s, length)))
            if verdict != 2:  # not a challenge: nothing more to say
                break
            s.sendall(os.urandom(64))  # a nonce and a proof without the secret
    return answers


class SecretTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="embps-secret-")
        self.addCleanup(self.dir.cleanup)
        self.procs = []
        self.secret = write_secret(self.dir.name, "secret", os.urandom(24).hex().encode() + b"\n")

    def tearDown(self):
        for p in self.procs:
            p.cleanup()

    def start(self, rank, ports, offset, *flags):
        addrs = ",".join("127.0.0.1:%d" % p for p in ports)
        p = gl.Proc(["--rank", str(rank), "--peers", addrs, "--peer-port-offset", str(offset),
                     *flags])
        self.procs.append(p)
        return p

    def wait_listening(self, p, port):
        self.assertTrue(gl.wait_for(lambda: "listening on 127.0.0.1:%d" % port in p.text()
                                    or not p.alive(), 30), p.text())
        self.assertTrue(p.alive(), p.text())

    def test_relayed_group_with_secret(self):
        # Control relays (--control-fanout 2 on 4 ranks: rank 2's control frames go through rank
        # 1) keep the bootstrap's connection between 1 and 2, authenticated like every other.
        group = gl.Group(4, "--group-secret-file", self.secret, "--control-fanout", "2")
        try:
            client = gl.RawClient(group.addresses)
            client.create("t", 16, 8)
            self.assertEqual(client.lookup("t", [1, 2, 3, 4], 8).shape, (4, 8))
            client.close()
        finally:
            codes = group.close()
        self.assertEqual(codes, {r: 0 for r in range(4)}, group.last_logs)
        self.assertIn("rank 2: control frames go to rank 1", group.last_logs)
        self.assertNotIn("ERROR", group.last_logs)

    def test_impostor_refused(self):
        ports, offset = gl.pick_ports(2)
        addr0 = "127.0.0.1:%d" % ports[0]
        rank0 = self.start(0, ports, offset, "--group-secret-file", self.secret)
        self.wait_listening(rank0, ports[0])
        stats = gl.RawClient([addr0]).stubs[0].GetStats(pb.GetStatsRequest(), timeout=10)
        ident = identity(",".join("127.0.0.1:%d" % p for p in ports), stats.mesh, stats.version)
        for kind in (0, 1):  # both connections a rank makes: control and data
            answers = gl.wait_for(lambda: self._try(impostor, ports[0] + offset, ident,
                                                    kind=kind), 20, 0.1)
            self.assertTrue(answers, rank0.text())
            self.assertNotEqual(answers[0][0], 0, "the impostor was accepted at once")
            self.assertEqual([a[0] for a in answers], [2, 1], answers)
            self.assertRegex(answers[1][1].decode(),
                             r"rank 1 at 127\.0\.0\.1:\d+ failed the group secret check")
        self.assertRegex(rank0.text(), r"rank 1 at 127\.0\.0\.1:\d+ failed the group secret check")
        # Rank 0 never serves with the impostor...
        self.assertFalse(gl.wait_for(lambda: gl.health(addr0) == gl.SERVING, 1.5, 0.1))
        self.assertTrue(rank0.alive(), rank0.text())
        # ...and still forms the group with the real rank 1.
        rank1 = self.start(1, ports, offset, "--group-secret-file", self.secret)
        for a, p in ((addr0, rank0), ("127.0.0.1:%d" % ports[1], rank1)):
            self.assertTrue(gl.wait_for(lambda: gl.health(a) == gl.SERVING, 30, 0.05),
                            rank0.text() + rank1.text())
        client = gl.RawClient([addr0, "127.0.0.1:%d" % ports[1]])
        client.create("t", 16, 4)
        self.assertEqual(client.lookup("t", [1, 2], 4).shape, (2, 4))
        client.close()
        for p in (rank0, rank1):
            self.assertEqual(p.stop(), 0, p.text())

    @staticmethod
    def _try(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except OSError:
            return None  # not listening yet

    def test_wrong_secret(self):
        other = write_secret(self.dir.name, "other", b"another secret of 32 bytes......")
        ports, offset = gl.pick_ports(2)
        rank0 = self.start(0, ports, offset, "--group-secret-file", self.secret,
                           "--bootstrap-timeout-ms", "4000")
        rank1 = self.start(1, ports, offset, "--group-secret-file", other,
                           "--bootstrap-timeout-ms", "4000")
        self.assertIsNotNone(rank1.wait(20), rank1.text())
        self.assertNotEqual(rank1.proc.returncode, 0, rank1.text())
        pat = r"rank 1 at 127\.0\.0\.1:\d+ failed the group secret check"
        self.assertRegex(rank1.text(), pat)
        self.assertTrue(gl.wait_for(lambda: "failed the group secret check" in rank0.text(), 10),
                        rank0.text())
        self.assertRegex(rank0.text(), pat)
        self.assertNotEqual(gl.health("127.0.0.1:%d" % ports[0]), gl.SERVING)
        self.assertIsNotNone(rank0.wait(20), rank0.text())
        self.assertNotEqual(rank0.proc.returncode, 0, rank0.text())

    def test_secret_on_one_rank_only(self):
        """A rank without the secret is refused, and both ranks say so in the README's words
        ("rank 1 at HOST:PORT failed the group secret check"), whichever of the two has it."""
        for with_secret, has, other, there, here in (
                (0, "no", "one", "none", "hmac-sha256"), (1, "a", "none", "hmac-sha256", "none")):
            ports, offset = gl.pick_ports(2)
            ranks = [self.start(r, ports, offset, "--bootstrap-timeout-ms", "3000",
                                *(["--group-secret-file", self.secret] if r == with_secret
                                  else [])) for r in (0, 1)]
            for p in ranks:
                self.assertIsNotNone(p.wait(20), p.text())
                self.assertNotEqual(p.proc.returncode, 0, p.text())
                self.assertRegex(p.text(), r"rank 1 at 127\.0\.0\.1:\d+ failed the group secret "
                                           r"check: it has %s group secret and rank 0 has %s "
                                           r"\(group_secret is '%s' there and '%s' here\); start "
                                           r"every rank with the same --group-secret-file"
                                 % (has, other, there, here))
                self.assertNotIn("configuration differs", p.text())
            self.assertIn("no --group-secret-file: any process that reaches",
                          ranks[1 - with_secret].text())

    def test_bad_secret_files(self):
        d = self.dir.name
        cases = {
            "missing": (os.path.join(d, "nope"), "cannot read the group secret file"),
            "empty": (write_secret(d, "empty", b""), "holds 0 bytes"),
            "newline only": (write_secret(d, "nl", b"\n"), "holds 0 bytes"),
            "short": (write_secret(d, "short", b"fifteen bytes!!\n"), "holds 15 bytes"),
            "long": (write_secret(d, "long", b"x" * 5000), "holds more than 4096 bytes"),
            "directory": (d, "not a regular file"),
        }
        for name, (path, why) in cases.items():
            port = gl.free_ephemeral_port()
            p = gl.Proc(["--listen", "127.0.0.1:%d" % port, "--group-secret-file", path])
            self.procs.append(p)
            self.assertEqual(p.wait(20), 2, "%s: %s" % (name, p.text()))
            self.assertIn("--group-secret-file", p.text(), name)
            self.assertIn(why, p.text(), name)
            self.assertNotIn("listening on", p.text(), name)

    def test_readable_by_others_warns(self):
        """Every user may read it: a warning. Its group may (Kubernetes' fsGroup): none."""
        loose = write_secret(self.dir.name, "loose", b"a secret of sixteen+ bytes", 0o644)
        group = write_secret(self.dir.name, "group", b"a secret of sixteen+ bytes", 0o640)
        for path, warned in ((loose, True), (group, False)):
            port = gl.free_ephemeral_port()
            p = gl.Proc(["--listen", "127.0.0.1:%d" % port, "--group-secret-file", path])
            self.procs.append(p)
            self.wait_listening(p, port)
            self.assertEqual("every user of this host may read it" in p.text(), warned, p.text())
            self.assertEqual(p.stop(), 0, p.text())

if __name__ == "__main__":
    unittest.main(verbosity=2)
