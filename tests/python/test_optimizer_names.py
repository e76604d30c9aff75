"""The Python library's optimizer names are the C registry's (common/optimizer.h's
EMBPS_OPTIMIZERS): the library maps names to the proto enum on its own, so this holds the two
equal. The C side is read from what the built `embps` prints, which is expanded from the
registry: create-table's --help (the names, the server's default marked, the hyper-parameter
defaults) and the message for an unknown --optimizer. No server is started."""
import inspect
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

import embps  # noqa: E402
from embps import _names as pyclient  # noqa: E402
from embps import values  # noqa: E402

CLI = os.environ.get("EMBPS_CLI_BIN") or os.path.join(
    os.path.dirname(os.path.dirname(HERE)), "build", "bin", "embps")


def cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=30)


def create_table_help():
    r = cli("create-table", "--help")
    assert r.returncode == 0, r.stderr
    lines = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^  (--[a-z0-9-]+)(?: \S+)?\s+(.*)$", line)
        if m:
            lines[m.group(1)] = m.group(2)
    return lines


class OptimizerNamesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.help = create_table_help()
        listed = [n.strip() for n in cls.help["--optimizer"].split(",")]
        cls.c_default = [n[:-len(" (default)")] for n in listed if n.endswith(" (default)")]
        cls.c_names = [n[:-len(" (default)")] if n.endswith(" (default)") else n for n in listed]
        cls.py_names = [n for n in pyclient.OPTIMIZER_NAMES if n not in (None, "default")]

    def test_same_names(self):
        self.assertEqual(self.c_names, ["sgd", "adagrad", "rowwise_adagrad", "adam"])
        self.assertEqual(sorted(self.py_names), sorted(self.c_names))
        self.assertEqual(sorted(set(values.OPTIMIZERS.values())), sorted(self.c_names))

    def test_names_map_to_the_proto_enum(self):
        for n in self.c_names:
            number = pyclient._OPT["OPTIMIZER_" + n.upper()]
            self.assertEqual(pyclient.OPTIMIZER_NAMES[n], number, n)
            self.assertEqual(values.OPTIMIZERS[number], n, n)

    def test_same_default(self):
        self.assertEqual(len(self.c_default), 1, self.help["--optimizer"])
        default = self.c_default[0]
        self.assertEqual(values.OPTIMIZERS[0], default)  # OPTIMIZER_UNSPECIFIED as answered
        sig = inspect.signature(embps.Client.create_table)
        self.assertEqual(sig.parameters["optimizer"].default, default)

    def test_unknown_name_message_lists_the_registry(self):
        r = cli("create-table", "t", "--rows", "4", "--emb-width", "2", "--optimizer", "lion")
        self.assertEqual(r.returncode, 2, r.stderr)
        m = re.search(r"--optimizer: expected one of ([a-z_, ]+)", r.stderr)
        self.assertIsNotNone(m, r.stderr)
        self.assertEqual([n.strip() for n in m.group(1).split(",")], self.c_names)

    def test_same_hyper_parameter_defaults(self):
        doc = " ".join(embps.Client.create_table.__doc__.split())
        for flag, word in (("--lr", "lr"), ("--eps", "eps"), ("--beta1", "beta1"),
                           ("--beta2", "beta2")):
            c = re.search(r"\(0: ([0-9.e+-]+)\)", self.help[flag])
            self.assertIsNotNone(c, self.help[flag])
            py = re.search(r"\b%s ([0-9.e+-]+?)[,)]" % word, doc)
            self.assertIsNotNone(py, "create_table's docstring names no default for " + word)
            self.assertEqual(float(py.group(1)), float(c.group(1)), word)


if __name__ == "__main__":
    unittest.main(verbosity=2)
