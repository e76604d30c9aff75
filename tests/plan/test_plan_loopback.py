"""`embps plan`'s predictions against real groups of 1, 2 and 4 ranks on loopback (issue 34):
each rank's resident memory grows by the plan's rows and optimizer state when the table is
created and by its checkpoint snapshot at the first checkpoint, which writes the plan's checkpoint
bytes on each rank, and the bytes each rank takes from and gives to its clients and sends to its peers over
a load of lookups and pushes are the plan's per-op figures times the ops counted, all within
20%. A plan whose constants were wrong (a row's bytes, a round's peer payload) fails here.

Run with /usr/bin/python3; EMBPS_SERVER_BIN and EMBPS_CLI_BIN name the binaries."""
import shutil
import sys
import tempfile
import unittest

import planlib
from planlib import metricslib as ml

ROWS = 400000       # 104 MB of rows and rowwise state on one rank, 27 MB a rank on four
WIDTH = 64
TOKENS = 4096       # a batch: large next to a message's few framing bytes
OPTIMIZER = "rowwise_adagrad"


class PlanLoopback(unittest.TestCase):
    def check_group(self, n):
        p = planlib.plan("--group-size", str(n), "--rows", str(ROWS), "--emb-width", str(WIDTH),
                         "--optimizer", OPTIMIZER, "--tokens-per-batch", str(TOKENS))
        ckpt = tempfile.mkdtemp(prefix="embps-plan-ckpt.")
        g, urls = ml.metrics_group(n, "--checkpoint-dir", ckpt)
        try:
            before = [planlib.rss_bytes(proc.pid) for proc in g.procs]
            ml.cli(g.servers, "create-table", "t", "--rows", str(ROWS), "--emb-width",
                   str(WIDTH), "--optimizer", OPTIMIZER)
            after = [planlib.rss_bytes(proc.pid) for proc in g.procs]
            want = p["memory"]["rows"] + p["memory"]["optimizer_state"]
            for r in range(n):
                grew = after[r] - before[r]
                print("[plan] %d ranks, rank %d: RSS grew %d bytes at CreateTable, plan says rows "
                      "+ state %d (%.3f)" % (n, r, grew, want, grew / want))
                self.assertTrue(planlib.within(grew, want) or planlib.SANITIZED,
                                "rank %d of %d: RSS grew %d bytes, the plan says %d" %
                                (r, n, grew, want))

            c0 = [planlib.counters(ml.scrape(u), "t") for u in urls]
            ml.cli(g.servers, "bench", "t", "--batch", str(TOKENS), "--duration", "2", "--warmup",
                   "0", "--push-ratio", "0.5", "--pipeline", "2", "--json", timeout=120)
            c1 = [planlib.counters(ml.scrape(u), "t") for u in urls]
            for r in range(n):
                d = planlib.delta(c1[r], c0[r])
                self.assertGreater(d["lookups"], 0)
                self.assertGreater(d["pushes"], 0)
                pred = planlib.ops_bytes(p, d["lookups"], d["pushes"])
                for k in ("client_in", "client_out", "peer_sent"):
                    ratio = d[k] / pred[k] if pred[k] else float(d[k] == 0)
                    print("[plan] %d ranks, rank %d: %s %d bytes over %d lookups and %d pushes, "
                          "plan %d (%.3f)" % (n, r, k, d[k], d["lookups"], d["pushes"], pred[k],
                                              ratio))
                    self.assertTrue(planlib.within(d[k], pred[k]),
                                    "rank %d of %d: %s measured %d bytes, the plan says %d" %
                                    (r, n, k, d[k], pred[k]))
                self.assertEqual(d["peer_received"], d["peer_sent"])

            # A checkpoint: each rank writes the plan's bytes, and holds a snapshot of rows and
            # state (the cpu backend's copy-on-write buffers) from then on.
            before = [planlib.rss_bytes(proc.pid) for proc in g.procs]
            ml.cli(g.servers, "checkpoint")
            after = [planlib.rss_bytes(proc.pid) for proc in g.procs]
            c2 = [planlib.counters(ml.scrape(u), "t") for u in urls]
            for r in range(n):
                for what, got, want in (
                        ("checkpoint bytes written", c2[r]["ckpt_written"] - c1[r]["ckpt_written"],
                         p["checkpoint"]["bytes_per_rank"]),
                        ("RSS growth at the checkpoint", after[r] - before[r],
                         p["memory"]["checkpoint_snapshot"])):
                    print("[plan] %d ranks, rank %d: %s %d, plan %d (%.3f)" %
                          (n, r, what, got, want, got / want))
                    self.assertTrue(planlib.within(got, want) or
                                    (planlib.SANITIZED and what.startswith("RSS")),
                                    "rank %d of %d: %s %d, the plan says %d" %
                                    (r, n, what, got, want))
        finally:
            codes = g.close()
            shutil.rmtree(ckpt, ignore_errors=True)
        self.assertTrue(all(c == 0 for c in codes.values()), codes)

    def test_one_rank(self):
        self.check_group(1)

    def test_two_ranks(self):
        self.check_group(2)

    def test_four_ranks(self):
        self.check_group(4)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
