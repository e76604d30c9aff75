"""Helpers for the shard-group tests: N embps-server ranks on free loopback ports (started,
waited for and stopped by tests/lib/embps_servers.py, whose names are re-exported here: Group,
Proc, pick_ports, ...), raw grpcio clients that split batches into shards by hand, the
optimizers in numpy, and docs/design.md's error messages.

Stubs come from tests/interop/embps_testlib.py (generated from proto/ at import time)."""
import itertools
import os
import re
import subprocess
import sys
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "interop"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))

import embps_testlib as lib  # noqa: E402
from embps_testlib import embps_pb2 as pb, embps_pb2_grpc as pbg  # noqa: E402,F401
from embps_testlib import health_pb2, health_pb2_grpc  # noqa: E402,F401
from embps_servers import (Group, GroupStartError, Proc, Server,  # noqa: E402,F401
                           cli_binary, free_ephemeral_port, pick_ports, port_free, port_open,
                           server_binary, wait_for)

grpc = lib.grpc
SC = grpc.StatusCode
OPT = {"sgd": pb.OPTIMIZER_SGD, "adagrad": pb.OPTIMIZER_ADAGRAD,
       "rowwise_adagrad": pb.OPTIMIZER_ROWWISE_ADAGRAD, "adam": pb.OPTIMIZER_ADAM}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CALL_TIMEOUT = 60.0  # no single call of these tests may take longer (bounds every wait)


def health(address, timeout=2.0):
    """The rank's health status, or None when it cannot be asked."""
    ch = lib.channel(address)
    try:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                 timeout=timeout)
        return r.status
    except grpc.RpcError:
        return None
    finally:
        ch.close()


def run_on_group(n, body, *flags):
    """Starts an n-rank group (with flags), calls body(client, out) with a RawClient to it and a
    dict to fill, stops the group and returns out with "exit_codes" ({rank: code}) and "logs"."""
    group = Group(n, *flags)
    client = RawClient(group.addresses)
    out = {}
    try:
        body(client, out)
    finally:
        client.close()
        out["exit_codes"] = group.close()
        out["logs"] = group.last_logs
    return out


# ---- raw gRPC clients -----------------------------------------------------------------------------

_batch_ids = itertools.count(1000)
_batch_lock = threading.Lock()


def next_batch_id():
    with _batch_lock:
        return next(_batch_ids)


def table_spec(name, rows, width, opt="rowwise_adagrad", seed=7, dtype=None, **kw):
    o = pb.OptimizerConfig(kind=OPT[opt], lr=kw.get("lr", 0.05), eps=kw.get("eps", 1e-6),
                           half_life=kw.get("half_life", 0.0),
                           initial_accumulator=kw.get("init_acc", 0.0),
                           weight_decay=kw.get("wd", 0.0), beta1=kw.get("b1", 0.0),
                           beta2=kw.get("b2", 0.0))
    return pb.TableSpec(name=name, rows=rows, emb_width=width,
                        dtype=pb.DTYPE_F32 if dtype is None else dtype, seed=seed, optimizer=o)


