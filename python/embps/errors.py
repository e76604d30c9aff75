"""The exceptions of the embps package and the shape messages it shares with the C client.

Every failure that comes from a server (or from gRPC on the way) is an `Error` carrying the
gRPC status code and the server's message. A batch or table that does not fit the group's
shape is refused before anything is sent with a `ShapeError`, which is both an `Error`
(code INVALID_ARGUMENT) and a `ValueError`. Its text is word for word what the C client and
the servers say (common/shape.c; DESIGN.md's error table), since users search for it, and it
ends with the remedy, which `remedy` also holds on its own.
"""
import grpc


class Error(Exception):
    """A failed embps call.

    code: the grpc.StatusCode. message: the whole text, which starts with "rank R (HOST:PORT): "
    in a group of more than one rank when one rank failed, as the C client's does (str(e) is the
    message). details: the server's message alone. rank, address: the rank that failed and its
    address, or None when the failure is not one rank's."""

    def __init__(self, code, message, *, details=None, rank=None, address=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = message if details is None else details
        self.rank = rank
        self.address = address

    def __str__(self):
        return self.message

    def __repr__(self):
        return "%s(%s, %r)" % (type(self).__name__, self.code, self.message)


class ShapeError(Error, ValueError):
    """A batch or table that does not shard over the group, refused before anything is sent.

    remedy: what to do about it (the end of the message), plus the library's own way out where
    it has one (padding=True for batches)."""

    def __init__(self, message, remedy=None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.remedy = remedy


def padded_tokens(tokens_per_batch, group_size):
    """The smallest multiple of group_size that is >= tokens_per_batch."""
    return -(-tokens_per_batch // group_size) * group_size


def tokens_per_batch_error(tokens_per_batch, group_size):
    """DESIGN.md's "T % N != 0" error, as common/shape.c words it."""
    padded = padded_tokens(tokens_per_batch, group_size)
    remedy = ("pad the batch to %d tokens (a multiple of %d) with padding token 0"
              % (padded, group_size))
    return ShapeError("tokens_per_batch=%d does not shard evenly over the %d-rank communicator: %s"
                      % (tokens_per_batch, group_size, remedy),
                      remedy + ", or create the embps.Client with padding=True")


def batch_size_error(batch_size, group_size):
    """docs/design.md's sample split of a feature batch ("Feature batches"), as the servers word
    it: B samples that do not split over the group."""
    padded = padded_tokens(batch_size, group_size)
    remedy = ("pad the batch to %d samples (a multiple of %d) with empty bags"
              % (padded, group_size))
    return ShapeError("batch_size=%d does not shard evenly over the %d-rank communicator: %s"
                      % (batch_size, group_size, remedy),
                      remedy + ", or create the embps.Client with padding=True")


def emb_width_error(emb_width, group_size):
    """DESIGN.md's "D % N != 0" error, as common/shape.c words it."""
    remedy = "choose an emb_width that is a multiple of %d, or change the mesh" % group_size
    return ShapeError("emb_width=%d does not shard evenly over the %d-rank communicator: %s"
                      % (emb_width, group_size, remedy), remedy)


def batch_too_large_error(tokens_per_batch):
    """client/group.c's refusal of a batch whose size does not fit the wire's uint32."""
    return ShapeError("tokens_per_batch=%d is over 4294967295: split the batch" % tokens_per_batch,
                      "split the batch")
