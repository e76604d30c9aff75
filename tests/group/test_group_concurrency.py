"""Concurrency and pipelining through a shard group: 4 client threads, each with its own channel
to every rank, each pushing and looking up its own disjoint token range with many calls in
flight (futures); the shards of one batch go to the ranks in an order that differs between
threads and batches (rank N-1 first, rank 0 first, shuffled), so ranks see the batches of
different clients in different orders. Everything completes within bounded time (no
deadlock); every lookup sees exactly the pushes its client sent before it (DESIGN.md: requests
from one client connection are ordered as sent, even when pipelined; async pushes are seen by
the next lookup), and the final rows equal a sequential numpy reference per range.

Then the C client library through the CLI: a pipelined bench over the group, and stats showing
every rank ready with collective traffic."""
import json
import random
import threading
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

THREADS, RANGE, WIDTH, WINDOW, OPS = 4, 24, 8, 8, 48
ROWS = 4 + THREADS * RANGE  # a multiple of 4; the last 3 rows are never pushed
OPT = dict(lr=0.05, half_life=4.0, wd=0.001)  # rowwise_adagrad: order-sensitive


class Worker(threading.Thread):
    def __init__(self, k, group, table, initial):
        super().__init__(daemon=True)
        self.k, self.group, self.table = k, group, table
        self.lo = 1 + k * RANGE
        self.ref = gl.Reference(initial, "rowwise_adagrad", OPT["lr"], 1e-6, OPT["half_life"],
                                0.0, OPT["wd"])
        self.errors = []
        self.done_ops = 0
        self.final = None

    def order(self, i):
        n = self.group.n
        kind = (self.k + i) % 3
        if kind == 0:
            return list(range(n))
        if kind == 1:
            return list(reversed(range(n)))
        o = list(range(n))
        random.Random(self.k * 1000 + i).shuffle(o)
        return o

    def check(self, item):
        kind, futs, want = item
        try:
            if kind == "lookup":
                got = gl.RawClient.rows_of(futs, WIDTH)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
            else:
                norm, uniq, mode = want
                for r, f in enumerate(futs):
                    resp = f.result()
                    if mode == pb.UPDATE_MODE_SYNC:
                        assert resp.applied and not resp.skipped, resp
                        assert resp.num_unique == uniq, (resp.num_unique, uniq)
                        assert abs(resp.grad_norm - norm) <= 1e-5 * norm, (resp.grad_norm, norm)
                    else:
                        assert resp.ordered, resp
            self.done_ops += 1
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.errors.append("thread %d: %s: %s" % (self.k, kind, str(e)[:500]))

    def run(self):
        client = gl.RawClient(self.group.addresses)
        rng = np.random.default_rng(self.k + 100)
        n = self.group.n
        inflight = []
        try:
            for i in range(OPS):
                T = 4 * n * (1 + i % 2)
                tokens = rng.integers(self.lo, self.lo + RANGE, size=T)
                tokens[i % T] = 0  # padding token in every batch
                if i % 3 == 2:
                    _, futs = client.lookup_async(self.table, tokens, order=self.order(i))
                    inflight.append(("lookup", futs, self.ref.rows(tokens)))
                else:
                    grads = rng.normal(size=(T, WIDTH)).astype(np.float32)
                    mode = pb.UPDATE_MODE_ASYNC if i % 4 == 3 else pb.UPDATE_MODE_SYNC
                    _, futs = client.push_async(self.table, tokens, grads, mode,
                                                order=self.order(i))
                    norm, uniq = self.ref.push(tokens, grads)
                    inflight.append(("push", futs, (norm, uniq, mode)))
                while len(inflight) >= WINDOW:
                    self.check(inflight.pop(0))
            while inflight:
                self.check(inflight.pop(0))
            self.final = client.lookup(self.table, np.arange(self.lo, self.lo + RANGE), WIDTH)
        except Exception as e:  # noqa: BLE001
            self.errors.append("thread %d: %s" % (self.k, repr(e)[:500]))
        finally:
            client.close()


class ConcurrencyTest(unittest.TestCase):
    def run_group(self, n):
        group = gl.Group(n)
        try:
            client = gl.RawClient(group.addresses)
            client.create("conc", ROWS, WIDTH, "rowwise_adagrad", seed=5, **OPT)
            initial = client.lookup("conc", np.arange(ROWS), WIDTH)
            workers = [Worker(k, group, "conc", initial) for k in range(THREADS)]
            t0 = time.time()
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=max(1.0, 120 - (time.time() - t0)))
            hung = [w.k for w in workers if w.is_alive()]
            self.assertEqual(hung, [], "threads still running after 120 s (deadlock?):\n" +
                             group.logs())
            errors = [e for w in workers for e in w.errors]
            self.assertFalse(errors, "\n".join(errors[:5]))
            for w in workers:
                self.assertEqual(w.done_ops, OPS)
                want = w.ref.rows(np.arange(w.lo, w.lo + RANGE))
                np.testing.assert_allclose(w.final, want, rtol=1e-6, atol=1e-7,
                                           err_msg="thread %d's range, %d ranks" % (w.k, n))
                self.assertFalse(np.allclose(w.final, initial[w.lo:w.lo + RANGE]))
            # The whole table: padding row zero, every range as its thread left it.
            final = client.lookup("conc", np.arange(ROWS), WIDTH)
            self.assertTrue(np.all(final[0] == 0))
            np.testing.assert_array_equal(final[1 + THREADS * RANGE:], initial[1 + THREADS * RANGE:])
            for w in workers:
                np.testing.assert_array_equal(final[w.lo:w.lo + RANGE], w.final)
            client.close()
        finally:
            group.close_checked(self)

    def test_two_ranks(self):
        self.run_group(2)

    def test_four_ranks(self):
        self.run_group(4)

    def test_cli_bench_and_stats(self):
        group = gl.Group(2)
        try:
            r = gl.run_cli(group, "create-table", "bench", "--rows", "5000", "--emb-width", "16")
            self.assertEqual(r.returncode, 0, r.stderr)
            r = gl.run_cli(group, "bench", "bench", "--batch", "256", "--duration", "2",
                           "--warmup", "0.5", "--concurrency", "2", "--pipeline", "4",
                           "--push-ratio", "0.5", "--json", timeout=90)
            self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
            out = json.loads(r.stdout)
            self.assertGreater(out["lookups"], 0, out)
            self.assertGreater(out["pushes"], 0, out)
            self.assertEqual(out.get("errors", 0), 0, out)
            r = gl.run_cli(group, "stats", "--json")
            self.assertEqual(r.returncode, 0, r.stderr)
            stats = json.loads(r.stdout)
            self.assertEqual(sorted(s["rank"] for s in stats), [0, 1])
            for s in stats:
                self.assertEqual(s["group_size"], 2, s)
                self.assertIs(s["ready"], True, s)
                self.assertEqual(s["mesh"], "shard=2", s)
                self.assertGreater(s["peer_bytes_sent"], 0, s)
                self.assertGreater(s["peer_bytes_received"], 0, s)
                t = {t["name"]: t for t in s["tables"]}["bench"]
                self.assertGreater(t["lookups"], 0, s)
                self.assertGreater(t["pushes"], 0, s)
        finally:
            group.close_checked(self)


if __name__ == "__main__":
    unittest.main(verbosity=2)
