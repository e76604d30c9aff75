"""embps.torch.RemoteEmbedding against a local reference, on real 1- and 2-rank groups.

The reference is the same model written with torch.nn.Embedding / torch.nn.EmbeddingBag
(padding_idx=0) tables in float64, whose rows start as the server's (read with a lookup before
training) and are updated by a reference of the server's optimizer written here from the
semantics docs/python.md states: row-wise Adagrad, accum = accum*decay + mean(g^2 over the row),
w -= lr*g/(sqrt(accum)+eps), decay = exp(-ln 2/half_life), duplicate tokens' gradients summed,
padding row 0 reading zero and ignoring gradients. Both sides train their dense part with their
own torch.optim.SGD in float64, so the only float32 arithmetic is the servers'.

Checks: with sync pushes the embps run matches the reference to 1e-5 relative after 50 steps
(losses, every row of the table, the dense weights), also with dedup=True, with prefetch()
after backward (every forward a prefetch hit), and with batches the module pads to the group
size; pooling sum/mean with offsets, 2-D bags and per_sample_weights matches EmbeddingBag in the
forward and in per_sample_weights' gradient, and 20 pooled steps match the reference; with async
pushes (max_pending 1 and 2) and prefetch before backward the model still learns (the held-out
loss falls by at least half) and never has more than max_pending pushes unanswered. Also: no push
under no_grad, eval() or requires_grad_(False); shapes, dtypes, devices; prefetch's contract
(equal tokens hit, others miss and fall back, a prefetch sees the pushes started before it and
none after); async errors surface at the backward or flush() that awaits them; `import embps`
does not import torch.

Skips (exit 77, "SKIP: ..." on stdout) where torch is not importable.
Run: /usr/bin/python3 tests/python/test_torch.py (ctest -L python)."""
import concurrent.futures
import math
import subprocess
import sys
import unittest

try:
    import torch
except ImportError as e:  # Debian's python3-torch (deploy/packages.sh)
    print("SKIP: torch is not importable (%s): install python3-torch" % e)
    sys.exit(77)

import numpy as np  # noqa: E402

from testenv import PYTHON_DIR, embps, gl  # noqa: E402

import embps.torch as et  # noqa: E402

torch.set_num_threads(2)
ROWS = 300
WIDTH = 64  # shard width 32 on 2 ranks
LR, EPS, HALF_LIFE = 0.05, 1e-8, 20.0
GROUPS = {}
_names = iter(range(10 ** 6))


def setUpModule():
    for n in (1, 2):
        GROUPS[n] = gl.Group(n)


def tearDownModule():
    bad = []
    for n, g in GROUPS.items():
        codes = g.close()
        if any(c != 0 for c in codes.values()):
            bad.append("%d-rank group exited with %s:\n%s" % (n, codes, g.last_logs))
    if bad:
        raise AssertionError("\n".join(bad))


