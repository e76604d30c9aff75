"""embps.Client: a worker's connection to a shard group, over stock grpcio.

A client holds one gRPC channel per rank (_calls.py). At construction it asks every rank's
ListTables for the group size and checks that one address was given per rank, as the C client
does (client/admin.c), so a mistyped list fails at once rather than at the first batch.

Batches follow DESIGN.md and client/group.c exactly (_batch.py splits and joins them): a batch
of T tokens is split into group_size contiguous shards, shard r to rank r, every shard carrying
the same batch id; with padding on, padding token 0 is appended to make T a multiple of the
group size. Batch ids count up from a random 31-bit value shifted left by 32, per client, like
the C client's.

Pipelining: lookup_async and push_async start one gRPC call per rank (grpc's future API) and
return at once with a future; lookup and push make blocking calls (see _calls.GroupCalls.send).
Either way every rank's channel carries one thread's calls in the order it made them, and the
servers run one connection's batches in arrival order (server/service/service.c): a lookup
started after a push sees it, pipelined or not (tests/python/test_client.py checks it). The two
bulk messages are encoded and decoded by hand (_wire.py) to avoid protobuf's copies of the rows.

The other modules of the package, by concern: _connect.py (addresses, tokens, TLS), _calls.py
(channels, calls, BatchFuture), _batch.py (splitting, padding, joining), _admin.py (tables,
stats, health, checkpoints), _features.py (feature batches: lookup_features, push_features,
split by samples and pooled on the servers), errors.py, values.py (what the calls return).

Attempts and retries (_retry.py): every shard of a lookup or push carries the batch's digest
(_digest.py) and its attempt number (0 first). A batch that fails with UNAVAILABLE or
DEADLINE_EXCEEDED is sent again, every shard, with the same batch id and digest and attempt + 1,
after a backoff (20 ms doubling to 1 s, jittered), up to max_attempts and never past the
overall deadline (timeout); the servers answer a retried push whose first attempt they applied
with that attempt's result (PushResult.replayed), so a push takes effect at most once. The
blocking calls retry in the caller's thread, the futures on a timer thread (BatchFuture).

Threads: a Client may be shared by threads. Future callbacks run on gRPC's threads: they must
not block on another embps call.
"""
import random
import threading
import time

import grpc

from . import _arrays, _batch, _digest, _features, _malloc, _retry
from ._admin import TableAdmin
from ._calls import BatchFuture, GroupCalls
from ._connect import parse_servers, read_token, tls_credentials
from ._names import MODES, pb
from .errors import Error, ShapeError


