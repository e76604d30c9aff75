"""What users of a shard group meet when they get it wrong, checked against DESIGN.md's error table
word for word: a batch that does not shard evenly (CLI and raw grpcio), an emb_width that does
not (CLI and raw), a bad mesh at startup (exits before listening), CreateTable sent to a
non-leader, a shard sent to the wrong rank, shards of one batch that disagree, a batch whose
shards do not all arrive (the deadline), and ranks whose configurations differ at bootstrap.
After each rejected call the group keeps serving and the table is unchanged."""
import json
import os
import re
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

IA = SC.INVALID_ARGUMENT

# The wording users search for (the brief's error table); docs/design.md's table gives each message
# in full, starting with these words and ending with the remedy.
MESSAGES = {
    "T % N != 0": "tokens_per_batch={T} does not shard evenly over the {N}-rank communicator",
    "D % N != 0": "emb_width={D} does not shard evenly over the {N}-rank communicator",
    "an axis not in the mesh": "axis '{a}' is not a mesh axis of {mesh}",
    "a table axis missing": "requires token shards to vary across the communicator: table_axis "
                            "{missing} missing from data_axis {data_axis}",
    "data_axis splits tokens": "requires exactly one token shard per communicator rank: data_axis "
                               "{data_axis} shards tokens over {K} positions outside table_axis "
                               "{table_axis}",
}


def message(row, **values):
    text = MESSAGES[row]
    return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), text)


class DesignTableTest(unittest.TestCase):
    def test_messages_are_design_md(self):
        for row, text in MESSAGES.items():
            self.assertTrue(gl.design_row(row).startswith(text), (row, gl.design_row(row)))


expect = gl.expect_rpc_error


