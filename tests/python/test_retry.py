"""Attempts and retries of the Python client (python/embps/_retry.py), against real grpcio.

  - The schedule alone, on a fake clock: the backoff (20 ms doubling to 1 s, jitter in [0.5, 1)),
    max_attempts, the overall deadline that no attempt starts after or outlives, each
    attempt's deadline, and which statuses are retried.
  - A stopped server: a lookup, a push and a push future fail UNAVAILABLE within timeout (plus
    slack for the machine), after several attempts that the error counts, and say what the
    status means for the push; max_attempts=1 sends once.
  - A frozen server (SIGSTOP): every attempt ends DEADLINE_EXCEEDED at attempt_timeout, and the
    call gives up within timeout.
  - A server stopped and started again on the same address: the retrying client reaches the new
    process (the channel reconnects within the retries; it answers NOT_FOUND, the table being
    gone, which is not retried).
Servers come from tests/lib/embps_servers.py. No timing is asserted but the deadline's bound.
"""
import concurrent.futures
import os
import signal
import sys
import threading
import time
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))

import embps  # noqa: E402
from embps import _retry  # noqa: E402
import embps_servers as es  # noqa: E402

SLACK = 3.0  # seconds past the deadline a loaded CI machine may take to report it
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class _E:
    """Stands for an embps.Error in the schedule's eyes."""

    def __init__(self, retryable=True):
        self.retryable = retryable


class ScheduleTest(unittest.TestCase):
    def test_backoff_doubles_to_one_second(self):
        top = [_retry.backoff(k, lambda: 0.999999) for k in range(10)]
        low = [_retry.backoff(k, lambda: 0.0) for k in range(10)]
        for k in range(10):
            full = min(1.0, 0.02 * 2 ** k)
            self.assertAlmostEqual(top[k], full, places=5)
            self.assertAlmostEqual(low[k], full / 2, places=9)
        self.assertEqual(_retry.backoff(1000, lambda: 0.5), 0.75)  # no overflow, capped

    def test_max_attempts(self):
        clock = FakeClock()
        a = _retry.Attempts(None, 4, None, clock=clock, rand=lambda: 0.0)
        delays = []
        while True:
            d = a.retry_after(_E())
            if d is None:
                break
            delays.append(d)
            clock.t += d
        self.assertEqual(a.attempt, 3)  # attempts 0..3: four in all
        self.assertEqual(delays, [0.01, 0.02, 0.04])
        one = _retry.Attempts(None, 1, None, clock=clock)
        self.assertIsNone(one.retry_after(_E()))

    def test_not_retryable(self):
        a = _retry.Attempts(10.0, 4, None, clock=FakeClock())
        self.assertIsNone(a.retry_after(_E(False)))
        self.assertEqual(a.attempt, 0)

    def test_overall_deadline(self):
        """Attempts until the next backoff would reach the deadline; every attempt's calls get
        at most what is left, and at most attempt_timeout."""
        clock = FakeClock()
        a = _retry.Attempts(2.0, 1000, 0.5, clock=clock, rand=lambda: 0.999999)
        end = clock.t + 2.0
        timeouts = []
        while True:
            t = a.call_timeout()
            timeouts.append(t)
            self.assertLessEqual(clock.t + t, end + 1e-9, "an attempt outlives the deadline")
            clock.t += t  # the attempt takes all it may (a frozen server)
            d = a.retry_after(_E())
            if d is None:
                break
            self.assertLess(clock.t + d, end, "an attempt would start after the deadline")
            clock.t += d
        self.assertTrue(all(t <= 0.5 for t in timeouts))
        self.assertGreaterEqual(len(timeouts), 3)
        self.assertLessEqual(clock.t, end + 1e-9)

    def test_call_timeout(self):
        clock = FakeClock()
        self.assertIsNone(_retry.Attempts(None, 4, None, clock=clock).call_timeout())
        self.assertEqual(_retry.Attempts(None, 4, 0.3, clock=clock).call_timeout(), 0.3)
        a = _retry.Attempts(1.0, 4, None, clock=clock)
        clock.t += 0.75
        self.assertAlmostEqual(a.call_timeout(), 0.25)
        clock.t += 5
        self.assertEqual(a.call_timeout(), 0.0)

    def test_retryable_codes(self):
        C = grpc.StatusCode
        self.assertTrue(_retry.retryable([C.UNAVAILABLE]))
        self.assertTrue(_retry.retryable([C.DEADLINE_EXCEEDED, C.UNAVAILABLE]))
        self.assertTrue(_retry.retryable([C.UNAVAILABLE, C.CANCELLED]))
        self.assertFalse(_retry.retryable([C.CANCELLED]))
        self.assertFalse(_retry.retryable([C.UNAVAILABLE, C.INVALID_ARGUMENT]))
        self.assertFalse(_retry.retryable([C.NOT_FOUND]))
        self.assertFalse(_retry.retryable([C.ABORTED]))

    def test_arguments(self):
        for bad in (0, -1, 1.5, True, "4"):
            with self.assertRaises(ValueError):
                _retry.check_max_attempts(bad)
        for bad in (0, -1.0, "1", True, float("nan")):
            with self.assertRaises(ValueError):
                _retry.check_seconds(bad, "attempt_timeout")
        self.assertEqual(_retry.check_seconds(2, "timeout"), 2.0)


def make_table(c, name="t"):
    c.create_table(name, rows=64, emb_width=8, optimizer="sgd", lr=0.1, seed=3)


TOK = np.arange(1, 9)
GRADS = np.ones((8, 8), np.float32)


