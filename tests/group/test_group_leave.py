"""A rank that stops cleanly (SIGTERM, drained) tells the others it leaves: they log it as news
("rank 0 left the group (shutting down)", level info), not as "error ... the shard group is
broken", so a clean rolling stop prints no error line. The group still cannot serve without the
rank: later calls fail with UNAVAILABLE saying the group is broken, and health says NOT_SERVING.
A rank that dies (SIGKILL) says nothing, and the others still log the error."""
import re
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import SC, pb

WIDTH = 6
ROWS = 32
LOG_WAIT = 30.0  # seconds a survivor may take to log the news (generous: a loaded machine)
ERROR_LINE = re.compile(r"^\S+Z error .*the shard group is broken", re.M)


def left_line(rank):
    return re.compile(r"^\S+Z info .*rank %d left the group \(shutting down\)" % rank, re.M)


class LeaveTest(unittest.TestCase):
    def setUp(self):
        self.group = None

    def tearDown(self):
        if self.group:
            self.group.close()

    def start(self, n):
        group = self.group = gl.Group(n)
        client = gl.RawClient(group.addresses)
        self.addCleanup(client.close)
        client.create("k", ROWS, WIDTH, "sgd")
        rows = client.lookup("k", np.arange(2 * n), WIDTH)  # the group served a batch
        self.assertEqual(rows.shape, (2 * n, WIDTH))
        return group, client

    def wait_log(self, group, rank, pattern, what):
        self.assertTrue(gl.wait_for(lambda: pattern.search(group.procs[rank].text()), LOG_WAIT),
                        "rank %d never logged %s:\n%s" % (rank, what, group.logs()))

    def check_broken_for_calls(self, group, client, r):
        tok = np.asarray([1], "<i8").tobytes()
        e = gl.rpc_error(lambda: client.stubs[r].Lookup(pb.LookupRequest(
            table="k", batch_id=gl.next_batch_id(), shard_index=r, shard_count=group.n,
            tokens_per_batch=group.n, tokens=tok), timeout=10))
        self.assertIsNotNone(e, "rank %d served a lookup without its group" % r)
        self.assertEqual(e.code(), SC.UNAVAILABLE, "rank %d: %s" % (r, e.details()))
        self.assertIn("the shard group is broken", e.details())
        self.assertEqual(gl.health(group.addresses[r]), gl.NOT_SERVING, "rank %d" % r)

    def stop_cleanly(self, group, rank):
        code = group.procs[rank].stop()
        self.assertEqual(code, 0, "rank %d exited %s on SIGTERM:\n%s" % (rank, code,
                                                                         group.logs()))

    def finish(self, group):
        """Stops the survivors with SIGTERM (each must exit 0) and returns the group's logs."""
        alive = [r for r, p in enumerate(group.procs) if p.alive()]
        codes = group.close()
        self.group = None
        self.assertEqual(sorted(codes), alive)
        for r, c in codes.items():
            self.assertEqual(c, 0, "rank %d exited %s on SIGTERM:\n%s" % (r, c, group.last_logs))
        return group.last_logs

    def test_leader_stops_first(self):
        group, client = self.start(2)
        self.stop_cleanly(group, 0)
        self.wait_log(group, 1, left_line(0), "that rank 0 left (info)")
        self.check_broken_for_calls(group, client, 1)
        text = group.procs[1].text()
        self.assertIsNone(ERROR_LINE.search(text),
                          "rank 1 logged the leader's clean stop as an error:\n" + text)
        last = self.finish(group)
        self.assertIsNone(ERROR_LINE.search(last), "an error line after the stop:\n" + last)

    def test_follower_stops_first(self):
        # The leader hears it, and passes the news on to the other follower.
        group, client = self.start(3)
        self.stop_cleanly(group, 1)
        for r in (0, 2):
            self.wait_log(group, r, left_line(1), "that rank 1 left (info)")
        for r in (0, 2):
            self.check_broken_for_calls(group, client, r)
            text = group.procs[r].text()
            self.assertIsNone(ERROR_LINE.search(text),
                              "rank %d logged rank 1's clean stop as an error:\n%s" % (r, text))
        last = self.finish(group)
        self.assertIsNone(ERROR_LINE.search(last), "an error line after the stop:\n" + last)

    def test_leader_killed(self):
        group, client = self.start(2)
        group.kill(0)
        self.wait_log(group, 1, ERROR_LINE, "the broken group as an error")
        text = group.procs[1].text()
        self.assertIsNone(left_line(0).search(text),
                          "rank 1 took a killed leader for a clean stop:\n" + text)
        self.check_broken_for_calls(group, client, 1)
        self.finish(group)


if __name__ == "__main__":
    unittest.main()
