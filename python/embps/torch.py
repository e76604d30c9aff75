"""embps.torch: an embps table as a PyTorch module (imported on its own: `import embps` does not
import torch).

    import embps, embps.torch, torch
    client = embps.Client("10.0.0.1:7070,10.0.0.2:7070")
    client.create_table("items", rows=10_000_000, emb_width=64, optimizer="rowwise_adagrad",
                        lr=0.05)
    items = embps.torch.RemoteEmbedding(client, "items")              # no local parameters
    dense = torch.nn.Linear(64, 1)
    opt = torch.optim.Adam(dense.parameters())                        # the dense part's optimizer
    for tokens, labels in batches:
        loss = loss_fn(dense(items(tokens)).squeeze(-1), labels)
        opt.zero_grad()
        loss.backward()          # pushes d loss / d rows to the servers, which apply the step
        opt.step()

Two optimizers, no wrapping. The table's optimizer is the server's: create_table chose it (SGD,
Adagrad, row-wise Adagrad, Adam) with its learning rate, and the servers apply it when backward
pushes the gradient rows. The module holds no copy of the table and has no parameters, so
model.parameters() is the dense part alone and torch.optim sees only it. Nothing has to be
wrapped or registered for the embeddings to train (TFRA's silent failure mode), and duplicate
tokens' gradients are summed by the servers, not dropped.

What one forward does: the tokens (a LongTensor of any shape) are flattened into one batch and
looked up (Client.lookup, or the future of an earlier prefetch(); see below); with dedup=True the
distinct tokens only. The rows come back as float32 on the module's device (device=, or wherever
module.to() moved it; CPU by default). When the output takes part in autograd (grad enabled,
module.training, module.requires_grad), it is the output of a torch.autograd.Function whose
backward pushes the gradient of every looked-up row, once, to the table: one forward is one
optimizer step on the servers. So call each RemoteEmbedding once per training step per batch
(two calls are two server steps; accumulating gradients over several backward calls before
stepping is not possible: each backward is a step), and do not scale the loss (torch.cuda.amp's
GradScaler) since the servers never see the scale. Padding token 0 reads zero and its gradients
are ignored (the servers' rule); a batch whose size does not split over the group is padded with
token 0 by the module, so any batch size works with any Client.

Pooling (pooling="sum" or "mean"), as torch.nn.EmbeddingBag with padding_idx=0: 2-D tokens are
one bag per row; 1-D tokens take offsets (the start of each bag; include_last_offset as in
EmbeddingBag); per_sample_weights (sum only) scale each token's row. Padding tokens are left out
of a bag, so a mean divides by the bag's non-padding tokens and an empty bag is zeros. The
pooling is ordinary torch arithmetic on the looked-up rows, so autograd scatters the pooled
gradient back to each token's row (and to per_sample_weights when they require grad) and
backward pushes those rows.

Overlap the caller controls:
  prefetch(tokens) starts the lookup of a later batch (Client.lookup_async) and returns at once.
    The forward whose tokens are equal (compared element by element) uses its rows; a forward
    with other tokens looks them up afresh. A prefetched lookup sees every push this process
    started before prefetch() was called, and none after (the client orders one thread's calls
    on each connection): prefetch after loss.backward() gives exactly the rows a plain forward
    would, prefetch before it gives rows up to one step stale for the tokens this step updates
    (the PERSIA/TorchRec trade, now the caller's choice). Prefetches wait in order; a forward
    drops those queued before the one it uses, or all of them when none matches.
  mode="async" pushes with the servers' async mode (the reply comes once the update is ordered;
    every later lookup still sees it) and does not wait for the reply in backward: at most
    max_pending pushes are left unanswered, the oldest being awaited when a new one would exceed
    the bound (max_pending=1: step k's backward waits for step k-1's push). flush() waits for
    all. A failed push raises at the backward or flush() that awaits it. mode="sync" waits in
    backward for the servers to apply the step (last_push holds the reply: applied, skipped,
    grad_norm, num_unique).

Many features in one call: RemoteEmbeddingBagCollection(client, {"user": "users", "hist":
("items", "mean"), ...}) takes a whole step's sparse features (a dict of ids, (values, lengths)
or 2-D bags, or keys/values/lengths as TorchRec's KeyedJaggedTensor holds them) and returns a
dict of pooled (or, with pooling "none", per-id) rows: one Client.lookup_features per forward,
pooled on the servers before the exchange, and one Client.push_features per backward, whose
pooled gradients the servers expand to the bags' ids. prefetch(), mode="async", max_pending
and flush() work as RemoteEmbedding's.

Threads: one module per training thread; the client may be shared.
"""
import collections
import threading

import numpy as np
import torch
from torch import nn

from ._features import Feature
from ._names import POOLING_NAMES

__all__ = ["RemoteEmbedding", "RemoteEmbeddingBagCollection"]

_MODES = ("sync", "async")
_POOLINGS = (None, "sum", "mean")
_MAX_PREFETCHED = 8  # queued prefetches a module keeps; older ones are dropped


class _Prefetched:
    """A lookup started by prefetch(): the caller's flattened tokens, the tokens asked for
    (the distinct ones with dedup), the inverse index (dedup) and the BatchFuture."""
    __slots__ = ("tokens", "query", "inverse", "future")

    def __init__(self, tokens, query, inverse, future):
        self.tokens, self.query, self.inverse, self.future = tokens, query, inverse, future


class _RemoteRows(torch.autograd.Function):
    """Looked-up rows as a differentiable tensor. The lookup has already happened (forward only
    wraps its rows); backward pushes the gradient of the rows for the tokens that were looked up.
    anchor is a fresh zero-size tensor that requires grad: it makes autograd record the node,
    since the rows themselves come from no tensor."""

    @staticmethod
    def forward(ctx, anchor, module, query, rows, device):
        ctx.module, ctx.query = module, query
        out = torch.from_numpy(rows)
        return out if device.type == "cpu" else out.to(device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.module._push(ctx.query, grad)
        return None, None, None, None, None


def _long_tokens(tokens, what):
    """tokens as an int64 torch tensor (on whatever device it was); TypeError if not integers."""
    if not isinstance(tokens, torch.Tensor):
        a = np.asarray(tokens)
        if a.size == 0 and not isinstance(tokens, np.ndarray):
            a = a.astype(np.int64)  # [] is float64 to numpy
        tokens = torch.as_tensor(a)
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError("%s must be integers (a LongTensor), not %s" % (what, tokens.dtype))
    return tokens.long()


class RemoteEmbedding(nn.Module):
    """An embps table as an nn.Module (see the module's documentation for the whole contract).

    client: an embps.Client; table: the name of a table the group holds (NOT_FOUND otherwise;
    create it with client.create_table, which also chooses the table's optimizer).
    mode: "sync" (backward waits until the servers applied the step) or "async" (the servers'
    async pushes, at most max_pending of them unanswered). pooling: None, "sum" or "mean".
    dedup: look up and push each distinct token once (the module sums duplicates' gradients
    itself; fewer bytes on the wire when batches repeat tokens), instead of leaving duplicates
    to the servers. include_last_offset: as torch.nn.EmbeddingBag's. device: where outputs go
    (default CPU; module.to(device) moves it too). requires_grad: False freezes the table (no
    push, outputs do not require grad), as does eval() or torch.no_grad().

    forward(tokens, offsets=None, per_sample_weights=None) returns float32 rows of shape
    tokens.shape + (emb_width,) without pooling, (bags, emb_width) with it.

    Counters for the curious: prefetch_hits, prefetch_misses (forwards that had prefetches
    queued but none with their tokens), pushes, steps_skipped (sync pushes the servers skipped
    for a non-finite gradient); pending: async pushes not yet answered.

    Raises ValueError (bad mode, pooling, max_pending), embps.Error (the table is not there)."""

    def __init__(self, client, table, *, mode="sync", max_pending=1, pooling=None, dedup=False,
                 include_last_offset=False, device=None, requires_grad=True):
        super().__init__()
        if mode not in _MODES:
            raise ValueError("RemoteEmbedding: mode %r is neither sync nor async" % (mode,))
        if pooling not in _POOLINGS:
            raise ValueError("RemoteEmbedding: pooling %r is none of None, 'sum', 'mean'"
                             % (pooling,))
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 0:
            raise ValueError("RemoteEmbedding: max_pending must be an int >= 0, not %r"
                             % (max_pending,))
        self.client = client
        self.table = table
        self.spec = client.table(table)
        self.emb_width = self.spec.emb_width
        self.mode = mode
        self.max_pending = max_pending
        self.pooling = pooling
        self.dedup = bool(dedup)
        self.include_last_offset = bool(include_last_offset)
        self.requires_grad = bool(requires_grad)
        # The output device is this zero-size buffer's, so that module.to()/cuda() move the
        # outputs as they move a parameter. An integer dtype: module.double() leaves it alone,
        # and the output stays float32. Not persistent: state_dict stays empty.
        self.register_buffer("_device_anchor", torch.empty(0, dtype=torch.uint8,
                                                           device="cpu" if device is None
                                                           else device),
                             persistent=False)
        self._lock = threading.Lock()
        self._pending = collections.deque()  # async pushes' futures, oldest first
        self._prefetched = collections.deque()
        self.last_push = None
        self.pushes = 0
        self.steps_skipped = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    # -- nn.Module --

    @property
    def device(self):
        """Where outputs are put."""
        return self._device_anchor.device

    def requires_grad_(self, requires_grad=True):
        """requires_grad_(False) freezes the table: outputs do not require grad, nothing is
        pushed. Returns self."""
        self.requires_grad = bool(requires_grad)
        return super().requires_grad_(requires_grad)

    def extra_repr(self):
        s = "table=%r, emb_width=%d, optimizer=%s, mode=%r" % (
            self.table, self.emb_width, self.spec.optimizer, self.mode)
        if self.spec.capacity:
            s += ", capacity=%d" % self.spec.capacity
        if self.mode == "async":
            s += ", max_pending=%d" % self.max_pending
        if self.pooling:
            s += ", pooling=%r" % self.pooling
        if self.dedup:
            s += ", dedup=True"
        return s

    # -- the batch's tokens --

    def _query(self, flat):
        """(tokens to look up, inverse or None) for the caller's flattened tokens."""
        if not self.dedup:
            return flat, None
        query, inverse = np.unique(flat, return_inverse=True)
        return query, inverse.reshape(-1)

    def _padded(self, query):
        """query with padding token 0 appended up to a multiple of the group size."""
        extra = -len(query) % self.client.group_size
        if not extra:
            return query
        return np.concatenate([query, np.zeros(extra, np.int64)])

    @staticmethod
    def _flat_numpy(tok):
        """A 1-D int64 numpy copy of tok (a copy: the caller may reuse its tensor before
        backward reads the tokens)."""
        return tok.detach().reshape(-1).to("cpu").numpy().astype(np.int64, copy=True)

    def prefetch(self, tokens):
        """Starts the lookup of tokens (a later forward's, equal element by element) and
        returns at once. The rows it gets see every push started before this call. Argument
        errors raise here; a lookup that fails raises in the forward that uses it."""
        flat = self._flat_numpy(_long_tokens(tokens, "prefetch: tokens"))
        query, inverse = self._query(flat)
        future = None
        if len(query):
            future = self.client.lookup_async(self.table, self._padded(query))
        with self._lock:
            self._prefetched.append(_Prefetched(flat, query, inverse, future))
            while len(self._prefetched) > _MAX_PREFETCHED:
                self._prefetched.popleft()

    def _take_prefetched(self, flat):
        """The queued prefetch of exactly these tokens (dropping those before it), or None
        (dropping all)."""
        with self._lock:
            if not self._prefetched:
                return None
            for i, p in enumerate(self._prefetched):
                if np.array_equal(p.tokens, flat):
                    for _ in range(i + 1):
                        self._prefetched.popleft()
                    self.prefetch_hits += 1
                    return p
            self._prefetched.clear()
            self.prefetch_misses += 1
            return None

    def _lookup(self, flat):
        """(query, inverse, rows) for the flattened tokens: rows[i] is query[i]'s row."""
        p = self._take_prefetched(flat)
        if p is not None:
            query, inverse, future = p.query, p.inverse, p.future
            rows = future.result() if future is not None else None
        else:
            query, inverse = self._query(flat)
            rows = self.client.lookup(self.table, self._padded(query)) if len(query) else None
        if rows is None:
            rows = np.zeros((0, self.emb_width), np.float32)
        return query, inverse, rows[:len(query)]

    # -- forward --

    def _rows(self, tok):
        """The (T, emb_width) rows of tok's T tokens on the module's device, differentiable
        (pushing in backward) when this forward trains."""
        flat = self._flat_numpy(tok)
        query, inverse, rows = self._lookup(flat)
        device = self.device
        if self.requires_grad and self.training and torch.is_grad_enabled() and len(query):
            anchor = torch.empty(0, requires_grad=True)
            out = _RemoteRows.apply(anchor, self, query, rows, device)
        else:
            out = torch.from_numpy(rows)
            if device.type != "cpu":
                out = out.to(device)
        if inverse is not None:
            out = out.index_select(0, torch.from_numpy(inverse).to(device))
        return out

    def forward(self, tokens, offsets=None, per_sample_weights=None):
        """Rows of tokens (any shape), or their bags pooled (see the class). Raises TypeError
        (tokens not integers), ValueError (offsets or weights that do not fit, a negative
        token of a dense table: a hash-keyed table's tokens are any int64 ids), embps.Error (a
        token out of range, the table gone, a server error)."""
        tok = _long_tokens(tokens, "tokens")
        if self.pooling is None:
            if offsets is not None or per_sample_weights is not None:
                raise ValueError("RemoteEmbedding: offsets and per_sample_weights need "
                                 "pooling='sum' or 'mean'")
            return self._rows(tok).reshape(*tok.shape, self.emb_width)
        bags, num_bags = self._bags(tok, offsets)
        weights = None
        if per_sample_weights is not None:
            if self.pooling != "sum":
                raise ValueError("RemoteEmbedding: per_sample_weights need pooling='sum', not "
                                 "%r (as torch.nn.EmbeddingBag)" % self.pooling)
            if tuple(per_sample_weights.shape) != tuple(tok.shape):
                raise ValueError("RemoteEmbedding: per_sample_weights has shape %s, tokens %s: "
                                 "give one weight per token"
                                 % (tuple(per_sample_weights.shape), tuple(tok.shape)))
            weights = per_sample_weights.reshape(-1).to(self.device, torch.float32)
        rows = self._rows(tok)
        device = self.device
        bags = bags.to(device)
        if self.pooling == "mean":
            # padding tokens are left out of the count, as EmbeddingBag(padding_idx=0) does
            real = (tok.reshape(-1) != 0).to(device, torch.float32)
            count = torch.zeros(num_bags, device=device).index_add_(0, bags, real)
            weights = real / count.clamp(min=1.0).index_select(0, bags)
        if weights is not None:
            rows = rows * weights.unsqueeze(1)
        out = torch.zeros(num_bags, self.emb_width, device=device)
        return out.index_add(0, bags, rows)

    def _bags(self, tok, offsets):
        """(bag of each token as a LongTensor on the CPU, number of bags)."""
        if tok.dim() == 2:
            if offsets is not None:
                raise ValueError("RemoteEmbedding: 2-D tokens are one bag per row: pass "
                                 "offsets=None")
            b, length = tok.shape
            return torch.arange(b).repeat_interleave(length), b
        if tok.dim() != 1:
            raise ValueError("RemoteEmbedding: pooling takes 1-D tokens with offsets or 2-D "
                             "tokens (one bag per row), not shape %s" % (tuple(tok.shape),))
        if offsets is None:
            raise ValueError("RemoteEmbedding: 1-D tokens need offsets (where each bag starts)")
        off = _long_tokens(offsets, "offsets").detach().to("cpu")
        n = tok.shape[0]
        if off.dim() != 1:
            raise ValueError("RemoteEmbedding: offsets must be 1-D, not shape %s"
                             % (tuple(off.shape),))
        if self.include_last_offset:
            if len(off) < 1 or int(off[-1]) != n:
                raise ValueError("RemoteEmbedding: with include_last_offset, offsets must end "
                                 "with the number of tokens (%d)" % n)
            ends = off[1:]
            off = off[:-1]
        else:
            ends = torch.cat([off[1:], torch.tensor([n])])
        if len(off) and (int(off[0]) != 0 or bool((ends < off).any()) or int(ends[-1]) > n):
            raise ValueError("RemoteEmbedding: offsets must start at 0 and not decrease, and "
                             "no bag may end past the %d tokens" % n)
        num_bags = len(off)
        return torch.arange(num_bags).repeat_interleave(ends - off), num_bags

    # -- pushes --

    def _push(self, query, grad):
        """Pushes grad's rows for query's tokens (from backward)."""
        g = grad.detach().to("cpu", torch.float32).numpy()
        n = len(query)
        tokens = self._padded(query)
        if len(tokens) != n:
            g = np.concatenate([g, np.zeros((len(tokens) - n, g.shape[1]), np.float32)])
        if self.mode == "sync":
            res = self.client.push(self.table, tokens, g, mode="sync")
            self.last_push = res
            self.pushes += 1
            self.steps_skipped += bool(res.skipped)
            return
        future = self.client.push_async(self.table, tokens, g, mode="async")
        due = []
        with self._lock:
            self.pushes += 1
            self._pending.append(future)
            while len(self._pending) > self.max_pending:
                due.append(self._pending.popleft())
        for f in due:
            self.last_push = f.result()

    @property
    def pending(self):
        """The number of async pushes whose reply has not been awaited yet."""
        with self._lock:
            return len(self._pending)

    def flush(self):
        """Waits for every async push not yet answered (all of them, even when one fails);
        raises the first failure, an embps.Error."""
        with self._lock:
            due, self._pending = list(self._pending), collections.deque()
        first = None
        for f in due:
            try:
                self.last_push = f.result()
            except Exception as e:  # every one is awaited before raising
                if first is None:
                    first = e
        if first is not None:
            raise first


# ---- many features, one call: RemoteEmbeddingBagCollection ----------------------------------

class _Step:
    """One forward's batch as the servers see it: the feature names in order, the
    embps.Features sent (B padded to the group size with empty bags), the caller's samples B,
    the padded count P, and the canonical input (to match a prefetch)."""
    __slots__ = ("names", "features", "samples", "padded", "canon")

    def __init__(self, names, features, samples, padded, canon):
        self.names, self.features = names, features
        self.samples, self.padded, self.canon = samples, padded, canon


class _RemoteBags(torch.autograd.Function):
    """A feature batch's outputs as differentiable tensors, one per feature, from one lookup
    (forward only wraps its rows, numpy arrays, on device); backward pushes the gradients of
    the outputs that got one, in one push_features. anchor: as _RemoteRows'."""

    @staticmethod
    def forward(ctx, anchor, module, step, rows, device):
        ctx.module, ctx.step = module, step
        ctx.set_materialize_grads(False)
        outs = [torch.from_numpy(r) for r in rows]
        return tuple(o if device.type == "cpu" else o.to(device) for o in outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.module._push(ctx.step, grads)
        return None, None, None, None, None


def _flat_array(x, what, dtype):
    """x (tensor, array or sequence) as a 1-D numpy copy of dtype (a copy: the caller may reuse
    its tensor before backward)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        if dtype == np.int64:
            if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
                raise TypeError("%s must be integers (a LongTensor), not %s" % (what, x.dtype))
            x = x.long()
        else:
            x = x.to(torch.float32)
        a = x.numpy()
    else:
        a = np.asarray(x)
        if a.size == 0 and not isinstance(x, np.ndarray):
            a = a.astype(dtype)
        if dtype == np.int64 and a.dtype.kind not in "iu":
            raise TypeError("%s must be integers, not %s" % (what, a.dtype))
    if a.ndim != 1:
        raise ValueError("%s must be 1-D, not shape %s" % (what, tuple(a.shape)))
    return np.array(a, dtype=dtype, copy=True)


class RemoteEmbeddingBagCollection(nn.Module):
    """Many sparse features over embps tables as one nn.Module: one LookupFeatures call per
    forward, pooled on the servers, and one PushFeatures per backward (TorchRec's
    EmbeddingBagCollection, remote).

    client: an embps.Client. features: a dict of feature name -> table name (pooled with
    `pooling`), or -> (table, pooling), pooling one of "sum", "mean", "weighted_sum", "none".
    Several features may share a table (a repeated id then gets one summed gradient and one
    optimizer step per backward). mode, max_pending, device, requires_grad: as RemoteEmbedding's
    (the tables' optimizers are the servers', chosen by create_table; the module has no
    parameters).

    forward(features) with features a dict of name -> ids, where ids is a 1-D tensor (one id per
    sample), a 2-D (B, L) tensor (one bag of L ids per sample; id 0 pads), or a tuple (values,
    lengths) or (values, lengths, weights) of a jagged feature; or forward(keys=, values=,
    lengths=, weights=None) as TorchRec's KeyedJaggedTensor holds them (lengths key-major: B per
    key), or forward(kjt) with any object that has keys(), values(), lengths() and
    weights_or_none(). Every feature given must hold B samples; a subset of the module's features
    may be given. Returns {name: tensor}: (B, emb_width) float32 for a pooled feature, (ids,
    emb_width) for pooling "none", on the module's device. weighted_sum's weights are constants
    (no gradient flows to them: the pooling happens on the servers). The batch is padded to the
    group size with empty bags, so any B works.

    prefetch(features) (the same arguments) starts a later forward's lookup, as
    RemoteEmbedding.prefetch: a forward whose features are equal (names, ids, lengths, weights)
    uses it. backward pushes the gradients of the outputs that took part in the loss (a
    feature whose output did not is left out of the push, as an unused nn.EmbeddingBag gets no
    gradient). Counters: pushes, steps_skipped (pushes in which some table's step was
    skipped), prefetch_hits, prefetch_misses, pending; last_push holds the last
    PushFeaturesResult awaited.

    Raises ValueError (a bad features config, mode, max_pending), embps.Error (a table the
    group lacks)."""

    def __init__(self, client, features, *, pooling="sum", mode="sync", max_pending=1,
                 device=None, requires_grad=True):
        super().__init__()
        if mode not in _MODES:
            raise ValueError("RemoteEmbeddingBagCollection: mode %r is neither sync nor async"
                             % (mode,))
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 0:
            raise ValueError("RemoteEmbeddingBagCollection: max_pending must be an int >= 0, "
                             "not %r" % (max_pending,))
        if not isinstance(features, dict) or not features:
            raise ValueError("RemoteEmbeddingBagCollection: features must be a non-empty dict "
                             "of feature name -> table name or (table, pooling)")
        self.client = client
        self.features = {}
        for name, cfg in features.items():
            table, pool = (cfg, pooling) if isinstance(cfg, str) else tuple(cfg)
            if not isinstance(name, str) or not name:
                raise ValueError("RemoteEmbeddingBagCollection: feature name %r is not a "
                                 "non-empty str" % (name,))
            if pool not in POOLING_NAMES:
                raise ValueError("RemoteEmbeddingBagCollection: feature '%s': pooling %r is "
                                 "not one of 'none', 'sum', 'mean', 'weighted_sum'"
                                 % (name, pool))
            self.features[name] = (table, pool)
        self.specs = {t: client.table(t) for t in dict.fromkeys(t for t, _ in
                                                                  self.features.values())}
        self.mode = mode
        self.max_pending = max_pending
        self.requires_grad = bool(requires_grad)
        self.register_buffer("_device_anchor", torch.empty(0, dtype=torch.uint8,
                                                           device="cpu" if device is None
                                                           else device),
                             persistent=False)
        self._lock = threading.Lock()
        self._pending = collections.deque()
        self._prefetched = collections.deque()
        self.last_push = None
        self.pushes = 0
        self.steps_skipped = 0
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    # -- nn.Module --

    @property
    def device(self):
        """Where outputs are put."""
        return self._device_anchor.device

    def requires_grad_(self, requires_grad=True):
        """requires_grad_(False) freezes the tables: no push. Returns self."""
        self.requires_grad = bool(requires_grad)
        return super().requires_grad_(requires_grad)

    def extra_repr(self):
        return "features={%s}, mode=%r" % (
            ", ".join("%r: (%r, %r)" % (n, t, p) for n, (t, p) in self.features.items()),
            self.mode)

    # -- the batch --

    def _canonical(self, features, keys, values, lengths, weights):
        """{name: (ids, lengths, weights or None)} as int64/int64/float32 numpy copies, in the
        input's order, and the number of samples B."""
        if features is not None and (keys is not None or values is not None
                                     or lengths is not None or weights is not None):
            raise ValueError("RemoteEmbeddingBagCollection: pass features, or keys, values and "
                             "lengths, not both")
        if features is not None and not isinstance(features, dict) and hasattr(
                features, "keys") and hasattr(features, "values") and hasattr(features,
                                                                                "lengths"):
            kjt = features  # a KeyedJaggedTensor, duck-typed
            features = None
            keys, values, lengths = list(kjt.keys()), kjt.values(), kjt.lengths()
            weights = kjt.weights_or_none() if hasattr(kjt, "weights_or_none") else None
        out = {}
        if features is None:
            if keys is None or values is None or lengths is None:
                raise ValueError("RemoteEmbeddingBagCollection: give features (a dict), or "
                                 "keys, values and lengths")
            keys = list(keys)
            vals = _flat_array(values, "values", np.int64)
            lens = _flat_array(lengths, "lengths", np.int64)
            wts = None if weights is None else _flat_array(weights, "weights", np.float32)
            if not keys or len(lens) % len(keys):
                raise ValueError("RemoteEmbeddingBagCollection: %d lengths for %d keys: "
                                 "lengths holds B per key, key after key"
                                 % (len(lens), len(keys)))
            b = len(lens) // len(keys)
            if int(lens.sum()) != len(vals) or (lens < 0).any():
                raise ValueError("RemoteEmbeddingBagCollection: lengths add up to %d values, "
                                 "values holds %d" % (int(lens.sum()), len(vals)))
            if wts is not None and len(wts) != len(vals):
                raise ValueError("RemoteEmbeddingBagCollection: %d weights for %d values: give "
                                 "one weight per value" % (len(wts), len(vals)))
            start = 0
            for k, name in enumerate(keys):
                ln = lens[k * b:(k + 1) * b]
                end = start + int(ln.sum())
                w = None
                if wts is not None and self._pooling(name) == "weighted_sum":
                    w = wts[start:end]
                out[name] = (vals[start:end], ln, w)
                start = end
            return out, b
        if not isinstance(features, dict) or not features:
            raise ValueError("RemoteEmbeddingBagCollection: features must be a non-empty dict "
                             "of feature name -> ids")
        b = None
        for name, x in features.items():
            self._pooling(name)
            what = "feature '%s'" % name
            w = None
            if isinstance(x, (tuple, list)) and len(x) in (2, 3) and not np.isscalar(x[0]):
                ids = _flat_array(x[0], what + ": values", np.int64)
                ln = _flat_array(x[1], what + ": lengths", np.int64)
                if len(x) == 3 and x[2] is not None:
                    w = _flat_array(x[2], what + ": weights", np.float32)
            else:
                t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
                if t.dim() == 2:
                    ln = np.full(t.shape[0], t.shape[1], np.int64)
                    ids = _flat_array(t.reshape(-1), what, np.int64)
                elif t.dim() == 1:
                    ids = _flat_array(t, what, np.int64)
                    ln = np.ones(len(ids), np.int64)
                else:
                    raise ValueError("RemoteEmbeddingBagCollection: %s: ids must be 1-D (one "
                                     "per sample) or 2-D (a bag per row), not shape %s"
                                     % (what, tuple(t.shape)))
            if b is None:
                b = len(ln)
            elif len(ln) != b:
                raise ValueError("RemoteEmbeddingBagCollection: %s has %d samples, the "
                                 "features before it %d" % (what, len(ln), b))
            out[name] = (ids, ln, w)
        return out, b

    def _pooling(self, name):
        if name not in self.features:
            raise ValueError("RemoteEmbeddingBagCollection: '%s' is not a feature of this "
                             "module (%s)" % (name, ", ".join(self.features)))
        return self.features[name][1]

    def _step(self, canon, samples):
        """The _Step of a canonical batch: B padded to the group size with empty bags."""
        n = self.client.group_size
        padded = -(-samples // n) * n
        feats = {}
        for name, (ids, ln, w) in canon.items():
            table, pool = self.features[name]
            if padded != samples:
                ln = np.concatenate([ln, np.zeros(padded - samples, np.int64)])
            if pool == "weighted_sum" and w is None:
                raise ValueError("RemoteEmbeddingBagCollection: feature '%s' pools "
                                 "weighted_sum and needs weights, one per id" % name)
            feats[name] = Feature(table, ids, ln, w if pool == "weighted_sum" else None,
                                        pool)
        return _Step(list(canon), feats, samples, padded, canon)

    @staticmethod
    def _same(a, b):
        if list(a) != list(b):
            return False
        for name in a:
            for x, y in zip(a[name], b[name]):
                if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                    return False
        return True

    def prefetch(self, features=None, *, keys=None, values=None, lengths=None, weights=None):
        """Starts the lookup of a later forward's features (the same arguments as forward) and
        returns at once; see RemoteEmbedding.prefetch for what it sees."""
        canon, b = self._canonical(features, keys, values, lengths, weights)
        step = self._step(canon, b)
        future = self.client.lookup_features_async(step.features)
        with self._lock:
            self._prefetched.append((step, future))
            while len(self._prefetched) > _MAX_PREFETCHED:
                self._prefetched.popleft()

    def _take_prefetched(self, canon):
        with self._lock:
            if not self._prefetched:
                return None
            for i, (step, future) in enumerate(self._prefetched):
                if self._same(step.canon, canon):
                    for _ in range(i + 1):
                        self._prefetched.popleft()
                    self.prefetch_hits += 1
                    return step, future
            self._prefetched.clear()
            self.prefetch_misses += 1
            return None

    def forward(self, features=None, *, keys=None, values=None, lengths=None, weights=None):
        """{name: tensor} of the features given (see the class). Raises TypeError, ValueError
        (inputs that do not fit), embps.ShapeError or embps.Error (from the client, naming the
        feature)."""
        canon, b = self._canonical(features, keys, values, lengths, weights)
        got = self._take_prefetched(canon)
        if got is not None:
            step, future = got
            rows = future.result()
        else:
            step = self._step(canon, b)
            rows = self.client.lookup_features(step.features)
        arrays = []
        for name in step.names:
            r = rows[name]
            arrays.append(r[:b] if self.features[name][1] != "none" else r)
        device = self.device
        if self.requires_grad and self.training and torch.is_grad_enabled():
            anchor = torch.empty(0, requires_grad=True)
            outs = _RemoteBags.apply(anchor, self, step, arrays, device)
        else:
            outs = [torch.from_numpy(a) for a in arrays]
            if device.type != "cpu":
                outs = [o.to(device) for o in outs]
        return dict(zip(step.names, outs))

    # -- pushes --

    def _push(self, step, grads):
        """Pushes the gradients of the outputs that got one (from backward)."""
        feats, g = {}, {}
        for name, grad in zip(step.names, grads):
            if grad is None:
                continue
            a = grad.detach().to("cpu", torch.float32).numpy()
            if self.features[name][1] != "none" and step.padded != step.samples:
                a = np.concatenate([a, np.zeros((step.padded - step.samples, a.shape[1]),
                                                np.float32)])
            feats[name], g[name] = step.features[name], a
        if not feats:
            return
        if self.mode == "sync":
            res = self.client.push_features(feats, g, mode="sync")
            self.last_push = res
            self.pushes += 1
            self.steps_skipped += bool(res.skipped)
            return
        future = self.client.push_features_async(feats, g, mode="async")
        due = []
        with self._lock:
            self.pushes += 1
            self._pending.append(future)
            while len(self._pending) > self.max_pending:
                due.append(self._pending.popleft())
        for f in due:
            self.last_push = f.result()

    pending = RemoteEmbedding.pending
    flush = RemoteEmbedding.flush
