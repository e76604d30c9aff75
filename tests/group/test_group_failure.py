"""A rank killed mid-stream: a client keeps pipelined lookups and pushes going through a 2-rank
(and a 3-rank, and a 6-rank one with control relays whose relay or member dies) group, with some shards parked on the survivors (their batch's other shards never
sent), and rank 1 gets SIGKILL. Calls pending on the survivors fail with UNAVAILABLE within a few
seconds (not at the 10 s batch deadline, not at the 30 s peer timeout, not never); later calls
fail at once with UNAVAILABLE saying the group is broken; health says NOT_SERVING and stats
ready=false; the survivors still exit 0 on SIGTERM."""
import os
import signal
import threading
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

WIDTH = 6
ROWS = 96
FAIL_WITHIN = 5.0  # seconds from the kill to every pending call's error


class Stream(threading.Thread):
    """Pipelined lookups and pushes (4 in flight) until stopped or broken."""

    def __init__(self, group):
        super().__init__(daemon=True)
        self.group, self.stop = group, threading.Event()
        self.ok = 0
        self.rank_errors = {}  # rank -> [(status code, details, seconds since the kill)]
        self.kill_time = None

    def run(self):
        client = gl.RawClient(self.group.addresses)
        rng = np.random.default_rng(3)
        n = self.group.n
        inflight = []
        try:
            i = 0
            while not self.stop.is_set() and i < 100000:
                i += 1
                tokens = rng.integers(0, ROWS, size=4 * n)
                if i % 2:
                    _, futs = client.push_async("k", tokens,
                                                rng.normal(size=(4 * n, WIDTH)).astype("f4"),
                                                timeout=30)
                else:
                    _, futs = client.lookup_async("k", tokens, timeout=30)
                inflight.append(futs)
                if len(inflight) >= 4:
                    broken = self.reap(inflight.pop(0))
                    if broken:
                        break
            while inflight:
                self.reap(inflight.pop(0))
        finally:
            client.close()

    def reap(self, futs):
        broken = False
        for r, f in enumerate(futs):
            e = gl.rpc_error(f.result)
            if e is None:
                self.ok += 1
            else:
                since = time.time() - self.kill_time if self.kill_time else None
                self.rank_errors.setdefault(r, []).append((e.code(), e.details(), since))
                broken = True
        return broken


