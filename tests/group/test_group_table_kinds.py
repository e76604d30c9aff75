"""Table kinds on a group of 2 ranks: a spec the server refuses (the kinds mixed, a hash-keyed
option out of its rules, a hash-keyed table past the memory budget) is answered with docs/design.md's status and message and creates nothing
on any rank: ListTables on both ranks stays empty, and the name is free for a dense table after."""
import unittest

import grouplib as gl
from grouplib import pb

SC = gl.SC


def spec(name="t", rows=0, width=8, **kind):
    s = gl.table_spec(name, rows, width)
    for k, v in kind.items():
        setattr(s, k, v)
    return s


# (spec's kind, status, design.md's row prefix, its placeholders)
REFUSALS = [
    (dict(rows=10, capacity=100), SC.INVALID_ARGUMENT, "rows and capacity both given",
     dict(R=10, C=100)),
    (dict(rows=10, admit_after=3), SC.INVALID_ARGUMENT, "a hash-keyed option given to a dense",
     dict(field="admit_after", value=3)),
    (dict(rows=10, eviction=pb.EVICTION_LFU), SC.INVALID_ARGUMENT,
     "a hash-keyed option given to a dense", dict(field="eviction", value=2)),
    (dict(capacity=1 << 32), SC.INVALID_ARGUMENT, "a capacity beyond",
     dict(C=1 << 32, max=(1 << 32) - 1)),
    (dict(capacity=100, eviction=9), SC.INVALID_ARGUMENT, "an eviction policy the server",
     dict(E=9)),
    (dict(capacity=100, admit_after=300), SC.INVALID_ARGUMENT, "an admission threshold",
     dict(K=300)),
    (dict(capacity=100, half_life_steps=4), SC.INVALID_ARGUMENT, "half_life_steps without lfu",
     dict(H=4, policy="lru")),
    (dict(capacity=100, eviction=pb.EVICTION_TTL), SC.INVALID_ARGUMENT,
     "ttl eviction without ttl_steps", dict(S=0, max=1 << 62)),
    (dict(capacity=100, sketch_width=16), SC.INVALID_ARGUMENT, "sketch_width without admission",
     dict(W=16)),
    (dict(capacity=1 << 31), SC.RESOURCE_EXHAUSTED, "a hash-keyed table alone past",
     dict(t="t")),
]


class TableKindsTest(unittest.TestCase):
    def test_refused_specs_create_nothing_on_any_rank(self):
        group = gl.Group(2, "--max-memory-bytes", str(1 << 28))
        client = gl.RawClient(group.addresses)
        try:
            for kind, code, row, values in REFUSALS:
                with self.subTest(kind=kind):
                    req = pb.CreateTableRequest(spec=spec(**kind))
                    gl.expect_rpc_error(
                        self, lambda: client.stubs[0].CreateTable(req, timeout=gl.CALL_TIMEOUT),
                        code, gl.design_message(row, **values))
                    for r in range(2):
                        tables = client.stubs[r].ListTables(pb.ListTablesRequest(),
                                                            timeout=gl.CALL_TIMEOUT).tables
                        self.assertEqual(list(tables), [], "rank %d holds a table" % r)
            client.stubs[0].CreateTable(pb.CreateTableRequest(spec=spec(rows=10)),
                                        timeout=gl.CALL_TIMEOUT)
            # a valid hash-keyed table is served (on the cpu backend)
            client.stubs[0].CreateTable(pb.CreateTableRequest(
                spec=spec("h", capacity=1000, admit_after=2, eviction=pb.EVICTION_LFU,
                          half_life_steps=100)), timeout=gl.CALL_TIMEOUT)
            for r in range(2):
                tables = client.stubs[r].ListTables(pb.ListTablesRequest(),
                                                    timeout=gl.CALL_TIMEOUT).tables
                self.assertEqual([(t.name, t.rows, t.capacity) for t in tables],
                                 [("t", 10, 0), ("h", 0, 1000)])
        finally:
            client.close()
            group.close_checked(self)


if __name__ == "__main__":
    unittest.main(verbosity=2)