def rel_err(a, b):
    """max |a - b| / max |b| (an error relative to the tensor's scale)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


class ReferenceTable:
    """The server's table and optimizer in float64: an nn.Embedding or nn.EmbeddingBag with
    padding_idx=0 whose weight is the server's rows, and row-wise Adagrad as docs/python.md
    states it."""

    def __init__(self, initial, spec, bag_mode=None):
        w = torch.tensor(initial, dtype=torch.float64)
        if bag_mode is None:
            self.module = torch.nn.Embedding(w.shape[0], w.shape[1], padding_idx=0,
                                             dtype=torch.float64)
        else:
            self.module = torch.nn.EmbeddingBag(w.shape[0], w.shape[1], mode=bag_mode,
                                                padding_idx=0, dtype=torch.float64)
        with torch.no_grad():
            self.module.weight.copy_(w)
        self.accum = torch.zeros(w.shape[0], dtype=torch.float64)
        # the server keeps lr, eps in float32: use its values (the spec reports them)
        self.lr, self.eps = spec.lr, spec.eps
        self.decay = math.exp(-math.log(2.0) / spec.half_life) if spec.half_life > 0 else 1.0

    def step(self, tokens):
        """One push of this batch: every distinct non-padding token's row, with its summed
        gradient (nn.Embedding's dense weight.grad sums duplicates)."""
        w, g = self.module.weight, self.module.weight.grad
        uniq = torch.unique(torch.as_tensor(tokens).reshape(-1))
        uniq = uniq[uniq != 0]
        with torch.no_grad():
            gu = g[uniq]
            self.accum[uniq] = self.accum[uniq] * self.decay + (gu * gu).mean(1)
            w[uniq] -= self.lr * gu / (self.accum[uniq].sqrt().unsqueeze(1) + self.eps)
        w.grad = None


class Flat(torch.nn.Module):
    """tokens (B, L) -> embeddings (B, L, D) -> flattened -> Linear -> (B,), in float64."""

    def __init__(self, emb, length, seed):
        super().__init__()
        self.emb = emb
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(length * WIDTH, 1, dtype=torch.float64)

    def forward(self, tokens):
        e = self.emb(tokens).double()
        return self.dense(e.reshape(e.shape[0], -1)).squeeze(-1)


class Pooled(torch.nn.Module):
    """bags -> pooled (B, D) -> Linear -> (B,), in float64."""

    def __init__(self, emb, seed):
        super().__init__()
        self.emb = emb
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(WIDTH, 1, dtype=torch.float64)

    def forward(self, tokens, offsets, per_sample_weights=None):
        if per_sample_weights is not None and isinstance(self.emb, torch.nn.EmbeddingBag):
            per_sample_weights = per_sample_weights.double()
        e = self.emb(tokens, offsets, per_sample_weights=per_sample_weights).double()
        return self.dense(e).squeeze(-1)


class Teacher:
    """Seeded targets a Flat model can learn: a hidden table (row 0 zero) and a hidden linear
    map of the flattened rows."""

    def __init__(self, length, seed):
        rng = np.random.default_rng(seed)
        self.hidden = rng.normal(0, 0.5, size=(ROWS, WIDTH))
        self.hidden[0] = 0
        self.mix = rng.normal(0, 1.0 / math.sqrt(length * WIDTH), size=length * WIDTH)

    def __call__(self, tok):
        return torch.from_numpy(self.hidden[tok].reshape(len(tok), -1) @ self.mix)


def flat_batches(steps, batch, length, seed, high=ROWS // 3, padding=0.1):
    """Seeded (tokens, targets): by default tokens with many duplicates (rows below 100) and
    padding."""
    rng = np.random.default_rng(seed)
    teacher = Teacher(length, seed + 1)
    out = []
    for _ in range(steps):
        tok = rng.integers(0, high, size=(batch, length))
        tok[rng.random(tok.shape) < padding] = 0
        out.append((torch.from_numpy(tok), teacher(tok)))
    return out


def bag_batches(steps, bags, seed):
    """Seeded (tokens, offsets, per_sample_weights, targets) with empty bags and padding."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 7, size=bags)
        lengths[rng.integers(bags)] = 0
        n = int(lengths.sum())
        tok = rng.integers(0, ROWS // 3, size=n)
        tok[rng.random(n) < 0.1] = 0
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        weights = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
        out.append((torch.from_numpy(tok), torch.from_numpy(offsets), torch.from_numpy(weights),
                    torch.from_numpy(rng.uniform(-1, 1, bags))))
    return out


class GroupCase:
    """Tests run on an N-rank group (subclasses set N)."""
    N = 1

    @classmethod
    def setUpClass(cls):
        cls.client = embps.Client(GROUPS[cls.N].servers, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def table(self, optimizer="rowwise_adagrad", **kw):
        name = "t%d_%d" % (self.N, next(_names))
        kw.setdefault("lr", LR)
        kw.setdefault("eps", EPS)
        kw.setdefault("half_life", HALF_LIFE)
        self.client.create_table(name, ROWS, WIDTH, optimizer=optimizer, seed=11, **kw)
        return name

    def all_rows(self, table):
        return self.client.lookup(table, np.arange(ROWS)).astype(np.float64)

    def table_pushes(self, table):
        return sum(t.pushes for s in self.client.stats() for t in s.tables if t.name == table)

    # ---- sync pushes against the reference ----

    def run_flat(self, steps=50, batch=13, length=5, dedup=False, prefetch=False):
        """50 steps of Flat on embps and on the reference; every loss and, at the end, the table
        and the dense weights must agree to 1e-5 relative."""
        t = self.table()
        initial = self.all_rows(t)
        emb = et.RemoteEmbedding(self.client, t, dedup=dedup)
        model = Flat(emb, length, seed=5)
        ref_table = ReferenceTable(initial, self.client.table(t))
        ref = Flat(ref_table.module, length, seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.dense.parameters(), lr=0.05)
        self.assertEqual([p.shape for p in model.parameters()],
                         [p.shape for p in ref.dense.parameters()],
                         "the module must have no parameters of its own")
        data = flat_batches(steps, batch, length, seed=3)
        if prefetch:
            emb.prefetch(data[0][0])
        worst = 0.0
        for k, (tok, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(tok), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if prefetch and k + 1 < steps:
                emb.prefetch(data[k + 1][0])  # after backward: the rows see this step's push
            ref_loss = torch.nn.functional.mse_loss(ref(tok), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            ref_table.step(tok)
            worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            if k == 0:
                first = ref_loss.item()
            self.assertTrue(emb.last_push.applied, emb.last_push)
        self.assertLess(worst, 1e-5, "loss")
        final = self.all_rows(t)
        want = ref_table.module.weight.detach().numpy()
        moved = np.abs(want - initial).max()
        self.assertGreater(moved, 1e-2, "the reference did not train: the test proves nothing")
        err = rel_err(final, want)
        self.assertLess(err, 1e-5, "table after %d steps" % steps)
        np.testing.assert_array_equal(final[0], 0)
        for p, q in zip(model.dense.parameters(), ref.dense.parameters()):
            self.assertLess(rel_err(p.detach(), q.detach()), 1e-5, "dense part")
        self.assertEqual(emb.pushes, steps)
        if prefetch:
            self.assertEqual((emb.prefetch_hits, emb.prefetch_misses), (steps, 0))
        print("  %d-rank sync%s%s: %d steps, loss %.4f -> %.4f, loss err %.1e, table err %.1e "
              "(rows moved up to %.3f)" % (self.N, " dedup" if dedup else "",
                                           " prefetch" if prefetch else "", steps, first,
                                           ref_loss.item(), worst, err, moved), file=sys.stderr)

    def test_sync_matches_reference(self):
        self.run_flat()

    def test_sync_dedup_matches_reference(self):
        self.run_flat(dedup=True)

    def test_sync_prefetch_after_backward_matches_reference(self):
        self.run_flat(prefetch=True, batch=16, length=4)

    # ---- pooling against EmbeddingBag ----

    def test_pooled_forward_matches_embedding_bag(self):
        t = self.table()
        rng = np.random.default_rng(21)
        for mode in ("sum", "mean"):
            initial = self.all_rows(t)  # the sum case's backward pushes
            for dedup in (False, True):
                emb = et.RemoteEmbedding(self.client, t, pooling=mode, dedup=dedup)
                ref = ReferenceTable(initial, self.client.table(t), bag_mode=mode).module
                tok, off, psw, _ = bag_batches(1, 9, seed=int(rng.integers(1000)))[0]
                got = emb(tok, off)
                self.assertEqual((got.shape, got.dtype), ((9, WIDTH), torch.float32))
                self.assertLess(rel_err(got.detach(), ref(tok, off).detach()), 1e-6, mode)
                # include_last_offset, and 2-D bags (padded with token 0 to one length)
                emb_last = et.RemoteEmbedding(self.client, t, pooling=mode,
                                              include_last_offset=True)
                ref_last = torch.nn.EmbeddingBag(ROWS, WIDTH, mode=mode, padding_idx=0,
                                                 include_last_offset=True, dtype=torch.float64)
                ref_last.weight = ref.weight
                off_last = torch.cat([off, torch.tensor([len(tok)])])
                self.assertLess(rel_err(emb_last(tok, off_last).detach(),
                                        ref_last(tok, off_last).detach()), 1e-6)
                bags2 = torch.from_numpy(rng.integers(0, ROWS, size=(7, 5)))
                bags2[bags2 % 4 == 0] = 0
                bags2[3] = 0  # an all-padding bag
                self.assertLess(rel_err(emb(bags2).detach(), ref(bags2).detach()), 1e-6)
            # per_sample_weights (sum only), and their gradient
            if mode == "sum":
                emb = et.RemoteEmbedding(self.client, t, pooling="sum")
                w1 = psw.clone().requires_grad_(True)
                w2 = psw.double().clone().requires_grad_(True)
                out = emb(tok, off, per_sample_weights=w1)
                want = ref(tok, off, per_sample_weights=w2)
                self.assertLess(rel_err(out.detach(), want.detach()), 1e-6)
                g = torch.from_numpy(rng.normal(size=(9, WIDTH)))
                (out.double() * g).sum().backward()
                (want * g).sum().backward()
                self.assertLess(rel_err(w1.grad, w2.grad), 1e-5, "per_sample_weights' gradient")
        with self.assertRaisesRegex(ValueError, "per_sample_weights need pooling='sum'"):
            et.RemoteEmbedding(self.client, t, pooling="mean")(tok, off, per_sample_weights=psw)
        with self.assertRaisesRegex(ValueError, "need offsets"):
            et.RemoteEmbedding(self.client, t, pooling="sum")(tok)
        with self.assertRaisesRegex(ValueError, "offsets=None"):
            et.RemoteEmbedding(self.client, t, pooling="sum")(bags2, off)
        with self.assertRaisesRegex(ValueError, "start at 0"):
            et.RemoteEmbedding(self.client, t, pooling="sum")(tok, off + 1)
        with self.assertRaisesRegex(ValueError, "need pooling"):
            et.RemoteEmbedding(self.client, t)(tok, off)

    def run_pooled(self, mode, weighted, steps=20):
        """Pooled training: the gradient scattered from bags to rows, pushed, must match the
        reference EmbeddingBag's."""
        t = self.table()
        initial = self.all_rows(t)
        emb = et.RemoteEmbedding(self.client, t, pooling=mode)
        model = Pooled(emb, seed=9)
        ref_table = ReferenceTable(initial, self.client.table(t), bag_mode=mode)
        ref = Pooled(ref_table.module, seed=9)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.dense.parameters(), lr=0.05)
        worst = 0.0
        for tok, off, psw, y in bag_batches(steps, 11, seed=13):
            psw = psw if weighted else None
            loss = torch.nn.functional.mse_loss(model(tok, off, psw), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref_loss = torch.nn.functional.mse_loss(ref(tok, off, psw), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            ref_table.step(tok)
            worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        want = ref_table.module.weight.detach().numpy()
        self.assertGreater(np.abs(want - initial).max(), 1e-2)
        err = rel_err(self.all_rows(t), want)
        self.assertLess(worst, 1e-5, "loss")
        self.assertLess(err, 1e-5, "table")
        print("  %d-rank pooled %s%s: %d steps, loss err %.1e, table err %.1e"
              % (self.N, mode, " weighted" if weighted else "", steps, worst, err),
              file=sys.stderr)

    def test_pooled_mean_matches_reference(self):
        self.run_pooled("mean", False)

    def test_pooled_sum_weighted_matches_reference(self):
        self.run_pooled("sum", True)

    # ---- async pushes and prefetch ----

    def test_async_prefetch_converges(self):
        """A learnable task (targets from a hidden table and a hidden linear map); async pushes
        with max_pending N, each next batch prefetched before backward (rows up to one step
        stale). The held-out loss must fall by at least half."""
        max_pending = self.N
        t = self.table(lr=0.05)
        length, steps = 4, 150
        data = flat_batches(steps + 16, 32, length, seed=31, high=ROWS, padding=0)
        held_out = (torch.cat([tok for tok, _ in data[steps:]]),  # 512 samples never trained on
                    torch.cat([y for _, y in data[steps:]]))
        data = data[:steps]
        emb = et.RemoteEmbedding(self.client, t, mode="async", max_pending=max_pending)
        model = Flat(emb, length, seed=2)
        opt = torch.optim.Adam(model.dense.parameters(), lr=0.01)

        def evaluate():
            model.eval()
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()
            model.train()
            return loss

        before = evaluate()
        emb.prefetch(data[0][0])
        seen = 0
        for k, (tok, y) in enumerate(data):
            loss = torch.nn.functional.mse_loss(model(tok), y)
            if k + 1 < steps:
                emb.prefetch(data[k + 1][0])  # overlaps this step's backward and push
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen = max(seen, emb.pending)
            self.assertLessEqual(emb.pending, max_pending)
        self.assertEqual(seen, max_pending)
        emb.flush()
        self.assertEqual(emb.pending, 0)
        self.assertTrue(emb.last_push.ordered and not emb.last_push.applied, emb.last_push)
        self.assertEqual((emb.prefetch_hits, emb.prefetch_misses), (steps, 0))
        after = evaluate()
        print("  %d-rank async max_pending=%d + prefetch: held-out loss %.4f -> %.4f (x%.3f) "
              "after %d steps" % (self.N, max_pending, before, after, after / before, steps),
              file=sys.stderr)
        self.assertLess(after, 0.5 * before)

    # ---- the module's contract ----

    def test_no_push_without_training(self):
        t = self.table()
        emb = et.RemoteEmbedding(self.client, t)
        dense = torch.nn.Linear(WIDTH, 1)
        tok = torch.arange(1, 9)
        before = self.all_rows(t)

        def loss_of(out):
            return dense(out).sum()

        with torch.no_grad():
            out = emb(tok)
        self.assertFalse(out.requires_grad)
        emb.eval()
        out = emb(tok)
        self.assertFalse(out.requires_grad)
        loss_of(out).backward()  # the dense part still trains
        emb.train()
        emb.requires_grad_(False)
        out = emb(tok)
        self.assertFalse(out.requires_grad)
        loss_of(out).backward()
        with torch.inference_mode():
            self.assertFalse(emb(tok).requires_grad)
        self.assertEqual((emb.pushes, self.table_pushes(t)), (0, 0))
        np.testing.assert_array_equal(self.all_rows(t), before)
        emb.requires_grad_(True)
        out = emb(tok)
        self.assertTrue(out.requires_grad)
        loss_of(out).backward()
        self.assertEqual((emb.pushes, self.table_pushes(t)), (1, self.N))
        self.assertFalse(np.array_equal(self.all_rows(t)[1:9], before[1:9]))

    def test_shapes_dtypes_devices(self):
        t = self.table()
        emb = et.RemoteEmbedding(self.client, t, device="cpu")
        for shape in [(), (1,), (7,), (3, 5), (2, 3, 3), (0,), (2, 0)]:
            tok = torch.from_numpy(np.random.default_rng(1).integers(0, ROWS, size=shape))
            rows = self.client.lookup(t, np.arange(ROWS))  # as the last backward left them
            out = emb(tok)
            self.assertEqual(tuple(out.shape), shape + (WIDTH,))
            self.assertEqual((out.dtype, out.device.type), (torch.float32, "cpu"))
            np.testing.assert_array_equal(out.detach().numpy(), rows[tok.numpy()])
            if out.numel():
                out.sum().backward()  # odd sizes are padded to the group size by the module
        self.assertEqual(emb.pushes, 5)
        # int32 tokens, lists, numpy arrays; floats refused
        for tok in (torch.tensor([1, 2, 3], dtype=torch.int32), [1, 2, 3], np.array([1, 2, 3])):
            with torch.no_grad():
                np.testing.assert_array_equal(emb(tok).numpy(), rows[[1, 2, 3]])
        self.assertEqual(tuple(emb([]).shape), (0, WIDTH))
        with self.assertRaisesRegex(TypeError, "integers"):
            emb(torch.tensor([1.0, 2.0]))
        with self.assertRaisesRegex(ValueError, "negative"):
            emb(torch.tensor([1, -2]))
        with self.assertRaises(embps.Error) as cm:
            # in rank 0's shard: one in another rank's shard is rank 0's DEADLINE_EXCEEDED
            # after --batch-deadline-ms (the client reports the first rank's error)
            emb(torch.tensor([ROWS, 1]))
        self.assertEqual(cm.exception.code.name, "INVALID_ARGUMENT")
        # the output stays float32 when the model is made float64; it follows module.to()
        emb.double()
        self.assertEqual(emb(torch.tensor([1, 2])).dtype, torch.float32)
        self.assertEqual(list(emb.state_dict()), [])
        if torch.cuda.is_available():
            emb.to("cuda")
            out = emb(torch.tensor([1, 2], device="cuda"))
            self.assertEqual(out.device.type, "cuda")
            out.sum().backward()
            emb_cuda = et.RemoteEmbedding(self.client, t, device="cuda", pooling="sum")
            self.assertEqual(emb_cuda(torch.tensor([[1, 2]])).device.type, "cuda")

    def test_prefetch_contract(self):
        t = self.table()
        emb = et.RemoteEmbedding(self.client, t)
        a, b = torch.tensor([[1, 2], [3, 3]]), torch.tensor([4, 5, 6, 7])
        rows_a = self.client.lookup(t, a.reshape(-1))
        rows_b = self.client.lookup(t, b)
        # equal tokens hit (whatever their shape), others miss and are looked up afresh
        emb.prefetch(a.reshape(-1))
        np.testing.assert_array_equal(emb(a).detach().reshape(-1, WIDTH).numpy(), rows_a)
        emb.prefetch(a)
        np.testing.assert_array_equal(emb(b).detach().numpy(), rows_b)
        self.assertEqual((emb.prefetch_hits, emb.prefetch_misses), (1, 1))
        # two queued: using the second drops the first
        emb.prefetch(a)
        emb.prefetch(b)
        emb(b)
        emb(a)
        self.assertEqual((emb.prefetch_hits, emb.prefetch_misses), (2, 1))
        # a prefetch sees the pushes started before it, none after
        out = emb(a)
        emb.prefetch(a)  # before out's backward: one step stale
        out.sum().backward()  # pushes to rows 1..3
        np.testing.assert_array_equal(emb(a).detach().reshape(-1, WIDTH).numpy(), rows_a)
        pushed = self.client.lookup(t, a.reshape(-1))
        self.assertFalse(np.array_equal(pushed, rows_a), "a's rows were pushed to")
        emb.prefetch(a)  # after it: fresh
        np.testing.assert_array_equal(emb(a).detach().reshape(-1, WIDTH).numpy(), pushed)
        self.assertEqual((emb.prefetch_hits, emb.prefetch_misses), (4, 1))
        # a prefetch of nothing
        emb.prefetch(torch.tensor([], dtype=torch.long))
        self.assertEqual(tuple(emb(torch.tensor([], dtype=torch.long)).shape), (0, WIDTH))

    def test_async_errors_and_flush(self):
        t = self.table()
        failing = FailingPushes(self.client)
        emb = et.RemoteEmbedding(failing, t, mode="async", max_pending=2)
        for _ in range(2):
            emb(torch.tensor([1, 2])).sum().backward()
        self.assertEqual(emb.pending, 2)
        failing.futures[0].set_exception(embps.Error(gl.SC.UNAVAILABLE, "rank 1 went away"))
        with self.assertRaisesRegex(embps.Error, "rank 1 went away"):
            emb(torch.tensor([1, 2])).sum().backward()  # awaits the first push
        self.assertEqual(emb.pending, 2)
        failing.futures[2].set_exception(embps.Error(gl.SC.INTERNAL, "third"))
        for f in failing.futures[1:2]:
            f.set_result(embps.PushResult(False, False, True, 0.0, 0, 0))
        with self.assertRaisesRegex(embps.Error, "third"):
            emb.flush()
        self.assertEqual(emb.pending, 0)
        emb.flush()
        # max_pending=0: every backward awaits its own push (here, the real servers')
        emb0 = et.RemoteEmbedding(self.client, t, mode="async", max_pending=0)
        emb0(torch.tensor([1, 2])).sum().backward()
        self.assertEqual(emb0.pending, 0)
        self.assertTrue(emb0.last_push.ordered)

    def test_constructor_errors(self):
        t = self.table()
        for kw, msg in [(dict(mode="later"), "neither sync nor async"),
                        (dict(pooling="max"), "pooling 'max'"),
                        (dict(max_pending=-1), "max_pending")]:
            with self.assertRaisesRegex(ValueError, msg):
                et.RemoteEmbedding(self.client, t, **kw)
        with self.assertRaises(embps.Error) as cm:
            et.RemoteEmbedding(self.client, "no-such-table")
        self.assertEqual(cm.exception.code.name, "NOT_FOUND")
        r = repr(et.RemoteEmbedding(self.client, t, mode="async", pooling="mean"))
        self.assertIn("table='%s'" % t, r)
        self.assertIn("pooling='mean'", r)


class FailingPushes:
    """A client whose push_async returns futures the test settles (the rest is the real one)."""

    def __init__(self, client):
        self.client = client
        self.futures = []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def push_async(self, table, tokens, grads, mode="sync"):
        f = concurrent.futures.Future()
        self.futures.append(f)
        return f


class OneRank(GroupCase, unittest.TestCase):
    N = 1


class TwoRanks(GroupCase, unittest.TestCase):
    N = 2


class ImportTest(unittest.TestCase):
    def test_embps_does_not_import_torch(self):
        code = ("import sys, embps; assert 'torch' not in sys.modules, 'torch imported'; "
                "import embps.torch; assert 'torch' in sys.modules")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(__import__("os").environ, PYTHONPATH=PYTHON_DIR), timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
