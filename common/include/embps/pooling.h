/* How a feature's bags become rows: part of the client library's public API (installed as
 * <embps/pooling.h>, included by <embps/embps.h>). Values equal embps.v1.Pooling; the server's
 * engine declares the same values (server/engine/engine.h) for its own use. */
#ifndef EMBPS_PUBLIC_POOLING_H
#define EMBPS_PUBLIC_POOLING_H

/** A feature's pooling (docs/design.md, "Feature batches"). A bag is one sample's ids; id 0 is
 * padding inside a bag: it adds nothing to a pooled row and does not count in a mean, and an empty
 * bag (or one of padding only) pools to zeros. */
typedef enum embps_pooling {
  EMBPS_POOLING_NONE = 0,        /* one row per id, in the table's dtype, as embps_lookup() */
  EMBPS_POOLING_SUM = 1,         /* one f32 row per bag: the sum of its rows */
  EMBPS_POOLING_MEAN = 2,        /* the sum divided by the bag's nonzero ids */
  EMBPS_POOLING_WEIGHTED_SUM = 3 /* the sum of each row times its id's weight */
} embps_pooling_t;

#endif
