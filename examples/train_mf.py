#!/usr/bin/python3
"""A small recommender trained end to end against a running embps group.

Synthetic implicit feedback: every user and item has hidden factors (seeded); a user likes an
item when the factors' dot product plus an item popularity term plus a little noise is positive.
The model is matrix factorisation: a user table and an item table on embps (row-wise Adagrad,
applied by the servers) and a small dense part in local PyTorch (a scale and a bias on the dot
product, trained by torch.optim.Adam). Every epoch prints a progress line; the end prints the
held-out AUC (pairs never trained on, users and items seen).

    /usr/bin/python3 examples/train_mf.py --servers 127.0.0.1:7070,127.0.0.1:7071
    /usr/bin/python3 examples/train_mf.py --quick     # seconds (tests/python/test_example.py)

Each run creates two tables named PREFIX_users and PREFIX_items (a fresh PREFIX per run unless
--table-prefix is given); the group keeps them until it is restarted. Runs from a checkout without
installing the package (it falls back to ../python). Needs numpy and torch (Debian: python3-numpy,
python3-torch); no sklearn: the AUC is computed here.
"""
import argparse
import os
import secrets
import sys
import time

import numpy as np
import torch

try:
    import embps
except ImportError:  # a checkout: the package is in ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "python"))
    import embps
import embps.torch  # noqa: E402


def synthetic(users, items, per_user, factors, seed):
    """(user ids, item ids, labels) of per_user distinct items for every user. Ids start at 1:
    token 0 is embps's padding row."""
    rng = np.random.default_rng(seed)
    u_f = rng.normal(size=(users + 1, factors))
    i_f = rng.normal(size=(items + 1, factors))
    popularity = rng.normal(scale=0.5, size=items + 1)
    u = np.repeat(np.arange(1, users + 1), per_user)
    i = np.concatenate([rng.choice(np.arange(1, items + 1), per_user, replace=False)
                        for _ in range(users)])
    score = (u_f[u] * i_f[i]).sum(1) / np.sqrt(factors) + popularity[i]
    label = (score + rng.normal(scale=0.3, size=len(u)) > 0).astype(np.float32)
    return u, i, label


def auc(labels, scores):
    """Area under the ROC curve: the Mann-Whitney statistic, ties counted half."""
    labels = np.asarray(labels) > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if not pos or not neg:
        return float("nan")
    _, inverse, counts = np.unique(np.asarray(scores), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based, ties averaged
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


class MF(torch.nn.Module):
    """logit = scale * <user row, item row> + bias: the rows on embps, scale and bias local."""

    def __init__(self, users, items):
        super().__init__()
        self.users, self.items = users, items
        self.head = torch.nn.Linear(1, 1)
        with torch.no_grad():  # start as the plain dot product
            self.head.weight.fill_(1.0)
            self.head.bias.zero_()

    def forward(self, u, i):
        dot = (self.users(u) * self.items(i)).sum(-1, keepdim=True)
        return self.head(dot).squeeze(-1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None,
                   help="every rank's HOST:PORT in rank order (default: EMBPS_SERVERS, else "
                        "127.0.0.1:7070)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (default 6; "
                                                            "5 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smaller data set and fewer epochs")
    p.add_argument("--users", type=int, default=None, help="default 3000 (600 with --quick)")
    p.add_argument("--items", type=int, default=None, help="default 600 (300 with --quick)")
    p.add_argument("--per-user", type=int, default=None,
                   help="interactions per user (default 150; 100 with --quick)")
    p.add_argument("--emb-width", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024, help="samples per step")
    p.add_argument("--lr", type=float, default=0.1, help="the tables' row-wise Adagrad rate")
    p.add_argument("--mode", choices=("sync", "async"), default="async",
                   help="push mode (async: the servers answer once a step is ordered)")
    p.add_argument("--max-pending", type=int, default=1,
                   help="async pushes left unanswered per table (the staleness bound)")
    p.add_argument("--table-prefix", default=None, help="default: train_mf_ and a random tag")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    epochs = a.epochs if a.epochs is not None else (5 if a.quick else 6)
    users = a.users or (600 if a.quick else 3000)
    items = a.items or (300 if a.quick else 600)
    per_user = a.per_user or (100 if a.quick else 150)
    prefix = a.table_prefix or "train_mf_" + secrets.token_hex(3)
    torch.manual_seed(a.seed)

    u, i, y = synthetic(users, items, per_user, factors=8, seed=a.seed)
    rng = np.random.default_rng(a.seed + 1)
    order = rng.permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    print("data: %d users, %d items, %d interactions (%.0f%% positive); %d train, %d held out"
          % (users, items, len(y), 100 * y.mean(), len(train), len(test)))

    with embps.Client(a.servers, timeout=60) as client:
        for name, rows, seed in (("users", users + 1, 1), ("items", items + 1, 2)):
            try:
                client.create_table("%s_%s" % (prefix, name), rows, a.emb_width,
                                    optimizer="rowwise_adagrad", lr=a.lr,
                                    seed=a.seed * 10 + seed)
            except embps.Error as e:
                if e.code.name != "ALREADY_EXISTS":
                    raise
                print("train_mf: the group already has a table %s_%s (tables live until the "
                      "group restarts): pass another --table-prefix" % (prefix, name),
                      file=sys.stderr)
                return 1
        print("group: %d rank(s) at %s; tables %s_users, %s_items (emb_width=%d, row-wise "
              "Adagrad lr=%g, %s pushes)" % (client.group_size, ",".join(client.addresses),
                                             prefix, prefix, a.emb_width, a.lr, a.mode))
        kw = dict(mode=a.mode, max_pending=a.max_pending)
        user_emb = embps.torch.RemoteEmbedding(client, prefix + "_users", **kw)
        item_emb = embps.torch.RemoteEmbedding(client, prefix + "_items", **kw)
        model = MF(user_emb, item_emb)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)  # the dense part only
        loss_fn = torch.nn.BCEWithLogitsLoss()
        ut, it, yt = (torch.from_numpy(x) for x in (u, i, y))

        def evaluate():
            model.eval()
            with torch.no_grad():
                logits = model(ut[test], it[test])
                loss = loss_fn(logits, yt[test]).item()
            model.train()
            return loss, auc(y[test], logits.numpy())

        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            perm = train[rng.permutation(len(train))]
            batches = [perm[k:k + a.batch] for k in range(0, len(perm), a.batch)]
            user_emb.prefetch(ut[batches[0]])
            item_emb.prefetch(it[batches[0]])
            total = 0.0
            for k, b in enumerate(batches):
                loss = loss_fn(model(ut[b], it[b]), yt[b])
                if k + 1 < len(batches):  # the next lookups overlap this step's backward
                    user_emb.prefetch(ut[batches[k + 1]])
                    item_emb.prefetch(it[batches[k + 1]])
                opt.zero_grad()
                loss.backward()  # pushes both tables' gradient rows
                opt.step()
                total += loss.item() * len(b)
            user_emb.flush()
            item_emb.flush()
            dt = time.perf_counter() - t0
            test_loss, test_auc = evaluate()
            print("epoch %d/%d  train loss %.4f  held-out loss %.4f  AUC %.4f  %.1f s "
                  "(%.0f samples/s)" % (epoch, epochs, total / len(train), test_loss, test_auc,
                                        dt, len(train) / dt), flush=True)
        print("final held-out AUC: %.4f" % evaluate()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
