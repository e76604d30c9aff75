"""A batch split over the group and joined back, as DESIGN.md and client/group.c do it.

A batch of T tokens is split into group_size contiguous shards of T/group_size tokens, shard r
to rank r, every shard carrying the same batch id. With padding on, T is rounded up to a
multiple of the group size with padding token 0 (whose rows read zero and whose gradients are
ignored) appended at the end, so the caller's tokens keep their positions and the joined lookup
is simply the first n rows. A batch that does not split is refused before anything is sent with
the C client's message (errors.tokens_per_batch_error).

Every shard carries the digest of the whole batch (_digest.py), which the caller computes once
per batch and which stays the same on every attempt (_retry.py).

Here are the plan of a batch (Plan), the per-rank requests (encoded by _wire.py), and the joins
of the per-rank replies: rows written into the caller's array, push replies folded as
client/batch.c's push_join folds them. Nothing here makes a call.
"""
import numpy as np

from . import _arrays, _wire
from ._names import BF16, F32, ITEMSIZE, NP_DTYPE
from .errors import ShapeError, batch_too_large_error, tokens_per_batch_error
from .values import AssignResult, DTYPES, PushResult

_MAX_TOKENS_PER_BATCH = 4294967295


class Plan:
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


# ---- lookups ----------------------------------------------------------------------------------

def lookup_dtype(dtype):
    """The row format a lookup asks for: None (f32 rows) or BF16 (raw bf16 bits)."""
    if dtype is None or dtype in ("f32", "float32"):
        return None
    if dtype in ("bf16", "bfloat16"):
        return BF16
    raise ValueError("lookup: dtype %r is neither f32 nor bf16" % (dtype,))


def check_out(out, n, want):
    """Refuses an out array that lookup cannot fill with n rows of the format want."""
    od = NP_DTYPE[want or F32]
    if (not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != n
            or out.dtype != od or not out.flags.c_contiguous or not out.flags.writeable):
        raise ShapeError("lookup: out must be a writable C-contiguous %s array of shape "
                         "(%d, emb_width)" % (od, n), "pass out=None")


def lookup_requests(table, tok, plan, group_size, batch_id, want, client_id, digest=0):
    """Every rank's LookupRequest (bytes) for tokens tok, in rank order, each carrying the
    batch's digest (_digest.digest of the whole batch; 0: none)."""
    tf = _wire.table_field(table)
    reqs = []
    for r in range(group_size):
        first, real, pad = plan.shard(r)
        reqs.append(_wire.lookup_request(tf, batch_id, r, group_size, plan.tokens_per_batch,
                                         tok[first:first + real], pad * 8, want or 0,
                                         client_id, digest))
    return reqs


def join_lookup(table, bid, plan, replies, want, out, internal, tables):
    """Parses every rank's LookupResponse and writes the rows of the caller's tokens into
    out (allocated here when None): f32, or raw bf16 bits when want is BF16. Returns out.
    internal(r, what) makes the Error for a reply that makes no sense; tables[table] is set to
    the (dtype, emb_width) the replies carry."""
    s, n = plan.shard_tokens, plan.n
    width = dtype = None
    for r, buf in enumerate(replies):
        try:
            rb, ri, w, dt, rows = _wire.parse_lookup_response(buf)
        except _wire.WireError as e:
            raise internal(r, "malformed LookupResponse (%s)" % e) from None
        if rb != bid or ri != r:
            raise internal(r, "lookup reply is for batch %d shard %d, the request was "
                              "batch %d shard %d" % (rb, ri, bid, r))
        dt = dt or F32
        if width is None:
            width, dtype = w, dt
            tables[table] = (dt, w)
            if dt not in ITEMSIZE:
                raise internal(r, "lookup reply carries dtype %d" % dt)
            if out is None:
                out = np.empty((n, w), NP_DTYPE[want or F32])
            elif out.shape[1] != w:
                raise ShapeError("lookup: out has %d columns, but table '%s' has "
                                 "emb_width=%d" % (out.shape[1], table, w), "pass out=None")
        elif (w, dt) != (width, dtype):
            raise internal(r, "lookup reply has emb_width=%d %s, rank 0's has "
                              "emb_width=%d %s" % (w, DTYPES.get(dt), width,
                                                   DTYPES.get(dtype)))
        if len(rows) != s * w * ITEMSIZE[dt]:
            raise internal(r, "lookup reply holds %d bytes of rows, %d tokens of "
                              "emb_width=%d %s need %d"
                           % (len(rows), s, w, DTYPES[dt], s * w * ITEMSIZE[dt]))
        first, real, _ = plan.shard(r)
        if not real:
            continue
        src = np.frombuffer(rows, NP_DTYPE[dt], real * w).reshape(real, w)
        if dt == BF16 and want is None:
            _arrays.bf16_to_f32(src, out[first:first + real])
        else:
            out[first:first + real] = src
    if out is None:  # a group without ranks cannot happen; keeps the type right
        out = np.empty((n, 0), np.float32)
    return out


# ---- pushes -----------------------------------------------------------------------------------

def _fit(a, table, info, what, remedy):
    """a (f32 or bf16-bits rows) checked against the table's (dtype, emb_width) info, when known,
    and converted to the table's dtype: f32 rounded to bf16 (nearest even) for a bf16 table, bf16
    bits widened exactly for an f32 one. what names the array in the error ("push: grads")."""
    if info is None:
        return a
    tdtype, width = info
    if a.shape[1] != width:
        raise ShapeError("%s has %d columns, but table '%s' has emb_width=%d"
                         % (what, a.shape[1], table, width), remedy)
    if tdtype == BF16 and a.dtype != np.uint16:
        a = _arrays.f32_to_bf16(a)
    elif tdtype == F32 and a.dtype == np.uint16:
        a = _arrays.bf16_to_f32(a)
    return a


def check_reply(what, bid, r, m, internal):
    """Raises internal's error when rank r's reply m (of the RPC what) is not for batch bid,
    shard r (client/call.c's embps__reply_check)."""
    if m.batch_id != bid or m.shard_index != r:
        raise internal(r, "%s reply from rank %d is for batch %d shard %d, the request was batch "
                          "%d shard %d" % (what, r, m.batch_id, m.shard_index, bid, r))


def fit_grads(g, table, info):
    """g (f32 or bf16-bits gradient rows) fitted to the table (_fit)."""
    return _fit(g, table, info, "push: grads", "pass one gradient row of emb_width values per token")


def push_requests(table, tok, g, plan, group_size, batch_id, mode, client_id, digest=0):
    """Every rank's PushGradientsRequest (bytes) for tokens tok and gradient rows g (f32, or
    bf16 bits as uint16), in rank order; mode is the UpdateMode number; digest as for
    lookup_requests."""
    dtype = BF16 if g.dtype == np.uint16 else F32
    row_bytes = g.shape[1] * g.dtype.itemsize
    tf = _wire.table_field(table)
    reqs = []
    for r in range(group_size):
        first, real, pad = plan.shard(r)
        reqs.append(_wire.push_request(tf, batch_id, r, group_size, plan.tokens_per_batch,
                                       tok[first:first + real], pad, g[first:first + real],
                                       row_bytes, dtype, mode, client_id, digest))
    return reqs


def join_push(bid, replies, internal, attempts=1):
    """The ranks' PushGradientsResponses joined as client/batch.c's push_join does; replayed
    when any rank answered from the group's retry window (a retry of a push an earlier attempt
    had applied: every rank decides that alike, at the same round). attempts: the attempts
    made, this one included."""
    applied = ordered = True
    skipped = replayed = False
    for r, m in enumerate(replies):
        check_reply("push", bid, r, m, internal)
        applied = applied and m.applied
        ordered = ordered and m.ordered
        skipped = skipped or m.skipped
        replayed = replayed or m.replayed
    m0 = replies[0]
    return PushResult(applied=applied, skipped=skipped, ordered=ordered,
                      grad_norm=m0.grad_norm, num_unique=m0.num_unique, batch_id=bid,
                      replayed=replayed, attempts=attempts)


# ---- assigns ----------------------------------------------------------------------------------

def fit_rows(rows, table, info, what="assign"):
    """rows (f32 or bf16-bits rows) fitted to the table (_fit)."""
    return _fit(rows, table, info, what + ": rows", "pass one row of emb_width values per token")


def assign_requests(table, tok, rows, plan, group_size, batch_id, reset_state, client_id,
                    digest=0):
    """Every rank's AssignRequest (bytes) for tokens tok and rows (f32, or bf16 bits as uint16),
    in rank order; digest as for lookup_requests (an assign's is a batch's: table, T, tokens)."""
    dtype = BF16 if rows.dtype == np.uint16 else F32
    row_bytes = rows.shape[1] * rows.dtype.itemsize
    tf = _wire.table_field(table)
    reqs = []
    for r in range(group_size):
        first, real, pad = plan.shard(r)
        reqs.append(_wire.assign_request(tf, batch_id, r, group_size, plan.tokens_per_batch,
                                         tok[first:first + real], pad, rows[first:first + real],
                                         row_bytes, dtype, reset_state, client_id, digest))
    return reqs


def join_assign(bid, replies, internal, attempts=1):
    """The ranks' AssignResponses joined as client/batch.c's assign_join does: every rank counts
    the same; replayed when any rank answered from the group's retry window."""
    replayed = False
    for r, m in enumerate(replies):
        check_reply("assign", bid, r, m, internal)
        replayed = replayed or m.replayed
    m0 = replies[0]
    return AssignResult(num_assigned=m0.num_assigned, num_refused=m0.num_refused, batch_id=bid,
                        replayed=replayed, attempts=attempts)
