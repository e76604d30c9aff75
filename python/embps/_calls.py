"""The group's channels and the calls made on them: one gRPC channel per rank, calls started on
a list of ranks at once, their outcomes turned into embps.Error, and BatchFuture, which joins a
batch's per-rank calls into one concurrent.futures.Future.

Each channel has its own TCP connection: the channels use a local subchannel pool, so two
clients in one process do not share connections, as two C clients do not. Calls carry the
client's metadata (its bearer token) and deadline; what a call means (which request, how the
replies join) is the caller's business (_batch.py, _admin.py, client.py).

Threads: GroupCalls may be used by many threads. Future callbacks run on gRPC's threads.
"""
import concurrent.futures
import threading

import grpc

from . import _retry
from ._connect import check_address
from ._names import pb
from .errors import Error

_SERVICE = "/embps.v1.EmbeddingService/"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_WORKERS_PER_RANK = 8  # threads of one client making blocking calls to one rank at once
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),  # the servers set the limit (--max-message-bytes)
    ("grpc.max_receive_message_length", -1),
    ("grpc.use_local_subchannel_pool", 1),  # this client's own connections
    # The channel's own reconnection backoff (grpcio's default: 1 s growing 1.6 times to 120 s)
    # and its re-resolution of the address kept within the retries' (_retry.py): while either
    # holds the channel in TRANSIENT_FAILURE, a call fails at once without dialling. A rank
    # restarted 3 s after it stopped was reached by a retrying client 7.7 s after it was ready
    # with grpcio's defaults, 4.7 s with the backoff alone, and 0.1-0.7 s with both (grpcio
    # 1.51, loopback; tests/python/test_retry.py checks it comes back).
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.dns_min_time_between_resolutions_ms", 200),
]


# ---- futures ----------------------------------------------------------------------------------

class BatchFuture(concurrent.futures.Future):
    """A lookup or push in flight: one gRPC call per rank, joined into one result when the
    last one finishes (on a gRPC thread), so result(), exception(), done(),
    add_done_callback() and concurrent.futures.wait()/as_completed() behave as for any
    concurrent.futures.Future. result() raises embps.Error (the first failing rank's, in rank
    order, preferring a refusal to a deadline or an unavailable rank, and a CANCELLED one only
    when no rank failed otherwise: GroupCalls.results).

    Retries happen here, not in result(): when an attempt fails in a way that is retried
    (_retry.py), the next one is started after its backoff by a timer thread, with the same
    batch id and digest, and the future completes with the first attempt that succeeds or with
    the last one's error; nobody has to wait on it for that to happen. cancel() cancels the
    calls still in flight and any retry not yet started; a cancelled batch may still have been
    applied by the ranks that had it. batch_id: the batch's id on the wire; attempts: how many
    attempts were started so far."""

    def __init__(self, batch, group_calls, on_retry=None):
        super().__init__()
        self.batch_id = batch.batch_id
        self._batch = batch
        self._group = group_calls
        self._on_retry = on_retry  # called (no arguments) before each retry is sent
        self._lock = threading.RLock()
        self._calls = ()
        self._timer = None
        self._start()  # the first attempt: a closed client raises to the caller

    @property
    def attempts(self):
        return self._batch.schedule.attempt + 1

    def _start(self):
        b = self._batch
        calls = self._group.send(b.kind, b.requests(), False, b.schedule.call_timeout())
        with self._lock:
            self._calls = calls
            cancelled = self.cancelled()
        if cancelled:
            for c in calls:
                c.cancel()
        left = [len(calls)]
        left_lock = threading.Lock()

        def call_done(_call):
            with left_lock:
                left[0] -= 1
                if left[0]:
                    return
            self._attempt_done(calls)
        for c in calls:
            c.add_done_callback(call_done)

    def _attempt_done(self, calls):
        b = self._batch
        try:
            value = b.join(calls)
        except Error as e:
            if self.cancelled():
                return
            delay = None if self._group.closed else b.schedule.retry_after(e)
            if delay is None:
                self._finish(error=b.give_up(e))
                return
            timer = threading.Timer(delay, self._retry, (e,))
            timer.daemon = True
            with self._lock:
                if self.cancelled():
                    return
                self._timer = timer
            timer.start()
        except BaseException as e:  # handed to the waiter
            self._finish(error=e)
        else:
            self._finish(value=value)

    def _retry(self, last):
        if self.cancelled():
            return
        try:
            if self._on_retry is not None:
                self._on_retry()
            self._start()
        except ValueError:  # the client was closed during the backoff
            self._finish(error=self._batch.give_up(last))
        except BaseException as e:
            self._finish(error=e)

    def _finish(self, value=None, error=None):
        try:
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(value)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    def cancel(self):
        with self._lock:
            if not super().cancel():
                return False
            calls, timer = self._calls, self._timer
        if timer is not None:
            timer.cancel()
        for c in calls:
            c.cancel()
        return True


