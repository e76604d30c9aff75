"""System tests of the `embps` command-line tool and of embps-server's own command line.

A real embps-server runs on a free loopback port for the whole module (started by
tests/lib/embps_servers.py) and every CLI command runs as a user would run it, through subprocess:
exit codes (0; 1 for server and runtime errors; 2 for usage errors, per client/cli/args.h),
stdout parsed into rows, JSON or counters, and the server's message on stderr. Numbers are
checked against values computed here: SGD with --grad-value gives exactly w - lr*g in f32
(reproduced with struct round trips), and two tables with one seed print the same rows.
The server's flags are tested by starting short-lived servers: --help names every flag with
its EMBPS_ variable, an environment variable takes effect (and a flag beats it), and a bad
value makes the server exit non-zero naming the flag. Every server is stopped with SIGTERM
and must exit 0. Standard library only; every subprocess has a timeout.
"""
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
import embps_servers  # noqa: E402

SERVER_BIN = embps_servers.server_binary()
CLI_BIN = embps_servers.cli_binary()
CMD_TIMEOUT = 60

COMMANDS = {
    "drop-table": [],
    "create-table": ["--rows", "--capacity", "--emb-width", "--dtype", "--optimizer", "--lr",
                     "--eps", "--half-life", "--weight-decay", "--initial-accumulator", "--beta1",
                     "--beta2", "--seed", "--init-scale", "--admit-after", "--eviction",
                     "--half-life-steps", "--ttl-steps", "--sketch-width"],
    "tables": ["--json"],
    "lookup": ["--tokens"],
    "push": ["--tokens", "--grads", "--grad-value", "--async"],
    "lookup-features": ["--json"],
    "stats": ["--json"],
    "health": ["--service"],
    "assign": ["--tokens", "--rows", "--rows-file", "--keep-state"],
    "import": ["FILE.npy", "--ids", "--start", "--batch-rows", "--keep-state", "--no-progress"],
    "checkpoint": ["--table"],
    "checkpoints": [],
    "bench": ["--batch", "--mix", "--tables", "--duration", "--warmup", "--concurrency",
              "--pipeline", "--rate", "--tokens", "--key-space", "--zipf", "--push-ratio", "--async", "--seed", "--output",
              "--json", "--features", "--per-table"],
}

SERVER_FLAGS = ["listen", "rank", "peers", "peer-port-offset", "mesh", "table-axis", "data-axis",
                "bootstrap-timeout-ms", "peer-timeout-ms", "batch-deadline-ms",
                "max-message-bytes", "max-memory-bytes", "max-connections",
                "stall-timeout-ms", "idle-timeout-ms", "max-connections-per-source",
                "device", "log-level", "checkpoint-dir", "checkpoint-keep", "checkpoint-interval-s",
                "checkpoint-full-every", "restore"]
# Settings folded into others (issue 29): the server no longer knows them.
REMOVED_SERVER_FLAGS = ["max-table-bytes", "max-reply-bytes", "max-connection-reply-bytes",
                        "checkpoint-incremental", "backend", "max-tables"]


def f32(x):
    """x rounded to the nearest f32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


class Server(embps_servers.Server):
    """embps-server on a free loopback port, ready (tests/lib/embps_servers.py); close() stops it
    and returns its exit status, printing its log when that is not 0."""

    def __init__(self, *flags, env=None):
        super().__init__(*flags, env=env, prefix="embps-cli-server-")

    def close(self):
        rc = super().close()
        if rc != 0:
            print("embps-server exited with %s; its log:\n%s" % (rc, self.last_log))
        return rc


def dead_address():
    """An address nobody listens on: a server's port after it has stopped."""
    s = Server()
    addr = s.address
    assert s.close() == 0
    return addr


SERVER = None


def setUpModule():
    global SERVER
    SERVER = Server()


def tearDownModule():
    rc = SERVER.close()
    if rc != 0:
        raise AssertionError("embps-server exited with %s after SIGTERM" % rc)


def embps(*args, servers=None, env=None, timeout=CMD_TIMEOUT):
    """Runs the CLI against the module's server; returns the CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("EMBPS_SERVERS", None)
    full_env.update(env or {})
    argv = [CLI_BIN]
    if servers is not False:
        argv += ["--servers", servers or SERVER.address]
    return subprocess.run(argv + list(args), capture_output=True, text=True, env=full_env,
                          timeout=timeout)


class CliTestCase(unittest.TestCase):
    def ok(self, *args, **kw):
        r = embps(*args, **kw)
        self.assertEqual(r.returncode, 0, "embps %s failed (%d):\n%s%s" %
                         (" ".join(args), r.returncode, r.stdout, r.stderr))
        return r

    def fails(self, code, fragments, *args, **kw):
        r = embps(*args, **kw)
        self.assertEqual(r.returncode, code, "embps %s: exit %d, expected %d:\n%s%s" %
                         (" ".join(args), r.returncode, code, r.stdout, r.stderr))
        for frag in fragments:
            self.assertIn(frag, r.stderr, "embps %s" % " ".join(args))
        return r

    def lookup(self, table, tokens):
        """Parsed rows of `embps lookup`: a list of (token, [values]), the values as the exact
        f32 numbers printed (%.9g round-trips an f32)."""
        r = self.ok("lookup", table, "--tokens", ",".join(str(t) for t in tokens))
        rows = []
        for line in r.stdout.splitlines():
            parts = line.split()
            rows.append((int(parts[0]), [f32(float(v)) for v in parts[1:]]))
        self.assertEqual([t for t, _ in rows], list(tokens))
        return rows

    def create(self, name, *flags):
        r = self.ok("create-table", name, *flags)
        self.assertIn("created table " + name, r.stdout)
        return r

    def table_json(self, name):
        r = self.ok("tables", "--json")
        for t in json.loads(r.stdout):
            if t["name"] == name:
                return t
        self.fail("table %s not listed" % name)

    def table_stats(self, name):
        r = self.ok("stats", "--json")
        ranks = json.loads(r.stdout)
        self.assertEqual(len(ranks), 1)
        for t in ranks[0]["tables"]:
            if t["name"] == name:
                return t
        self.fail("table %s not in stats" % name)


class TestHelp(CliTestCase):
    def test_global_help(self):
        r = embps("--help", servers=False)
        self.assertEqual(r.returncode, 0)
        for cmd in COMMANDS:
            self.assertRegex(r.stdout, r"(?m)^  %s\s" % re.escape(cmd))
        for flag, env in [("--servers", "EMBPS_SERVERS"), ("--deadline-ms", "EMBPS_DEADLINE_MS"),
                          ("--connect-timeout-ms", "EMBPS_CONNECT_TIMEOUT_MS"),
                          ("--pad", "EMBPS_PAD")]:
            self.assertIn(flag, r.stdout)
            self.assertIn(env, r.stdout)

    def test_command_help(self):
        for cmd, flags in COMMANDS.items():
            r = embps(cmd, "--help", servers=False)
            self.assertEqual(r.returncode, 0, cmd)
            self.assertIn("usage: embps", r.stdout)
            self.assertIn(cmd, r.stdout)
            for flag in flags + ["--help"]:
                self.assertRegex(r.stdout, r"(?m)^  %s\b" % re.escape(flag), cmd)
            # -h too, and --help wins over a missing NAME.
            self.assertEqual(embps(cmd, "-h", servers=False).returncode, 0, cmd)

    def test_no_command(self):
        r = embps(servers=False)
        self.assertEqual(r.returncode, 2)
        self.assertIn("usage: embps", r.stderr)


class TestTables(CliTestCase):
    def test_create_with_every_option(self):
        self.create("cli_full", "--rows", "1000", "--emb-width", "16", "--dtype", "bf16",
                    "--optimizer", "rowwise_adagrad", "--lr", "0.05", "--eps", "1e-7",
                    "--half-life", "100", "--weight-decay", "0.001", "--seed", "9")
        t = self.table_json("cli_full")
        self.assertEqual(t["rows"], 1000)
        self.assertEqual(t["emb_width"], 16)
        self.assertEqual(t["dtype"], "bf16")
        self.assertEqual(t["optimizer"], "rowwise_adagrad")
        self.assertAlmostEqual(t["lr"], 0.05, places=6)
        self.assertEqual(t["seed"], 9)
        # The plain listing shows the same table.
        r = self.ok("tables")
        self.assertTrue(r.stdout.startswith("name"))
        line = [l for l in r.stdout.splitlines() if l.split()[0] == "cli_full"]
        self.assertEqual(len(line), 1)
        self.assertEqual(line[0].split()[1:], ["dense", "1000", "16", "bf16", "rowwise_adagrad",
                                               "-"])
        self.assertEqual((t["kind"], t["capacity"]), ("dense", 0))
        self.assertNotIn("eviction", t)

    def created(self, name, *flags):
        """The table `embps create-table` printed, as a dict of its "key value" fields."""
        r = self.create(name, *flags)
        m = re.match(r"created table (\S+): (.*)$", r.stdout.strip())
        self.assertIsNotNone(m, r.stdout)
        self.assertEqual(m.group(1), name)
        fields = dict(kv.split(" ", 1) for kv in m.group(2).split(", "))
        return {k: v if k in ("dtype", "optimizer") else float(v) for k, v in fields.items()}

    def test_create_prints_the_servers_defaults(self):
        # Only --rows and --emb-width: the server fills in every default, and the CLI prints
        # the table the server answered, not the (zero) settings it sent.
        t = self.created("cli_defaults", "--rows", "100", "--emb-width", "16")
        self.assertEqual((t["rows"], t["emb_width"], t["dtype"], t["optimizer"]),
                         (100, 16, "f32", "rowwise_adagrad"))
        self.assertAlmostEqual(t["lr"], 0.01, places=7)
        self.assertAlmostEqual(t["eps"], 1e-8, places=12)
        self.assertAlmostEqual(t["beta1"], 0.9, places=6)
        self.assertAlmostEqual(t["beta2"], 0.999, places=6)
        self.assertAlmostEqual(t["init_scale"], 0.25, places=6)  # 1/sqrt(emb_width)
        self.assertEqual((t["half_life"], t["weight_decay"], t["initial_accumulator"], t["seed"]),
                         (0, 0, 0, 0))
        # What the user gave is kept, and what they left out is still the server's default.
        t = self.created("cli_defaults_adam", "--rows", "50", "--emb-width", "4", "--optimizer",
                         "adam", "--lr", "0.05", "--beta1", "0.8", "--dtype", "bf16",
                         "--seed", "7")
        self.assertEqual((t["optimizer"], t["dtype"], t["seed"]), ("adam", "bf16", 7))
        self.assertAlmostEqual(t["lr"], 0.05, places=6)
        self.assertAlmostEqual(t["beta1"], 0.8, places=6)
        self.assertAlmostEqual(t["beta2"], 0.999, places=6)
        self.assertAlmostEqual(t["init_scale"], 0.5, places=6)
        # The listing agrees with what create-table printed.
        self.assertAlmostEqual(self.table_json("cli_defaults")["lr"], 0.01, places=7)

    def test_every_optimizer_and_dtype(self):
        for opt in ["sgd", "adagrad", "rowwise_adagrad", "adam"]:
            for dtype in ["f32", "bf16"]:
                name = "cli_%s_%s" % (opt, dtype)
                flags = ["--rows", "50", "--emb-width", "8", "--dtype", dtype, "--optimizer", opt,
                         "--lr", "0.1", "--seed", "4"]
                if opt == "adam":
                    flags += ["--beta1", "0.8", "--beta2", "0.99"]
                if opt == "adagrad":
                    flags += ["--initial-accumulator", "0.1"]
                self.create(name, *flags)
                t = self.table_json(name)
                self.assertEqual((t["optimizer"], t["dtype"]), (opt, dtype))
                before = self.lookup(name, [7])[0][1]
                r = self.ok("push", name, "--tokens", "7,7", "--grad-value", "0.5")
                self.assertIn("applied=1 skipped=0", r.stdout)
                self.assertIn("num_unique=1", r.stdout)
                after = self.lookup(name, [7])[0][1]
                # Every element moved against the (positive) gradient.
                for b, a in zip(before, after):
                    self.assertLess(a, b, name)

    def test_duplicate_and_bad_tables(self):
        self.create("cli_dup", "--rows", "10", "--emb-width", "4")
        self.fails(1, ["ALREADY_EXISTS", "cli_dup"], "create-table", "cli_dup", "--rows", "20",
                   "--emb-width", "4")
        self.assertEqual(self.table_json("cli_dup")["rows"], 10)
        # Usage errors (exit 2) name the flag and the bad text.
        self.fails(2, ["--rows", "12x"], "create-table", "cli_bad", "--rows", "12x",
                   "--emb-width", "4")
        self.fails(2, ["--emb-width"], "create-table", "cli_bad", "--rows", "12",
                   "--emb-width", "-4")
        self.fails(2, ["exactly one of --rows (a dense table) and --capacity (a hash-keyed "
                       "table) is required"], "create-table", "cli_bad", "--emb-width", "4")
        self.fails(2, ["exactly one of --rows"], "create-table", "cli_bad", "--rows", "4",
                   "--capacity", "4", "--emb-width", "4")
        self.fails(2, ["--emb-width is required"], "create-table", "cli_bad", "--capacity", "4")
        self.fails(2, ["--eviction is an option of hash-keyed tables, and --rows makes a dense "
                       "one: give --capacity instead of --rows, or leave --eviction out"],
                   "create-table", "cli_bad", "--rows", "4", "--emb-width", "4", "--eviction",
                   "lfu")
        self.fails(2, ["--eviction: expected one of lru, lfu, ttl"], "create-table", "cli_bad",
                   "--capacity", "4", "--emb-width", "4", "--eviction", "fifo")
        self.fails(2, ["--capacity", "0 is outside"], "create-table", "cli_bad", "--capacity",
                   "0", "--emb-width", "4")
        # A hash-keyed spec out of the server's rules: its message, nothing created.
        self.fails(1, ["INVALID_ARGUMENT", "admit_after=300 is out of range"], "create-table",
                   "cli_bad", "--capacity", "100", "--emb-width", "4", "--admit-after", "300")
        self.fails(1, ["INVALID_ARGUMENT", "half_life_steps=0 is out of range"], "create-table",
                   "cli_bad", "--capacity", "100", "--emb-width", "4", "--eviction", "lfu")
        self.fails(1, ["INVALID_ARGUMENT", "ttl_steps=5 is an option of ttl eviction"],
                   "create-table", "cli_bad", "--capacity", "100", "--emb-width", "4",
                   "--ttl-steps", "5")
        self.fails(1, ["INVALID_ARGUMENT", "capacity=4294967296 is out of range"],
                   "create-table", "cli_bad", "--capacity", "4294967296", "--emb-width", "4")
        self.fails(2, ["--dtype"], "create-table", "cli_bad", "--rows", "12", "--emb-width", "4",
                   "--dtype", "f64")
        self.fails(2, ["--optimizer"], "create-table", "cli_bad", "--rows", "12",
                   "--emb-width", "4", "--optimizer", "lion")
        self.fails(2, ["--lr"], "create-table", "cli_bad", "--rows", "12", "--emb-width", "4",
                   "--lr", "fast")
        self.fails(2, ["unknown option '--colour'"], "create-table", "cli_bad", "--rows", "12",
                   "--emb-width", "4", "--colour", "red")
        self.fails(2, ["missing NAME"], "create-table", "--rows", "12", "--emb-width", "4")
        # Server errors (exit 1) carry the server's message.
        self.fails(1, ["INVALID_ARGUMENT", "rows=1 is out of range"], "create-table", "cli_bad",
                   "--rows", "1", "--emb-width", "4")
        self.fails(1, ["INVALID_ARGUMENT", "emb_width=100000 is out of range"], "create-table",
                   "cli_bad", "--rows", "10", "--emb-width", "100000")
        self.fails(1, ["RESOURCE_EXHAUSTED", "--max-memory-bytes"], "create-table", "cli_bad",
                   "--rows", "1000000000000", "--emb-width", "65536")
        self.fails(1, ["INVALID_ARGUMENT", "only letters"], "create-table", "bad/name",
                   "--rows", "10", "--emb-width", "4")
        names = [t["name"] for t in json.loads(self.ok("tables", "--json").stdout)]
        self.assertNotIn("cli_bad", names)


class TestLookupPush(CliTestCase):
    def test_lookup_rows(self):
        self.create("cli_la", "--rows", "100", "--emb-width", "8", "--seed", "42")
        self.create("cli_lb", "--rows", "100", "--emb-width", "8", "--seed", "42",
                    "--optimizer", "adam")
        self.create("cli_lc", "--rows", "100", "--emb-width", "8", "--seed", "43")
        tokens = [0, 1, 2, 1, 99, 0]
        a = self.lookup("cli_la", tokens)
        b = self.lookup("cli_lb", tokens)
        c = self.lookup("cli_lc", tokens)
        self.assertEqual(len(a), 6)
        for _, row in a:
            self.assertEqual(len(row), 8)
        self.assertEqual(a[0][1], [0.0] * 8)
        self.assertEqual(a[5][1], [0.0] * 8)
        self.assertEqual(a[1][1], a[3][1])
        self.assertNotEqual(a[1][1], a[2][1])
        self.assertNotEqual(a[2][1], a[4][1])
        bound = 1 / math.sqrt(8)
        for v in a[1][1] + a[2][1] + a[4][1]:
            self.assertTrue(-bound <= v < bound and v != 0.0)
        self.assertEqual(a, b)  # same seed, same rows
        self.assertNotEqual(a[1][1], c[1][1])
        self.assertEqual(a, self.lookup("cli_la", tokens))

    def test_sgd_push_exact(self):
        self.create("cli_sgd", "--rows", "10", "--emb-width", "4", "--optimizer", "sgd",
                    "--lr", "0.1", "--seed", "3")
        w = self.lookup("cli_sgd", [5])[0][1]
        lr, g = f32(0.1), f32(0.3)
        r = self.ok("push", "cli_sgd", "--tokens", "5", "--grad-value", "0.3")
        m = re.match(r"applied=1 skipped=0 grad_norm=(\S+) num_unique=1$", r.stdout.strip())
        self.assertIsNotNone(m, r.stdout)
        self.assertAlmostEqual(float(m.group(1)), 2 * g, places=6)  # sqrt(4 * g^2)
        w1 = self.lookup("cli_sgd", [5])[0][1]
        want = [f32(x - f32(lr * g)) for x in w]
        self.assertEqual(w1, want)
        # Async: ordered, and the next lookup sees it.
        r = self.ok("push", "cli_sgd", "--tokens", "5", "--grad-value", "0.3", "--async")
        self.assertEqual(r.stdout.strip(), "ordered=1 applied=0 skipped=0")
        w2 = self.lookup("cli_sgd", [5])[0][1]
        self.assertEqual(w2, [f32(x - f32(lr * g)) for x in want])
        # Explicit rows, a duplicate token summed, the padding row ignored.
        w3 = self.lookup("cli_sgd", [2])[0][1]
        r = self.ok("push", "cli_sgd", "--tokens", "2,0,2",
                    "--grads", "0.5,0.25,0,1|9,9,9,9|0.5,0.25,2,-1")
        self.assertIn("applied=1 skipped=0", r.stdout)
        self.assertIn("num_unique=1", r.stdout)
        sums = [1.0, 0.5, 2.0, 0.0]
        w4 = self.lookup("cli_sgd", [2, 0])
        self.assertEqual(w4[0][1],
                         [f32(x - f32(lr * s)) for x, s in zip(w3, sums)])
        self.assertEqual(w4[1][1], [0.0] * 4)
        # The CLI refuses non-finite numbers; two finite gradients whose f32 sum overflows
        # are gated like a non-finite one: nothing changes.
        self.fails(2, ["--grad-value"], "push", "cli_sgd", "--tokens", "5", "--grad-value", "inf")
        r = self.ok("push", "cli_sgd", "--tokens", "5,5", "--grad-value", "3e38")
        self.assertIn("applied=0 skipped=1", r.stdout)
        self.assertEqual(self.lookup("cli_sgd", [5])[0][1], w2)

    def test_push_bf16(self):
        self.create("cli_bf", "--rows", "10", "--emb-width", "4", "--dtype", "bf16",
                    "--optimizer", "sgd", "--lr", "0.5", "--seed", "3")
        w = self.lookup("cli_bf", [4])[0][1]
        self.ok("push", "cli_bf", "--tokens", "4", "--grad-value", "0.25")
        w1 = self.lookup("cli_bf", [4])[0][1]
        for a, b in zip(w, w1):
            self.assertAlmostEqual(b, a - 0.125, delta=abs(a - 0.125) / 128 + 1e-6)

    def test_errors(self):
        self.create("cli_err", "--rows", "10", "--emb-width", "4")
        self.fails(1, ["NOT_FOUND", "no_such_table"], "lookup", "no_such_table", "--tokens", "1")
        self.fails(1, ["NOT_FOUND", "no_such_table"], "push", "no_such_table", "--tokens", "1",
                   "--grad-value", "1")
        self.fails(1, ["INVALID_ARGUMENT", "token 99", "outside [0, 10)"], "lookup", "cli_err",
                   "--tokens", "1,99")
        self.fails(1, ["INVALID_ARGUMENT", "token 10 at position 0"], "lookup", "cli_err",
                   "--tokens", "10")
        self.fails(1, ["INVALID_ARGUMENT", "token -1"], "lookup", "cli_err", "--tokens", "-1")
        self.fails(1, ["INVALID_ARGUMENT", "token 10"], "push", "cli_err", "--tokens", "10",
                   "--grad-value", "1")
        self.fails(1, ["INVALID_ARGUMENT", "token -3"], "push", "cli_err", "--tokens", "-3",
                   "--grad-value", "1")
        self.fails(1, ["FAILED_PRECONDITION", "--checkpoint-dir"], "checkpoint")
        self.fails(1, ["FAILED_PRECONDITION", "--checkpoint-dir"], "checkpoints")
        self.fails(2, ["--path"], "checkpoint", "--path", "/tmp/x")
        self.fails(2, ["--tokens"], "lookup", "cli_err", "--tokens", "1,x")
        self.fails(2, ["--tokens is required"], "lookup", "cli_err")
        self.fails(2, ["exactly one of --grads and --grad-value"], "push", "cli_err",
                   "--tokens", "1")
        self.fails(2, ["--grads has 1 rows of 3 values"], "push", "cli_err", "--tokens", "1",
                   "--grads", "1,2,3")
        self.fails(2, ["exactly one of --batch and --mix is required"], "bench", "cli_err")
        self.fails(2, ["--push-ratio"], "bench", "cli_err", "--batch", "8", "--push-ratio", "2")
        self.fails(2, ["unknown command 'frobnicate'"], "frobnicate")
        self.fails(2, ["unknown option '--colour'"], "--colour", "tables", servers=False)
        self.fails(2, ["--deadline-ms"], "--deadline-ms", "soon", "tables")
        dead = dead_address()
        for args in (["lookup", "cli_err", "--tokens", "1"], ["tables"], ["stats"],
                     ["health"], ["push", "cli_err", "--tokens", "1", "--grad-value", "1"],
                     ["create-table", "x", "--rows", "4", "--emb-width", "4"],
                     ["bench", "cli_err", "--batch", "4", "--duration", "0.1"]):
            self.fails(1, ["UNAVAILABLE", dead], *args, servers=dead)
        # The table is as it was.
        self.assertEqual(self.table_stats("cli_err")["pushes"], 0)


def write_npy(path, descr, shape, data, fortran=False, cut=0):
    """A .npy as numpy.save writes it (version 1.0), standard library only: descr ('<f4',
    '<u2', '<i8', ...), shape, data the packed bytes; cut drops that many bytes at the end."""
    dims = "(%s)" % "".join("%d, " % d for d in shape) if len(shape) != 1 else "(%d,)" % shape[0]
    if len(shape) == 2:
        dims = "(%d, %d)" % shape
    head = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, dims)
    pad = 64 - (10 + len(head) + 1) % 64
    head = head + " " * (pad % 64) + "\n"
    blob = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode() + data
    with open(path, "wb") as f:
        f.write(blob[:len(blob) - cut] if cut else blob)
    return path


def f32_rows(rows, width, seed):
    """rows x width f32 values (exact in f32), row 0 zeros, and their bytes."""
    vals = [[0.0] * width] + [[f32(((r * 31 + c * 7 + seed) % 97 - 48) / 8.0 + 0.001 * seed)
                               for c in range(width)] for r in range(1, rows)]
    return vals, b"".join(struct.pack("<%df" % width, *v) for v in vals)


class TestImport(CliTestCase):
    def setUp(self):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="embps-cli-import-")

    def tearDown(self):
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def listed(self, name):
        return any(t["name"] == name for t in json.loads(self.ok("tables", "--json").stdout))

    def test_import_creates_and_reads_back(self):
        vals, data = f32_rows(37, 4, 1)
        f = write_npy(self.path("a.npy"), "<f4", (37, 4), data)
        r = self.ok("import", "imp_f32", f, "--batch-rows", "5", "--no-progress")
        self.assertIn("created table imp_f32: rows 37, emb_width 4, dtype f32", r.stdout)
        self.assertIn("imported 37 rows of %s into imp_f32: assigned=36 refused=0" % f, r.stdout)
        self.assertEqual(r.stderr, "")  # no progress line off a terminal
        self.assertEqual([v for _, v in self.lookup("imp_f32", range(37))], vals)
        # bf16 bits: a bf16 table, every bit kept
        bits = [(r * 257 + c * 3) & 0x7F7F for r in range(9) for c in range(4)]
        bits[:4] = [0] * 4
        fb = write_npy(self.path("b.npy"), "<u2", (9, 4), struct.pack("<36H", *bits))
        self.ok("import", "imp_bf16", fb, "--no-progress")
        self.assertEqual(self.table_json("imp_bf16")["dtype"], "bf16")
        got = self.lookup("imp_bf16", range(9))
        want = [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        self.assertEqual([x for _, v in got for x in v], want)
        # hash-keyed with ids (64-bit, negative among them): capacity = the rows
        ids = [7, -5, 2**62 + 3, 11, 12, 13, 14, 15, 16]
        fi = write_npy(self.path("ids.npy"), "<i8", (9,), struct.pack("<9q", *ids))
        vals9, data9 = f32_rows(9, 4, 2)
        fr = write_npy(self.path("r9.npy"), "<f4", (9, 4), data9)
        r = self.ok("import", "imp_hash", fr, "--ids", fi, "--no-progress")
        self.assertIn("created table imp_hash: capacity 9", r.stdout)
        self.assertIn("assigned=9 refused=0", r.stdout)
        self.assertEqual([v for _, v in self.lookup("imp_hash", ids)], vals9)

    def test_start_resumes_and_progress(self):
        vals, data = f32_rows(20, 4, 3)
        self.ok("import", "imp_resume", write_npy(self.path("a.npy"), "<f4", (20, 4), data),
                "--no-progress")
        vals2, data2 = f32_rows(20, 4, 4)
        f2 = write_npy(self.path("b.npy"), "<f4", (20, 4), data2)
        r = self.ok("import", "imp_resume", f2, "--start", "15", "--batch-rows", "2",
                    "--no-progress")
        self.assertIn("imported 5 rows", r.stdout)
        got = [v for _, v in self.lookup("imp_resume", range(20))]
        self.assertEqual(got[:15], vals[:15])
        self.assertEqual(got[15:], vals2[15:])
        # on a terminal (a pty for stderr), a progress line
        import pty
        master, slave = pty.openpty()
        try:
            p = subprocess.run([CLI_BIN, "--servers", SERVER.address, "import", "imp_resume",
                                f2], stdout=subprocess.PIPE, stderr=slave, timeout=CMD_TIMEOUT)
            os.close(slave)
            slave = -1
            out = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
        finally:
            if slave >= 0:
                os.close(slave)
            os.close(master)
        self.assertEqual(p.returncode, 0)
        self.assertIn(b"import imp_resume: 20/20 rows (100.0%)", out)

    def test_bad_files_write_nothing(self):
        vals, data = f32_rows(10, 4, 5)
        good = write_npy(self.path("good.npy"), "<f4", (10, 4), data)
        cases = [
            (write_npy(self.path("t.npy"), "<f4", (10, 4), data, cut=3), "is cut short"),
            (write_npy(self.path("f.npy"), "<f4", (10, 4), data, fortran=True),
             "is in Fortran order"),
            (write_npy(self.path("d.npy"), "<f8", (5, 4), data[:160]),
             "holds dtype '<f8' (float64), which embps does not read"),
            (write_npy(self.path("one.npy"), "<f4", (40,), data), "rows must be a 2-D"),
        ]
        with open(self.path("not.npy"), "wb") as fh:
            fh.write(b"PK\x03\x04 a zip, not a .npy")
        cases.append((self.path("not.npy"), "is not a .npy file"))
        cases.append((self.path("missing.npy"), "cannot be opened"))
        for f, frag in cases:
            self.fails(2, [f, frag], "import", "imp_bad", f, "--no-progress")
            self.assertFalse(self.listed("imp_bad"), f)
        self.fails(2, ["missing FILE.npy"], "import", "imp_bad")
        # into an existing table: the width, the rows, the ids; nothing written
        self.create("imp_into", "--rows", "10", "--emb-width", "8")
        before = self.lookup("imp_into", range(10))
        self.fails(2, ["holds rows of 4 values, but table imp_into has emb_width=8"],
                   "import", "imp_into", good)
        self.create("imp_small", "--rows", "5", "--emb-width", "4")
        self.fails(2, ["has 10 rows, but table imp_small has rows=5"], "import", "imp_small",
                   good)
        ids = write_npy(self.path("ids.npy"), "<i8", (10,),
                        struct.pack("<10q", *([1, 2, 3, 4, 5, 6, 7, 8, 9] + [5])))
        self.fails(2, ["id 5 at position 4 is outside [0, 5) of table imp_small: nothing was "
                       "written"], "import", "imp_small", good, "--ids", ids)
        short = write_npy(self.path("ids3.npy"), "<i8", (3,), struct.pack("<3q", 1, 2, 3))
        self.fails(2, ["ids must be a 1-D integer array", "of one id per row"], "import",
                   "imp_small", good, "--ids", short)
        self.assertEqual(self.lookup("imp_into", range(10)), before)
        self.fails(2, ["--start"], "import", "imp_into", good, "--start", "11")

    def test_assign(self):
        self.create("asg", "--rows", "8", "--emb-width", "2", "--optimizer", "sgd", "--lr", "1")
        r = self.ok("assign", "asg", "--tokens", "3,4,3,0", "--rows", "1,2|3,4|5,6|7,8")
        self.assertEqual(r.stdout.strip(), "assigned=2 refused=0")
        self.assertEqual(self.lookup("asg", [3, 4, 0]), [(3, [5.0, 6.0]), (4, [3.0, 4.0]),
                                                        (0, [0.0, 0.0])])
        f = write_npy(self.path("r.npy"), "<f4", (2, 2), struct.pack("<4f", 0.5, 1.5, 2.5, 3.5))
        self.ok("assign", "asg", "--tokens", "5,6", "--rows-file", f, "--keep-state")
        self.assertEqual(self.lookup("asg", [5, 6]), [(5, [0.5, 1.5]), (6, [2.5, 3.5])])
        self.fails(2, ["give exactly one of --rows and --rows-file"], "assign", "asg",
                   "--tokens", "1")
        self.fails(2, ["--rows has 1 rows of 3 values; table asg needs 1 rows (one per token) of "
                       "2 values (emb_width)"], "assign", "asg", "--tokens", "1", "--rows",
                   "1,2,3")
        self.fails(1, ["INVALID_ARGUMENT", "token 9 at position 0 is outside [0, 8)"], "assign",
                   "asg", "--tokens", "9", "--rows", "1,2")
        self.assertEqual(self.lookup("asg", [5, 6]), [(5, [0.5, 1.5]), (6, [2.5, 3.5])])


class TestAdmin(CliTestCase):
    def test_health(self):
        r = self.ok("health")
        self.assertEqual(r.stdout.strip(), "SERVING")
        r = self.ok("health", "--service", "embps.v1.EmbeddingService")
        self.assertEqual(r.stdout.strip(), "SERVING")
        self.fails(1, ["NOT_FOUND", "unknown service"], "health", "--service", "nope.Service")
        # EMBPS_SERVERS supplies the address; --servers wins over it.
        r = embps("health", servers=False, env={"EMBPS_SERVERS": SERVER.address})
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "SERVING"))
        dead = dead_address()
        r = embps("health", servers=False, env={"EMBPS_SERVERS": dead})
        self.assertEqual(r.returncode, 1)
        self.assertIn("UNAVAILABLE", r.stderr)
        r = embps("health", env={"EMBPS_SERVERS": dead})
        self.assertEqual(r.returncode, 0)

    def test_stats(self):
        self.create("cli_st", "--rows", "20", "--emb-width", "4", "--optimizer", "sgd")
        self.lookup("cli_st", [1, 2, 3])
        self.lookup("cli_st", [4])
        self.ok("push", "cli_st", "--tokens", "1,1,2", "--grad-value", "1")
        self.ok("push", "cli_st", "--tokens", "1,1", "--grad-value", "3e38")  # sum overflows
        r = self.ok("stats")
        self.assertRegex(r.stdout, r"(?m)^rank 0/1 \(%s\):.* backend cpu, version \S+" %
                         re.escape(SERVER.address))
        self.assertIn("table cli_st: rows 20, emb_width 4, lookups 2, pushes 2, rows looked up "
                      "4, rows pushed 5, steps applied 1, steps skipped 1, bytes 320", r.stdout)
        ranks = json.loads(self.ok("stats", "--json").stdout)
        self.assertEqual(len(ranks), 1)
        rank = ranks[0]
        self.assertEqual((rank["rank"], rank["group_size"], rank["backend"]), (0, 1, "cpu"))
        self.assertEqual(rank["address"], SERVER.address)
        self.assertGreater(rank["requests"], 5)
        self.assertGreaterEqual(rank["connections"], 1)
        t = [t for t in rank["tables"] if t["name"] == "cli_st"][0]
        want = {"name": "cli_st", "rows": 20, "emb_width": 4, "lookups": 2, "pushes": 2,
                "rows_looked_up": 4, "rows_pushed": 5, "steps_applied": 1, "steps_skipped": 1,
                "bytes": 320}
        self.assertEqual({k: t.get(k) for k in want}, want)


class TestHashKeyed(CliTestCase):
    """A hash-keyed table through the CLI: created with --capacity, listed with its kind and
    settings, any 64-bit id (negative as int64 included) looked up and pushed, its counters in
    stats, and bench --key-space over it evicting at a full table."""

    def create_hash(self, name, *flags):
        return self.ok("create-table", name, *flags)

    def test_create_list_lookup_push_stats(self):
        r = self.create_hash("cli_hash", "--capacity", "64", "--emb-width", "4", "--optimizer",
                             "sgd", "--lr", "1", "--seed", "5", "--eviction", "lfu",
                             "--half-life-steps", "10")
        self.assertRegex(r.stdout, r"^created table cli_hash: capacity 64, emb_width 4, dtype "
                                   r"f32, optimizer sgd, .*, admit_after 1, eviction lfu, "
                                   r"half_life_steps 10, ttl_steps 0, sketch_width 0\n$")
        t = self.table_json("cli_hash")
        self.assertEqual((t["kind"], t["rows"], t["capacity"], t["eviction"],
                          t["half_life_steps"], t["admit_after"]),
                         ("hash", 0, 64, "lfu", 10, 1))
        line = [l for l in self.ok("tables").stdout.splitlines() if l.startswith("cli_hash ")]
        self.assertEqual(line[0].split()[1:], ["hash", "64", "4", "f32", "sgd",
                                               "lfu,half_life_steps=10"])
        keys = [2**63 - 1, -5, -(2**63), 1, 12345678901234567]
        before = dict(self.lookup("cli_hash", keys))
        self.assertEqual(len(set(tuple(v) for v in before.values())), len(keys))  # own rows
        self.assertEqual(self.table_stats("cli_hash")["keys"], 0)  # a lookup stores nothing
        self.ok("push", "cli_hash", "--tokens", ",".join(map(str, keys)), "--grad-value", "0.5")
        after = dict(self.lookup("cli_hash", keys))
        for k in keys:  # sgd, lr 1: w - 0.5, in f32
            self.assertEqual(after[k], [f32(v - 0.5) for v in before[k]], k)
        st = self.table_stats("cli_hash")
        self.assertEqual((st["kind"], st["capacity"], st["keys"], st["keys_admitted"],
                          st["keys_evicted"], st["keys_refused"], st["gradients_dropped"]),
                         ("hash", 64, 5, 5, 0, 0, 0))
        text = self.ok("stats").stdout
        self.assertRegex(text, r"table cli_hash: capacity 64, keys 5, load 7\.8%, emb_width 4, "
                               r".*, keys admitted 5, evicted 0, expired 0, refused 0, "
                               r"gradients dropped 0\n")

    def test_admission_counts_dropped_gradients(self):
        self.create_hash("cli_hash_adm", "--capacity", "16", "--emb-width", "4", "--optimizer",
                         "sgd", "--admit-after", "2")
        self.ok("push", "cli_hash_adm", "--tokens", "-7", "--grad-value", "1")
        st = self.table_stats("cli_hash_adm")
        self.assertEqual((st["keys"], st["gradients_dropped"]), (0, 1))
        self.ok("push", "cli_hash_adm", "--tokens", "-7", "--grad-value", "1")
        st = self.table_stats("cli_hash_adm")
        self.assertEqual((st["keys"], st["keys_admitted"]), (1, 1))

    def test_bench_key_space_evicts(self):
        self.create_hash("cli_hash_bench", "--capacity", "32", "--emb-width", "8", "--optimizer",
                         "sgd", "--lr", "0.001")
        r = self.ok("bench", "cli_hash_bench", "--batch", "64", "--duration", "0.5",
                    "--warmup", "0", "--push-ratio", "0.5", "--tokens", "zipf", "--key-space",
                    "100000", "--json")
        j = json.loads(r.stdout)
        self.assertEqual((j["errors"], j["key_space"]), (0, 100000))
        self.assertGreater(j["pushes"], 0)
        st = self.table_stats("cli_hash_bench")
        self.assertEqual(st["keys"], 32)
        self.assertGreater(st["keys_evicted"], 0)
        self.assertEqual(st["keys_admitted"], st["keys"] + st["keys_evicted"] + st["keys_expired"])


class TestBench(CliTestCase):
    @classmethod
    def setUpClass(cls):
        r = embps("create-table", "cli_bench", "--rows", "10000", "--emb-width", "32",
                  "--optimizer", "sgd", "--lr", "0.001")
        assert r.returncode == 0, r.stderr

    KEYS = ["lookup_rows_per_s", "push_rows_per_s", "p50_ms", "p99_ms", "p999_ms",
            "lookup_gbytes_per_s"]

    def test_bench_json(self):
        r = self.ok("bench", "cli_bench", "--batch", "256", "--duration", "1", "--json")
        self.assertEqual(r.stderr, "")  # no progress lines
        j = json.loads(r.stdout)
        for k in self.KEYS:
            self.assertIn(k, j)
        self.assertGreater(j["lookup_rows_per_s"], 0)
        self.assertGreater(j["lookups"], 0)
        self.assertEqual(j["pushes"], 0)
        self.assertEqual(j["push_rows_per_s"], 0)
        self.assertEqual(j["batch"], 256)
        # Counts are JSON numbers: batches is the batches answered, the sizes an array.
        self.assertIs(type(j["batches"]), int)
        self.assertEqual(j["batches"], j["lookups"] + j["pushes"])
        self.assertEqual((j["batch_sizes"], j["batch_weights"]), ([256], [1]))
        self.assertGreater(j["lookup_gbytes_per_s"], 0)
        self.assertTrue(0 < j["p50_ms"] <= j["p99_ms"] <= j["p999_ms"])
        # rows/s is batches/s x batch, and GB/s is rows/s x row bytes.
        self.assertAlmostEqual(j["lookup_rows_per_s"], j["lookup_batches_per_s"] * 256,
                               delta=1.0)
        self.assertAlmostEqual(j["lookup_gbytes_per_s"], j["lookup_rows_per_s"] * 128 / 1e9,
                               delta=1e-5)

    def test_bench_push_ratio(self):
        before = self.table_stats("cli_bench")
        r = self.ok("bench", "cli_bench", "--batch", "256", "--duration", "1", "--warmup", "0",
                    "--push-ratio", "0.5", "--concurrency", "2", "--pipeline", "2",
                    "--zipf", "1.05", "--json")
        j = json.loads(r.stdout)
        self.assertGreater(j["lookups"], 0)
        self.assertGreater(j["pushes"], 0)
        self.assertGreater(j["push_rows_per_s"], 0)
        self.assertGreater(j["lookup_rows_per_s"], 0)
        share = j["pushes"] / float(j["lookups"] + j["pushes"])
        self.assertTrue(0.3 < share < 0.7, share)
        after = self.table_stats("cli_bench")
        self.assertGreaterEqual(after["pushes"] - before["pushes"], j["pushes"])
        self.assertGreater(after["steps_applied"], before["steps_applied"])

    def test_bench_report(self):
        r = self.ok("bench", "cli_bench", "--batch", "64", "--duration", "1.5", "--warmup", "0",
                    "--push-ratio", "0.25", "--async")
        self.assertRegex(r.stderr, r"bench\s+\d+\.\ds\s+lookups \d+\s+pushes \d+")
        lines = r.stdout.splitlines()
        self.assertIn("table cli_bench: batch 64", lines[0])
        self.assertEqual(lines[1].split()[:4], ["op", "count", "batches/s", "rows/s"])
        ops = {l.split()[0]: l.split()[1:] for l in lines[2:5]}
        self.assertEqual(set(ops), {"lookup", "push", "all"})
        self.assertRegex(lines[5], r"^client CPU \d+\.\d\d s \(user \+ system, all threads\) "
                         r"in \d+\.\d\d s: \d+% of one core, \d+\.\d{3} ms a batch$")
        self.assertEqual(len(lines), 6)
        self.assertGreater(int(ops["lookup"][0]), 0)
        self.assertGreater(int(ops["push"][0]), 0)
        self.assertEqual(int(ops["all"][0]), int(ops["lookup"][0]) + int(ops["push"][0]))

    def test_bench_client_cpu(self):
        """client_cpu_s is the bench's own CPU time after the warm-up: a busy closed loop uses
        far more of it than an open loop of 10 batches/s over the same table and time, and no
        more than its threads could (two workers and the main thread)."""
        def run(*extra):
            r = self.ok("bench", "cli_bench", "--batch", "256", "--duration", "1.5",
                        "--warmup", "0.5", "--json", *extra)
            j = json.loads(r.stdout)
            self.assertTrue(1.0 <= j["client_cpu_wall_s"] < 1.5 + 5, j["client_cpu_wall_s"])
            self.assertTrue(0 < j["client_cpu_s"] <= 3 * j["client_cpu_wall_s"], j)
            return j
        busy = run("--concurrency", "2", "--pipeline", "2")
        idle = run("--concurrency", "2", "--rate", "10")
        self.assertGreater(busy["count"], 20 * idle["count"])
        self.assertLess(idle["client_cpu_s"] * 3, busy["client_cpu_s"], (idle, busy))

    def test_bench_ghz_keys(self):
        r = self.ok("bench", "cli_bench", "--batch", "64", "--duration", "1", "--warmup", "0",
                    "--output", "json")
        j = json.loads(r.stdout)
        self.assertEqual(j["count"], j["lookups"])
        self.assertEqual(j["statusCodeDistribution"], {"OK": j["count"]})
        self.assertEqual(j["errorDistribution"], {})
        self.assertAlmostEqual(j["rps"], j["count"] / (j["total"] / 1e9), delta=0.01 * j["rps"])
        self.assertTrue(0 < j["fastest"] <= j["average"] <= j["slowest"])
        pcts = [d["percentage"] for d in j["latencyDistribution"]]
        self.assertEqual(pcts, [10, 25, 50, 75, 90, 95, 99, 99.9, 99.99])
        lat = [d["latency"] for d in j["latencyDistribution"]]
        self.assertEqual(lat, sorted(lat))
        self.assertTrue(j["fastest"] <= lat[0] and lat[-1] <= j["slowest"])
        self.assertAlmostEqual(lat[2] / 1e6, j["p50_ms"], delta=1e-3)
        self.assertEqual(len(j["histogram"]), 11)
        self.assertEqual(sum(b["count"] for b in j["histogram"]), j["count"])
        marks = [b["mark"] for b in j["histogram"]]
        self.assertEqual(marks, sorted(marks))
        self.assertAlmostEqual(marks[-1], j["slowest"] / 1e9, delta=1e-9)

    def test_bench_csv_mix_tables(self):
        r = embps("create-table", "cli_bench2", "--rows", "300", "--emb-width", "16", "--dtype",
                  "bf16", "--optimizer", "sgd", "--lr", "0.001")
        self.assertEqual(r.returncode, 0, r.stderr)
        before = [self.table_stats(t) for t in ("cli_bench", "cli_bench2")]
        r = self.ok("bench", "cli_bench", "--tables", "cli_bench2", "--mix", "16:3,48",
                    "--duration", "1", "--warmup", "0", "--push-ratio", "0.5", "--output", "csv")
        self.assertEqual(r.stderr, "")  # no progress lines in csv
        lines = r.stdout.strip().splitlines()
        head = lines[0].split(",")
        self.assertEqual(head[:4], ["op", "count", "errors", "batches_per_s"])
        rows = {l.split(",")[0]: dict(zip(head, l.split(","))) for l in lines[1:]}
        self.assertEqual(set(rows), {"lookup", "push", "all"})
        self.assertEqual(int(rows["all"]["count"]),
                         int(rows["lookup"]["count"]) + int(rows["push"]["count"]))
        self.assertEqual(rows["all"]["errors"], "0")
        # Both tables got calls, and the batch sizes of the mix: rows/batches lies in (16, 48).
        after = [self.table_stats(t) for t in ("cli_bench", "cli_bench2")]
        for b, a in zip(before, after):
            self.assertGreater(a["lookups"] + a["pushes"], b["lookups"] + b["pushes"])
        per_batch = float(rows["all"]["rows_per_s"]) / float(rows["all"]["batches_per_s"])
        self.assertTrue(16 < per_batch < 48, per_batch)
        # The JSON report gives the mix as numbers.
        r = self.ok("bench", "cli_bench", "--mix", "16:3,48", "--duration", "0.3", "--warmup",
                    "0", "--json")
        j = json.loads(r.stdout)
        self.assertEqual((j["batch_sizes"], j["batch_weights"]), ([16, 48], [3, 1]))
        self.assertIs(type(j["batches"]), int)
        self.assertEqual(j["batches"], j["lookups"])
        self.fails(2, ["--mix", "item 2"], "bench", "cli_bench", "--mix", "16:3,x")
        self.fails(2, ["exactly one of --batch and --mix"], "bench", "cli_bench", "--batch", "4",
                   "--mix", "4")
        self.fails(2, ["--output"], "bench", "cli_bench", "--batch", "4", "--output", "xml")
        self.fails(1, ["NOT_FOUND", "nope"], "bench", "cli_bench", "--tables", "nope",
                   "--batch", "8", "--duration", "0.1")

    def test_bench_counts_errors_by_status(self):
        # A server killed in the middle of the run: the calls after it fail, are counted by
        # status, the run goes on to its end, and the exit code says calls failed.
        server = Server()
        try:
            r = embps("create-table", "t", "--rows", "1000", "--emb-width", "8",
                      servers=server.address)
            self.assertEqual(r.returncode, 0, r.stderr)
            p = subprocess.Popen([CLI_BIN, "--servers", server.address, "bench", "t", "--batch",
                                  "64", "--duration", "2", "--warmup", "0", "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # Kill once the bench is calling (its threads connect before the clock starts, which
            # takes a while under ThreadSanitizer): bounded, then the kill comes regardless.
            deadline = time.time() + 60
            while time.time() < deadline and p.poll() is None:
                st = embps("stats", "--json", servers=server.address)
                if st.returncode == 0 and any(
                        t["name"] == "t" and t["lookups"] >= 5
                        for t in json.loads(st.stdout)[0]["tables"]):
                    break
                time.sleep(0.1)
            server.proc.kill()
            out, err = p.communicate(timeout=CMD_TIMEOUT)
        finally:
            server.close()
        self.assertEqual(p.returncode, 1, err)
        self.assertIn("call(s) failed", err)
        j = json.loads(out)
        self.assertGreater(j["lookups"], 0, j)
        self.assertGreater(j["statusCodeDistribution"].get("Unavailable", 0), 0, j)
        self.assertEqual(j["statusCodeDistribution"]["OK"], j["lookups"])
        self.assertEqual(j["errors"], sum(n for k, n in j["statusCodeDistribution"].items()
                                          if k != "OK"))
        self.assertEqual(j["count"], j["lookups"] + j["errors"])
        self.assertEqual(sum(j["errorDistribution"].values()), j["errors"])
        self.assertTrue(any(k.startswith("UNAVAILABLE: ") for k in j["errorDistribution"]), j)

    def test_bench_open_loop_shows_a_stall(self):
        # The server stops (SIGSTOP) for 0.8 s in the middle of a 3 s open-loop run at 100
        # batches/s: the ~80 calls scheduled during the stall wait for it, so the p99 (and the
        # p90: 80 of ~300 calls) carries it. A closed loop over the same stall sends only one
        # call into it, and its p99 hides it (checked with its max only: the machine is shared).
        def run_with_stall(*mode):
            p = subprocess.Popen([CLI_BIN, "--servers", SERVER.address, "bench", "cli_bench",
                                  "--batch", "64", "--duration", "3", "--warmup", "0", "--json",
                                  *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
            time.sleep(1.2)
            os.kill(SERVER.proc.pid, signal.SIGSTOP)
            time.sleep(0.8)
            os.kill(SERVER.proc.pid, signal.SIGCONT)
            out, err = p.communicate(timeout=CMD_TIMEOUT)
            self.assertEqual(p.returncode, 0, err)
            return json.loads(out)
        j = run_with_stall("--rate", "100")
        self.assertEqual(j["mode"], "open")
        self.assertTrue(299 <= j["count"] <= 301, j["count"])  # the schedule, not the replies
        self.assertGreaterEqual(j["p99_ms"], 600, j)
        self.assertGreaterEqual(j["p90_ms"], 200, j)
        self.assertGreaterEqual(j["max_ms"], 750, j)
        j = run_with_stall()
        self.assertEqual(j["mode"], "closed")
        self.assertGreaterEqual(j["max_ms"], 750, j)

    def test_bench_bad_table(self):
        self.fails(1, ["NOT_FOUND", "nope"], "bench", "nope", "--batch", "8", "--duration", "0.1")
        # a dense table's ids lie in [1, rows): a key space beyond them is refused, named
        self.fails(1, ["--key-space 10000 does not fit table cli_bench, a dense table of 10000 "
                       "rows"], "bench", "cli_bench", "--batch", "8", "--duration", "0.1",
                   "--key-space", "10000")
        self.fails(2, ["--key-space"], "bench", "cli_bench", "--batch", "8", "--key-space", "0")

    def test_bench_key_space_dense(self):
        """--key-space N on a dense table draws ids from [1, N]: after a push-only run, rows
        past N are untouched (their initial values), rows within it moved."""
        self.create("cli_bench_ks", "--rows", "1000", "--emb-width", "4", "--optimizer", "sgd",
                    "--lr", "1", "--seed", "3")
        before = dict(self.lookup("cli_bench_ks", [1, 2, 3, 11, 500, 999]))
        r = self.ok("bench", "cli_bench_ks", "--batch", "64", "--duration", "0.3", "--warmup",
                    "0", "--push-ratio", "1", "--key-space", "3", "--json")
        self.assertEqual(json.loads(r.stdout)["key_space"], 3)
        after = dict(self.lookup("cli_bench_ks", [1, 2, 3, 11, 500, 999]))
        for t in (1, 2, 3):
            self.assertNotEqual(before[t], after[t], t)
        for t in (11, 500, 999):
            self.assertEqual(before[t], after[t], t)


class TestServerCommandLine(unittest.TestCase):
    def run_server(self, *flags, env=None, timeout=15):
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run([SERVER_BIN, "--listen", "127.0.0.1:0", *flags],
                              capture_output=True, text=True, env=full_env, timeout=timeout)

    def test_help_lists_every_flag_with_its_variable(self):
        r = subprocess.run([SERVER_BIN, "--help"], capture_output=True, text=True, timeout=15)
        self.assertEqual(r.returncode, 0)
        out = r.stdout + r.stderr
        listed = set(re.findall(r"(?m)^  --([a-z0-9-]+)\s", out)) - {"help"}
        # These flags at least; flags added later must follow the same pattern.
        self.assertLessEqual(set(SERVER_FLAGS), listed)
        self.assertFalse(set(REMOVED_SERVER_FLAGS) & listed)
        for flag in sorted(listed):
            env = "EMBPS_" + flag.upper().replace("-", "_")
            self.assertRegex(out, r"(?m)^  --%s\s[^\n]*\n\s+env %s\n" % (re.escape(flag), env))
        # A default is printed where there is one, never an empty one.
        self.assertRegex(out, r"--max-connections\s[^\n]*\(default 4096\)\n")
        self.assertNotIn("(default )", out)

    def test_bad_values_exit_nonzero_naming_the_flag(self):
        cases = [(["--max-message-bytes", "12x"], {}, "--max-message-bytes"),
                 (["--max-connections", "-1"], {}, "--max-connections"),
                 (["--stall-timeout-ms", ""], {}, "--stall-timeout-ms"),
                 (["--log-level", "loud"], {}, "--log-level"),
                 (["--device", "abacus"], {}, "--device: 'abacus' is not auto, cpu, cuda or cuda:N"),
                 (["--device", "cpu:1"], {}, "--device"),
                 (["--checkpoint-full-every", "0"], {}, "--checkpoint-full-every: 0"),
                 (["--control-fanout", "some"], {},
                  "--control-fanout 'some' is neither auto nor a count"),
                 ([], {"EMBPS_CONTROL_FANOUT": "-2"}, "--control-fanout '-2'"),
                 (["--frobnicate"], {}, "--frobnicate"),
                 (["--max-connections"], {}, "--max-connections"),
                 ([], {"EMBPS_MAX_CONNECTIONS": "abc"}, "EMBPS_MAX_CONNECTIONS"),
                 ([], {"EMBPS_DEVICE": "gpu"}, "--device: 'gpu'"),
                 ([], {"EMBPS_MAX_MESSAGE_BYTES": "lots"}, "EMBPS_MAX_MESSAGE_BYTES")]
        for flag in REMOVED_SERVER_FLAGS:
            cases.append((["--" + flag, "1"], {}, "unknown flag '--%s'" % flag))
        for flags, env, name in cases:
            r = self.run_server(*flags, env=env)
            self.assertEqual(r.returncode, 2, (flags, env, r.stderr))
            self.assertIn(name, r.stderr, (flags, env))
        r = self.run_server("--listen", "not-an-address")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("not-an-address", r.stderr)

    def test_environment_sets_max_message_bytes(self):
        small = Server(env={"EMBPS_MAX_MESSAGE_BYTES": "4K"})
        try:
            addr = small.address
            r = embps("create-table", "envt", "--rows", "1000", "--emb-width", "4", servers=addr)
            self.assertEqual(r.returncode, 0, r.stderr)
            r = embps("lookup", "envt", "--tokens", ",".join(["7"] * 600), servers=addr)
            self.assertEqual(r.returncode, 1)
            self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
            self.assertIn("larger than max", r.stderr)
            self.assertIn("4096", r.stderr)
            r = embps("lookup", "envt", "--tokens", ",".join(["7"] * 100), servers=addr)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(len(r.stdout.splitlines()), 100)
        finally:
            self.assertEqual(small.close(), 0)
        # The flag wins over the variable.
        big = Server("--max-message-bytes", "1M", env={"EMBPS_MAX_MESSAGE_BYTES": "4K"})
        try:
            addr = big.address
            self.assertEqual(embps("create-table", "envt", "--rows", "1000", "--emb-width", "4",
                                   servers=addr).returncode, 0)
            r = embps("lookup", "envt", "--tokens", ",".join(["7"] * 600), servers=addr)
            self.assertEqual(r.returncode, 0, r.stderr)
        finally:
            self.assertEqual(big.close(), 0)

    def test_addresses_refused_naming_the_setting(self):
        cases = [(["--listen", "[::1]7070"], {}, "--listen '[::1]7070' is not [ipv6]:port"),
                 (["--peers", "a:1,b"], {}, "--peers entry 'b' has no port"),
                 (["--peers", "a:1,,b:2"], {}, "empty --peers entry"),
                 ([], {"EMBPS_PEERS": "h:0"}, "EMBPS_PEERS entry 'h:0' has a bad port"),
                 ([], {"EMBPS_LISTEN": "a b:1"}, "EMBPS_LISTEN 'a b:1' has a bad character")]
        for flags, env, want in cases:
            r = self.run_server(*flags, env=env)
            self.assertEqual(r.returncode, 2, (flags, env, r.stderr))
            self.assertIn(want, r.stderr, (flags, env))

    def test_host_names_for_peers_listen_and_servers(self):
        """A group of one named by this machine's host name: the server serves on its --peers
        entry (resolved by name), and the CLI reaches it by the same name."""
        name = socket.gethostname()
        try:
            socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            self.skipTest("this host's name (%r) does not resolve" % name)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            self.skipTest("this host's name (%r) is not a DNS name" % name)
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        addr = "%s:%d" % (name, port)
        env = dict(os.environ)
        env.pop("EMBPS_LISTEN", None)
        proc = subprocess.Popen([SERVER_BIN, "--peers", addr], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline, text = time.time() + 30, ""
            while time.time() < deadline and "listening on" not in text:
                line = proc.stdout.readline()
                if not line:
                    break
                text += line
            self.assertIn("listening on %s" % addr, text)
            # Listening comes before the group (of one) has formed: NOT_SERVING until it has.
            for _ in range(100):
                r = embps("health", servers=addr)
                if r.returncode == 0 or "NOT_SERVING" not in r.stderr:
                    break
                time.sleep(0.1)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), "SERVING")
        finally:
            proc.terminate()
            code = proc.wait(timeout=20)
            proc.stdout.close()
        self.assertEqual(code, 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