class TwoRankErrorsTest(unittest.TestCase):
    """One 2-rank group with a 500 ms batch deadline."""

    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(2, "--batch-deadline-ms", "500")
        cls.client = gl.RawClient(cls.group.addresses)
        cls.client.create("e", 100, 8, "sgd", lr=0.1)
        cls.client.create("e2", 100, 8, "sgd", lr=0.1)
        cls.initial = cls.client.lookup("e", np.arange(100), 8)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        codes = cls.group.close()
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes,
                                                                            cls.group.last_logs)

    def assertServing(self):
        """A normal lookup and a push-then-undo work, and table e is as it started."""
        for r, a in enumerate(self.group.addresses):
            self.assertEqual(gl.health(a), gl.SERVING, "rank %d" % r)
        got = self.client.lookup("e", np.arange(100), 8)
        np.testing.assert_array_equal(got, self.initial)

    def raw_lookup(self, rank, table, tokens, T, shard_index=None, shard_count=2, batch_id=None,
                   timeout=10):
        return self.client.stubs[rank].Lookup(pb.LookupRequest(
            table=table, batch_id=gl.next_batch_id() if batch_id is None else batch_id,
            shard_index=rank if shard_index is None else shard_index, shard_count=shard_count,
            tokens_per_batch=T, tokens=np.asarray(tokens, "<i8").tobytes()), timeout=timeout)

    def raw_push(self, rank, table, tokens, T, batch_id=None, timeout=10,
                 mode=pb.UPDATE_MODE_SYNC):
        tok = np.asarray(tokens, "<i8")
        return self.client.stubs[rank].PushGradients(pb.PushGradientsRequest(
            table=table, batch_id=gl.next_batch_id() if batch_id is None else batch_id,
            shard_index=rank, shard_count=2, tokens_per_batch=T, tokens=tok.tobytes(),
            dtype=pb.DTYPE_F32, gradients=np.ones((len(tok), 8), "<f4").tobytes(), mode=mode),
            timeout=timeout)

    # ---- T % N ------------------------------------------------------------------------------------

    def test_tokens_per_batch_cli(self):
        r = gl.run_cli(self.group, "lookup", "e", "--tokens", "1,2,3")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(message("T % N != 0", T=3, N=2), r.stderr)
        r = gl.run_cli(self.group, "push", "e", "--tokens", "1,2,3", "--grad-value", "0.5")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(message("T % N != 0", T=3, N=2), r.stderr)
        # The load tester refuses before sending anything (pushes would change table e), for a
        # single size and for any size of a mix, and pads with the global --pad.
        for how in (["--batch", "1001"], ["--mix", "256:3,1001:1"]):
            r = gl.run_cli(self.group, "bench", "e", *how, "--duration", "1", "--warmup", "0",
                           "--push-ratio", "1", "--json")
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertEqual(r.stdout, "")
            self.assertIn(message("T % N != 0", T=1001, N=2), r.stderr)
        self.assertServing()
        r = gl.run_cli(self.group, "--pad", "bench", "e", "--batch", "3", "--duration", "0.5",
                       "--warmup", "0", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertGreater(json.loads(r.stdout)["lookups"], 0)
        self.assertServing()

    def test_tokens_per_batch_raw(self):
        want = message("T % N != 0", T=3, N=2)
        # Bypassing the client: each rank checks tokens_per_batch itself.
        expect(self, lambda: self.raw_lookup(0, "e", [1, 2], 3), IA, want)
        expect(self, lambda: self.raw_lookup(1, "e", [3], 3), IA, want)
        bid = gl.next_batch_id()
        expect(self, lambda: self.raw_push(0, "e", [1, 2], 3, batch_id=bid), IA, want)
        expect(self, lambda: self.raw_push(1, "e", [3], 3, batch_id=bid), IA, want)
        want5 = message("T % N != 0", T=5, N=2)
        expect(self, lambda: self.raw_lookup(0, "e", [1, 2], 5), IA, want5)
        self.assertServing()

    # ---- CreateTable on a non-leader; shards to the wrong rank -------------------------------------

    def test_create_table_on_rank_1(self):
        spec = gl.table_spec("on_rank_1", 10, 8)
        e = expect(self, lambda: self.client.stubs[1].CreateTable(
            pb.CreateTableRequest(spec=spec), timeout=10), SC.FAILED_PRECONDITION, "rank 0")
        self.assertNotIn("on_rank_1", [t.name for t in self.client.stubs[0].ListTables(
            pb.ListTablesRequest(), timeout=10).tables], e.details())
        self.assertServing()

    def test_wrong_shard_index(self):
        expect(self, lambda: self.raw_lookup(0, "e", [1, 2], 4, shard_index=1), IA,
               "shard_index=1", "rank 0")
        expect(self, lambda: self.raw_lookup(1, "e", [1, 2], 4, shard_index=0), IA,
               "shard_index=0", "rank 1")
        expect(self, lambda: self.raw_lookup(0, "e", [1, 2], 6, shard_count=3), IA,
               "shard_count=3")
        expect(self, lambda: self.raw_lookup(0, "e", [1, 2, 3], 4), IA)  # 3 tokens, needs 2
        self.assertServing()

    # ---- shards that disagree ------------------------------------------------------------------------

    def disagree(self, send0, send1):
        """Sends both shards of one batch concurrently; both must fail INVALID_ARGUMENT with
        'disagree', quickly (not by the deadline)."""
        bid = gl.next_batch_id()
        t0 = time.time()
        f0 = send0(bid)
        f1 = send1(bid)
        for r, f in enumerate((f0, f1)):
            e = gl.rpc_error(lambda: f.result())
            self.assertIsNotNone(e, "rank %d's shard succeeded" % r)
            self.assertEqual(e.code(), IA, e.details())
            self.assertIn("disagree", e.details())
            self.assertIn("batch %d" % bid, e.details())
        self.assertLess(time.time() - t0, 5.0)

    def lookup_future(self, rank, table, tokens, T):
        return lambda bid: self.client.stubs[rank].Lookup.future(pb.LookupRequest(
            table=table, batch_id=bid, shard_index=rank, shard_count=2, tokens_per_batch=T,
            tokens=np.asarray(tokens, "<i8").tobytes()), timeout=10)

    def push_future(self, rank, table, tokens, T):
        tok = np.asarray(tokens, "<i8")
        return lambda bid: self.client.stubs[rank].PushGradients.future(pb.PushGradientsRequest(
            table=table, batch_id=bid, shard_index=rank, shard_count=2, tokens_per_batch=T,
            tokens=tok.tobytes(), dtype=pb.DTYPE_F32,
            gradients=np.ones((len(tok), 8), "<f4").tobytes()), timeout=10)

    def test_disagreeing_tables(self):
        self.disagree(self.lookup_future(0, "e", [1, 2], 4), self.lookup_future(1, "e2", [3, 4], 4))
        self.assertServing()

    def test_disagreeing_kinds(self):
        # A push on rank 1 paired with a lookup on rank 0: the push must not be applied.
        self.disagree(self.lookup_future(0, "e", [1, 2], 4), self.push_future(1, "e", [3, 4], 4))
        self.disagree(self.push_future(0, "e", [1, 2], 4), self.lookup_future(1, "e", [3, 4], 4))
        self.assertServing()

    def test_disagreeing_tokens_per_batch(self):
        self.disagree(self.push_future(0, "e", [1, 2], 4), self.push_future(1, "e", [3, 4, 5], 6))
        self.assertServing()

    # ---- the batch deadline ----------------------------------------------------------------------------

    def test_deadline(self):
        for kind in ("lookup", "push"):
            bid = gl.next_batch_id()
            send = self.raw_lookup if kind == "lookup" else self.raw_push
            t0 = time.time()
            e = expect(self, lambda: send(0, "e", [1, 2], 4, batch_id=bid),
                       SC.DEADLINE_EXCEEDED, "rank(s) 1", "500 ms")
            took = time.time() - t0
            self.assertGreaterEqual(took, 0.4, e.details())
            self.assertLess(took, 3.0, e.details())
            # The missing shard, sent late, fails at once instead of waiting out a deadline.
            t0 = time.time()
            e = expect(self, lambda: send(1, "e", [3, 4], 4, batch_id=bid), SC.DEADLINE_EXCEEDED)
            self.assertLess(time.time() - t0, 0.45, e.details())
            self.assertServing()
        # And the other way round: only rank 1's shard.
        t0 = time.time()
        expect(self, lambda: self.raw_push(1, "e", [3, 4], 4), SC.DEADLINE_EXCEEDED, "rank(s) 0")
        self.assertLess(time.time() - t0, 3.0)
        self.assertServing()
        # Normal batches, pushes included, still work afterwards.
        rs = self.client.push("e2", [1, 2, 0, 1], np.ones((4, 8), np.float32))
        self.assertTrue(all(r.applied for r in rs))

    def test_async_push_is_answered_once_ordered(self):
        """An async push says "ordered" only once the leader has ordered its round: a batch whose
        other shard never comes gets the deadline's error, not a promise of an update that never
        happens; a whole batch is answered ordered, and a later lookup sees it."""
        t0 = time.time()
        e = expect(self, lambda: self.raw_push(0, "e2", [5, 6], 4, mode=pb.UPDATE_MODE_ASYNC),
                   SC.DEADLINE_EXCEEDED, "rank(s) 1")
        self.assertGreaterEqual(time.time() - t0, 0.4, e.details())
        before = self.client.lookup("e2", [7, 8, 9, 10], 8)
        rs = self.client.push("e2", [7, 8, 9, 10], np.ones((4, 8), np.float32),
                              mode=pb.UPDATE_MODE_ASYNC)
        self.assertTrue(all(r.ordered and not r.applied for r in rs), rs)
        after = self.client.lookup("e2", [7, 8, 9, 10], 8)
        np.testing.assert_allclose(after, before - 0.1, rtol=1e-6)
        self.assertServing()


class FourRankErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = gl.Group(4)
        cls.client = gl.RawClient(cls.group.addresses)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        codes = cls.group.close()
        assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes,
                                                                            cls.group.last_logs)

    def tables(self):
        return [t.name for t in self.client.stubs[0].ListTables(pb.ListTablesRequest(),
                                                                timeout=10).tables]

    def test_emb_width(self):
        want = message("D % N != 0", D=6, N=4)
        r = gl.run_cli(self.group, "create-table", "w6", "--rows", "10", "--emb-width", "6")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(want, r.stderr)
        expect(self, lambda: self.client.create("w6", 10, 6), IA, want)
        self.assertNotIn("w6", self.tables())
        # A width that shards evenly works, on every rank.
        self.client.create("w8", 12, 8)
        rows = self.client.lookup("w8", np.arange(12), 8)
        self.assertEqual(rows.shape, (12, 8))

    def test_tokens_per_batch_four(self):
        self.client.create("t4", 12, 8)
        want = message("T % N != 0", T=6, N=4)
        r = gl.run_cli(self.group, "lookup", "t4", "--tokens", "1,2,3,4,5,6")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(want, r.stderr)
        expect(self, lambda: self.client.stubs[2].Lookup(pb.LookupRequest(
            table="t4", batch_id=gl.next_batch_id(), shard_index=2, shard_count=4,
            tokens_per_batch=6, tokens=np.asarray([1], "<i8").tobytes()), timeout=10), IA, want)


