"""The Client's calls about tables and the servers rather than batches: create, drop and list
tables, statistics, health and checkpoints, and the client's memory of each table's dtype and
emb_width, which pushes use to convert gradients before sending them.

TableAdmin is mixed into embps.Client (client.py), whose public methods these are: it calls
the host's _unary (one admin call on a list of ranks, concurrently) and reads its _tables,
_addresses and group_size. Table calls go to rank 0, which carries them to the whole group;
stats and health ask every rank.
"""
import grpc

from ._names import DTYPE_NAMES, F32, OPTIMIZER_NAMES, STATUS_NAMES, pb
from .errors import Error, emb_width_error
from .values import CheckpointInfo, Health, RankStats, TableSpec


class TableAdmin:
    """The admin and table methods of embps.Client."""

    # -- the tables this client knows --

    def _remember(self, specs):
        for s in specs:
            self._tables[s.name] = (s.dtype or F32, s.emb_width)

    def _table_info(self, table, timeout=None):
        """(dtype, emb_width) of table if known or listed now; None if the group lacks it.
        timeout: the ListTables call's, when one is made (None: the client's)."""
        info = self._tables.get(table)
        if info is None:
            self._remember(self._unary("ListTables", pb.ListTablesRequest(), [0],
                                       timeout)[0].tables)
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
        if dtype not in DTYPE_NAMES:
            raise ValueError("create table: dtype %r is neither f32 nor bf16" % (dtype,))
        if optimizer not in OPTIMIZER_NAMES:
            raise ValueError("create table: unknown optimizer %r (sgd, adagrad, rowwise_adagrad, "
                             "adam)" % (optimizer,))
        if emb_width % self.group_size:
            raise emb_width_error(emb_width, self.group_size)
        opt = pb.OptimizerConfig(kind=OPTIMIZER_NAMES[optimizer], lr=lr, eps=eps,
                                 half_life=half_life, initial_accumulator=initial_accumulator,
                                 weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        spec = pb.TableSpec(name=name, rows=rows, emb_width=emb_width,
                            dtype=DTYPE_NAMES[dtype], seed=seed, optimizer=opt,
                            init_scale=init_scale)
        reply = self._unary("CreateTable", pb.CreateTableRequest(spec=spec), [0])[0]
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
        reply = self._unary("DropTable", pb.DropTableRequest(name=name), [0])[0]
        self._tables.pop(name, None)
        return reply.bytes

    def tables(self):
        """The group's tables (asked of rank 0), as TableSpecs."""
        specs = self._unary("ListTables", pb.ListTablesRequest(), [0])[0].tables
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
        n = self.group_size
        replies = self._unary("GetStats", pb.GetStatsRequest(), list(range(n)))
        return [RankStats.from_pb(m, self._addresses[r]) for r, m in enumerate(replies)]

    def health(self, service=""):
        """Every rank's grpc.health.v1 status for service ("": the whole server) as a Health,
        true when all serve. Raises embps.Error when a rank cannot be asked."""
        n = self.group_size
        replies = self._unary("Health", pb.HealthCheckRequest(service=service), list(range(n)))
        statuses = tuple(STATUS_NAMES.get(m.status, "UNKNOWN") for m in replies)
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
        m = self._unary("Checkpoint", pb.CheckpointRequest(table=table or ""), [0])[0]
        return CheckpointInfo(round=m.round, bytes=m.bytes, path=m.path, scope=table or "")

    def checkpoints(self):
        """The complete checkpoints in the group's --checkpoint-dir, oldest first."""
        m = self._unary("ListCheckpoints", pb.ListCheckpointsRequest(), [0])[0]
        return [CheckpointInfo(round=c.round, bytes=c.bytes, path=c.path, scope=c.scope,
                               time_unix_ms=c.time_unix_ms, group_size=c.group_size,
                               base_round=c.base_round, tables=tuple(c.tables))
                for c in m.checkpoints]
