"""embps.Client: a worker's connection to a shard group, over stock grpcio.

A client holds one gRPC channel per rank (each with its own TCP connection: the channels use a
local subchannel pool, so two clients in one process do not share connections, as two C clients
do not). At construction it asks every rank's ListTables for the group size and checks that one
address was given per rank, as the C client does (client/admin.c), so a mistyped list fails at
once rather than at the first batch.

Batches follow DESIGN.md and client/group.c exactly: a batch of T tokens is split into
group_size contiguous shards of T/group_size tokens, shard r to rank r, every shard carrying the
same batch id; with padding on, T is rounded up to a multiple of the group size with padding
token 0 (whose rows read zero and whose gradients are ignored) appended at the end, so the
caller's tokens keep their positions and the joined lookup is simply the first n rows. A batch
that does not split is refused before anything is sent with the C client's message
(errors.tokens_per_batch_error). Batch ids count up from a random 31-bit value shifted left by
32, per client, like the C client's.

Pipelining: lookup_async and push_async start one gRPC call per rank (grpc's future API) and
return at once with a future; lookup and push make blocking calls (see _send). Either way every
rank's channel carries one thread's calls in the order it made them, and the servers run one
connection's batches in arrival order (server/service/service.c): a lookup started after a
push sees it, pipelined or not (tests/python/test_client.py checks it). The two bulk messages
are encoded and decoded by hand (_wire.py) to avoid protobuf's copies of the rows.

Threads: a Client may be shared by threads. Future callbacks run on gRPC's threads: they must
not block on another embps call.
"""
import concurrent.futures
import os
import random
import socket
import threading

import grpc
import numpy as np

from . import _arrays, _malloc, _stubs, _wire
from .errors import (Error, ShapeError, batch_too_large_error, emb_width_error,
                     tokens_per_batch_error)
from .values import (DTYPES, OPTIMIZERS, CheckpointInfo, Health, PushResult, RankStats,
                    TableSpec)

_pb = _stubs.messages()
_DTYPE = _pb.enum("embps.v1.DType")
_OPT = _pb.enum("embps.v1.OptimizerKind")
_MODE = _pb.enum("embps.v1.UpdateMode")
_SERVING = _pb.enum("grpc.health.v1.HealthCheckResponse.ServingStatus")
F32, BF16 = _DTYPE["DTYPE_F32"], _DTYPE["DTYPE_BF16"]
if DTYPES != {F32: "f32", BF16: "bf16"} or any(
        OPTIMIZERS[_OPT["OPTIMIZER_" + n.upper()]] != n
        for n in ("sgd", "adagrad", "rowwise_adagrad", "adam")):
    raise ImportError("embps: the DType or OptimizerKind numbers in proto/ changed: update "
                      "embps/values.py")

_DTYPE_NAMES = {"f32": F32, "float32": F32, "bf16": BF16, "bfloat16": BF16}
_OPTIMIZER_NAMES = {"sgd": _OPT["OPTIMIZER_SGD"], "adagrad": _OPT["OPTIMIZER_ADAGRAD"],
                    "rowwise_adagrad": _OPT["OPTIMIZER_ROWWISE_ADAGRAD"],
                    "adam": _OPT["OPTIMIZER_ADAM"], None: _OPT["OPTIMIZER_UNSPECIFIED"],
                    "default": _OPT["OPTIMIZER_UNSPECIFIED"]}
_MODES = {"sync": _MODE["UPDATE_MODE_SYNC"], "async": _MODE["UPDATE_MODE_ASYNC"]}
_ITEMSIZE = {F32: 4, BF16: 2}
_NP_DTYPE = {F32: np.dtype("<f4"), BF16: np.dtype("<u2")}
_STATUS_NAMES = {v: k for k, v in _SERVING.items()}

_SERVICE = "/embps.v1.EmbeddingService/"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_MAX_TOKENS_PER_BATCH = 4294967295
_WORKERS_PER_RANK = 8  # threads of one client making blocking calls to one rank at once
_DEFAULT_SERVERS = "127.0.0.1:7070"  # as the CLI's --servers
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),  # the servers set the limit (--max-message-bytes)
    ("grpc.max_receive_message_length", -1),
    ("grpc.use_local_subchannel_pool", 1),  # this client's own connections
]


# ---- TLS --------------------------------------------------------------------------------------