class RawClient:
    """Its own channel to every rank; splits batches into N contiguous shards and sends shard r
    to rank r, concurrently (futures), in the rank order asked for. client_id (0: none) goes
    with every batch: the servers scope batch ids by it."""

    def __init__(self, addresses, client_id=0):
        self.n = len(addresses)
        self.client_id = client_id
        self.chans = [lib.channel(a) for a in addresses]
        self.stubs = [pbg.EmbeddingServiceStub(c) for c in self.chans]

    def close(self):
        for c in self.chans:
            c.close()

    def create(self, name, rows, width, opt="rowwise_adagrad", **kw):
        return self.stubs[0].CreateTable(
            pb.CreateTableRequest(spec=table_spec(name, rows, width, opt, **kw)),
            timeout=CALL_TIMEOUT)

    def _order(self, order):
        return list(order) if order is not None else list(range(self.n))

    def lookup_async(self, table, tokens, batch_id=None, order=None, timeout=CALL_TIMEOUT):
        """Sends every shard; returns (batch_id, [future per rank])."""
        tok = np.asarray(tokens, dtype="<i8")
        T = len(tok)
        assert T % self.n == 0
        s = T // self.n
        bid = next_batch_id() if batch_id is None else batch_id
        futs = [None] * self.n
        for r in self._order(order):
            futs[r] = self.stubs[r].Lookup.future(pb.LookupRequest(
                table=table, batch_id=bid, shard_index=r, shard_count=self.n,
                tokens_per_batch=T, tokens=tok[r * s:(r + 1) * s].tobytes(),
                client_id=self.client_id), timeout=timeout)
        return bid, futs

    @staticmethod
    def rows_of(futs, width):
        out = []
        for f in futs:
            resp = f.result()
            out.append(np.frombuffer(resp.rows, dtype="<f4").reshape(-1, width))
        return np.concatenate(out)

    def lookup(self, table, tokens, width, order=None):
        _, futs = self.lookup_async(table, tokens, order=order)
        return self.rows_of(futs, width)

    def lookup_bytes(self, table, tokens):
        """The batch's rows as the ranks sent them (any dtype), joined in rank order."""
        _, futs = self.lookup_async(table, tokens)
        return b"".join(f.result().rows for f in futs)

    def push_async(self, table, tokens, grads, mode=pb.UPDATE_MODE_SYNC, batch_id=None,
                   order=None, timeout=CALL_TIMEOUT):
        tok = np.asarray(tokens, dtype="<i8")
        # bf16 gradients travel as their uint16 bit patterns; anything else as f32.
        bf16 = getattr(grads, "dtype", None) == np.uint16
        g = np.asarray(grads, dtype="<u2" if bf16 else "<f4")
        T = len(tok)
        assert T % self.n == 0 and g.shape[0] == T
        s = T // self.n
        bid = next_batch_id() if batch_id is None else batch_id
        futs = [None] * self.n
        for r in self._order(order):
            futs[r] = self.stubs[r].PushGradients.future(pb.PushGradientsRequest(
                table=table, batch_id=bid, shard_index=r, shard_count=self.n,
                tokens_per_batch=T, tokens=tok[r * s:(r + 1) * s].tobytes(),
                dtype=pb.DTYPE_BF16 if bf16 else pb.DTYPE_F32,
                gradients=g[r * s:(r + 1) * s].tobytes(), mode=mode, client_id=self.client_id),
                timeout=timeout)
        return bid, futs

    def push(self, table, tokens, grads, mode=pb.UPDATE_MODE_SYNC, order=None):
        _, futs = self.push_async(table, tokens, grads, mode, order=order)
        return [f.result() for f in futs]


    def assign_async(self, table, tokens, rows, reset_state=True, batch_id=None, order=None,
                     timeout=CALL_TIMEOUT, digest=0, attempt=0):
        """An Assign (rows written as given), split as push_async splits a push; rows of uint16
        travel as bf16 bits, anything else as f32."""
        tok = np.asarray(tokens, dtype="<i8")
        bf16 = getattr(rows, "dtype", None) == np.uint16
        v = np.asarray(rows, dtype="<u2" if bf16 else "<f4")
        T = len(tok)
        assert T % self.n == 0 and v.shape[0] == T
        s = T // self.n
        bid = next_batch_id() if batch_id is None else batch_id
        futs = [None] * self.n
        for r in self._order(order):
            futs[r] = self.stubs[r].Assign.future(pb.AssignRequest(
                table=table, batch_id=bid, shard_index=r, shard_count=self.n,
                tokens_per_batch=T, tokens=tok[r * s:(r + 1) * s].tobytes(),
                dtype=pb.DTYPE_BF16 if bf16 else pb.DTYPE_F32,
                rows=v[r * s:(r + 1) * s].tobytes(), reset_state=reset_state,
                client_id=self.client_id, digest=digest, attempt=attempt), timeout=timeout)
        return bid, futs

    def assign(self, table, tokens, rows, reset_state=True, order=None):
        _, futs = self.assign_async(table, tokens, rows, reset_state, order=order)
        return [f.result() for f in futs]


