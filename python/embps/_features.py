"""Feature batches (LookupFeatures, PushFeatures; docs/design.md, "Feature batches"): a whole
training step's sparse features in one call per rank, pooled on the servers.

embps.Feature holds one feature of a batch as the caller gives it: its table, its ids (every
bag's, bag after bag), one bag length per sample, per-id weights (weighted sum only) and a
pooling mode. Here they are checked (each refusal names the feature, before anything is sent),
planned over the group and joined back:

  - Every feature holds one bag per sample: B samples, the same B for every feature.
  - Splitting is by samples: shard r holds samples [r P/N, (r+1) P/N) of every feature, where P
    is B, or with padding on B rounded up to a multiple of N with empty bags appended (a batch
    that does not split is refused otherwise, with the servers' words: errors.batch_size_error).
    Padded samples pool to zeros and are dropped from the results; their gradient rows are
    zeros. The id counts of the shards differ; nothing else has to be even.
  - The digest (_digest.features_digest) is computed once per batch over P, and stays the same
    on every attempt (_retry.py).

Nothing here makes a call: client.py runs the batches through the same attempts, retries and
futures as lookup and push.
"""
import collections.abc

import numpy as np

from . import _arrays, _batch, _digest, _wire
from ._names import BF16, F32, ITEMSIZE, NP_DTYPE, POOLING_NAMES
from .errors import ShapeError, batch_size_error
from .values import DTYPES, PushFeaturesResult, TableStep

_U4 = np.dtype("<u4")
_F4 = np.dtype("<f4")
_MAX_U32 = 4294967295
_SUM, _MEAN, _WSUM = POOLING_NAMES["sum"], POOLING_NAMES["mean"], POOLING_NAMES["weighted_sum"]
_NONE = POOLING_NAMES["none"]


class Feature:
    """One sparse feature of a batch (embps.Feature).

    table: the name of the table its ids index (several features may share one). ids: every
    sample's ids, bag after bag, as a 1-D array of integers (numpy, a list, a torch tensor; a
    dense table's in [0, rows), a hash-keyed table's any int64). lengths: the number of ids in
    each sample's bag, one per sample (None: one id per sample). weights: one float per id, with
    pooling "weighted_sum" only. pooling: "none" (one row per id, as lookup returns them),
    "sum", "mean" (the sum divided by the bag's nonzero ids) or "weighted_sum". Id 0 is padding
    inside a bag: it adds nothing and does not count in a mean; an empty bag pools to zeros.

    The values are kept as given and checked when the batch is sent (lookup_features,
    push_features), where a refusal can name the feature."""
    __slots__ = ("table", "ids", "lengths", "weights", "pooling")

    def __init__(self, table, ids, lengths=None, weights=None, pooling="none"):
        self.table = table
        self.ids = ids
        self.lengths = lengths
        self.weights = weights
        self.pooling = pooling

    def __repr__(self):
        n = getattr(self.ids, "shape", None)
        n = n[0] if n else (len(self.ids) if hasattr(self.ids, "__len__") else "?")
        return "embps.Feature(table=%r, %s ids, pooling=%r%s)" % (
            self.table, n, self.pooling, "" if self.weights is None else ", weighted")


class _Prepared:
    """One checked feature: name, table, pooling (the Pooling number), ids (int64 LE), lengths
    (u32 LE, P of them: padding samples' 0 at the end), weights (f32 LE or None), offsets
    (int64, P + 1: where each sample's bag starts in ids), and their encoded name and table."""
    __slots__ = ("name", "table", "pooling", "ids", "lengths", "weights", "offsets", "name_b",
                 "table_b")

    @property
    def pooled(self):
        return self.pooling != _NONE


def _as_numpy(x):
    return _arrays._tensor_to_numpy(x) if _arrays._is_tensor(x) else x


def _lengths(lengths, n_ids, where):
    """lengths as a u32 LE array whose sum is n_ids; None: one id per sample."""
    if lengths is None:
        return np.ones(n_ids, _U4)
    a = _as_numpy(lengths)
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
        if a.size == 0 and a.dtype.kind == "f":  # [] is float64 to numpy
            a = a.astype(np.int64)
    if a.ndim != 1:
        raise ShapeError("%s: lengths must be a 1-D array, one bag length per sample, not an "
                         "array of shape %s" % (where, tuple(a.shape)),
                         "give one length per sample")
    if a.dtype.kind not in "iu":
        raise TypeError("%s: lengths must be integers, not %s" % (where, a.dtype))
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0:
            raise ValueError("%s: lengths[%d] is %d: a bag holds 0 or more ids"
                             % (where, int(a.argmin()), lo))
        if hi > _MAX_U32:
            raise ValueError("%s: lengths[%d] is %d, over 4294967295: split the batch"
                             % (where, int(a.argmax()), hi))
    total = int(a.sum(dtype=np.uint64)) if a.size else 0
    if total != n_ids:
        raise ShapeError("%s: lengths add up to %d ids, but ids holds %d: give each sample's "
                         "bag length, in the order of the ids" % (where, total, n_ids),
                         "make lengths add up to len(ids)")
    return np.ascontiguousarray(a, dtype=_U4)