class StoppedServerTest(unittest.TestCase):
    def setUp(self):
        self.server = es.Server()
        self.addCleanup(self.server.close)
        self.client = embps.Client(self.server.address, timeout=10.0)
        self.addCleanup(self.client.close)
        make_table(self.client)
        self.server.close()  # the channel's connection breaks; nothing answers any more

    def fails_in_time(self, call, timeout, kind):
        self.client.timeout = timeout
        self.client.max_attempts = 1000
        retries0 = self.client.retries
        t0 = time.monotonic()
        with self.assertRaises(embps.Error) as cm:
            call()
        elapsed = time.monotonic() - t0
        e = cm.exception
        self.assertEqual(e.code, UNAVAILABLE, str(e))
        self.assertLessEqual(elapsed, timeout + SLACK, "the overall deadline was not honoured")
        # 20+40+80 ms (x jitter >= 0.5) fit in any timeout used here: at least 3 retries
        self.assertGreaterEqual(e.attempts, 4, str(e))
        self.assertEqual(self.client.retries - retries0, e.attempts - 1)
        self.assertIn("%s batch %d failed after %d attempts" % (kind, e.batch_id, e.attempts),
                      str(e))
        return e

    def test_lookup(self):
        e = self.fails_in_time(lambda: self.client.lookup("t", TOK), 1.5, "lookup")
        self.assertNotIn("applied", str(e))

    def test_push(self):
        e = self.fails_in_time(lambda: self.client.push("t", TOK, GRADS), 1.5, "push")
        self.assertIn("whether the push was applied is unknown", str(e))

    def test_push_future(self):
        """A future retries on its own: result() only collects the outcome."""
        def call():
            fut = self.client.push_async("t", TOK, GRADS)
            done, _ = concurrent.futures.wait([fut], timeout=30)
            self.assertTrue(done)
            self.assertGreaterEqual(fut.attempts, 4)
            return fut.result()
        self.fails_in_time(call, 1.5, "push")

    def test_cancel_stops_retries(self):
        self.client.timeout, self.client.max_attempts = 30.0, 1000
        fut = self.client.lookup_async("t", TOK)
        es.wait_for(lambda: fut.attempts >= 3, 10)
        self.assertTrue(fut.cancel())
        n = fut.attempts
        time.sleep(1.5)  # longer than the longest backoff
        self.assertEqual(fut.attempts, n, "a cancelled future kept retrying")
        self.assertTrue(fut.cancelled())

    def test_one_attempt(self):
        self.client.max_attempts = 1
        with self.assertRaises(embps.Error) as cm:
            self.client.push("t", TOK, GRADS)
        self.assertEqual(cm.exception.code, UNAVAILABLE)
        self.assertEqual(cm.exception.attempts, 1)
        self.assertNotIn("attempts", str(cm.exception))

    def test_max_attempts_bound(self):
        self.client.max_attempts = 3
        self.client.timeout = 30.0
        with self.assertRaises(embps.Error) as cm:
            self.client.lookup("t", TOK)
        self.assertEqual(cm.exception.attempts, 3)
        self.assertIn("max_attempts=3", str(cm.exception))


class FrozenServerTest(unittest.TestCase):
    """A server that takes connections and bytes but never answers (SIGSTOP)."""

    def test_attempts_time_out(self):
        server = es.Server()
        self.addCleanup(server.close)
        c = embps.Client(server.address, timeout=10.0)
        self.addCleanup(c.close)
        make_table(c)
        before = c.lookup("t", TOK)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            c.timeout, c.attempt_timeout, c.max_attempts = 1.6, 0.3, 100
            t0 = time.monotonic()
            with self.assertRaises(embps.Error) as cm:
                c.lookup("t", TOK)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        e = cm.exception
        self.assertEqual(e.code, DEADLINE, str(e))
        self.assertGreaterEqual(e.attempts, 3, str(e))
        self.assertLessEqual(elapsed, 1.6 + SLACK)
        # the thawed server still answers, and the lookups changed nothing
        c.timeout, c.attempt_timeout = 10.0, None
        self.assertTrue(np.array_equal(c.lookup("t", TOK), before))


class RestartedServerTest(unittest.TestCase):
    def test_reconnects(self):
        port = es.free_ephemeral_port()
        first = es.Proc(["--listen", "127.0.0.1:%d" % port], prefix="embps-retry-")
        self.addCleanup(first.cleanup)
        self.assertEqual(first.wait_ready(es.READY_TIMEOUT, port), port, first.text())
        c = embps.Client("127.0.0.1:%d" % port, timeout=10.0)
        self.addCleanup(c.close)
        make_table(c)
        c.lookup("t", TOK)
        self.assertEqual(first.stop(), 0)
        box = {}

        def restart():
            time.sleep(1.0)
            box["p"] = es.Proc(["--listen", "127.0.0.1:%d" % port], prefix="embps-retry-")
        th = threading.Thread(target=restart, daemon=True)
        th.start()
        self.addCleanup(lambda: box.get("p") and box["p"].cleanup())
        c.timeout, c.max_attempts = es.READY_TIMEOUT, 10000
        with self.assertRaises(embps.Error) as cm:
            c.lookup("t", TOK)
        th.join(5)
        e = cm.exception
        # the new process has no table "t": NOT_FOUND proves the retry reached it
        self.assertEqual(e.code, grpc.StatusCode.NOT_FOUND,
                         "%s\n%s" % (e, box["p"].text() if "p" in box else ""))
        self.assertGreater(e.attempts, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