def rpc_error(fn):
    """Runs fn; returns the grpc.RpcError it raised (None when it succeeded)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e
    return None


def expect_rpc_error(test, fn, code, *fragments):
    """Runs fn, which must fail with status code and a message holding every fragment; returns
    the error."""
    e = rpc_error(fn)
    test.assertIsNotNone(e, "the call succeeded; expected %s" % code)
    test.assertEqual(e.code(), code, e.details())
    for f in fragments:
        test.assertIn(f, e.details())
    return e


# ---- the optimizers in numpy ------------------------------------------------------------------------

class Reference:
    """The optimizers of kernels/embps_kernels.h in numpy (f32 math), as in
    tests/interop/test_grpc_interop.py, for f32 tables."""

    def __init__(self, initial, kind, lr, eps, half_life=0.0, init_acc=0.0, wd=0.0, b1=0.9,
                 b2=0.999):
        self.w = {}
        self.initial = initial  # 2-D array: row t is token t's initial row
        self.kind, self.lr, self.eps, self.wd = kind, np.float32(lr), np.float32(eps), np.float32(wd)
        self.decay = np.float32(np.exp(-np.log(2.0) / half_life)) if half_life > 0 else np.float32(1)
        self.init_acc, self.b1, self.b2 = np.float32(init_acc), np.float32(b1), np.float32(b2)
        self.state = {}
        self.step = 0

    def row(self, t):
        t = int(t)
        if t == 0:
            return np.zeros(self.initial.shape[1], np.float32)
        return self.w.get(t, self.initial[t]).astype(np.float32)

    def rows(self, tokens):
        return np.stack([self.row(t) for t in tokens])

    def push(self, tokens, grads):
        """Applies one step; returns (grad_norm, num_unique)."""
        sums = {}
        for t, g in zip([int(t) for t in tokens], grads):
            if t == 0:
                continue
            sums[t] = sums.get(t, np.zeros_like(g, dtype=np.float32)) + g.astype(np.float32)
        norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in sums.values())))
        self.step += 1
        for t in sorted(sums):
            w = self.row(t)
            g = sums[t] + self.wd * w
            w, self.state[t] = lib.optimizer_update(self.kind, w, g, self.state.get(t), self.lr,
                                                    self.eps, self.decay, self.init_acc, self.b1,
                                                    self.b2, self.step)
            self.w[t] = w.astype(np.float32)
        return norm, len(sums)


def run_cli(group_or_servers, *args, timeout=60):
    servers = group_or_servers if isinstance(group_or_servers, str) else group_or_servers.servers
    return subprocess.run([cli_binary(), "--servers", servers, *args], capture_output=True,
                          text=True, timeout=timeout)


def start_expecting_failure(args, timeout=60.0):
    """Runs one embps-server that must exit by itself; returns (code, output)."""
    p = subprocess.run([server_binary(), *args], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


class TmpDirs:
    """A unittest mixin: tmpdir() makes a folder that tearDown removes."""
    tmp_prefix = "embps-test-"

    def setUp(self):
        self.dirs = []

    def tearDown(self):
        import shutil
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    def tmpdir(self):
        import tempfile
        d = tempfile.mkdtemp(prefix=self.tmp_prefix)
        self.dirs.append(d)
        return d


def design_row(condition_prefix):
    """The message column of docs/design.md's error table for the row whose condition starts with
    condition_prefix, as a template: placeholders in braces."""
    path = os.environ.get("EMBPS_DESIGN_MD", os.path.join(lib.ROOT, "docs", "design.md"))
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].startswith(condition_prefix):
                return cells[2].strip("`")
    raise LookupError("%s has no error-table row starting with %r" % (path, condition_prefix))


def design_message(condition_prefix, **values):
    """docs/design.md's message for that row with its placeholders filled in, up to the first
    placeholder not given (callers compare with startswith: the remedy that follows may name
    values the test does not know)."""
    text = design_row(condition_prefix)
    first = re.search(r"\{(\w+)\}", text)
    if first is None or first.group(1) not in values:
        raise KeyError("the first placeholder of %r must be given" % text)
    cut = re.search(r"\{(?!(?:%s)\})\w+\}" % "|".join(map(re.escape, values)), text)
    if cut:
        text = text[:cut.start()]
    return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), text)