class _Finished:
    """A call that has already finished (a blocking call's outcome), read like a future."""
    __slots__ = ("value", "error")

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


# ---- channels ---------------------------------------------------------------------------------

def _serialize(m):
    return m.SerializeToString()


class _Rank:
    """One rank's channel and the methods called on it."""

    def __init__(self, address, tls=None):
        self.address = address
        if tls is None:
            self.channel = grpc.insecure_channel(check_address(address),
                                                 options=_CHANNEL_OPTIONS)
        else:
            creds, options = tls
            self.channel = grpc.secure_channel(check_address(address), creds,
                                               options=_CHANNEL_OPTIONS + options)
        ch = self.channel
        # The bulk calls take and return raw bytes (_wire.py); the rest protobuf messages. The
        # attribute names are the batches' kinds (_retry.Batch.kind), which send() calls.
        self.lookup = ch.unary_unary(_SERVICE + "Lookup")
        self.push = ch.unary_unary(_SERVICE + "PushGradients",
                                   response_deserializer=pb.PushGradientsResponse.FromString)
        self.assign = ch.unary_unary(_SERVICE + "Assign",
                                     response_deserializer=pb.AssignResponse.FromString)
        self.lookup_features = ch.unary_unary(_SERVICE + "LookupFeatures")
        self.push_features = ch.unary_unary(
            _SERVICE + "PushFeatures", response_deserializer=pb.PushFeaturesResponse.FromString)
        self.admin = {}
        for name, resp in (("CreateTable", pb.CreateTableResponse),
                           ("DropTable", pb.DropTableResponse),
                           ("ListTables", pb.ListTablesResponse),
                           ("GetStats", pb.GetStatsResponse),
                           ("Checkpoint", pb.CheckpointResponse),
                           ("ListCheckpoints", pb.ListCheckpointsResponse)):
            self.admin[name] = ch.unary_unary(_SERVICE + name,
                                              request_serializer=_serialize,
                                              response_deserializer=resp.FromString)
        self.admin["Health"] = ch.unary_unary(
            _HEALTH_CHECK, request_serializer=_serialize,
            response_deserializer=pb.HealthCheckResponse.FromString)


# ---- calls ------------------------------------------------------------------------------------