def _weights(weights, pooling_name, n_ids, where):
    """weights as an f32 LE array of n_ids, or None; refused beside a pooling other than
    weighted sum."""
    if pooling_name != "weighted_sum":
        if weights is not None:
            raise ValueError("%s: weights are given with pooling %r: per-id weights go with "
                             "pooling 'weighted_sum' only" % (where, pooling_name))
        return None
    if weights is None:
        if n_ids:
            raise ValueError("%s: pooling 'weighted_sum' needs weights, one per id (%d)"
                             % (where, n_ids))
        return np.zeros(0, _F4)
    a = _as_numpy(weights)
    if not isinstance(a, np.ndarray):
        a = np.asarray(a, dtype=_F4)
    if a.dtype.kind not in "fiu":
        raise TypeError("%s: weights must be floating point, not %s" % (where, a.dtype))
    if a.ndim != 1 or a.shape[0] != n_ids:
        raise ShapeError("%s: weights must hold one weight per id, shape (%d,), not %s"
                         % (where, n_ids, tuple(a.shape)), "give one weight per id")
    return np.ascontiguousarray(a, dtype=_F4)


def _name(s, what):
    if not isinstance(s, str) or not s:
        raise ValueError("%s must be a non-empty str, not %r" % (what, s))
    return s


class Batch:
    """A checked feature batch over the group: features (the _Prepared, in the request's
    order), samples (B, the caller's), batch_size (P, padded), shard_samples (P / N),
    group_size, and digest."""
    __slots__ = ("features", "samples", "batch_size", "shard_samples", "group_size", "digest")

    def __init__(self, features, what, group_size, pad, keyed):
        """features: a mapping name -> Feature; what: the call's name for messages ("lookup
        features"); keyed(table): whether table is hash-keyed (asked only for a negative or
        beyond-int64 id). Raises ShapeError, ValueError or TypeError, naming the feature."""
        if not isinstance(features, collections.abc.Mapping):
            raise TypeError("%s: features must be a dict of name -> embps.Feature, not %s"
                            % (what, type(features).__name__))
        if not features:
            raise ValueError("%s: no features: pass a dict of name -> embps.Feature" % what)
        prepared = []
        samples = first = None
        for name, f in features.items():
            _name(name, "%s: a feature's name" % what)
            where = "%s: feature '%s'" % (what, name)
            if not isinstance(f, Feature):
                raise TypeError("%s must be an embps.Feature, not %s" % (where,
                                                                         type(f).__name__))
            _name(f.table, "%s: table" % where)
            pname = "none" if f.pooling is None else f.pooling
            if pname not in POOLING_NAMES:
                raise ValueError("%s: pooling %r is not one of 'none', 'sum', 'mean', "
                                 "'weighted_sum'" % (where, f.pooling))
            p = _Prepared()
            p.name, p.table, p.pooling = name, f.table, POOLING_NAMES[pname]
            p.name_b, p.table_b = name.encode(), f.table.encode()
            p.ids = _arrays.as_tokens(f.ids, where + ": ids",
                                      lambda t=f.table: keyed(t))
            p.lengths = _lengths(f.lengths, len(p.ids), where)
            p.weights = _weights(f.weights, pname, len(p.ids), where)
            b = len(p.lengths)
            if samples is None:
                samples, first = b, name
            elif b != samples:
                raise ShapeError("%s: %d samples (bag lengths), but feature '%s' has %d: every "
                                 "feature of a batch holds one bag per sample"
                                 % (where, b, first, samples),
                                 "give every feature one length per sample")
            prepared.append(p)
        if samples == 0:
            raise ValueError("%s: the batch has no samples (every feature's lengths are empty)"
                             % what)
        if len(prepared) > _MAX_U32:
            raise ValueError("%s: too many features" % what)
        n = group_size
        if pad:
            total = -(-samples // n) * n
        elif samples % n:
            raise batch_size_error(samples, n)
        else:
            total = samples
        if total > _MAX_U32:
            raise ShapeError("batch_size=%d is over 4294967295: split the batch" % total,
                             "split the batch")
        for p in prepared:
            if total != samples:
                p.lengths = np.concatenate([p.lengths, np.zeros(total - samples, _U4)])
            off = np.zeros(total + 1, np.int64)
            np.cumsum(p.lengths, out=off[1:])
            p.offsets = off
        self.features = prepared
        self.samples, self.batch_size, self.group_size = samples, total, n
        self.shard_samples = total // n
        self.digest = _digest.features_digest(
            total, [(p.name_b, p.table_b, p.pooling, p.ids, p.lengths, p.weights)
                    for p in prepared])

    def tables(self):
        """The batch's tables, in the order the request first names them."""
        return list(dict.fromkeys(p.table for p in self.features))

    def samples_of(self, r):
        """(first, end, real): rank r's samples [first, end), of which the first real are the
        caller's (the rest padding)."""
        s = self.shard_samples
        first = r * s
        return first, first + s, max(0, min(first + s, self.samples) - first)

    def _shards(self, r, grads=None):
        first, end, real = self.samples_of(r)
        out = []
        for i, p in enumerate(self.features):
            a, b = int(p.offsets[first]), int(p.offsets[end])
            g, gpad = None, 0
            if grads is not None:
                g = grads[i]
                if p.pooled:
                    gpad = (end - first - real) * g.shape[1] * g.dtype.itemsize
                    g = g[first:first + real]
                else:
                    g = g[a:b]
            out.append(_wire.feature_shard(p.name_b, p.table_b, p.pooling, p.ids[a:b],
                                           p.lengths[first:end],
                                           None if p.weights is None else p.weights[a:b],
                                           g, gpad))
        return out

    def lookup_requests(self, batch_id, client_id):
        """Every rank's LookupFeaturesRequest (bytes), in rank order."""
        n = self.group_size
        return [_wire.features_request(batch_id, r, n, self.batch_size, self._shards(r),
                                       client_id, self.digest) for r in range(n)]

    def push_requests(self, batch_id, client_id, grads, mode):
        """Every rank's PushFeaturesRequest (bytes); grads: fit_grads's arrays, one per feature
        in order; mode: the UpdateMode number."""
        n = self.group_size
        return [_wire.features_request(batch_id, r, n, self.batch_size, self._shards(r, grads),
                                       client_id, self.digest, mode) for r in range(n)]

    # -- gradients --

    def fit_grads(self, grads, infos, what):
        """grads (a mapping name -> array, one per feature) checked and converted: a pooled
        feature's (B, emb_width) rows to f32, a feature with pooling none's (ids, emb_width)
        rows to its table's dtype (f32, or bf16 bits rounded to nearest even). infos: table ->
        (dtype, emb_width) or None where unknown. Returns the arrays in the features' order.
        Raises ShapeError, TypeError or ValueError naming the feature."""
        if not isinstance(grads, collections.abc.Mapping):
            raise TypeError("%s: grads must be a dict of feature name -> gradient rows, not %s"
                            % (what, type(grads).__name__))
        names = {p.name for p in self.features}
        extra = [k for k in grads if k not in names]
        if extra:
            raise ValueError("%s: grads names %r, which is not a feature of the batch"
                             % (what, extra[0]))
        out = []
        for p in self.features:
            where = "%s: feature '%s'" % (what, p.name)
            if p.name not in grads:
                raise ValueError("%s: no gradient rows in grads: give every feature's" % where)
            g = _as_numpy(grads[p.name])
            if not isinstance(g, np.ndarray):
                g = np.asarray(g, dtype=_F4)
            rows, per = ((self.samples, "sample (pooled)") if p.pooled
                         else (len(p.ids), "id (pooling none)"))
            if g.ndim != 2 or g.shape[0] != rows:
                raise ShapeError("%s: grads must hold one row per %s, shape (%d, emb_width), "
                                 "not %s" % (where, per, rows, tuple(g.shape)),
                                 "pass a 2-D array with a gradient row for each %s"
                                 % per.split()[0])
            g = _arrays.as_grads(g, rows, where)
            info = infos.get(p.table)
            if info is not None and g.shape[1] != info[1]:
                raise ShapeError("%s: grads has %d columns, but table '%s' has emb_width=%d"
                                 % (where, g.shape[1], p.table, info[1]),
                                 "pass rows of emb_width values")
            if p.pooled or info is None or info[0] == F32:
                want_bf16 = False
            else:
                want_bf16 = info[0] == BF16
            if want_bf16 and g.dtype != np.uint16:
                g = _arrays.f32_to_bf16(g)
            elif not want_bf16 and g.dtype == np.uint16:
                g = _arrays.bf16_to_f32(g)
            out.append(g)
        return out

    # -- joins --

    def join_lookup(self, bid, replies, internal, tables):
        """Every rank's LookupFeaturesResponse (bytes) joined into {name: rows}: a pooled
        feature's (B, emb_width) float32, a feature with pooling none's (ids, emb_width)
        float32 (a bf16 table's rows converted exactly). tables[table] is set to the (dtype,
        emb_width) that unpooled features' replies carry."""
        feats = self.features
        outs = [None] * len(feats)
        shapes = [None] * len(feats)
        for r, buf in enumerate(replies):
            try:
                rb, ri, got = _wire.parse_lookup_features_response(buf)
            except _wire.WireError as e:
                raise internal(r, "malformed LookupFeaturesResponse (%s)" % e) from None
            if rb != bid or ri != r:
                raise internal(r, "lookup features reply is for batch %d shard %d, the request "
                                  "was batch %d shard %d" % (rb, ri, bid, r))
            if len(got) != len(feats):
                raise internal(r, "lookup features reply holds %d features, the request %d"
                               % (len(got), len(feats)))
            first, end, real = self.samples_of(r)
            for i, (p, (name, w, dt, rows)) in enumerate(zip(feats, got)):
                dt = dt or F32
                if name != p.name:
                    raise internal(r, "lookup features reply's feature %d is '%s', the "
                                      "request's '%s'" % (i, name, p.name))
                if dt not in ITEMSIZE or (p.pooled and dt != F32):
                    raise internal(r, "lookup features reply carries dtype %d for feature '%s'"
                                   % (dt, name))
                if shapes[i] is None:
                    shapes[i] = (w, dt)
                    n = self.samples if p.pooled else len(p.ids)
                    outs[i] = np.empty((n, w), np.float32)
                    if not p.pooled:
                        tables[p.table] = (dt, w)
                elif shapes[i] != (w, dt):
                    raise internal(r, "lookup features reply has emb_width=%d %s for feature "
                                      "'%s', rank 0's has emb_width=%d %s"
                                   % (w, DTYPES.get(dt), name, shapes[i][0],
                                      DTYPES.get(shapes[i][1])))
                if p.pooled:
                    count, dst = end - first, (first, first + real)
                else:
                    a, b = int(p.offsets[first]), int(p.offsets[end])
                    count, dst = b - a, (a, b)
                need = count * w * ITEMSIZE[dt]
                if len(rows) != need:
                    raise internal(r, "lookup features reply holds %d bytes of rows for feature "
                                      "'%s', %d %s of emb_width=%d %s need %d"
                                   % (len(rows), name, count,
                                      "samples" if p.pooled else "ids", w, DTYPES[dt], need))
                k = dst[1] - dst[0]
                if not k:
                    continue
                src = np.frombuffer(rows, NP_DTYPE[dt], k * w).reshape(k, w)
                if dt == BF16:
                    _arrays.bf16_to_f32(src, outs[i][dst[0]:dst[1]])
                else:
                    outs[i][dst[0]:dst[1]] = src
        return {p.name: o for p, o in zip(feats, outs)}


def join_push(bid, replies, internal, attempts=1):
    """The ranks' PushFeaturesResponses joined: each table's step as rank 0 reports it, applied
    only when every rank says so and skipped when any does (every rank decides alike); ordered
    when every rank says so, replayed when any does."""
    ordered = True
    replayed = False
    m0 = replies[0]
    tables = [s.table for s in m0.steps]
    applied = [True] * len(tables)
    skipped = [False] * len(tables)
    for r, m in enumerate(replies):
        _batch.check_reply("push features", bid, r, m, internal)
        if [s.table for s in m.steps] != tables:
            raise internal(r, "push features reply from rank %d has steps for tables %s, rank "
                              "0's for %s" % (r, [s.table for s in m.steps], tables))
        for i, s in enumerate(m.steps):
            applied[i] = applied[i] and s.applied
            skipped[i] = skipped[i] or s.skipped
        ordered = ordered and m.ordered
        replayed = replayed or m.replayed
    steps = tuple(TableStep(table=s.table, applied=applied[i], skipped=skipped[i],
                            grad_norm=s.grad_norm, num_unique=s.num_unique)
                  for i, s in enumerate(m0.steps))
    return PushFeaturesResult(steps=steps, ordered=ordered, replayed=replayed, batch_id=bid,
                              attempts=attempts)
