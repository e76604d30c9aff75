/* A fake <nccl.h> for the simulated NCCL library (tests/unit/engine_sim/sim_nccl_lib.c): the
 * subset of NCCL's C API that server/comm/comm_nccl.c calls, with the real types, enum values,
 * struct layout and prototypes (NCCL 2.28's nccl.h), so that comm_nccl.c compiles unchanged
 * against it. The sim targets put this directory first on the include path and never see the
 * toolkit's headers.
 *
 * Only what the simulation implements is declared: a call comm_nccl.c starts making that is not
 * here fails to compile, which is the signal to simulate it too. */
#ifndef EMBPS_SIM_NCCL_H
#define EMBPS_SIM_NCCL_H

#include <cuda_runtime_api.h>
#include <limits.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_SUFFIX ""
#define NCCL_VERSION_CODE 22809
#define NCCL_VERSION(X, Y, Z)                                                                      \
  (((X) <= 2 && (Y) <= 8) ? (X)*1000 + (Y)*100 + (Z) : (X)*10000 + (Y)*100 + (Z))

typedef struct ncclComm *ncclComm_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL

typedef struct ncclConfig_v22800 {
  /* attributes that users should never touch. */
  size_t size;
  unsigned int magic;
  unsigned int version;
  /* attributes that users are able to customize. */
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
  const char *commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER                                                                    \
  {                                                                                                \
    sizeof(ncclConfig_t),                                 /* size */                               \
        0xcafebeef,                                       /* magic */                              \
        NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), /* version */                            \
        NCCL_CONFIG_UNDEF_INT,                            /* blocking */                           \
        NCCL_CONFIG_UNDEF_INT,                            /* cgaClusterSize */                     \
        NCCL_CONFIG_UNDEF_INT,                            /* minCTAs */                            \
        NCCL_CONFIG_UNDEF_INT,                            /* maxCTAs */                            \
        NCCL_CONFIG_UNDEF_PTR,                            /* netName */                            \
        NCCL_CONFIG_UNDEF_INT,                            /* splitShare */                         \
        NCCL_CONFIG_UNDEF_INT,                            /* trafficClass */                       \
        NCCL_CONFIG_UNDEF_PTR,                            /* commName */                           \
        NCCL_CONFIG_UNDEF_INT,                            /* collnetEnable */                      \
        NCCL_CONFIG_UNDEF_INT,                            /* CTAPolicy */                          \
        NCCL_CONFIG_UNDEF_INT,                            /* shrinkShare */                        \
        NCCL_CONFIG_UNDEF_INT,                            /* nvlsCTAs */                           \
        NCCL_CONFIG_UNDEF_INT,                            /* nChannelsPerNetPeer */                \
        NCCL_CONFIG_UNDEF_INT,                            /* nvlinkCentricSched */                 \
  }

typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;
typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  ncclNumOps = 5,
  ncclMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(ncclRedOp_dummy_t))
} ncclRedOp_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

/* ---- communicators --------------------------------------------------------------------------- */
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);

/* ---- collectives and point-to-point ---------------------------------------------------------- */
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif
