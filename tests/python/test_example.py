"""examples/train_mf.py end to end against a real 2-rank group, as a user runs it.

Quick mode, with the group given by EMBPS_SERVERS and the package found by the example itself
(no PYTHONPATH): a progress line per epoch and a final held-out AUC above 0.8. Then --servers
(which wins over a wrong EMBPS_SERVERS), --epochs, sync pushes and --table-prefix (the tables
appear on the group, and a second run with the same prefix stops with a message instead of
training on the first run's rows).

Skips (exit 77, "SKIP: ..." on stdout) where torch is not importable.
Run: /usr/bin/python3 tests/python/test_example.py (ctest -L python)."""
import os
import re
import subprocess
import sys
import unittest

try:
    import torch  # noqa: F401
except ImportError as e:  # Debian's python3-torch (deploy/packages.sh)
    print("SKIP: torch is not importable (%s): install python3-torch" % e)
    sys.exit(77)

from testenv import ROOT, embps, gl  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_mf.py")
GROUP = []


def setUpModule():
    GROUP.append(gl.Group(2))


def tearDownModule():
    codes = GROUP[0].close()
    if any(c != 0 for c in codes.values()):
        raise AssertionError("group exited with %s:\n%s" % (codes, GROUP[0].last_logs))


def run(*args, servers_env):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["EMBPS_SERVERS"] = servers_env
    return subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd="/")


class ExampleTest(unittest.TestCase):
    def test_quick_reaches_auc(self):
        r = run("--quick", servers_env=GROUP[0].servers)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        print(r.stdout, file=sys.stderr)
        epochs = re.findall(r"^epoch (\d+)/(\d+) .* AUC (\d\.\d+)", r.stdout, re.M)
        self.assertGreaterEqual(len(epochs), 2, r.stdout)
        self.assertEqual([int(e[0]) for e in epochs], list(range(1, int(epochs[0][1]) + 1)))
        m = re.search(r"^final held-out AUC: (\d\.\d+)$", r.stdout, re.M)
        self.assertIsNotNone(m, r.stdout)
        self.assertGreater(float(m.group(1)), 0.8, r.stdout)
        self.assertIn("group: 2 rank(s)", r.stdout)

    def test_flags_and_tables(self):
        g = GROUP[0]
        args = ("--quick", "--epochs", "1", "--mode", "sync", "--table-prefix", "ex",
                "--servers", g.servers)
        r = run(*args, servers_env="127.0.0.1:1")  # --servers wins over the environment
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(len(re.findall(r"^epoch \d+/1 ", r.stdout, re.M)), 1, r.stdout)
        self.assertIn("sync pushes", r.stdout)
        with embps.Client(g.servers) as c:
            tables = {t.name: t for t in c.tables()}
            stats = {t.name: t for t in c.stats()[0].tables}
        self.assertEqual((tables["ex_users"].rows, tables["ex_items"].rows), (601, 301))
        self.assertGreater(stats["ex_users"].steps_applied, 0)
        r = run(*args, servers_env="127.0.0.1:1")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("already has a table ex_users", r.stderr)
        self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
