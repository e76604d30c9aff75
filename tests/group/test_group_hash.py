"""Hash-keyed tables served by real groups (issue 31; docs/design.md, "Hash-keyed tables").

- Bitwise on every group size: tables of each eviction policy (lru with admit_after 2, lfu, ttl)
  and optimizer state (rowwise Adagrad with weight decay, Adam, Adagrad) fed one fixed sequence
  of Zipf-like 64-bit ids over a key range 10x the capacity (lookups and sync pushes, padding,
  one step with a NaN gradient) give bitwise the same lookups, push replies, final rows of every
  key and TableStats counters on 1, 2, 4 and 8 ranks (every rank reporting the same counters).
- A hash table whose capacity exceeds every key used, with admit_after 1, is a dense table: the
  same seed and small keys give bitwise the same lookups and rows as a dense table of those rows.
- Checkpoint, kill -9 of the whole group, restore onto another group size: the table continues
  bitwise like a group that never stopped, admission counts included.
- Incremental checkpoints: tables of 1024 slots with eviction (and expiry) take a full checkpoint,
  then incremental ones whose INDEX files are deltas (much smaller than the full index); a kill
  -9 and a restore from the last one (through the chain) onto 4 and 1 ranks continues bitwise
  like a group that never stopped, and so does a group restored from the full one into its own
  directory that chains an incremental checkpoint onto it.

The width is 256: whole 32-column row-statistics blocks on 1, 2, 4 and 8 ranks (the whole file
runs in a few seconds on 2 cores, 8 ranks included)."""
import os
import shutil
import struct
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

WIDTH, CAPACITY, KEYS, STEPS = 256, 64, 640, 30
SIZES = (1, 2, 4, 8)
TABLES = {  # name: (spec's hash-keyed settings, optimizer and its settings)
    "h_lru": (dict(admit_after=2), ("rowwise_adagrad", dict(lr=0.05, half_life=5.0, wd=0.001))),
    "h_lfu": (dict(eviction=pb.EVICTION_LFU, half_life_steps=4), ("adam", dict(lr=0.01))),
    "h_ttl": (dict(eviction=pb.EVICTION_TTL, ttl_steps=6),
              ("adagrad", dict(lr=0.05, init_acc=0.1))),
}
STAT_FIELDS = ("capacity", "keys", "keys_admitted", "keys_evicted", "keys_expired", "keys_refused",
               "gradients_dropped", "steps_applied", "steps_skipped")


def key_space(seed=31):
    """KEYS distinct nonzero 64-bit ids (as int64, negatives included)."""
    rng = np.random.default_rng(seed)
    ids = set()
    while len(ids) < KEYS:
        v = int(rng.integers(1, 1 << 63, dtype=np.int64)) * (1 if len(ids) % 2 else -1)
        ids.add(v)
    return np.array(sorted(ids), dtype=np.int64)


def script(seed=5):
    """The fixed sequence: (op, tokens[, grads]) with Zipf-like ranks over the key space."""
    keys = key_space()
    rng = np.random.default_rng(seed)
    ops = []
    for step in range(STEPS):
        ranks = np.minimum(rng.zipf(1.2, size=32), KEYS) - 1
        tokens = keys[ranks]
        tokens[step % 32] = 0  # padding
        grads = rng.normal(size=(32, WIDTH)).astype(np.float32)
        if step == 11:
            grads[5, 7] = np.nan  # the gate: this step changes nothing
        ops.append(("push", tokens, grads))
        if step % 3 == 2:
            ops.append(("lookup", keys[np.minimum(rng.zipf(1.2, size=16), KEYS) - 1]))
    return keys, ops


def create_hash(client, name, settings, opt, capacity=CAPACITY, seed=7):
    spec = gl.table_spec(name, 0, WIDTH, opt[0], seed=seed, **opt[1])
    spec.capacity = capacity
    for k, v in settings.items():
        setattr(spec, k, v)
    client.stubs[0].CreateTable(pb.CreateTableRequest(spec=spec), timeout=gl.CALL_TIMEOUT)


def stats(client, name):
    """The table's counters, which every rank must report alike."""
    got = []
    for stub in client.stubs:
        for t in stub.GetStats(pb.GetStatsRequest(), timeout=gl.CALL_TIMEOUT).tables:
            if t.name == name:
                got.append(tuple(getattr(t, f) for f in STAT_FIELDS))
    assert len(got) == len(client.stubs) and len(set(got)) == 1, got
    return got[0]


def final_rows(client, keys):
    """Every key's row (and padding's), in batches every group size splits evenly."""
    pad = np.zeros((-(len(keys) + 1)) % max(SIZES), dtype=np.int64)
    toks = np.concatenate([[0], keys, pad])
    return client.lookup_bytes_of(toks)


def run_ops(client, name, ops):
    """Runs ops on table name; returns what every op answered, as bytes."""
    out = []
    for op in ops:
        if op[0] == "lookup":
            out.append(client.lookup_bytes(name, op[1]))
        else:
            replies = client.push(name, op[1], op[2])
            r = replies[0]
            out.append(struct.pack("<dQ??", r.grad_norm, r.num_unique, r.applied, r.skipped))
    return out


class Client(gl.RawClient):
    table = None

    def lookup_bytes_of(self, toks):
        return b"".join(self.lookup_bytes(self.table, toks[i:i + 64])
                        for i in range(0, len(toks), 64))


def everything(client, keys, ops):
    """Runs the script on every table; returns {table: (answers, final rows, stats)}."""
    out = {}
    for name, (settings, opt) in TABLES.items():
        create_hash(client, name, settings, opt)
        answers = run_ops(client, name, ops)
        client.table = name
        out[name] = (answers, final_rows(client, keys), stats(client, name))
    return out


class BitwiseTest(unittest.TestCase):
    def test_every_group_size_gives_the_same_table(self):
        keys, ops = script()
        results = {}
        for n in SIZES:
            group = gl.Group(n)
            client = Client(group.addresses)
            try:
                results[n] = everything(client, keys, ops)
            finally:
                client.close()
                group.close_checked(self)
        for name in TABLES:
            answers, rows, st = results[1][name]
            s = dict(zip(STAT_FIELDS, st))
            # the sequence must exercise what it claims to
            self.assertEqual(s["capacity"], CAPACITY)
            self.assertEqual(s["keys"], CAPACITY, (name, s))
            self.assertGreater(s["keys_evicted"] + s["keys_expired"], 0, (name, s))
            self.assertEqual(s["steps_skipped"], 1, (name, s))
            if name == "h_lru":
                self.assertGreater(s["gradients_dropped"], 0, (name, s))
            for n in SIZES[1:]:
                with self.subTest(table=name, ranks=n):
                    got = results[n][name]
                    self.assertEqual(got[2], st, "TableStats differ")
                    for i, (a, b) in enumerate(zip(got[0], answers)):
                        self.assertEqual(a, b, "answer %d differs" % i)
                    self.assertEqual(got[1], rows, "final rows differ")


class DenseEquivalenceTest(unittest.TestCase):
    def test_small_keys_read_and_train_as_a_dense_table(self):
        rng = np.random.default_rng(3)
        rows = 200
        group = gl.Group(2)
        client = gl.RawClient(group.addresses)
        try:
            for opt in (("rowwise_adagrad", dict(lr=0.05, wd=0.01)), ("adam", dict(lr=0.01))):
                dense, hashed = "d_" + opt[0], "h_" + opt[0]
                client.stubs[0].CreateTable(pb.CreateTableRequest(
                    spec=gl.table_spec(dense, rows, WIDTH, opt[0], **opt[1])),
                    timeout=gl.CALL_TIMEOUT)
                create_hash(client, hashed, {}, opt, capacity=256)
                for step in range(12):
                    toks = rng.integers(0, rows, size=24)
                    grads = rng.normal(size=(24, WIDTH)).astype(np.float32)
                    if step == 4:
                        grads[2, 3] = np.inf
                    a = client.push(dense, toks, grads)[0]
                    b = client.push(hashed, toks, grads)[0]
                    self.assertEqual((a.grad_norm, a.num_unique, a.skipped),
                                     (b.grad_norm, b.num_unique, b.skipped))
                    look = rng.integers(0, rows, size=16)
                    self.assertEqual(client.lookup_bytes(dense, look),
                                     client.lookup_bytes(hashed, look), (opt[0], step))
                every = np.arange(rows, dtype=np.int64)
                self.assertEqual(client.lookup_bytes(dense, every),
                                 client.lookup_bytes(hashed, every), opt[0])
        finally:
            client.close()
            group.close_checked(self)


class RestoreTest(gl.TmpDirs, unittest.TestCase):
    tmp_prefix = "embps-hash-"

    def test_kill_nine_and_restore_onto_another_size(self):
        keys, ops = script(seed=9)
        half = len(ops) // 2
        # the reference: a group that never stopped
        group = gl.Group(2)
        client = Client(group.addresses)
        try:
            ref = everything(client, keys, ops)
        finally:
            client.close()
            group.close_checked(self)
        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d)
        client = Client(group.addresses)
        try:
            for name, (settings, opt) in TABLES.items():
                create_hash(client, name, settings, opt)
                run_ops(client, name, ops[:half])
            resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=gl.CALL_TIMEOUT)
            for name in TABLES:
                self.assertTrue(os.path.isfile(os.path.join(resp.path, "INDEX-" + name)))
        finally:
            client.close()
            for p in group.procs:  # kill -9 of the whole group
                p.kill()
            group.close()
        for m in (4, 1):
            with self.subTest(restored_on=m):
                group = gl.Group(m, "--restore", resp.path)
                client = Client(group.addresses)
                try:
                    for name in TABLES:
                        answers = run_ops(client, name, ops[half:])
                        client.table = name
                        self.assertEqual(answers, ref[name][0][half:], name)
                        self.assertEqual(final_rows(client, keys), ref[name][1], name)
                        # the index's counters survive (steps_applied and _skipped count
                        # this process's pushes)
                        self.assertEqual(stats(client, name)[:7], ref[name][2][:7], name)
                finally:
                    client.close()
                    group.close_checked(self)

    def test_corrupt_index_file_stops_the_restore(self):
        d = self.tmpdir()
        group = gl.Group(1, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            create_hash(client, "h", {}, ("sgd", {}))
            client.push("h", [5, 1 << 40], np.ones((2, WIDTH), np.float32))
            resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=gl.CALL_TIMEOUT)
        finally:
            client.close()
            group.close_checked(self)
        path = os.path.join(resp.path, "INDEX-h")
        with open(path, "r+b") as f:
            f.seek(40)
            b = f.read(1)
            f.seek(40)
            f.write(bytes([b[0] ^ 0xFF]))
        code, out = gl.start_expecting_failure(["--listen", "127.0.0.1:0", "--restore",
                                                resp.path])
        self.assertNotEqual(code, 0)
        self.assertIn(path, out)


CAP_INC, KEYS_INC = 1024, 10240
TABLES_INC = {  # name: (spec's hash-keyed settings, optimizer and its settings)
    "i_lru": (dict(admit_after=2), ("rowwise_adagrad", dict(lr=0.05))),
    "i_lfu": (dict(eviction=pb.EVICTION_LFU, half_life_steps=4), ("adam", dict(lr=0.01))),
    "i_ttl": (dict(eviction=pb.EVICTION_TTL, ttl_steps=6),
              ("adagrad", dict(lr=0.05, init_acc=0.1))),
}


def script_inc(seed=17):
    """Four phases of ops: A fills the tables (8 pushes of 512 keys, each key in two of them,
    so admit_after 2 admits it, 1792 keys for 1024 slots: evictions); B and C (4 pushes each)
    and D (8) push 32 Zipf-like keys of 10240 (new ones evict; in C, A's keys expire from the
    ttl table), with lookups between."""
    rng = np.random.default_rng(seed)
    keys = np.array(sorted({int(v) for v in rng.integers(1, 1 << 63, size=2 * KEYS_INC,
                                                          dtype=np.int64)})[:KEYS_INC],
                    dtype=np.int64)
    rng.shuffle(keys)
    phases = [[("push", keys[256 * i:256 * i + 512],
                rng.normal(size=(512, WIDTH)).astype(np.float32)) for i in range(8)]]
    for steps in (4, 4, 8):
        ops = []
        for step in range(steps):
            tokens = keys[np.minimum(rng.zipf(1.1, size=32), KEYS_INC) - 1]
            tokens[step % 32] = 0
            ops.append(("push", tokens, rng.normal(size=(32, WIDTH)).astype(np.float32)))
            ops.append(("lookup", keys[np.minimum(rng.zipf(1.1, size=16), KEYS_INC) - 1]))
        phases.append(ops)
    return keys, phases


def rows_of_all(client, name, keys):
    """Every key's row, in batches of 512 (every group size splits them evenly)."""
    toks = np.concatenate([[0], keys, np.zeros((-(len(keys) + 1)) % 512, dtype=np.int64)])
    return b"".join(client.lookup_bytes(name, toks[i:i + 512]) for i in range(0, len(toks), 512))


def index_file(path, name):
    with open(os.path.join(path, "INDEX-" + name), "rb") as f:
        return f.read()


