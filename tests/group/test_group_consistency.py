"""Results do not depend on the group's size: one table per optimizer (same seed) and one
deterministic sequence of sync pushes and lookups (duplicates and padding token 0 included,
batch sizes divisible by 1, 2, 3 and 4) through groups of 1, 2, 3 and 4 ranks, with raw grpcio
calls that split the shards by hand and send them to the ranks concurrently. Rows before any push
are bitwise those of the 1-rank group; every lookup and the final rows agree with the 1-rank
group to 1e-6 relative (atol 1e-7) and with a numpy reference of the optimizer; every rank's
push reply carries the whole batch's grad_norm and num_unique."""
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

ROWS, WIDTH, STEPS = 60, 12, 10  # 60 tokens and 12 columns divide by 1, 2, 3 and 4
SIZES = (1, 2, 3, 4)
BATCHES = (12, 24, 36)
OPTS = {
    "sgd": dict(lr=0.05, wd=0.01),
    "adagrad": dict(lr=0.05, half_life=10.0, init_acc=0.1),
    "rowwise_adagrad": dict(lr=0.05, half_life=5.0, wd=0.001),
    "adam": dict(lr=0.01),
}
ALL = np.arange(ROWS)


def script(opt):
    """The deterministic sequence for one optimizer: ("push", tokens, grads) and
    ("lookup", tokens)."""
    rng = np.random.default_rng(sorted(OPTS).index(opt) + 11)
    ops = []
    for step in range(STEPS):
        T = BATCHES[step % len(BATCHES)]
        tokens = rng.integers(0, 20, size=T)  # heavy duplication, padding (0) included
        tokens[step % T] = 0
        tokens[(step + 5) % T] = tokens[(step + 6) % T]
        grads = rng.normal(size=(T, WIDTH)).astype(np.float32)
        ops.append(("push", tokens, grads))
        if step % 3 == 1:
            ops.append(("lookup", rng.integers(0, 24, size=12)))
    return ops


def run_group(n):
    """Runs every optimizer's script through an n-rank group; returns
    {opt: {"initial", "lookups", "final", "replies"}}."""

    def body(client, out):
        for opt, kw in OPTS.items():
            client.create("t_" + opt, ROWS, WIDTH, opt, seed=1234, **kw)
        for opt in OPTS:
            name = "t_" + opt
            res = out[opt] = {"lookups": [], "replies": []}
            res["initial"] = client.lookup(name, ALL, WIDTH)
            for op in script(opt):
                if op[0] == "push":
                    res["replies"].append(client.push(name, op[1], op[2]))
                else:
                    res["lookups"].append(client.lookup(name, op[1], WIDTH))
            res["final"] = client.lookup(name, ALL, WIDTH)

    return gl.run_on_group(n, body)


class ConsistencyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {n: run_group(n) for n in SIZES}

    def test_exit_codes(self):
        for n in SIZES:
            for r, c in self.results[n]["exit_codes"].items():
                self.assertEqual(c, 0, "%d-rank group, rank %d exited %s\n%s" %
                                 (n, r, c, self.results[n]["logs"]))

    def test_initial_rows_bitwise(self):
        for opt in OPTS:
            one = self.results[1][opt]["initial"]
            self.assertTrue(np.all(one[0] == 0), "padding row reads zero")
            self.assertGreater(np.abs(one[1:]).min(), 0)
            for n in SIZES[1:]:
                got = self.results[n][opt]["initial"]
                self.assertEqual(got.tobytes(), one.tobytes(),
                                 "%s: %d-rank rows before any push differ from 1-rank" % (opt, n))

    def test_rows_agree_across_sizes(self):
        for opt in OPTS:
            one = self.results[1][opt]
            for n in SIZES[1:]:
                got = self.results[n][opt]
                for i, (a, b) in enumerate(zip(got["lookups"], one["lookups"])):
                    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                               err_msg="%s: lookup %d, %d ranks" % (opt, i, n))
                np.testing.assert_allclose(got["final"], one["final"], rtol=1e-6, atol=1e-7,
                                           err_msg="%s: final rows, %d ranks vs 1" % (opt, n))
                # Something changed, and only the pushed rows (tokens < 20) did.
                self.assertFalse(np.allclose(got["final"][1:20], got["initial"][1:20]))
                self.assertEqual(got["final"][20:].tobytes(), got["initial"][20:].tobytes())

    def test_rows_match_reference(self):
        for opt, kw in OPTS.items():
            for n in SIZES:
                got = self.results[n][opt]
                ref = gl.Reference(got["initial"], opt, kw.get("lr"), 1e-6, kw.get("half_life", 0.0),
                                   kw.get("init_acc", 0.0), kw.get("wd", 0.0))
                lookups = iter(got["lookups"])
                replies = iter(got["replies"])
                for i, op in enumerate(script(opt)):
                    if op[0] == "push":
                        norm, uniq = ref.push(op[1], op[2])
                        rs = next(replies)
                        self.assertEqual(len(rs), n)
                        for r, resp in enumerate(rs):
                            where = "%s, %d ranks, op %d, rank %d" % (opt, n, i, r)
                            self.assertTrue(resp.applied, where)
                            self.assertFalse(resp.skipped, where)
                            self.assertEqual(resp.shard_index, r, where)
                            self.assertEqual(resp.num_unique, uniq, where)
                            self.assertAlmostEqual(resp.grad_norm, norm, delta=1e-5 * norm,
                                                   msg=where)
                    else:
                        np.testing.assert_allclose(next(lookups), ref.rows(op[1]), rtol=1e-6,
                                                   atol=1e-7,
                                                   err_msg="%s, %d ranks, op %d" % (opt, n, i))
                np.testing.assert_allclose(got["final"], ref.rows(ALL), rtol=1e-6, atol=1e-7,
                                           err_msg="%s: final rows, %d ranks vs numpy" % (opt, n))


if __name__ == "__main__":
    unittest.main(verbosity=2)
