"""Bitwise independence of the group size, through real server processes: one deterministic
sequence of sync pushes (duplicates, padding token 0, weight decay, one push with a NaN and one
with an infinity, which the gate skips) and lookups, for every optimizer in f32 and bf16, on a
table of 256 columns (a shard width that is a multiple of the 32-column row-statistics block on
1, 2, 4 and 8 ranks; 2 ranks gather the row statistics whole, 4 and 8 combine them by owner). Every lookup, the final rows and every
push reply's grad_norm and num_unique must be bitwise those of the 1-rank group (the last lookup's
reply is large enough to leave in several chunks), and a second
1-rank run must repeat the first bit for bit. (test_group_consistency covers widths that do not
split into whole blocks, where results agree to rounding.)

The t_inplace tables (f32, no weight decay, 4096 rows) take pushes of 96 tokens, mostly
distinct: 96 KiB requests, which the network layer reads from the socket straight into the
message buffer, where the cpu backend's push reads its gradients in place; the bits must still
agree."""
import hashlib
import struct
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

ROWS, WIDTH, STEPS = 48, 256, 8
BIG = 8192  # tokens of the last lookup: 8 MiB of f32 rows over the group
SIZES = (1, 2, 4, 8)
BATCHES = (16, 32, 48)  # divisible by every size
BAD_STEPS = {5: np.nan, 6: np.inf}  # a gradient of a row that is not padding: the step is skipped
OPTS = {
    "sgd": dict(lr=0.05, wd=0.01),
    "adagrad": dict(lr=0.05, half_life=10.0, init_acc=0.1, wd=0.01),
    "rowwise_adagrad": dict(lr=0.05, half_life=5.0, wd=0.001),
    "adam": dict(lr=0.01, b1=0.9, b2=0.999, wd=0.01),
}
DTYPES = {"f32": pb.DTYPE_F32, "bf16": pb.DTYPE_BF16}
IN_PLACE_ROWS, IN_PLACE_BATCH = 4096, 96  # 96 x 256 f32 = 96 KiB: past EMBPS__H2_DIRECT_MIN
IN_PLACE_OPTS = {"rowwise_adagrad": dict(lr=0.05, half_life=5.0), "adam": dict(lr=0.01)}


def to_bf16_bits(a):
    """Round-to-nearest-even f32 -> bf16 bit patterns (finite inputs)."""
    u = np.asarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def script(opt, dtype):
    rng = np.random.default_rng(sorted(OPTS).index(opt) * 7 + len(dtype))
    ops = []
    for step in range(STEPS):
        T = BATCHES[step % len(BATCHES)]
        tokens = rng.integers(0, 24, size=T)
        tokens[step % T] = 0
        tokens[(step + 3) % T] = tokens[(step + 4) % T]
        grads = rng.normal(size=(T, WIDTH)).astype(np.float32)
        grads[:, ::9] *= 40.0  # uneven magnitudes, so the order of additions matters
        if step in BAD_STEPS:
            grads[np.flatnonzero(tokens)[0], 100] = BAD_STEPS[step]
        ops.append(("push", tokens, to_bf16_bits(grads) if dtype == "bf16" else grads))
        if step % 2 == 1:
            ops.append(("lookup", rng.integers(0, 32, size=16)))
    return ops


def script_in_place(opt):
    rng = np.random.default_rng(sorted(IN_PLACE_OPTS).index(opt) + 100)
    ops = []
    for step in range(4):
        tokens = rng.integers(1, IN_PLACE_ROWS, size=IN_PLACE_BATCH)
        tokens[step] = 0  # padding
        tokens[10:14] = tokens[20]  # one token of five positions among the distinct ones
        grads = rng.normal(size=(IN_PLACE_BATCH, WIDTH)).astype(np.float32)
        grads[:, ::9] *= 40.0
        grads[30, :5] = -0.0  # a lone -0.0 reads as +0.0, as its one-position sum is
        ops.append(("push", tokens, grads))
        ops.append(("lookup", np.concatenate([tokens[:40], tokens[10:18]])))
    return ops