class RankKilledTest(unittest.TestCase):
    def setUp(self):
        self.group = None

    def tearDown(self):
        if self.group:
            self.group.close()

    def kill_mid_stream(self, n, quiesce=False, victim=1, flags=()):
        """Returns (group, client, parked futures by rank, stream) after SIGKILL of rank victim
        (flags go to every rank). quiesce: the stream stops before the kill (the survivors are
        idle but for the parked calls, so none of them learns of the death through a
        collective)."""
        group = self.group = gl.Group(n, *flags)
        client = gl.RawClient(group.addresses)
        client.create("k", ROWS, WIDTH, "adagrad")
        stream = Stream(group)
        stream.start()
        self.assertTrue(gl.wait_for(lambda: stream.ok >= 40 or not stream.is_alive(), 30),
                        "the stream did not get going")
        self.assertEqual(stream.rank_errors, {})
        if quiesce:
            stream.stop.set()
            stream.join(timeout=30)
            self.assertFalse(stream.is_alive())
            self.assertEqual(stream.rank_errors, {})
        # Shards of batches whose other shards never come: parked on every survivor.
        parked = {}
        for r in range(n):
            if r == victim:
                continue
            bid = gl.next_batch_id()
            parked[r] = client.stubs[r].Lookup.future(pb.LookupRequest(
                table="k", batch_id=bid, shard_index=r, shard_count=n, tokens_per_batch=n,
                tokens=np.asarray([1], "<i8").tobytes()), timeout=FAIL_WITHIN + 3)
        time.sleep(0.2)
        for r, f in parked.items():
            self.assertFalse(f.done(), "rank %d answered a batch missing shards" % r)
        stream.kill_time = time.time()
        group.kill(victim)
        stream.join(timeout=FAIL_WITHIN + 10)
        self.assertFalse(stream.is_alive(), "the stream still waits 15 s after the kill:\n" +
                         group.logs())
        stream.stop.set()
        return group, client, parked, stream

    def check_survivor(self, group, client, parked, stream, r):
        kill = stream.kill_time
        # The call parked before the kill.
        e = gl.rpc_error(parked[r].result)
        self.assertIsNotNone(e, "rank %d answered a lookup missing a shard" % r)
        self.assertEqual(e.code(), SC.UNAVAILABLE, "rank %d: %s" % (r, e.details()))
        self.assertIn("broken", e.details())
        self.assertLess(time.time() - kill, FAIL_WITHIN + 1,
                        "rank %d's parked call failed too late" % r)
        # The stream's calls on this rank that failed did so with UNAVAILABLE, in time.
        for code, details, since in stream.rank_errors.get(r, []):
            self.assertEqual(code, SC.UNAVAILABLE, "rank %d: %s" % (r, details))
            self.assertLess(since, FAIL_WITHIN, "rank %d: %s" % (r, details))
        # Later calls fail at once, saying the group is broken.
        t0 = time.time()
        tok = np.asarray([1], "<i8").tobytes()
        for call in (lambda: client.stubs[r].Lookup(pb.LookupRequest(
                         table="k", batch_id=gl.next_batch_id(), shard_index=r,
                         shard_count=group.n, tokens_per_batch=group.n, tokens=tok), timeout=10),
                     lambda: client.stubs[r].PushGradients(pb.PushGradientsRequest(
                         table="k", batch_id=gl.next_batch_id(), shard_index=r,
                         shard_count=group.n, tokens_per_batch=group.n, tokens=tok,
                         dtype=pb.DTYPE_F32, gradients=np.ones(WIDTH, "<f4").tobytes()),
                         timeout=10)):
            e = gl.rpc_error(call)
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.UNAVAILABLE, "rank %d: %s" % (r, e.details()))
            self.assertIn("the shard group is broken", e.details())
            self.assertIn("rank", e.details())
        self.assertLess(time.time() - t0, 2.0, "rank %d: later calls are slow to fail" % r)
        self.assertEqual(gl.health(group.addresses[r]), gl.NOT_SERVING, "rank %d" % r)
        stats = client.stubs[r].GetStats(pb.GetStatsRequest(), timeout=10)
        self.assertFalse(stats.ready, "rank %d" % r)

    def finish(self, group, survivors):
        codes = group.close()
        self.group = None
        self.assertEqual(sorted(codes), survivors)
        for r, c in codes.items():
            self.assertEqual(c, 0, "rank %d exited %s on SIGTERM:\n%s" % (r, c, group.last_logs))

    def test_two_ranks(self):
        group, client, parked, stream = self.kill_mid_stream(2)
        self.assertGreater(len(stream.rank_errors.get(0, [])) + len(stream.rank_errors.get(1, [])),
                           0, "no call failed after the kill")
        self.check_survivor(group, client, parked, stream, 0)
        self.assertIn("rank 1", gl.rpc_error(parked[0].result).details())
        client.close()
        self.finish(group, [0])

    def test_three_ranks_leader(self):
        group, client, parked, stream = self.kill_mid_stream(3)
        self.check_survivor(group, client, parked, stream, 0)
        self.assertIn("rank 1", gl.rpc_error(parked[0].result).details())
        client.close()
        self.finish(group, [0, 2])

    def test_three_ranks_other_survivor(self):
        # Rank 2 is connected to the leader and to rank 1 only through the communicator; idle
        # when rank 1 dies, it must still learn that the group broke (from the leader), and not
        # leave its callers waiting forever or report SERVING.
        group, client, parked, stream = self.kill_mid_stream(3, quiesce=True)
        self.check_survivor(group, client, parked, stream, 2)
        client.close()
        self.finish(group, [0, 2])


    # Control relays (--control-fanout 2 on 6 ranks: rank 1 relays rank 2's control frames, rank 3
    # rank 4's, rank 5 talks to the leader directly). Idle survivors learn of the death through
    # the relay tree alone.
    RELAYS = ("--control-fanout", "2")

    def test_relay_killed(self):
        # Rank 4's only control connection is to rank 3: it learns when that connection dies;
        # the leader sees it die too and tells rank 1, which tells rank 2.
        group, client, parked, stream = self.kill_mid_stream(6, quiesce=True, victim=3,
                                                             flags=self.RELAYS)
        for r in (0, 1, 2, 4, 5):
            self.check_survivor(group, client, parked, stream, r)
        self.assertIn("rank 3", gl.rpc_error(parked[0].result).details())
        client.close()
        self.finish(group, [0, 1, 2, 4, 5])

    def test_member_behind_relay_killed(self):
        # Rank 3 sees its member die and tells the leader which rank it was; the leader tells
        # every rank, rank 2 through its relay (rank 1).
        group, client, parked, stream = self.kill_mid_stream(6, quiesce=True, victim=4,
                                                             flags=self.RELAYS)
        for r in (0, 1, 2, 3, 5):
            self.check_survivor(group, client, parked, stream, r)
        self.assertIn("rank 4", gl.rpc_error(parked[0].result).details())
        self.assertIn("rank 4", gl.rpc_error(parked[2].result).details())
        client.close()
        self.finish(group, [0, 1, 2, 3, 5])

    def test_member_behind_relay_killed_mid_stream(self):
        group, client, parked, stream = self.kill_mid_stream(6, victim=2, flags=self.RELAYS)
        for r in (0, 1, 3, 4, 5):
            self.check_survivor(group, client, parked, stream, r)
        client.close()
        self.finish(group, [0, 1, 3, 4, 5])


