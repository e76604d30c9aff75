"""Attempts of one batch under one overall deadline: which failures are retried, how long each
attempt may take, how long to wait between them, and the words of the error that gives up.

A batch (a lookup or a push) is named by (client_id, batch_id, attempt) and carries its digest
(_digest.py). Its first attempt is attempt 0; a retry re-sends every shard, byte for byte, with
attempt + 1, so a retried push has the same batch id and digest and the group applies it at most
once (a retry of one the group applied is answered with the first attempt's result, replayed).

Retried: a batch whose failing ranks all said UNAVAILABLE or DEADLINE_EXCEEDED, or CANCELLED
beside one of those (the servers withdraw a batch on every rank when one shard's connection
breaks before it is ordered, and its other shards' callers get CANCELLED). Everything else
(INVALID_ARGUMENT, NOT_FOUND, ...) is final at once: the same request would fail the same way.

Schedule: attempt k + 1 starts after a backoff of min(1 s, 20 ms * 2**k), times a jitter drawn
in [0.5, 1) so that many clients cut at once do not come back in step, and only while
  - fewer than max_attempts attempts were made (1: no retries), and
  - the overall deadline (the client's timeout, counted from the call) is further away than the
    backoff: no attempt starts after it and none outlives it, since each attempt's deadline is
    min(attempt_timeout, what is left) and grpcio sends it to the servers as grpc-timeout.
The clock and the random source are arguments so that the schedule is tested without waiting.
"""
import random
import time

import grpc

from . import _wire

RETRYABLE = frozenset((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))
BACKOFF_FIRST = 0.02  # seconds before the first retry (before jitter)
BACKOFF_MAX = 1.0  # the backoff doubles up to this
DEFAULT_MAX_ATTEMPTS = 4


def check_max_attempts(v):
    """v as max_attempts (an int >= 1); raises ValueError otherwise."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("max_attempts must be an int >= 1 (1: no retries), not %r" % (v,))
    return v


def check_seconds(v, what):
    """v as a number of seconds > 0 or None; raises ValueError otherwise."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError("%s must be a number of seconds > 0 or None, not %r" % (what, v))
    return float(v)


def retryable(codes):
    """Whether a batch whose failing ranks said codes (grpc.StatusCodes) is retried."""
    codes = set(codes)
    return bool(codes & RETRYABLE) and codes <= RETRYABLE | {grpc.StatusCode.CANCELLED}


def backoff(k, rand=random.random):
    """The wait before attempt k + 1 (k: the attempt that failed, 0 first), jitter included."""
    return min(BACKOFF_MAX, BACKOFF_FIRST * (2.0 ** min(k, 32))) * (0.5 + 0.5 * rand())


class Attempts:
    """The schedule of one batch's attempts. timeout: the overall deadline in seconds from now
    (None: none); max_attempts: attempts at most; attempt_timeout: each attempt's own bound
    (None: what is left of the overall one). attempt is the number of the attempt being made."""

    __slots__ = ("clock", "rand", "start", "deadline", "max_attempts", "attempt_timeout",
                 "attempt")

    def __init__(self, timeout, max_attempts, attempt_timeout, clock=time.monotonic,
                 rand=random.random):
        self.clock, self.rand = clock, rand
        self.start = clock()
        self.deadline = None if timeout is None else self.start + timeout
        self.max_attempts = max_attempts
        self.attempt_timeout = attempt_timeout
        self.attempt = 0

    def call_timeout(self):
        """The deadline of the current attempt's calls, in seconds from now (None: none)."""
        at = self.attempt_timeout
        if self.deadline is None:
            return at
        left = max(0.0, self.deadline - self.clock())
        return left if at is None else min(at, left)

    def retry_after(self, error):
        """Seconds to wait before the next attempt after error (an embps.Error of the current
        one), which then becomes current; None when the batch gives up with error."""
        if not error.retryable or self.attempt + 1 >= self.max_attempts:
            return None
        delay = backoff(self.attempt, self.rand)
        if self.deadline is not None and self.clock() + delay >= self.deadline:
            return None
        self.attempt += 1
        return delay

    def sibling(self):
        """A new schedule for another call made for the same batch (the ListTables a push may
        need first): the same deadline and bounds, its own attempts."""
        a = Attempts(None, self.max_attempts, self.attempt_timeout, self.clock, self.rand)
        a.start, a.deadline = self.start, self.deadline
        return a

    def give_up(self, error, what, push=False, batch_id=None):
        """error, the last attempt's, annotated as the call's outcome (batch_id, attempts and,
        when it was sent more than once, a message that says so and what it means). what names
        the call ("push batch 12"); push: whether a push's (or an assign's) fate rides on it."""
        error.batch_id = batch_id
        error.attempts = self.attempt + 1
        if error.attempts > 1:
            elapsed = self.clock() - self.start
            why = ("the timeout ran out" if self.deadline is not None
                   and self.clock() + backoff(self.attempt, lambda: 0.0) >= self.deadline
                   else "max_attempts=%d" % self.max_attempts if error.retryable
                   else "a status that is not retried")
            tail = ("%s failed after %d attempts in %.2f s (%s); the last attempt's status is "
                    "shown" % (what, error.attempts, elapsed, why))
            if push and error.code in RETRYABLE:
                tail += (": whether the %s was applied is unknown (at most once: every attempt "
                         "carried the same batch id and digest); a larger timeout or max_attempts "
                         "gives it more tries"
                         % ("assign" if what.startswith("assign") else "push"))
            error.message = "%s (%s)" % (error.message, tail)
            error.args = (error.message,)
        return error


_KIND_WORDS = {"lookup": "lookup", "push": "push", "lookup_features": "lookup features",
               "push_features": "push features", "assign": "assign"}


class Batch:
    """One lookup or push as its attempts send it: kind ("lookup", "push", "lookup_features" or
    "push_features": the _calls._Rank method it calls), batch_id, the first attempt's per-rank
    requests (bytes, from _batch.py or _features.py), join(calls, attempts) which turns an
    attempt's finished calls into the caller's value or raises its embps.Error, and schedule
    (an Attempts). The sync path (Client.lookup, push, lookup_features, push_features) and
    BatchFuture both drive it."""

    __slots__ = ("kind", "batch_id", "first", "joiner", "schedule")

    def __init__(self, kind, batch_id, requests, join, schedule):
        self.kind, self.batch_id, self.first = kind, batch_id, requests
        self.joiner, self.schedule = join, schedule

    def requests(self):
        """Every rank's request for the current attempt (_wire.with_attempt)."""
        a = self.schedule.attempt
        return [_wire.with_attempt(q, self.kind, a) for q in self.first]

    def join(self, calls):
        return self.joiner(calls, self.schedule.attempt + 1)

    def give_up(self, error):
        return self.schedule.give_up(error, "%s batch %d" % (_KIND_WORDS[self.kind],
                                                            self.batch_id),
                                     self.kind.startswith("push") or self.kind == "assign",
                                     self.batch_id)
