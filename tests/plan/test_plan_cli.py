"""`embps plan` as a command (issue 34): a table the group would refuse is refused with the
group's own message; several tables from a --tables file add up; the dtype, the optimizer, the
group size and a hash-keyed table's index move the figures as the store's arithmetic says; bad
input is a usage error (exit 2). No server is started.

Run with /usr/bin/python3; EMBPS_CLI_BIN names the binary."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import planlib
from embps_servers import cli_binary

BASE = ["--rows", "1000", "--emb-width", "64", "--tokens-per-batch", "1024"]


def run(*args):
    return subprocess.run([cli_binary(), "plan", *args], capture_output=True, text=True,
                          timeout=60)


class PlanCli(unittest.TestCase):
    def test_refuses_what_the_group_refuses(self):
        r = run("--group-size", "256", "--rows", "1000", "--emb-width", "128",
                "--tokens-per-batch", "65536")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("emb_width=128 does not shard evenly over the 256-rank communicator",
                      r.stderr)
        r = run("--group-size", "3", "--rows", "1000", "--emb-width", "3",
                "--tokens-per-batch", "1000")
        self.assertEqual(r.returncode, 1)
        self.assertIn("tokens_per_batch=1000 does not shard evenly over the 3-rank", r.stderr)

    def test_usage_errors(self):
        for args in (BASE, ["--group-size", "0", *BASE], ["--group-size", "2", "--rows", "10"],
                     ["--group-size", "2", *BASE, "--backend", "tpu"],
                     ["--group-size", "2", *BASE, "--dtype", "f16"]):
            r = run(*args)
            self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
            self.assertIn("embps: plan:", r.stderr)

    def test_figures_follow_the_layout(self):
        f32 = planlib.plan("--group-size", "2", *BASE, "--optimizer", "sgd")
        self.assertEqual(f32["memory"]["rows"], 1000 * 32 * 4)
        self.assertEqual(f32["memory"]["optimizer_state"], 0)
        bf16 = planlib.plan("--group-size", "2", *BASE, "--optimizer", "sgd", "--dtype", "bf16")
        self.assertEqual(bf16["memory"]["rows"], f32["memory"]["rows"] // 2)
        adam = planlib.plan("--group-size", "2", *BASE, "--optimizer", "adam")
        self.assertEqual(adam["memory"]["optimizer_state"], 1000 * 32 * 4 * 2)
        rowwise = planlib.plan("--group-size", "4", *BASE, "--optimizer", "rowwise_adagrad")
        self.assertEqual(rowwise["memory"]["optimizer_state"], 1000 * 4)  # per row, every rank
        one = planlib.plan("--group-size", "1", *BASE)
        self.assertEqual(one["bytes_per_step"]["peer_lookup"], 0)
        self.assertEqual(one["memory"]["checkpoint_snapshot"],
                         one["memory"]["rows"] + one["memory"]["optimizer_state"])
        none = planlib.plan("--group-size", "1", *BASE, "--no-checkpoints")
        self.assertEqual(none["memory"]["checkpoint_snapshot"], 0)
        self.assertEqual(none["checkpoint"]["bytes_per_rank"], 0)
        # A checkpoint holds every row's values and state, and a little more.
        ck = one["checkpoint"]["bytes_per_rank"]
        self.assertGreater(ck, one["memory"]["rows"] + one["memory"]["optimizer_state"])
        self.assertLess(ck, 1.01 * (one["memory"]["rows"] + one["memory"]["optimizer_state"]) +
                        8192)

    def test_ordering_through_control_relays(self):
        # From 16 ranks (auto) a batch's notice and its ROUND each take two hops through a relay:
        # two more one-way delays per op, two ops a step; --control-fanout as the servers have it.
        wide = ["--rows", "1000", "--emb-width", "64", "--tokens-per-batch", "1024",
                "--link-delay-ms", "1"]
        for n, relays in ((8, False), (16, True), (64, True)):
            auto = planlib.plan("--group-size", str(n), *wide)
            star = planlib.plan("--group-size", str(n), *wide, "--control-fanout", "0")
            forced = planlib.plan("--group-size", str(n), *wide, "--control-fanout", "2")
            d = lambda p: p["step_time_s"]["one_way_delays"]  # noqa: E731
            self.assertEqual(d(auto) - d(star), 4 if relays else 0, n)
            self.assertEqual(d(forced) - d(star), 4, n)
            self.assertEqual(auto["control_fanout"], {8: 0, 16: 4, 64: 8}[n])
            self.assertAlmostEqual(auto["step_time_s"]["link_delay"], d(auto) * 1e-3, places=9)
        one = planlib.plan("--group-size", "1", *wide, "--control-fanout", "2")
        self.assertEqual(one["step_time_s"]["one_way_delays"], 4)  # request and reply, per op
        r = run("--group-size", "16", *wide, "--control-fanout", "x")
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("--control-fanout", r.stderr)

    def test_hash_index_and_sketch(self):
        h1 = planlib.plan("--group-size", "2", "--capacity", "100000", "--emb-width", "64",
                          "--tokens-per-batch", "1024")
        self.assertGreater(h1["memory"]["hash_index"], 100000 * 8)
        self.assertEqual(h1["memory"]["admission_sketch"], 0)
        h2 = planlib.plan("--group-size", "2", "--capacity", "100000", "--emb-width", "64",
                          "--tokens-per-batch", "1024", "--admit-after", "2")
        self.assertEqual(h2["memory"]["hash_index"], h1["memory"]["hash_index"])
        self.assertGreaterEqual(h2["memory"]["admission_sketch"], 4 * 100000)

    def test_tables_file_adds_up(self):
        a = planlib.plan("--group-size", "2", "--rows", "1000", "--emb-width", "64",
                         "--tokens-per-batch", "1024")
        b = planlib.plan("--group-size", "2", "--rows", "5000", "--emb-width", "32",
                         "--dtype", "bf16", "--tokens-per-batch", "2048")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"tables": [
                {"name": "a", "rows": 1000, "emb_width": 64},
                {"name": "b", "rows": 5000, "emb_width": 32, "dtype": "bf16",
                 "tokens_per_batch": 2048}]}, f)
        try:
            both = planlib.plan("--group-size", "2", "--tables", f.name,
                                "--tokens-per-batch", "1024")
            bad = run("--group-size", "2", "--tables", f.name)  # a lacks tokens_per_batch
        finally:
            os.unlink(f.name)
        self.assertEqual([t["name"] for t in both["tables"]], ["a", "b"])
        for k in ("rows", "optimizer_state"):
            self.assertEqual(both["memory"][k], a["memory"][k] + b["memory"][k])
        for k in ("client_to_server_push", "server_to_client_lookup", "peer_lookup"):
            self.assertEqual(both["bytes_per_step"][k],
                             a["bytes_per_step"][k] + b["bytes_per_step"][k])
        self.assertEqual(bad.returncode, 2)
        self.assertIn("tokens_per_batch", bad.stderr)

    def test_text_output(self):
        r = run("--group-size", "2", *BASE)
        self.assertEqual(r.returncode, 0, r.stderr)
        for line in ("memory per rank", "optimizer state", "peer <-> peer, push",
                     "step (lookup, then push)", "checkpoint write", "binds first:"):
            self.assertIn(line, r.stdout)


if __name__ == "__main__":
    sys.exit(0 if unittest.main(exit=False, verbosity=2).result.wasSuccessful() else 1)