class IncrementalIndexTest(gl.TmpDirs, unittest.TestCase):
    tmp_prefix = "embps-hash-inc-"

    def check_continues(self, client, ref, keys, ops_from):
        """The restored group answers the ops of phases ops_from.. as the reference did (bytes
        compared with ==: assertEqual would diff megabytes when they differ)."""
        for name in TABLES_INC:
            answers = []
            for ops in ops_from:
                answers += run_ops(client, name, ops)
            want = ref[name][0][-len(answers):]
            differ = [i for i, (a, b) in enumerate(zip(answers, want)) if a != b]
            self.assertFalse(differ, "%s: answers %s differ" % (name, differ[:10]))
            self.assertTrue(rows_of_all(client, name, keys) == ref[name][1],
                            "%s: final rows differ" % name)
            self.assertEqual(stats(client, name)[:7], ref[name][2][:7], name)

    def test_deltas_restore_through_the_chain_onto_other_sizes(self):
        keys, phases = script_inc()
        ref = {}
        group = gl.Group(2)  # the reference: a group that never stopped
        client = Client(group.addresses)
        try:
            for name, (settings, opt) in TABLES_INC.items():
                create_hash(client, name, settings, opt, capacity=CAP_INC)
                answers = [a for ops in phases for a in run_ops(client, name, ops)]
                ref[name] = (answers, rows_of_all(client, name, keys), stats(client, name))
        finally:
            client.close()
            group.close_checked(self)
        s = {n: dict(zip(STAT_FIELDS, ref[n][2])) for n in TABLES_INC}
        for n in TABLES_INC:  # the sequence exercises what it claims to
            self.assertGreater(s[n]["keys_evicted"], 0, (n, s[n]))
        self.assertGreater(s["i_ttl"]["keys_expired"], 0, s["i_ttl"])
        self.assertGreater(s["i_lru"]["gradients_dropped"], 0, s["i_lru"])

        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d, "--checkpoint-full-every", "100",
                         "--checkpoint-keep", "10")
        client = Client(group.addresses)
        paths = []
        try:
            for name, (settings, opt) in TABLES_INC.items():
                create_hash(client, name, settings, opt, capacity=CAP_INC)
            for ops in phases[:3]:  # A, full checkpoint, B, incremental, C, incremental
                for name in TABLES_INC:
                    run_ops(client, name, ops)
                resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(),
                                                  timeout=gl.CALL_TIMEOUT)
                paths.append(resp.path)
            expired = dict(zip(STAT_FIELDS, stats(client, "i_ttl")))["keys_expired"]
        finally:
            client.close()
            for p in group.procs:  # kill -9 of the whole group
                p.kill()
            group.close()
        self.assertGreater(expired, 500)  # the last delta carries expiries
        for name in TABLES_INC:
            full = index_file(paths[0], name)
            self.assertEqual(full[:8], b"EMBPSHIX", name)
            for path in paths[1:]:
                delta = index_file(path, name)
                self.assertEqual(delta[:8], b"EMBPSHXD", (name, path))
                # a few dozen keys changed of 1024 (20 bytes each; an expiry 4, as in the full
                # index), and a few blocks of the sketch
                self.assertLess(len(delta) * 4, len(full), (name, path, len(delta), len(full)))
        for m in (4, 1):
            with self.subTest(restored_on=m):
                group = gl.Group(m, "--restore", paths[-1])
                client = Client(group.addresses)
                try:
                    self.check_continues(client, ref, keys, phases[3:])
                finally:
                    client.close()
                    group.close_checked(self)

        # A group restored from the full checkpoint into its own directory chains an incremental
        # checkpoint onto it (its index captured as decoded); restored from that, a group goes on.
        d2 = self.tmpdir()
        shutil.copytree(paths[0], os.path.join(d2, os.path.basename(paths[0])))
        group = gl.Group(4, "--checkpoint-dir", d2, "--restore", "auto",
                         "--checkpoint-full-every", "100")
        client = Client(group.addresses)
        try:
            for name in TABLES_INC:
                run_ops(client, name, phases[1])
            resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(), timeout=gl.CALL_TIMEOUT)
        finally:
            client.close()
            for p in group.procs:
                p.kill()
            group.close()
        for name in TABLES_INC:
            self.assertEqual(index_file(resp.path, name)[:8], b"EMBPSHXD", name)
        group = gl.Group(1, "--restore", resp.path)
        client = Client(group.addresses)
        try:
            self.check_continues(client, ref, keys, phases[2:])
        finally:
            client.close()
            group.close_checked(self)


if __name__ == "__main__":
    unittest.main(verbosity=2)