def _pem(value, what):
    """A PEM argument's bytes: value itself when bytes, else the file it names."""
    if value is None or isinstance(value, (bytes, bytearray)):
        return None if value is None else bytes(value)
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError("%s %s: cannot read it: %s" % (what, value, e.strerror)) from None


def _tls_credentials(ca, cert, key, server_name):
    """(channel credentials, extra channel options) for the Client's TLS arguments, or None for
    cleartext. grpcio offers ALPN h2 and checks the server's certificate and host name."""
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together: give both (mutual TLS) or neither")
    if ca is None:
        if cert is not None or server_name is not None:
            raise ValueError("tls_cert, tls_key and tls_server_name need tls_ca: TLS verifies "
                             "the server too")
        return None
    creds = grpc.ssl_channel_credentials(root_certificates=_pem(ca, "tls_ca"),
                                         private_key=_pem(key, "tls_key"),
                                         certificate_chain=_pem(cert, "tls_cert"))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return creds, options


# ---- addresses --------------------------------------------------------------------------------

def _refuse(text, tail):
    return ValueError("server address '%s'%s" % (text[:300], tail))


def _check_address(text):
    """text ("host:port" or "[ipv6]:port") checked by common/hostport.c's rules, with its
    messages; returns the gRPC target for it."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or close + 1 >= len(text) or text[close + 1] != ":":
            raise _refuse(text, " is not [ipv6]:port")
        host, port, ipv6 = text[1:close], text[close + 2:], True
    else:
        colon = text.rfind(":")
        if colon < 0:
            raise _refuse(text, " has no port (expected host:port)")
        host, port, ipv6 = text[:colon], text[colon + 1:], False
        if ":" in host:
            raise _refuse(text, ": write IPv6 hosts as [addr]:port")
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
        raise _refuse(text, " has a bad port (expected 1..65535)")
    if not host:
        raise _refuse(text, " has an empty host")
    if ipv6:
        try:
            socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
        except OSError:
            raise _refuse(text, ": '%s' is not an IPv6 address" % host[:64]) from None
        return "ipv6:" + text
    for c in host:
        if not (c.isascii() and (c.isalnum() or c in "-_.")):
            raise _refuse(text, " has a bad character %s in its host" %
                          ("'%s'" % c if c.isprintable() else "(byte 0x%02x)" % ord(c)))
    if ".." in host or host.startswith("."):
        raise _refuse(text, " has an empty label in its host")
    return text


def parse_servers(servers):
    """The group's addresses, in rank order, from "h:p,h:p", a sequence of "h:p", or (None)
    EMBPS_SERVERS, else 127.0.0.1:7070 as the CLI. Raises ValueError with the C client's
    messages."""
    if servers is None:
        servers = os.environ.get("EMBPS_SERVERS") or _DEFAULT_SERVERS
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    if not items:
        raise ValueError("no server address given")
    out = []
    for s in items:
        if not isinstance(s, str):
            raise TypeError("server addresses are host:port strings, not %r" % (s,))
        s = s.strip()
        if not s:
            raise ValueError("empty server address in the list (expected "
                             "host:port[,host:port...])")
        _check_address(s)
        out.append(s)
    return out


def read_token(token=None, token_file=None):
    """The bearer token to send: token as given, else token_file's text, else the file named by
    EMBPS_TOKEN_FILE (as the CLI's --token-file), else None. The file's surrounding whitespace
    (a trailing newline) is dropped; it must hold one token. Raises ValueError (both given, an
    empty file or one of several words, a token that is not visible ASCII) or OSError."""
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token is None:
        path = token_file if token_file is not None else os.environ.get("EMBPS_TOKEN_FILE")
        if not path:
            return None
        with open(path, "rb") as f:
            data = f.read(1025)
        if len(data) > 1024:
            raise ValueError("token file %s is longer than 1024 bytes" % path)
        token = data.decode("ascii", "replace").strip()
        if not token:
            raise ValueError("token file %s is empty: it should hold one token" % path)
        if len(token.split()) > 1:
            raise ValueError("token file %s holds more than one word: it should hold one token "
                             "alone" % path)
    if not isinstance(token, str):
        raise TypeError("token must be a str, not %s" % type(token).__name__)
    if not token or any(not ("!" <= c <= "~") for c in token):
        raise ValueError("the token must be visible ASCII characters (no spaces or line breaks)")
    return token


# ---- futures ----------------------------------------------------------------------------------

class BatchFuture(concurrent.futures.Future):
    """A lookup or push in flight: one gRPC call per rank, joined into one result when the
    last one finishes (on a gRPC thread), so result(), exception(), done(),
    add_done_callback() and concurrent.futures.wait()/as_completed() behave as for any
    concurrent.futures.Future. result() raises embps.Error (the first failing rank's, in rank
    order). cancel() cancels the calls still in flight; a cancelled batch may still have been
    applied by the ranks that had it. batch_id: the batch's id on the wire."""

    def __init__(self, batch_id, calls, join):
        super().__init__()
        self.batch_id = batch_id
        self._calls = calls
        self._join = join
        self._left = len(calls)
        self._left_lock = threading.Lock()
        for c in calls:
            c.add_done_callback(self._call_done)

    def _call_done(self, _call):
        with self._left_lock:
            self._left -= 1
            if self._left:
                return
        try:
            value = self._join(self._calls)
        except BaseException as e:  # handed to the waiter
            try:
                self.set_exception(e)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass
        else:
            try:
                self.set_result(value)
            except concurrent.futures.InvalidStateError:
                pass

    def cancel(self):
        if not super().cancel():
            return False
        for c in self._calls:
            c.cancel()
        return True


# ---- the client -------------------------------------------------------------------------------

class _Rank:
    """One rank's channel and the methods called on it."""

    def __init__(self, address, tls=None):
        self.address = address
        if tls is None:
            self.channel = grpc.insecure_channel(_check_address(address),
                                                 options=_CHANNEL_OPTIONS)
        else:
            creds, options = tls
            self.channel = grpc.secure_channel(_check_address(address), creds,
                                               options=_CHANNEL_OPTIONS + options)
        ch = self.channel
        # The bulk calls take and return raw bytes (_wire.py); the rest protobuf messages.
        self.lookup = ch.unary_unary(_SERVICE + "Lookup")
        self.push = ch.unary_unary(_SERVICE + "PushGradients",
                                   response_deserializer=_pb.PushGradientsResponse.FromString)
        self.admin = {}
        for name, resp in (("CreateTable", _pb.CreateTableResponse),
                           ("DropTable", _pb.DropTableResponse),
                           ("ListTables", _pb.ListTablesResponse),
                           ("GetStats", _pb.GetStatsResponse),
                           ("Checkpoint", _pb.CheckpointResponse),
                           ("ListCheckpoints", _pb.ListCheckpointsResponse)):
            self.admin[name] = ch.unary_unary(_SERVICE + name,
                                              request_serializer=_serialize,
                                              response_deserializer=resp.FromString)
        self.admin["Health"] = ch.unary_unary(
            _HEALTH_CHECK, request_serializer=_serialize,
            response_deserializer=_pb.HealthCheckResponse.FromString)


class _Finished:
    """A call that has already finished (a blocking call's outcome), read like a future."""
    __slots__ = ("value", "error")

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


def _serialize(m):
    return m.SerializeToString()


class _Plan:
    """A batch of n tokens over the group: tokens_per_batch (padded) and tokens per shard."""
    __slots__ = ("n", "tokens_per_batch", "shard_tokens")

    def __init__(self, n, group_size, pad):
        t = n
        if pad:
            t = -(-n // group_size) * group_size
        elif n % group_size:
            raise tokens_per_batch_error(n, group_size)
        if t > _MAX_TOKENS_PER_BATCH:
            raise batch_too_large_error(t)
        self.n, self.tokens_per_batch, self.shard_tokens = n, t, t // group_size

    def shard(self, r):
        """(first, real, pad): rank r's shard is tokens [first, first + real) plus pad padding
        tokens (client/group.c's embps__shard_range)."""
        first = r * self.shard_tokens
        real = max(0, min(first + self.shard_tokens, self.n) - first)
        return first, real, self.shard_tokens - real


class Client:
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
        self._metadata = None if token is None else (("authorization", "Bearer " + token),)
        tls = _tls_credentials(tls_ca, tls_cert, tls_key, tls_server_name)
        self.timeout = timeout
        self.padding = bool(padding)
        self._lock = threading.Lock()
        self._batch_id = ((random.SystemRandom().getrandbits(31)) << 32) + 1
        # Sent with every batch: the servers scope batch ids by it, so this client's ids never
        # collide with another client's. Never 0, which means "no client id".
        self.client_id = random.SystemRandom().getrandbits(64) or 1
        self._tables = {}  # name -> (dtype number, emb_width), from replies
        self._ranks = []
        self._pools = [None] * len(self._addresses)  # see _send
        self._closed = False
        _malloc.tune()
        try:
            for a in self._addresses:
                self._ranks.append(_Rank(a, tls))
            self._learn_group_size(connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- plumbing --

    @property
    def group_size(self):
        """The number of ranks (learned from the servers at construction)."""
        return len(self._ranks)

    @property
    def addresses(self):
        """Every rank's address, in rank order."""
        return self._addresses

    def __repr__(self):
        return "embps.Client(%r, group_size=%d%s)" % (
            ",".join(self._addresses), len(self._ranks), ", closed" if self._closed else "")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Closes every channel; calls in flight fail with CANCELLED. Idempotent."""
        with self._lock:
            self._closed = True
            pools, self._pools = self._pools, [None] * len(self._pools)
        for r in self._ranks:
            r.channel.close()
        for p in pools:
            if p is not None:
                p.shutdown(wait=False)

    def _check_open(self):
        if self._closed:
            raise ValueError("this embps.Client is closed")

    def _error(self, e, rank):
        """An embps.Error for rank's failed call e (a grpc.RpcError)."""
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        address = self._addresses[rank]
        msg = details if len(self._ranks) == 1 else "rank %d (%s): %s" % (rank, address, details)
        return Error(code, msg, details=details, rank=rank, address=address)

    def _results(self, calls, ranks=None):
        """The replies of finished per-rank calls; raises the first failing rank's Error."""
        out = []
        for i, c in enumerate(calls):
            r = i if ranks is None else ranks[i]
            try:
                out.append(c.result())
            except grpc.RpcError as e:
                raise self._error(e, r) from None
            except (grpc.FutureCancelledError, concurrent.futures.CancelledError):
                raise Error(grpc.StatusCode.CANCELLED, "the call to rank %d (%s) was cancelled"
                            % (r, self._addresses[r]), rank=r,
                            address=self._addresses[r]) from None
        return out

    def _unary(self, method, request, ranks, timeout=None):
        """Runs an admin call on ranks (a list of rank numbers), concurrently; its replies."""
        self._check_open()
        t = self.timeout if timeout is None else timeout
        md = self._metadata
        calls = [self._ranks[r].admin[method].future(request, timeout=t, metadata=md)
                 for r in ranks]
        return self._results(calls, ranks)

    def _learn_group_size(self, timeout):
        n = len(self._ranks)
        replies = self._unary("ListTables", _pb.ListTablesRequest(), list(range(n)), timeout)
        for r, m in enumerate(replies):
            if m.group_size != 0 and m.group_size != n:
                raise Error(grpc.StatusCode.FAILED_PRECONDITION,
                            "%s belongs to a group of %d ranks but %d address%s given: list "
                            "every rank's host:port in rank order"
                            % (self._addresses[r], m.group_size, n,
                               " was" if n == 1 else "es were"),
                            rank=r, address=self._addresses[r])
        self._remember(replies[0].tables)

    def _remember(self, specs):
        for s in specs:
            self._tables[s.name] = (s.dtype or F32, s.emb_width)

    def _table_info(self, table):
        """(dtype, emb_width) of table if known or listed now; None if the group lacks it."""
        info = self._tables.get(table)
        if info is None:
            self._remember(self._unary("ListTables", _pb.ListTablesRequest(), [0])[0].tables)
            info = self._tables.get(table)
        return info

    # -- admin --

    def create_table(self, name, rows, emb_width, dtype="f32", optimizer="rowwise_adagrad", *,
                     lr=0.0, eps=0.0, half_life=0.0, initial_accumulator=0.0, weight_decay=0.0,
                     beta1=0.0, beta2=0.0, seed=0, init_scale=0.0):
        """Creates a table of rows x emb_width on the group (asked of rank 0) and returns its
        TableSpec with the server's defaults filled in.

        dtype: "f32" or "bf16" storage (optimizer math is f32). optimizer: "sgd", "adagrad",
        "rowwise_adagrad" or "adam". Zero floats take the optimizer's defaults (lr 0.01, eps
        1e-8, beta1 0.9, beta2 0.999); half_life: accumulator half-life in steps (0: no
        decay); init_scale: rows start uniform in [-init_scale, init_scale) (0:
        1/sqrt(emb_width)), a function of (seed, row, column) only.

        Raises ShapeError (emb_width does not split over the group), ValueError (bad name,
        dtype or optimizer), embps.Error (ALREADY_EXISTS, INVALID_ARGUMENT, ...)."""
        if not isinstance(name, str) or not name:
            raise ValueError("create table: no table name")
        if dtype not in _DTYPE_NAMES:
            raise ValueError("create table: dtype %r is neither f32 nor bf16" % (dtype,))
        if optimizer not in _OPTIMIZER_NAMES:
            raise ValueError("create table: unknown optimizer %r (sgd, adagrad, rowwise_adagrad, "
                             "adam)" % (optimizer,))
        if emb_width % len(self._ranks):
            raise emb_width_error(emb_width, len(self._ranks))
        opt = _pb.OptimizerConfig(kind=_OPTIMIZER_NAMES[optimizer], lr=lr, eps=eps,
                                  half_life=half_life, initial_accumulator=initial_accumulator,
                                  weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        spec = _pb.TableSpec(name=name, rows=rows, emb_width=emb_width,
                             dtype=_DTYPE_NAMES[dtype], seed=seed, optimizer=opt,
                             init_scale=init_scale)
        reply = self._unary("CreateTable", _pb.CreateTableRequest(spec=spec), [0])[0]
        self._remember([reply.spec])
        return TableSpec.from_pb(reply.spec)

    def drop_table(self, name):
        """Drops table `name` on the whole group (asked of rank 0): every rank frees its rows and
        optimizer state, the bytes go back to the servers' --max-memory-bytes budget, and the name
        may be created again. Batches of the table still in flight fail with NOT_FOUND. Returns
        the bytes the table held on each rank.

        Raises ValueError (no name), embps.Error (NOT_FOUND, INVALID_ARGUMENT, ...)."""
        if not isinstance(name, str) or not name:
            raise ValueError("drop table: no table name")
        reply = self._unary("DropTable", _pb.DropTableRequest(name=name), [0])[0]
        self._tables.pop(name, None)
        return reply.bytes

    def tables(self):
        """The group's tables (asked of rank 0), as TableSpecs."""
        specs = self._unary("ListTables", _pb.ListTablesRequest(), [0])[0].tables
        self._remember(specs)
        return [TableSpec.from_pb(s) for s in specs]

    def table(self, name):
        """One table's TableSpec; embps.Error NOT_FOUND if the group has none of that name."""
        for t in self.tables():
            if t.name == name:
                return t
        raise Error(grpc.StatusCode.NOT_FOUND, "table '%s' not found" % name)

    def stats(self):
        """Every rank's statistics, in rank order (RankStats)."""
        n = len(self._ranks)
        replies = self._unary("GetStats", _pb.GetStatsRequest(), list(range(n)))
        return [RankStats.from_pb(m, self._addresses[r]) for r, m in enumerate(replies)]

    def health(self, service=""):
        """Every rank's grpc.health.v1 status for service ("": the whole server) as a Health,
        true when all serve. Raises embps.Error when a rank cannot be asked."""
        n = len(self._ranks)
        replies = self._unary("Health", _pb.HealthCheckRequest(service=service), list(range(n)))
        statuses = tuple(_STATUS_NAMES.get(m.status, "UNKNOWN") for m in replies)
        message = ""
        for r, s in enumerate(statuses):
            if s != "SERVING":
                message = "rank %d (%s) is %s" % (r, self._addresses[r], s)
                break
        return Health(serving=not message, statuses=statuses, message=message)

    def checkpoint(self, table=None):
        """Takes a checkpoint of table (None: every table) into the servers' --checkpoint-dir
        now and returns once it is complete (CheckpointInfo: round, bytes, path). Raises
        embps.Error (FAILED_PRECONDITION without --checkpoint-dir, RESOURCE_EXHAUSTED when a disk
        filled up, NOT_FOUND)."""
        m = self._unary("Checkpoint", _pb.CheckpointRequest(table=table or ""), [0])[0]
        return CheckpointInfo(round=m.round, bytes=m.bytes, path=m.path, scope=table or "")

    def checkpoints(self):
        """The complete checkpoints in the group's --checkpoint-dir, oldest first."""
        m = self._unary("ListCheckpoints", _pb.ListCheckpointsRequest(), [0])[0]
        return [CheckpointInfo(round=c.round, bytes=c.bytes, path=c.path, scope=c.scope,
                               time_unix_ms=c.time_unix_ms, group_size=c.group_size,
                               base_round=c.base_round, tables=tuple(c.tables))
                for c in m.checkpoints]

    # -- batches --

    def _next_batch_id(self):
        with self._lock:
            bid = self._batch_id
            self._batch_id += 1
        return bid

    def _send(self, method, requests, wait):
        """Starts one call per rank, request r to rank r.

        Calls that are not waited for at once (wait false: lookup_async, push_async) are grpc
        futures, started under the client's lock, so that every rank's channel carries one
        thread's batches in the order it made them and two threads' batches never interleave.

        A batch the caller waits for now (lookup, push) uses grpc's blocking calls instead: rank
        0's in this thread, the other ranks' in this client's worker threads (a pool per rank,
        kept between calls). A blocking call polls its own completion queue in its thread,
        while a future's completion goes through its channel's polling thread, which grpcio
        starts when a channel has no call in flight and stops when it has none again: with
        one batch at a time, that was a thread started and stopped per call and per rank,
        about 0.4 ms on loopback, and 0.6 ms of CPU a 2-rank lookup of 4096 x 128 f32
        (measured; tests/bench/python_bench.py). Order is kept: this thread's earlier calls
        were started before, and it makes no other call until this batch is done."""
        self._check_open()
        t = self.timeout
        md = self._metadata
        ranks = self._ranks
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
                self._check_open()
                pool = self._pools[rank]
                if pool is None:
                    pool = concurrent.futures.ThreadPoolExecutor(
                        _WORKERS_PER_RANK, thread_name_prefix="embps-rank%d" % rank)
                    self._pools[rank] = pool
        return pool

    def _lookup_start(self, table, tokens, dtype, out, wait):
        if not isinstance(table, str) or not table:
            raise ValueError("lookup: no table name")
        if dtype is None or dtype in ("f32", "float32"):
            want = None
        elif dtype in ("bf16", "bfloat16"):
            want = BF16
        else:
            raise ValueError("lookup: dtype %r is neither f32 nor bf16" % (dtype,))
        tok = _arrays.as_tokens(tokens, "lookup")
        n = len(tok)
        if out is not None:
            od = _NP_DTYPE[want or F32]
            if (not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != n
                    or out.dtype != od or not out.flags.c_contiguous or not out.flags.writeable):
                raise ShapeError("lookup: out must be a writable C-contiguous %s array of shape "
                                 "(%d, emb_width)" % (od, n), "pass out=None")
        g = len(self._ranks)
        plan = _Plan(n, g, self.padding)
        bid = self._next_batch_id()
        tf = _wire.table_field(table)
        reqs = []
        for r in range(g):
            first, real, pad = plan.shard(r)
            reqs.append(_wire.lookup_request(tf, bid, r, g, plan.tokens_per_batch,
                                             tok[first:first + real], pad * 8, want or 0,
                                             self.client_id))
        calls = self._send("lookup", reqs, wait)

        def join(calls):
            return self._lookup_join(table, bid, plan, self._results(calls), want, out)
        return bid, calls, join

    def _lookup_join(self, table, bid, plan, replies, want, out):
        """Parses every rank's LookupResponse and writes the rows of the caller's tokens into
        out (allocated here when None): f32, or raw bf16 bits when want is BF16."""
        s, n = plan.shard_tokens, plan.n
        width = dtype = None
        for r, buf in enumerate(replies):
            try:
                rb, ri, w, dt, rows = _wire.parse_lookup_response(buf)
            except _wire.WireError as e:
                raise self._internal(r, "malformed LookupResponse (%s)" % e) from None
            if rb != bid or ri != r:
                raise self._internal(r, "lookup reply is for batch %d shard %d, the request was "
                                        "batch %d shard %d" % (rb, ri, bid, r))
            dt = dt or F32
            if width is None:
                width, dtype = w, dt
                self._tables[table] = (dt, w)
                if dt not in _ITEMSIZE:
                    raise self._internal(r, "lookup reply carries dtype %d" % dt)
                if out is None:
                    out = np.empty((n, w), _NP_DTYPE[want or F32])
                elif out.shape[1] != w:
                    raise ShapeError("lookup: out has %d columns, but table '%s' has "
                                     "emb_width=%d" % (out.shape[1], table, w), "pass out=None")
            elif (w, dt) != (width, dtype):
                raise self._internal(r, "lookup reply has emb_width=%d %s, rank 0's has "
                                        "emb_width=%d %s" % (w, DTYPES.get(dt), width,
                                                             DTYPES.get(dtype)))
            if len(rows) != s * w * _ITEMSIZE[dt]:
                raise self._internal(r, "lookup reply holds %d bytes of rows, %d tokens of "
                                        "emb_width=%d %s need %d"
                                     % (len(rows), s, w, DTYPES[dt], s * w * _ITEMSIZE[dt]))
            first, real, _ = plan.shard(r)
            if not real:
                continue
            src = np.frombuffer(rows, _NP_DTYPE[dt], real * w).reshape(real, w)
            if dt == BF16 and want is None:
                _arrays.bf16_to_f32(src, out[first:first + real])
            else:
                out[first:first + real] = src
        if out is None:  # a group without ranks cannot happen; keeps the type right
            out = np.empty((n, 0), np.float32)
        return out

    def _internal(self, r, what):
        msg = what if len(self._ranks) == 1 else "rank %d (%s): %s" % (r, self._addresses[r],
                                                                        what)
        return Error(grpc.StatusCode.INTERNAL, msg, details=what, rank=r,
                     address=self._addresses[r])

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
        if mode not in _MODES:
            raise ValueError("push: mode %r is neither sync nor async" % (mode,))
        tok = _arrays.as_tokens(tokens, "push")
        n = len(tok)
        g = _arrays.as_grads(grads, n, "push")
        groups = len(self._ranks)
        plan = _Plan(n, groups, self.padding)
        info = self._table_info(table)
        if info is not None and g.shape[1] != info[1]:  # the table may have been made anew
            self._tables.pop(table, None)
            info = self._table_info(table)
        if info is not None:
            tdtype, width = info
            if g.shape[1] != width:
                raise ShapeError("push: grads has %d columns, but table '%s' has emb_width=%d"
                                 % (g.shape[1], table, width),
                                 "pass one gradient row of emb_width values per token")
            if tdtype == BF16 and g.dtype != np.uint16:
                g = _arrays.f32_to_bf16(g)
            elif tdtype == F32 and g.dtype == np.uint16:
                g = _arrays.bf16_to_f32(g)
        dtype = BF16 if g.dtype == np.uint16 else F32
        row_bytes = g.shape[1] * g.dtype.itemsize
        bid = self._next_batch_id()
        tf = _wire.table_field(table)
        reqs = []
        for r in range(groups):
            first, real, pad = plan.shard(r)
            reqs.append(_wire.push_request(tf, bid, r, groups, plan.tokens_per_batch,
                                           tok[first:first + real], pad, g[first:first + real],
                                           row_bytes, dtype, _MODES[mode], self.client_id))
        calls = self._send("push", reqs, wait)

        def join(calls):
            try:
                replies = self._results(calls)
            except Error:
                self._tables.pop(table, None)  # the table may have changed: ask again next time
                raise
            return self._push_join(bid, replies)
        return bid, calls, join

    def _push_join(self, bid, replies):
        """The ranks' PushGradientsResponses joined as client/batch.c's push_join does."""
        applied = ordered = True
        skipped = False
        for r, m in enumerate(replies):
            if m.batch_id != bid or m.shard_index != r:
                raise self._internal(r, "push reply from rank %d is for batch %d shard %d, the "
                                        "request was batch %d shard %d"
                                     % (r, m.batch_id, m.shard_index, bid, r))
            applied = applied and m.applied
            ordered = ordered and m.ordered
            skipped = skipped or m.skipped
        m0 = replies[0]
        return PushResult(applied=applied, skipped=skipped, ordered=ordered,
                          grad_norm=m0.grad_norm, num_unique=m0.num_unique, batch_id=bid)

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