class Client(TableAdmin):
    """A connection to an embps shard group.

    servers: every rank's "host:port" in rank order, as "h:p,h:p" or a list; None reads
    EMBPS_SERVERS (else 127.0.0.1:7070). timeout: deadline of every call in seconds (None:
    none): the one deadline of a lookup or push with all its attempts; padding: pad batches
    whose size is not a multiple of the group size with padding token 0 instead of refusing
    them. max_attempts: how many times a lookup or push is sent at most (default 4; 1: no
    retries), retried on UNAVAILABLE and DEADLINE_EXCEEDED (see docs/python.md);
    attempt_timeout: each attempt's own deadline in seconds (None: what is left of timeout).
    All four may be changed later as attributes.
    connect_timeout: the deadline of learning the group size at construction. token: a bearer
    token sent on every call as the gRPC metadata 'authorization: Bearer TOKEN' (servers started
    with --auth-tokens-file); token_file: a file holding it; neither: the file named by
    EMBPS_TOKEN_FILE if set, else no token.

    TLS (servers started with --tls-cert): tls_ca, the CA certificates that sign the servers'
    certificates (a PEM file's path, or its bytes); the servers' certificates must chain to them
    and name the host dialed, or tls_server_name. tls_cert and tls_key: this client's own
    certificate and key for mutual TLS (servers with --tls-client-ca). Without tls_ca the
    channels are cleartext (h2c).

    Raises ValueError (a bad address or token), embps.Error (UNAVAILABLE: a rank cannot be
    reached; FAILED_PRECONDITION: the number of addresses is not the group's size;
    UNAUTHENTICATED: the servers need a token and got none or an unknown one; ...).
    Use as a context manager or call close()."""

    def __init__(self, servers=None, *, timeout=None, padding=False, connect_timeout=10.0,
                 token=None, token_file=None, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, max_attempts=_retry.DEFAULT_MAX_ATTEMPTS,
                 attempt_timeout=None):
        self._addresses = tuple(parse_servers(servers))
        token = read_token(token, token_file)
        # Metadata of every call (grpcio's standard per-call metadata).
        metadata = None if token is None else (("authorization", "Bearer " + token),)
        tls = tls_credentials(tls_ca, tls_cert, tls_key, tls_server_name)
        self.timeout = _retry.check_seconds(timeout, "timeout")
        self.padding = bool(padding)
        self.max_attempts = _retry.check_max_attempts(max_attempts)
        self.attempt_timeout = _retry.check_seconds(attempt_timeout, "attempt_timeout")
        self.retries = 0  # attempts after a batch's first, over this client's life
        if not _digest.available():
            _digest.digest("", b"", 0)  # raises ImportError with the remedy
        self._lock = threading.Lock()
        self._batch_id = ((random.SystemRandom().getrandbits(31)) << 32) + 1
        # Sent with every batch: the servers scope batch ids by it, so this client's ids never
        # collide with another client's. Never 0, which means "no client id".
        self.client_id = random.SystemRandom().getrandbits(64) or 1
        self._tables = {}  # name -> (dtype number, emb_width), from replies (_admin.py)
        self._keyed = {}  # name -> True for a hash-keyed table, from ListTables (_admin.py)
        _malloc.tune()
        self._calls = GroupCalls(self._addresses, tls, metadata)
        try:
            self._learn_group_size(connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- plumbing --

    @property
    def group_size(self):
        """The number of ranks (learned from the servers at construction)."""
        return len(self._calls.ranks)

    @property
    def addresses(self):
        """Every rank's address, in rank order."""
        return self._addresses

    def __repr__(self):
        return "embps.Client(%r, group_size=%d%s)" % (
            ",".join(self._addresses), self.group_size, ", closed" if self._calls.closed else "")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Closes every channel; calls in flight fail with CANCELLED. Idempotent."""
        self._calls.close()

    def _unary(self, method, request, ranks, timeout=None):
        """Runs an admin call on ranks (a list of rank numbers), concurrently; its replies."""
        return self._calls.unary(method, request, ranks,
                                 self.timeout if timeout is None else timeout)

    def _learn_group_size(self, timeout):
        n = self.group_size
        replies = self._unary("ListTables", pb.ListTablesRequest(), list(range(n)), timeout)
        for r, m in enumerate(replies):
            if m.group_size != 0 and m.group_size != n:
                raise Error(grpc.StatusCode.FAILED_PRECONDITION,
                            "%s belongs to a group of %d ranks but %d address%s given: list "
                            "every rank's host:port in rank order"
                            % (self._addresses[r], m.group_size, n,
                               " was" if n == 1 else "es were"),
                            rank=r, address=self._addresses[r])
        self._remember(replies[0].tables)

    # -- batches --

    def _next_batch_id(self):
        with self._lock:
            bid = self._batch_id
            self._batch_id += 1
        return bid

    def _schedule(self):
        """A new batch's Attempts, from the client's settings as they are now."""
        return _retry.Attempts(_retry.check_seconds(self.timeout, "timeout"),
                               _retry.check_max_attempts(self.max_attempts),
                               _retry.check_seconds(self.attempt_timeout, "attempt_timeout"))

    def _run(self, batch):
        """A blocking lookup or push: its attempts in this thread, the caller's value or the
        last attempt's Error (annotated by _retry)."""
        sched = batch.schedule
        last = None
        while True:
            if last is not None:
                if self._calls.closed:  # closed during the backoff
                    raise batch.give_up(last)
                self._count_retry()
            calls = self._calls.send(batch.kind, batch.requests(), True, sched.call_timeout())
            try:
                return batch.join(calls)
            except Error as e:
                delay = None if self._calls.closed else sched.retry_after(e)
                if delay is None:
                    raise batch.give_up(e) from None
                last = e
            time.sleep(delay)

    def _future(self, batch):
        """A BatchFuture for batch, counting its retries in self.retries."""
        return BatchFuture(batch, self._calls, self._count_retry)

    def _count_retry(self):
        with self._lock:
            self.retries += 1

    def _lookup_batch(self, table, tokens, dtype, out):
        if not isinstance(table, str) or not table:
            raise ValueError("lookup: no table name")
        want = _batch.lookup_dtype(dtype)
        tok = _arrays.as_tokens(tokens, "lookup", lambda: self._is_keyed(table))
        n = len(tok)
        if out is not None:
            _batch.check_out(out, n, want)
        g = self.group_size
        plan = _batch.Plan(n, g, self.padding)
        bid = self._next_batch_id()
        digest = _digest.digest(table, tok, plan.tokens_per_batch)
        reqs = _batch.lookup_requests(table, tok, plan, g, bid, want, self.client_id, digest)

        def join(calls, _attempts):
            return _batch.join_lookup(table, bid, plan, self._calls.results(calls), want, out,
                                      self._calls.internal, self._tables)
        return _retry.Batch("lookup", bid, reqs, join, self._schedule())

    def lookup(self, table, tokens, *, dtype=None, out=None):
        """The rows of tokens in table, as a (len(tokens), emb_width) numpy array, row i for
        tokens[i]. Token 0 (padding) reads zeros.

        tokens: a 1-D array of integers (numpy of any int dtype, a list, a torch tensor): of a
        dense table non-negative (in [0, rows)); of a hash-keyed table any int64 value (uint64
        values beyond int64 are taken as their int64 bits, the same key). dtype: None or "f32": float32 rows (a bf16 table's rows converted exactly);
        "bf16": the raw bf16 bits as uint16 (only for a bf16 table: an f32 table refuses it with
        INVALID_ARGUMENT). out: an optional array to fill instead of a new one (C-contiguous,
        that dtype and shape).

        Retried on UNAVAILABLE and DEADLINE_EXCEEDED (max_attempts, within timeout).
        Raises ShapeError (the batch does not split over the group, tokens not 1-D), TypeError
        or ValueError (tokens that are not integers, or a dense table's negative), embps.Error (NOT_FOUND,
        INVALID_ARGUMENT for a token out of range, UNAVAILABLE, DEADLINE_EXCEEDED, ...)."""
        return self._run(self._lookup_batch(table, tokens, dtype, out))

    def lookup_async(self, table, tokens, *, dtype=None, out=None):
        """lookup() started without waiting: returns a BatchFuture whose result() is the rows
        (retries, if any, happen without anyone waiting: see BatchFuture). Argument errors
        (ShapeError, ...) are raised here, before anything is sent. tokens may be reused at once
        (the requests hold copies); out must not be touched until the future is done."""
        return self._future(self._lookup_batch(table, tokens, dtype, out))

    def _push_batch(self, table, tokens, grads, mode):
        if not isinstance(table, str) or not table:
            raise ValueError("push: no table name")
        if mode not in MODES:
            raise ValueError("push: mode %r is neither sync nor async" % (mode,))
        tok = _arrays.as_tokens(tokens, "push", lambda: self._is_keyed(table))
        n = len(tok)
        g = _arrays.as_grads(grads, n, "push")
        groups = self.group_size
        plan = _batch.Plan(n, groups, self.padding)
        sched = self._schedule()
        info = self._push_table_info(table, sched)
        if info is not None and g.shape[1] != info[1]:  # the table may have been made anew
            self._tables.pop(table, None)
            info = self._push_table_info(table, sched)
        g = _batch.fit_grads(g, table, info)
        bid = self._next_batch_id()
        digest = _digest.digest(table, tok, plan.tokens_per_batch)
        reqs = _batch.push_requests(table, tok, g, plan, groups, bid, MODES[mode],
                                    self.client_id, digest)

        def join(calls, attempts):
            replies = self._results_of_table(table, calls)
            return _batch.join_push(bid, replies, self._calls.internal, attempts)
        return _retry.Batch("push", bid, reqs, join, sched)

    def _results_of_table(self, table, calls):
        """The replies of a push's or an assign's calls on table; a failure that no retry mends
        also forgets what the client knew of the table (it may have changed): the next call asks
        again."""
        try:
            return self._calls.results(calls)
        except Error as e:
            if not e.retryable:
                self._tables.pop(table, None)
            raise

    def _push_table_info(self, table, sched):
        """_table_info for a push about to be made, its ListTables (when the table is not known
        yet) retried as the push would be, within the push's deadline (sched's)."""
        a = sched.sibling()
        while True:
            try:
                return self._table_info(table, a.call_timeout())
            except Error as e:
                delay = None if self._calls.closed else a.retry_after(e)
                if delay is None:
                    raise a.give_up(e, "the ListTables before a push to table '%s'" % table) \
                        from None
            time.sleep(delay)
            self._count_retry()

    def push(self, table, tokens, grads, mode="sync"):
        """Pushes gradients for tokens; returns a PushResult.

        grads: one row per token, shape (len(tokens), emb_width): float arrays are sent as f32
        (rounded to bf16, to nearest even, for a bf16 table); uint16 arrays are taken as bf16
        bits. Duplicate tokens' gradients are summed by the servers; padding token 0's are
        ignored. mode: "sync" (the reply comes once the step is applied: applied/skipped,
        grad_norm, num_unique) or "async" (once it is ordered: ordered=True; every later lookup
        sees it).

        Retried on UNAVAILABLE and DEADLINE_EXCEEDED (max_attempts, within timeout) with the same
        batch id and digest: the group applies it at most once, and answers a retry of a push it
        had applied with the first result (PushResult.replayed). What each status says about
        whether it was applied: docs/python.md.

        Raises ShapeError (the batch does not split, grads of the wrong shape), TypeError,
        ValueError, embps.Error (NOT_FOUND; INVALID_ARGUMENT; ...). A refused push changes
        nothing."""
        return self._run(self._push_batch(table, tokens, grads, mode))

    def push_async(self, table, tokens, grads, mode="sync"):
        """push() started without waiting: returns a BatchFuture whose result() is the
        PushResult (retries, if any, happen without anyone waiting: see BatchFuture). Argument
        errors are raised here, before anything is sent; tokens and grads may be reused as soon
        as this returns (the requests hold copies)."""
        return self._future(self._push_batch(table, tokens, grads, mode))

    # -- rows written directly --

    def _assign_batch(self, table, tokens, rows, reset_state):
        what = "assign"
        if not isinstance(table, str) or not table:
            raise ValueError("assign: no table name")
        tok = _arrays.as_tokens(tokens, what, lambda: self._is_keyed(table))
        n = len(tok)
        r = _arrays.as_grads(rows, n, what)
        groups = self.group_size
        plan = _batch.Plan(n, groups, self.padding)
        sched = self._schedule()
        info = self._push_table_info(table, sched)
        if info is not None and r.shape[1] != info[1]:  # the table may have been made anew
            self._tables.pop(table, None)
            info = self._push_table_info(table, sched)
        r = _batch.fit_rows(r, table, info)
        bid = self._next_batch_id()
        digest = _digest.digest(table, tok, plan.tokens_per_batch)
        reqs = _batch.assign_requests(table, tok, r, plan, groups, bid, bool(reset_state),
                                      self.client_id, digest)

        def join(calls, attempts):
            replies = self._results_of_table(table, calls)
            return _batch.join_assign(bid, replies, self._calls.internal, attempts)
        return _retry.Batch("assign", bid, reqs, join, sched)

    def assign(self, table, tokens, rows, reset_state=True):
        """Sets the rows of tokens in table to rows, as given; returns an AssignResult.

        rows: one row per token, shape (len(tokens), emb_width): float arrays are sent as f32
        (rounded to bf16, to nearest even, for a bf16 table); uint16 arrays are taken as bf16
        bits (widened exactly for an f32 table). A table stores them bit for bit: a lookup then
        reads exactly these rows (lookup(dtype="bf16") the bits of a bf16 table). A token given
        twice takes its last row; token 0 (padding) is skipped. Of a hash-keyed table, a key
        without a slot is inserted (no admission count; the table's eviction rule frees a slot
        when it is full; keys left without one are counted in num_refused). reset_state: the
        rows' optimizer state goes back to its initial value too (else it is kept; a key given a
        new slot starts from the initial state either way).

        Ordered like a push (a lookup made after it sees it) and retried like one, with the same
        batch id and digest: written at most once (AssignResult.replayed). Needs the worker or
        admin role. Raises ShapeError, TypeError, ValueError, embps.Error (NOT_FOUND,
        INVALID_ARGUMENT for a token outside a dense table's rows, PERMISSION_DENIED, ...); a
        refused assign writes nothing."""
        return self._run(self._assign_batch(table, tokens, rows, reset_state))

    def assign_async(self, table, tokens, rows, reset_state=True):
        """assign() started without waiting: returns a BatchFuture whose result() is the
        AssignResult. Argument errors are raised here, before anything is sent; tokens and rows
        may be reused as soon as this returns (the requests hold copies)."""
        return self._future(self._assign_batch(table, tokens, rows, reset_state))

    def import_array(self, table, array, ids=None, start=0, *, batch_rows=None,
                     reset_state=True, progress=None):
        """Streams a (rows, emb_width) array into table in batches of assigns; returns an
        ImportResult. See docs/python.md, "Importing an array" (embps/_import.py).

        array: float32 (rounded to bf16 for a bf16 table), or uint16 holding bf16 bits (a bf16
        table's exact bits; widened exactly for an f32 table); any array-like numpy can view
        without a copy, such as np.load(path, mmap_mode="r"), so a large file is read as it is
        sent. ids: None (array row i is table row i; a dense table's row 0 is the padding row and
        is not written) or one int64 id per row (a dense table's row number, or a hash-keyed
        table's key). start: the first row of the array to send (resume an import that stopped:
        its error says where). A table the group lacks is created with the array's shape: dense
        with rows = len(array) without ids, hash-keyed with capacity = len(array) with ids, in
        the array's dtype (uint16: bf16), the optimizer's defaults. batch_rows: rows per assign
        (None: about 8 MiB of rows); progress: print a progress line to stderr (None: when it is
        a terminal). Everything is checked before the first batch is sent (width, dtype, ids'
        length and range): an array that does not fit writes nothing."""
        from . import _import
        return _import.import_array(self, table, array, ids, start, batch_rows, reset_state,
                                    progress)

    # -- feature batches --

    def _features_batch(self, features, what):
        return _features.Batch(features, what, self.group_size, self.padding, self._is_keyed)

    def _lookup_features_batch(self, features):
        fb = self._features_batch(features, "lookup features")
        bid = self._next_batch_id()
        reqs = fb.lookup_requests(bid, self.client_id)

        def join(calls, _attempts):
            return fb.join_lookup(bid, self._calls.results(calls), self._calls.internal,
                                  self._tables)
        return _retry.Batch("lookup_features", bid, reqs, join, self._schedule())

    def lookup_features(self, features):
        """Looks up a batch of sparse features in one call per rank, pooled on the servers
        (docs/design.md, "Feature batches"); returns {name: rows} in the features' order.

        features: a dict of name -> embps.Feature(table, ids, lengths=None, weights=None,
        pooling="none"), every feature holding one bag per sample (B samples). A pooled feature
        ("sum", "mean", "weighted_sum") gives a (B, emb_width) float32 array, row i sample i's
        bag pooled (bf16 tables too); pooling "none" gives (len(ids), emb_width) float32 rows,
        one per id, as lookup does. Id 0 is padding: it reads zeros, adds nothing to a bag and
        does not count in a mean; an empty bag pools to zeros.

        The batch is split by samples: B/N per rank (padding=True pads B to a multiple of N
        with empty bags, dropped from the result). Retried on UNAVAILABLE and DEADLINE_EXCEEDED
        (max_attempts, within timeout), as lookup.

        Raises ShapeError (B does not split over the group; lengths, weights or grads of the
        wrong size), TypeError or ValueError (ids that are not integers, a dense table's
        negative id, an unknown pooling, weights beside a pooling other than weighted_sum),
        each naming the feature, before anything is sent; embps.Error (NOT_FOUND: a table the
        group lacks; INVALID_ARGUMENT: an id out of a dense table's rows; UNAVAILABLE, ...),
        the servers' message naming the feature."""
        return self._run(self._lookup_features_batch(features))

    def lookup_features_async(self, features):
        """lookup_features() started without waiting: returns a BatchFuture whose result() is
        the {name: rows} dict. Argument errors are raised here, before anything is sent; the
        features' arrays may be reused at once (the requests hold copies)."""
        return self._future(self._lookup_features_batch(features))

    def _push_features_batch(self, features, grads, mode):
        what = "push features"
        if mode not in MODES:
            raise ValueError("%s: mode %r is neither sync nor async" % (what, mode))
        fb = self._features_batch(features, what)
        sched = self._schedule()
        tables = fb.tables()
        infos = {t: self._push_table_info(t, sched) for t in tables}
        try:
            g = fb.fit_grads(grads, infos, what)
        except ShapeError:  # a table may have been made anew with another width: ask again
            for t in tables:
                self._tables.pop(t, None)
            infos = {t: self._push_table_info(t, sched) for t in tables}
            g = fb.fit_grads(grads, infos, what)
        bid = self._next_batch_id()
        reqs = fb.push_requests(bid, self.client_id, g, MODES[mode])

        def join(calls, attempts):
            try:
                replies = self._calls.results(calls)
            except Error as e:
                if not e.retryable:  # the tables may have changed: ask again next time
                    for t in tables:
                        self._tables.pop(t, None)
                raise
            return _features.join_push(bid, replies, self._calls.internal, attempts)
        return _retry.Batch("push_features", bid, reqs, join, sched)

    def push_features(self, features, grads, mode="sync"):
        """Pushes the gradients of a feature batch (the features given to lookup_features) in
        one call per rank; returns a PushFeaturesResult with one TableStep per table.

        grads: a dict of feature name -> gradient rows, one entry per feature: a pooled
        feature's (B, emb_width) float rows, one per sample (sent as f32), which the servers
        expand to the bag's ids (times the id's weight for weighted_sum, divided by the bag's
        nonzero ids for mean; padding ids get none); pooling "none"'s (len(ids), emb_width),
        one per id, as push takes them (rounded to bf16 for a bf16 table; uint16 arrays are
        bf16 bits). Every feature of a table joins one optimizer step of that table, gated
        alone: bitwise one push of the expanded gradients per table. mode: "sync" (steps
        applied, with each table's applied/skipped, grad_norm, num_unique) or "async" (ordered).

        Retried as push is, with the same batch id and digest: applied at most once (a retry of
        one the group applied answers replayed, with no steps). Raises as lookup_features does,
        and ShapeError for grads of the wrong shape, naming the feature; a refused push changes
        nothing on any table."""
        return self._run(self._push_features_batch(features, grads, mode))

    def push_features_async(self, features, grads, mode="sync"):
        """push_features() started without waiting: returns a BatchFuture whose result() is
        the PushFeaturesResult. Argument errors are raised here, before anything is sent; the
        arrays may be reused as soon as this returns (the requests hold copies)."""
        return self._future(self._push_features_batch(features, grads, mode))