class GroupCalls:
    """Every rank's channel, in rank order, and the calls made on them.

    addresses: "host:port" per rank (already checked: _connect.parse_servers); tls: the
    (credentials, options) of _connect.tls_credentials or None; metadata: sent with every call
    (the bearer token) or None. Channels are opened here; close() closes them."""

    def __init__(self, addresses, tls, metadata):
        self.addresses = tuple(addresses)
        self.metadata = metadata
        self.ranks = []
        self.closed = False
        self._lock = threading.Lock()
        self._pools = [None] * len(self.addresses)  # see send
        try:
            for a in self.addresses:
                self.ranks.append(_Rank(a, tls))
        except BaseException:
            self.close()
            raise

    def close(self):
        """Closes every channel; calls in flight fail with CANCELLED. Idempotent."""
        with self._lock:
            self.closed = True
            pools, self._pools = self._pools, [None] * len(self._pools)
        for r in self.ranks:
            r.channel.close()
        for p in pools:
            if p is not None:
                p.shutdown(wait=False)

    def check_open(self):
        if self.closed:
            raise ValueError("this embps.Client is closed")

    def error(self, e, rank):
        """An embps.Error for rank's failed call e (a grpc.RpcError)."""
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        address = self.addresses[rank]
        msg = details if len(self.ranks) == 1 else "rank %d (%s): %s" % (rank, address, details)
        return Error(code, msg, details=details, rank=rank, address=address)

    def internal(self, r, what):
        """An INTERNAL embps.Error for rank r's reply that makes no sense (what says why)."""
        msg = what if len(self.ranks) == 1 else "rank %d (%s): %s" % (r, self.addresses[r],
                                                                       what)
        return Error(grpc.StatusCode.INTERNAL, msg, details=what, rank=r,
                     address=self.addresses[r])

    def results(self, calls, ranks=None):
        """The replies of finished per-rank calls. When any failed, raises the first failing
        rank's Error in rank order, preferring a refusal (a code that is not retried, nor
        CANCELLED) to UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED: a rank that refuses its
        shard (a token or feature it finds wrong) leaves the other ranks' shards to expire at
        the batch deadline, and the servers cancel a batch's other shards when one fails, so the
        refusal is what says why. retryable is set from every failing rank's code
        (_retry.retryable)."""
        out = []
        errors = []
        for i, c in enumerate(calls):
            r = i if ranks is None else ranks[i]
            try:
                out.append(c.result())
            except grpc.RpcError as e:
                errors.append(self.error(e, r))
            except (grpc.FutureCancelledError, concurrent.futures.CancelledError):
                errors.append(Error(grpc.StatusCode.CANCELLED, "the call to rank %d (%s) was "
                                    "cancelled" % (r, self.addresses[r]), rank=r,
                                    address=self.addresses[r]))
        if not errors:
            return out
        quiet = _retry.RETRYABLE | {grpc.StatusCode.CANCELLED}
        first = next((e for e in errors if e.code not in quiet),
                     next((e for e in errors if e.code != grpc.StatusCode.CANCELLED), errors[0]))
        first.retryable = _retry.retryable(e.code for e in errors)
        raise first

    def unary(self, method, request, ranks, timeout):
        """Runs an admin call on ranks (a list of rank numbers), concurrently; its replies."""
        self.check_open()
        md = self.metadata
        calls = [self.ranks[r].admin[method].future(request, timeout=timeout, metadata=md)
                 for r in ranks]
        return self.results(calls, ranks)

    def send(self, method, requests, wait, timeout):
        """Starts one call per rank, request r to rank r; returns the calls (read them with
        results()).

        Calls that are not waited for at once (wait false: lookup_async, push_async) are grpc
        futures, started under the lock, so that every rank's channel carries one thread's
        batches in the order it made them and two threads' batches never interleave.

        A batch the caller waits for now (lookup, push) uses grpc's blocking calls instead: rank
        0's in this thread, the other ranks' in this client's worker threads (a pool per rank,
        kept between calls). A blocking call polls its own completion queue in its thread,
        while a future's completion goes through its channel's polling thread, which grpcio
        starts when a channel has no call in flight and stops when it has none again: with
        one batch at a time, that was a thread started and stopped per call and per rank,
        about 0.4 ms on loopback, and 0.6 ms of CPU a 2-rank lookup of 4096 x 128 f32
        (measured; tests/bench/python_bench.py). Order is kept: this thread's earlier calls
        were started before, and it makes no other call until this batch is done."""
        self.check_open()
        t = timeout
        md = self.metadata
        ranks = self.ranks
        if not wait:
            with self._lock:
                return [getattr(ranks[r], method).future(q, timeout=t, metadata=md)
                        for r, q in enumerate(requests)]
        calls = [None] * len(requests)
        for r in range(1, len(requests)):
            calls[r] = self._workers(r).submit(getattr(ranks[r], method), requests[r],
                                               timeout=t, metadata=md)
        try:
            calls[0] = _Finished(getattr(ranks[0], method)(requests[0], timeout=t,
                                                           metadata=md))
        except grpc.RpcError as e:
            calls[0] = _Finished(error=e)
        return calls

    def _workers(self, rank):
        """The pool of threads that make rank's blocking calls (rank > 0), made on first use."""
        pool = self._pools[rank]
        if pool is None:
            with self._lock:
                self.check_open()
                pool = self._pools[rank]
                if pool is None:
                    pool = concurrent.futures.ThreadPoolExecutor(
                        _WORKERS_PER_RANK, thread_name_prefix="embps-rank%d" % rank)
                    self._pools[rank] = pool
        return pool