class MeshErrorsTest(unittest.TestCase):
    """A mesh DESIGN.md rejects: the process exits non-zero with the message and never listens."""

    def start_bad(self, n, flags, env=None):
        ports, offset = gl.pick_ports(n)
        peers = ",".join("127.0.0.1:%d" % p for p in ports)
        p = gl.Proc(["--rank", "0", "--peers", peers, "--peer-port-offset", str(offset), *flags],
                    env=env)
        try:
            deadline = time.time() + 20
            while p.alive() and time.time() < deadline:
                self.assertFalse(gl.port_open(ports[0]), "it listens on its client port")
                time.sleep(0.01)
            rc = p.wait(0.1)
            self.assertIsNotNone(rc, "still running after 20 s:\n" + p.text())
            self.assertNotEqual(rc, 0, p.text())
            text = p.text()
            self.assertNotIn("listening on", text)
            self.assertFalse(gl.port_open(ports[0]))
            self.assertFalse(gl.port_open(ports[0] + offset))
            return text
        finally:
            p.cleanup()

    def test_axis_not_in_mesh(self):
        text = self.start_bad(2, ["--mesh", "shard=2", "--table-axis", "model"])
        self.assertIn(message("an axis not in the mesh", a="model", mesh="(shard=2)"), text)

    def test_table_axis_missing_from_data_axis(self):
        text = self.start_bad(4, ["--mesh", "batch=2,shard=2", "--table-axis", "batch,shard",
                                  "--data-axis", "shard"])
        self.assertIn(message("a table axis missing", missing="(batch)", data_axis="(shard)"),
                      text)

    def test_data_axis_outside_table_axis(self):
        # Through the environment variables this time.
        text = self.start_bad(4, [], env={"EMBPS_MESH": "batch=2,replica=2",
                                          "EMBPS_TABLE_AXIS": "replica",
                                          "EMBPS_DATA_AXIS": "batch,replica"})
        self.assertIn(message("data_axis splits tokens", data_axis="(batch,replica)", K=2,
                              table_axis="(replica)"), text)


