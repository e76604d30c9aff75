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
stats, health, checkpoints), errors.py, values.py (what the calls return).

Threads: a Client may be shared by threads. Future callbacks run on gRPC's threads: they must
not block on another embps call.
"""
import random
import threading

import grpc

from . import _arrays, _batch, _malloc
from ._admin import TableAdmin
from ._calls import BatchFuture, GroupCalls
from ._connect import parse_servers, read_token, tls_credentials
from ._names import MODES, pb
from .errors import Error


class Client(TableAdmin):
    """A connection to an embps shard group.

    servers: every rank's "host:port" in rank order, as "h:p,h:p" or a list; None reads
    EMBPS_SERVERS (else 127.0.0.1:7070). timeout: deadline of every call in seconds (None:
    none); padding: pad batches whose size is not a multiple of the group size with padding
    token 0 instead of refusing them (both may be changed later as attributes).
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
                 tls_server_name=None):
        self._addresses = tuple(parse_servers(servers))
        token = read_token(token, token_file)
        # Metadata of every call (grpcio's standard per-call metadata).
        metadata = None if token is None else (("authorization", "Bearer " + token),)
        tls = tls_credentials(tls_ca, tls_cert, tls_key, tls_server_name)
        self.timeout = timeout
        self.padding = bool(padding)
        self._lock = threading.Lock()
        self._batch_id = ((random.SystemRandom().getrandbits(31)) << 32) + 1
        # Sent with every batch: the servers scope batch ids by it, so this client's ids never
        # collide with another client's. Never 0, which means "no client id".
        self.client_id = random.SystemRandom().getrandbits(64) or 1
        self._tables = {}  # name -> (dtype number, emb_width), from replies (_admin.py)
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

    def _lookup_start(self, table, tokens, dtype, out, wait):
        if not isinstance(table, str) or not table:
            raise ValueError("lookup: no table name")
        want = _batch.lookup_dtype(dtype)
        tok = _arrays.as_tokens(tokens, "lookup")
        n = len(tok)
        if out is not None:
            _batch.check_out(out, n, want)
        g = self.group_size
        plan = _batch.Plan(n, g, self.padding)
        bid = self._next_batch_id()
        reqs = _batch.lookup_requests(table, tok, plan, g, bid, want, self.client_id)
        calls = self._calls.send("lookup", reqs, wait, self.timeout)

        def join(calls):
            return _batch.join_lookup(table, bid, plan, self._calls.results(calls), want, out,
                                      self._calls.internal, self._tables)
        return bid, calls, join

    def lookup(self, table, tokens, *, dtype=None, out=None):
        """The rows of tokens in table, as a (len(tokens), emb_width) numpy array, row i for
        tokens[i]. Token 0 (padding) reads zeros.

        tokens: a 1-D array of non-negative integers (numpy of any int dtype, a list, a torch
        tensor). dtype: None or "f32": float32 rows (a bf16 table's rows converted exactly);
        "bf16": the raw bf16 bits as uint16 (only for a bf16 table: an f32 table refuses it with
        INVALID_ARGUMENT). out: an optional array to fill instead of a new one (C-contiguous,
        that dtype and shape).

        Raises ShapeError (the batch does not split over the group, tokens not 1-D), TypeError
        or ValueError (tokens that are not non-negative integers), embps.Error (NOT_FOUND,
        INVALID_ARGUMENT for a token out of range, UNAVAILABLE, DEADLINE_EXCEEDED, ...)."""
        _, calls, join = self._lookup_start(table, tokens, dtype, out, True)
        return join(calls)  # joins in this thread: cheaper than a BatchFuture's callbacks

    def lookup_async(self, table, tokens, *, dtype=None, out=None):
        """lookup() started without waiting: returns a BatchFuture whose result() is the rows.
        Argument errors (ShapeError, ...) are raised here, before anything is sent. tokens may be
        reused at once (the requests hold copies); out must not be touched until the future is
        done."""
        bid, calls, join = self._lookup_start(table, tokens, dtype, out, False)
        return BatchFuture(bid, calls, join)

    def _push_start(self, table, tokens, grads, mode, wait):
        if not isinstance(table, str) or not table:
            raise ValueError("push: no table name")
        if mode not in MODES:
            raise ValueError("push: mode %r is neither sync nor async" % (mode,))
        tok = _arrays.as_tokens(tokens, "push")
        n = len(tok)
        g = _arrays.as_grads(grads, n, "push")
        groups = self.group_size
        plan = _batch.Plan(n, groups, self.padding)
        info = self._table_info(table)
        if info is not None and g.shape[1] != info[1]:  # the table may have been made anew
            self._tables.pop(table, None)
            info = self._table_info(table)
        g = _batch.fit_grads(g, table, info)
        bid = self._next_batch_id()
        reqs = _batch.push_requests(table, tok, g, plan, groups, bid, MODES[mode],
                                    self.client_id)
        calls = self._calls.send("push", reqs, wait, self.timeout)

        def join(calls):
            try:
                replies = self._calls.results(calls)
            except Error:
                self._tables.pop(table, None)  # the table may have changed: ask again next time
                raise
            return _batch.join_push(bid, replies, self._calls.internal)
        return bid, calls, join

    def push(self, table, tokens, grads, mode="sync"):
        """Pushes gradients for tokens; returns a PushResult.

        grads: one row per token, shape (len(tokens), emb_width): float arrays are sent as f32
        (rounded to bf16, to nearest even, for a bf16 table); uint16 arrays are taken as bf16
        bits. Duplicate tokens' gradients are summed by the servers; padding token 0's are
        ignored. mode: "sync" (the reply comes once the step is applied: applied/skipped,
        grad_norm, num_unique) or "async" (once it is ordered: ordered=True; every later lookup
        sees it).

        Raises ShapeError (the batch does not split, grads of the wrong shape), TypeError,
        ValueError, embps.Error (NOT_FOUND; INVALID_ARGUMENT; ...). A refused push changes
        nothing."""
        _, calls, join = self._push_start(table, tokens, grads, mode, True)
        return join(calls)

    def push_async(self, table, tokens, grads, mode="sync"):
        """push() started without waiting: returns a BatchFuture whose result() is the
        PushResult. Argument errors are raised here, before anything is sent; tokens and grads
        may be reused as soon as this returns (the requests hold copies)."""
        bid, calls, join = self._push_start(table, tokens, grads, mode, False)
        return BatchFuture(bid, calls, join)