class StartupTest(unittest.TestCase):
    """Before the whole group is up a rank listens but does not serve; a rank whose peers never
    come gives up at --bootstrap-timeout-ms, naming them."""

    def test_not_serving_until_ready(self):
        ports, offset = gl.pick_ports(2)
        addrs = ["127.0.0.1:%d" % p for p in ports]
        common = ["--peers", ",".join(addrs), "--peer-port-offset", str(offset)]
        procs = [gl.Proc(["--rank", "0", *common])]
        try:
            self.assertTrue(gl.wait_for(lambda: "listening on %s" % addrs[0] in procs[0].text(),
                                        20), procs[0].text())
            self.assertEqual(gl.health(addrs[0]), gl.NOT_SERVING)
            client = gl.RawClient(addrs)
            stats = client.stubs[0].GetStats(pb.GetStatsRequest(), timeout=10)
            self.assertFalse(stats.ready)
            self.assertEqual(stats.group_size, 2)
            e = gl.rpc_error(lambda: client.create("early", 10, 8))
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.UNAVAILABLE, e.details())
            procs.append(gl.Proc(["--rank", "1", *common]))
            for a in addrs:
                self.assertTrue(gl.wait_for(lambda: gl.health(a) == gl.SERVING, 30, 0.05),
                                procs[0].text() + procs[1].text())
            stats = client.stubs[0].GetStats(pb.GetStatsRequest(), timeout=10)
            self.assertTrue(stats.ready)
            self.assertEqual(stats.mesh, "shard=2")
            client.create("late", 10, 8)
            self.assertEqual(client.lookup("late", [0, 1], 8).shape, (2, 8))
            client.close()
            for r, p in enumerate(procs):
                self.assertEqual(p.stop(), 0, "rank %d:\n%s" % (r, p.text()))
        finally:
            for p in procs:
                p.cleanup()

    def test_bootstrap_timeout(self):
        ports, offset = gl.pick_ports(3)
        p = gl.Proc(["--rank", "0", "--peers", ",".join("127.0.0.1:%d" % q for q in ports),
                     "--peer-port-offset", str(offset), "--bootstrap-timeout-ms", "1500"])
        try:
            t0 = time.time()
            rc = p.wait(15)
            self.assertIsNotNone(rc, "still waiting 15 s later:\n" + p.text())
            self.assertGreaterEqual(time.time() - t0, 1.4)
            self.assertNotEqual(rc, 0, p.text())
            self.assertRegex(p.text(), r"1, 2", p.text())
        finally:
            p.cleanup()

    def test_sigterm_while_forming(self):
        """A rank still waiting for its group (here rank 1 of 2, rank 0 never started, with the
        default 120 s bootstrap timeout) exits 0 within a second of SIGTERM."""
        ports, offset = gl.pick_ports(2)
        addrs = ["127.0.0.1:%d" % q for q in ports]
        p = gl.Proc(["--rank", "1", "--peers", ",".join(addrs), "--peer-port-offset",
                     str(offset)])
        try:
            self.assertTrue(gl.wait_for(lambda: "waiting for the group" in p.text(), 20),
                            p.text())
            time.sleep(0.3)  # well inside the bootstrap's retry loop
            t0 = time.time()
            rc = p.stop(timeout=5.0)
            took = time.time() - t0
            self.assertEqual(rc, 0, p.text())
            self.assertLess(took, 1.0, p.text())
            self.assertIn("shutting down", p.text())
        finally:
            p.cleanup()


class DrainTest(unittest.TestCase):
    def test_sigterm_drains(self):
        """SIGTERM on a serving rank: calls it has taken run to their answers, new calls are
        refused with UNAVAILABLE, health says NOT_SERVING, and it exits 0 once drained. Here a
        sync push's shard waits on rank 0 for rank 1's shard, which is sent after the SIGTERM:
        both answer applied, with the batch's two distinct tokens."""
        group = gl.Group(2, "--batch-deadline-ms", "20000")
        client = gl.RawClient(group.addresses)
        try:
            client.create("d", 16, 8, "sgd", lr=0.5)
            bid = gl.next_batch_id()
            tok = np.array([4, 5], "<i8")
            g = np.ones((2, 8), "<f4")

            def shard(r):
                return client.stubs[r].PushGradients.future(pb.PushGradientsRequest(
                    table="d", batch_id=bid, shard_index=r, shard_count=2, tokens_per_batch=2,
                    tokens=tok[r:r + 1].tobytes(), dtype=pb.DTYPE_F32,
                    gradients=g[r:r + 1].tobytes()), timeout=30)

            first = shard(0)
            time.sleep(0.3)  # parked on rank 0
            p0 = group.procs[0]
            os.kill(p0.pid, signal.SIGTERM)
            self.assertTrue(gl.wait_for(lambda: "draining 1 call" in p0.text(), 5), p0.text())
            self.assertTrue(p0.alive(), p0.text())
            self.assertEqual(gl.health(group.addresses[0]), gl.NOT_SERVING)
            e = gl.rpc_error(lambda: client.stubs[0].ListTables(pb.ListTablesRequest(),
                                                                timeout=10))
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), SC.UNAVAILABLE)
            self.assertIn("shutting down", e.details())
            second = shard(1)
            for f in (first, second):
                self.assertTrue(f.result().applied)
                self.assertEqual(f.result().num_unique, 2)
            self.assertEqual(p0.wait(5), 0, p0.text())
            self.assertIn("drained", p0.text())
        finally:
            client.close()
            group.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
