"""The `embps` CLI against a server with --auth-tokens-file: --token-file (or EMBPS_TOKEN_FILE)
sends the token on every command, bench and health included; without it a command fails with
the server's message (exit 1), health alone still answers; a wrong role is refused with the
role and the method; a token file that cannot be used is a usage error (exit 2) that names the
file but never prints the token. Standard library only; every subprocess has a timeout."""
import json
import os
import shutil
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

TOKENS = {"admin": "cli-admin-token-0d9a8b7c6e5f", "worker": "cli-worker-token-1f2e3d4c5b6a",
          "reader": "cli-reader-token-9a8b7c6d5e4f"}


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


class CliAuthTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="embps-cli-auth-")
        cls.tokens = os.path.join(cls.dir, "tokens")
        with open(cls.tokens, "w") as f:
            for role, tok in TOKENS.items():
                f.write("%s %s\n" % (role, tok))
        cls.files = {}
        for role, tok in TOKENS.items():
            cls.files[role] = os.path.join(cls.dir, role + ".token")
            with open(cls.files[role], "w") as f:
                f.write(tok + "\n")  # a trailing newline, as editors and secrets leave
        cls.server = embps_servers.Server("--device", "cpu", "--auth-tokens-file", cls.tokens)
        cls.servers = cls.server.address

    @classmethod
    def tearDownClass(cls):
        code = cls.server.close()
        log = cls.server.last_log
        shutil.rmtree(cls.dir, ignore_errors=True)
        assert code == 0, "server exited with %s:\n%s" % (code, log)
        for tok in TOKENS.values():
            assert tok not in log, "the server log holds a token"

    @classmethod
    def cli(cls, *args, token=None, env_token=None):
        env = dict(os.environ, EMBPS_SERVERS=cls.servers)
        env.pop("EMBPS_TOKEN_FILE", None)
        if env_token:
            env["EMBPS_TOKEN_FILE"] = cls.files[env_token]
        flags = ["--token-file", cls.files[token]] if token else []
        return subprocess.run([CLI_BIN, *flags, *args], capture_output=True, text=True,
                              timeout=CMD_TIMEOUT, env=env)

    def assert_fails(self, r, code, text):
        self.assertEqual(r.returncode, code, r.stdout + r.stderr)
        self.assertIn(text, r.stderr)
        for tok in TOKENS.values():
            self.assertNotIn(tok, r.stdout + r.stderr)

    def test_every_command_with_its_role(self):
        r = self.cli("create-table", "c", "--rows", "32", "--emb-width", "4", "--optimizer",
                     "sgd", "--lr", "1", token="admin")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.cli("tables", token="reader")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("c ", r.stdout)
        r = self.cli("lookup", "c", "--tokens", "5", env_token="reader")
        self.assertEqual(r.returncode, 0, r.stderr)
        before = [float(x) for x in r.stdout.split()[1:]]
        r = self.cli("push", "c", "--tokens", "5", "--grad-value", "0.25", env_token="worker")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.cli("lookup", "c", "--tokens", "5", token="worker")
        # SGD with lr 1: w - 0.25 in f32 (printed with 9 digits, which round-trip an f32)
        self.assertEqual([f32(float(x)) for x in r.stdout.split()[1:]],
                         [f32(f32(w) - 0.25) for w in before])
        self.assertEqual(self.cli("stats", token="reader").returncode, 0)
        self.assertEqual(self.cli("health", token="reader").returncode, 0)
        r = self.cli("bench", "c", "--batch", "8", "--duration", "1", "--warmup", "0",
                     "--push-ratio", "0.5", "--json", token="worker")
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        self.assertGreater(out["lookups"] + out["pushes"], 0)  # a slow (sanitized) run may
        # finish only a few calls in its second; that they succeeded is what counts here

    def test_without_a_token(self):
        self.assert_fails(self.cli("tables"), 1,
                          "embps: tables: UNAUTHENTICATED: missing authorization metadata: this "
                          "server requires 'authorization: Bearer TOKEN'")
        self.assert_fails(self.cli("bench", "c", "--batch", "8", "--duration", "0.2"), 1,
                          "UNAUTHENTICATED")
        r = self.cli("health")  # probes need no token
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "SERVING")

    def test_wrong_role_and_unknown_token(self):
        self.assert_fails(self.cli("create-table", "x", "--rows", "8", "--emb-width", "4",
                                   token="worker"), 1,
                          "embps: create-table: PERMISSION_DENIED: role 'worker' may not call "
                          "CreateTable (needs 'admin')")
        self.assert_fails(self.cli("checkpoint", token="reader"), 1,
                          "role 'reader' may not call Checkpoint (needs 'admin')")
        other = os.path.join(self.dir, "other.token")
        with open(other, "w") as f:
            f.write("not-a-token-of-this-server-00\n")
        r = subprocess.run([CLI_BIN, "--servers", self.servers, "--token-file", other, "tables"],
                           capture_output=True, text=True, timeout=CMD_TIMEOUT)
        self.assert_fails(r, 1, "UNAUTHENTICATED: the bearer token is not known to this server")

    def test_unusable_token_files(self):
        missing = os.path.join(self.dir, "missing.token")
        two = os.path.join(self.dir, "two.token")
        empty = os.path.join(self.dir, "empty.token")
        with open(two, "w") as f:
            f.write("%s\n%s\n" % (TOKENS["reader"], TOKENS["admin"]))
        with open(empty, "w") as f:
            f.write("\n\n")
        for path, want in ((missing, "No such file or directory"),
                           (two, "holds more than one word"), (empty, "is empty")):
            r = subprocess.run([CLI_BIN, "--servers", self.servers, "--token-file=" + path,
                                "tables"], capture_output=True, text=True, timeout=CMD_TIMEOUT)
            self.assert_fails(r, 2, "embps: options: --token-file %s" % path)
            self.assertIn(want, r.stderr)
        r = subprocess.run([CLI_BIN, "--help"], capture_output=True, text=True,
                           timeout=CMD_TIMEOUT)
        self.assertIn("--token-file", r.stdout)
        self.assertIn("EMBPS_TOKEN_FILE", r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