class BootstrapDisagreementTest(unittest.TestCase):
    """Two ranks whose configurations differ: one refuses the other with a message that says
    'differs' and names the key; neither waits past --bootstrap-timeout-ms (3000)."""

    def run_pair(self, flags0, flags1, key):
        ports, offset = gl.pick_ports(2)
        addrs = ["127.0.0.1:%d" % p for p in ports]
        common = ["--peer-port-offset", str(offset), "--bootstrap-timeout-ms", "3000"]
        procs = []
        try:
            for r, extra in enumerate((flags0(addrs), flags1(addrs))):
                procs.append(gl.Proc(["--rank", str(r), *common, *extra]))
            t0 = time.time()
            codes = [p.wait(max(0.1, 15 - (time.time() - t0))) for p in procs]
            took = time.time() - t0
            logs = "\n".join("---- rank %d ----\n%s" % (r, p.text()) for r, p in enumerate(procs))
            self.assertNotIn(None, codes, "a rank still runs 15 s later:\n" + logs)
            self.assertLess(took, 3.0 + 7.0, logs)
            for r, c in enumerate(codes):
                self.assertNotEqual(c, 0, "rank %d exited 0:\n%s" % (r, logs))
                self.assertNotIn("the group is ready", procs[r].text(), logs)
            self.assertRegex(logs, r"differs from rank \d's: %s is " % key)
            for p in procs:  # whichever was refused first, nobody served
                self.assertNotIn("group is ready", p.text())
        finally:
            for p in procs:
                p.cleanup()

    def test_table_axis_differs(self):
        # Same size, another axis name: it parses, but the mesh and its axes differ.
        self.run_pair(lambda a: ["--peers", ",".join(a)],
                      lambda a: ["--peers", ",".join(a), "--mesh", "model=2", "--table-axis",
                                 "model", "--data-axis", "model"],
                      "(mesh|table_axis|data_axis)")

    def test_peers_differ(self):
        # The same addresses spelled differently ("localhost" is 127.0.0.1): bootstrap connects,
        # and the peers lists differ.
        self.run_pair(lambda a: ["--peers", ",".join(a)],
                      lambda a: ["--listen", a[1], "--peers",
                                 ",".join(x.replace("127.0.0.1", "localhost") for x in a)],
                      "peers")


if __name__ == "__main__":
    unittest.main(verbosity=2)