def play(client, name, ops):
    """Runs a script's ops on a table; returns what it saw (each push reply, each lookup's rows)."""
    seen = []
    for op in ops:
        if op[0] == "push":
            for resp in client.push(name, op[1], op[2]):
                seen.append(("reply", resp.applied, resp.num_unique,
                             struct.pack("<d", resp.grad_norm)))
        else:
            seen.append(("rows", client.lookup_bytes(name, op[1])))
    return seen


def run_group(n):
    """Runs every table's script through an n-rank group; returns {table: [what it saw]}."""

    def body(client, out):
        for dtype, dt in DTYPES.items():
            for opt, kw in OPTS.items():
                name = "t_%s_%s" % (opt, dtype)
                client.create(name, ROWS, WIDTH, opt, seed=99, dtype=dt, **kw)
                seen = out[name] = play(client, name, script(opt, dtype))
                # Replies of several 1 MiB chunks on a rank of 1 or 2, one chunk on 8: the rows
                # sent as the engine publishes them are those of the whole reply.
                # (A digest: a failing comparison of 8 MiB would spend minutes in difflib.)
                big = client.lookup_bytes(name, np.arange(BIG) * 7 % ROWS)
                seen.append(("big", len(big), hashlib.sha256(big).hexdigest()))
                seen.append(("final", client.lookup_bytes(name, np.arange(ROWS))))
        for opt, kw in IN_PLACE_OPTS.items():
            name = "t_inplace_%s" % opt
            client.create(name, IN_PLACE_ROWS, WIDTH, opt, seed=5, dtype=pb.DTYPE_F32, **kw)
            seen = out[name] = play(client, name, script_in_place(opt))
            seen.append(("final", client.lookup_bytes(name, np.arange(IN_PLACE_ROWS))))

    return gl.run_on_group(n, body)


class BitwiseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = {n: run_group(n) for n in SIZES}
        cls.again = run_group(1)

    def test_exit_codes(self):
        for n, res in list(self.results.items()) + [(1, self.again)]:
            for r, c in res["exit_codes"].items():
                self.assertEqual(c, 0, "%d-rank group, rank %d exited %s\n%s" %
                                 (n, r, c, res["logs"]))

    def test_every_push_applied_but_the_gated(self):
        one = self.results[1]
        for name, seen in one.items():
            if name.startswith("t_"):
                replies = [s for s in seen if s[0] == "reply"]
                self.assertEqual(len(replies), 4 if "inplace" in name else STEPS, name)
                gated = set() if "inplace" in name else set(BAD_STEPS)
                self.assertEqual([bool(s[1]) for s in replies],
                                 [i not in gated for i in range(len(replies))], name)

    def test_bitwise_across_sizes(self):
        one = self.results[1]
        for n in SIZES[1:]:
            got = self.results[n]
            for name, seen in one.items():
                if not name.startswith("t_"):
                    continue
                # Each push answers once per rank: compare each rank's reply with the 1-rank one.
                expect = []
                for s in seen:
                    expect.extend([s] * n if s[0] == "reply" else [s])
                self.assertEqual(len(got[name]), len(expect), name)
                for i, (a, b) in enumerate(zip(got[name], expect)):
                    self.assertEqual(a, b, "%s, %d ranks: item %d (%s) differs from 1 rank's" %
                                     (name, n, i, b[0]))
            # The sequence did move rows (the comparison means something).
            for name in one:
                if name.startswith("t_"):
                    self.assertNotEqual(one[name][-1][1], b"\0" * len(one[name][-1][1]))

    def test_bitwise_run_to_run(self):
        for name, seen in self.results[1].items():
            if name.startswith("t_"):
                self.assertEqual(self.again[name], seen, "%s: a second 1-rank run differs" % name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
