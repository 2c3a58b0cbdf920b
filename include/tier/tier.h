/* tier/tier.h — the C ABI of tier: engines, tensors and pending acquires behind opaque handles,
 * with DLPack tensors as the way bytes come in and go out.
 *
 * The C++ API (tier/engine.hpp) is the reference; this header exposes the same engine to C and to
 * any framework that speaks DLPack, from one shared library (libtier.so, CMake target tier::c).
 * It includes no C++ header and no CUDA header; it compiles as C99/C11 and as C++.
 *
 * Errors. Every call that can fail returns a tier_status_t: TIER_OK (0) or one of the
 * TIER_ERROR_* codes, which mirror tier::StatusCode value for value. tier_last_error() gives the
 * message of the last failed call on the calling thread; it names the function, the argument or
 * object that was wrong and, where there is one, the fix. No C++ exception crosses this ABI: an
 * unexpected one becomes TIER_ERROR_INTERNAL (TIER_ERROR_RESOURCE_EXHAUSTED for an allocation
 * failure) with its text in tier_last_error().
 *
 * Versioning. Structs passed in or out start with `size_t struct_size`, which the caller sets to
 * sizeof(the struct as its header declares it), best through the *_INIT macro. A newer library
 * reads an older caller's struct (missing fields take their defaults) and writes only the bytes
 * the caller's struct has; an older library accepts a newer caller's larger struct when the fields
 * it does not know are zero (zero is every new field's default). Functions and enum values are
 * only ever added. TIER_VERSION is the version of this header, tier_version() that of the library.
 *
 * Ownership, in one line each (docs/c_api.md has the details):
 *  - tier_engine_t*: from tier_engine_create, given back with tier_engine_destroy. Tickets and
 *    DLPack tensors keep the engine alive, so destroying the handle first is allowed.
 *  - tier_tensor_t: a value (an id); it stays valid until tier_tensor_unregister. Stale ids are
 *    detected and answered with TIER_ERROR_NOT_FOUND.
 *  - tier_ticket_t*: from tier_tensor_acquire, given back with tier_ticket_destroy.
 *  - DLManagedTensor* given to tier_tensor_register: owned by tier from the call on; its deleter
 *    is called exactly once, before the call returns, whether it succeeds or not.
 *  - DLManagedTensor* from tier_ticket_wait: owned by the caller, who calls its deleter exactly
 *    once; the deleter ends the lease.
 *  - char* from tier_engine_stats_json / tier_engine_config_json: owned by the caller, freed with
 *    tier_string_free.
 *  - tier_comm_t*: from tier_comm_create_callbacks / tier_comm_create_nccl, given back with
 *    tier_comm_destroy.
 *  - tier_optimizer_t*: from tier_optimizer_create, given back with tier_optimizer_destroy.
 *    DLTensors handed to tier_optimizer_* calls stay the caller's (tier reads or writes them
 *    during the call only).
 *
 * Thread safety. Engine functions may be called from any thread, concurrently. A ticket, and a
 * communicator, is used by one thread at a time (any thread). A DLPack tensor's deleter may be
 * called from any thread. tier_last_error() is per thread.
 */
#ifndef TIER_TIER_H_
#define TIER_TIER_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define TIER_API __attribute__((visibility("default")))
#define TIER_CHECK_RESULT __attribute__((warn_unused_result))
#else
#define TIER_API
#define TIER_CHECK_RESULT
#endif

/* ---------------------------------------------------------------------------------------------
 * Version */

#define TIER_VERSION_MAJOR 0
#define TIER_VERSION_MINOR 1
#define TIER_VERSION_PATCH 0
/* major * 10000 + minor * 100 + patch. */
#define TIER_VERSION (TIER_VERSION_MAJOR * 10000 + TIER_VERSION_MINOR * 100 + TIER_VERSION_PATCH)

/* The version of the loaded library, as TIER_VERSION encodes it. */
TIER_API int tier_version(void);
/* "0.1.0". Static storage. */
TIER_API const char* tier_version_string(void);

/* ---------------------------------------------------------------------------------------------
 * Optimizers: chosen by the engine config's "optimizer": {"type": ...}; probe before building one */

/* The optimizer types this library runs, lower case and comma-separated: "adam,adamw,adagrad,lion,lamb".
   Static storage. */
TIER_API const char* tier_optimizer_types(void);
/* 1 when `type` (any case, e.g. "Lamb") is one of them, 0 otherwise (also for NULL). */
TIER_API int tier_optimizer_supported(const char* type);

/* ---------------------------------------------------------------------------------------------
 * Status codes and errors */

typedef enum tier_status {
  TIER_OK = 0,
  TIER_ERROR_INVALID_ARGUMENT = 1,     /* bad input: a NULL handle, a wrong struct_size, a bad value */
  TIER_ERROR_NOT_FOUND = 2,            /* no such tensor (name or handle), file or key */
  TIER_ERROR_ALREADY_EXISTS = 3,       /* a tensor name taken twice */
  TIER_ERROR_OUT_OF_RANGE = 4,         /* an offset or index past the end */
  TIER_ERROR_RESOURCE_EXHAUSTED = 5,   /* a tier's budget (or host memory) cannot hold the request */
  TIER_ERROR_TIMED_OUT = 6,            /* waited longer than allowed */
  TIER_ERROR_CANCELLED = 7,            /* the operation was cancelled (engine shutting down, ...) */
  TIER_ERROR_IO = 8,                   /* a read or write failed */
  TIER_ERROR_NO_SPACE = 9,             /* the file system is full */
  TIER_ERROR_UNSUPPORTED = 10,         /* a capability is missing (device type, kernel, file system) */
  TIER_ERROR_FAILED_PRECONDITION = 11, /* the object is in the wrong state for the call */
  TIER_ERROR_DATA_LOSS = 12,           /* stored data is corrupt or incomplete */
  TIER_ERROR_DEVICE = 13,              /* the accelerator runtime reported an error */
  TIER_ERROR_INTERNAL = 14             /* a bug in tier, or an unexpected exception inside it */
} tier_status_t;

/* Short stable name of a code ("ok", "invalid_argument", ...; "unknown" for other values).
 * Static storage. */
TIER_API const char* tier_status_string(tier_status_t code);

/* The message of the last call on this thread that failed, e.g.
 * "tier_tensor_acquire: resource_exhausted: acquire 'w' (4.0 MiB) on device: larger than the
 * device budget (1.0 MiB); raise tier.budgets.device". "" when no call on this thread has failed.
 * Successful calls leave it alone. The string belongs to tier and stays valid until the next
 * failing tier call on this thread. */
TIER_API const char* tier_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Nouns */

/* Where a copy of a tensor lives, fastest first (tier::Tier). */
typedef enum tier_tier { TIER_TIER_DEVICE = 0, TIER_TIER_HOST = 1, TIER_TIER_NVME = 2 } tier_tier_t;
#define TIER_NUM_TIERS 3

/* How a lease uses the tensor (tier::Access). Several readers at once; a writer is exclusive.
 * TIER_ACCESS_WRITE does not load the old contents (the caller overwrites all of them). */
typedef enum tier_access { TIER_ACCESS_READ = 0, TIER_ACCESS_WRITE = 1, TIER_ACCESS_READ_WRITE = 2 } tier_access_t;

/* What a tensor is to the training step (tier::Role). */
typedef enum tier_role {
  TIER_ROLE_PARAM = 0,
  TIER_ROLE_GRAD = 1,
  TIER_ROLE_MASTER = 2,
  TIER_ROLE_EXP_AVG = 3,
  TIER_ROLE_EXP_AVG_SQ = 4,
  TIER_ROLE_USER = 5,
  TIER_ROLE_ACTIVATION = 6
} tier_role_t;

/* The state of one tensor's copy on one tier. */
typedef enum tier_copy_state {
  TIER_COPY_ABSENT = 0,
  TIER_COPY_LOADING = 1,
  TIER_COPY_VALID_CLEAN = 2,  /* valid, and the home copy holds the same bytes */
  TIER_COPY_VALID_DIRTY = 3,  /* valid and newer than the home copy */
  TIER_COPY_WRITING_BACK = 4, /* valid, being written one tier toward home */
  TIER_COPY_RESERVED = 5,     /* storage held for a writer */
  TIER_COPY_STALE = 6         /* the home copy's storage, holding older bytes */
} tier_copy_state_t;

/* Tensors registered through this ABI have at most this many dimensions. */
#define TIER_MAX_NDIM 16

/* An engine. Opaque. */
typedef struct tier_engine tier_engine_t;
/* A pending acquire: a future of a DLPack tensor. Opaque. */
typedef struct tier_ticket tier_ticket_t;
/* A registered tensor: a value handle, copied freely. id 0 is never a tensor. */
typedef struct tier_tensor {
  uint64_t id;
} tier_tensor_t;

/* ---------------------------------------------------------------------------------------------
 * Engine */

/* How to build an engine. The configuration is DeepSpeed's JSON plus tier's "tier" section
 * (docs/configuration.md), given as text or as a file; with neither, every key takes its
 * default. */
typedef struct tier_engine_config {
  size_t struct_size;    /* sizeof(tier_engine_config_t); set by TIER_ENGINE_CONFIG_INIT */
  const char* json;      /* the configuration as JSON text, or NULL */
  const char* json_path; /* or a path to a JSON file, or NULL; giving both is an error */
  int32_t strict;        /* nonzero: keys neither tier nor DeepSpeed knows are errors */
  int32_t ignore_env;    /* nonzero: do not apply the TIER_* environment overrides */
} tier_engine_config_t;
#define TIER_ENGINE_CONFIG_INIT \
  { sizeof(tier_engine_config_t), NULL, NULL, 0, 0 }

/* Builds an engine: the device tier (CUDA, or the emulated device where there is no GPU), the
 * pinned host arena and, when any tensor may live on NVMe, the swap space. On success
 * *out_engine is a new engine owned by the caller (tier_engine_destroy); on failure it is set to
 * NULL. Errors: TIER_ERROR_INVALID_ARGUMENT (NULL argument, wrong struct_size, a bad key or value:
 * the message names it), TIER_ERROR_NOT_FOUND (json_path), and whatever building a tier reports
 * (TIER_ERROR_UNSUPPORTED for "cuda" without a GPU, TIER_ERROR_IO for a swap path, ...). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_create(const tier_engine_config_t* config,
                                                            tier_engine_t** out_engine);

/* Gives the handle back. The engine itself (its threads, memory and swap files) goes when the
 * handle and every ticket and DLPack tensor from it are gone; the last of them waits for the
 * engine's transfers to finish. NULL is ignored. The handle must not be used afterwards, and no
 * other call may be using it concurrently. */
TIER_API void tier_engine_destroy(tier_engine_t* engine);

/* Where device-tier tensors live: {kDLCUDA, id} on a GPU, {kDLCPU, 0} on the emulated device
 * (its memory is host memory). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_device(tier_engine_t* engine, DLDevice* out_device);

/* Writes every dirty tensor to its home tier and makes NVMe durable (fdatasync). Tensors under an
 * open write lease are written after their release, by a later flush. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_flush(tier_engine_t* engine);

/* Bracket one training step: the order of acquires in the first step is recorded and prefetched in
 * the following ones. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_begin_step(tier_engine_t* engine);
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_end_step(tier_engine_t* engine);

/* The engine's statistics as one JSON object: resident/peak bytes and budget per tier, bytes,
 * operations and busy time per link, backend names, scheduler metrics. *out_json is a
 * NUL-terminated string owned by the caller: free it with tier_string_free. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_stats_json(tier_engine_t* engine, char** out_json);

/* The resolved configuration (every key, defaults filled in) as JSON; free with tier_string_free. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_config_json(tier_engine_t* engine, char** out_json);

/* Checks every invariant of the engine (each tensor has a valid copy, budgets hold, counts add
 * up); TIER_ERROR_INTERNAL naming the first violation. For tests and debugging. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_engine_check(tier_engine_t* engine);

/* Frees a string returned by tier. NULL is ignored. */
TIER_API void tier_string_free(char* s);

/* ---------------------------------------------------------------------------------------------
 * Tensors */

/* How a tensor is registered. */
typedef struct tier_tensor_options {
  size_t struct_size; /* sizeof(tier_tensor_options_t); set by TIER_TENSOR_OPTIONS_INIT */
  tier_tier_t home;   /* where its durable copy lives; default TIER_TIER_HOST */
  tier_role_t role;   /* default TIER_ROLE_USER */
  int32_t group;      /* layer or parameter group; default 0 */
  /* For a CUDA source (kDLCUDA, kDLCUDAHost, kDLCUDAManaged): the cudaStream_t on which the
   * source's contents are (being) produced. tier copies after the work queued there so far and
   * waits for the copy before returning. NULL is the legacy default stream. Ignored for CPU
   * sources. */
  void* stream;
} tier_tensor_options_t;
#define TIER_TENSOR_OPTIONS_INIT \
  { sizeof(tier_tensor_options_t), TIER_TIER_HOST, TIER_ROLE_USER, 0, NULL }

/* Registers a tensor named `name` (unique in the engine) with the dtype, shape and contents of
 * `src`, homed on options->home (options may be NULL: the defaults).
 *
 * Ownership: tier owns `src` from the call on and calls its deleter exactly once (when it is not
 * NULL) before returning, on success and on every error alike; the contents are copied in first.
 *
 * Accepted sources: dtypes float16/32/64, bfloat16, int8/32/64, uint8 (lanes 1); 0 to
 * TIER_MAX_NDIM dimensions with at least one element; on kDLCPU, kDLCUDAHost and kDLCUDAManaged
 * any strides (the elements are gathered in row-major order); on kDLCUDA compact row-major
 * layout only (strides NULL or row-major), copied with the CUDA runtime when the library was built
 * with CUDA. Other device types are TIER_ERROR_UNSUPPORTED.
 *
 * Errors: TIER_ERROR_INVALID_ARGUMENT (NULL argument, bad options, shape or dtype),
 * TIER_ERROR_UNSUPPORTED (device type, layout), TIER_ERROR_ALREADY_EXISTS (name taken),
 * TIER_ERROR_RESOURCE_EXHAUSTED (the home tier's budget, or the host tier that stages the copy,
 * cannot hold it), TIER_ERROR_DEVICE (the CUDA copy failed), TIER_ERROR_INTERNAL (the deleter
 * threw a C++ exception). On error nothing stays registered and *out_tensor is {0}. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_register(tier_engine_t* engine, const char* name,
                                                              DLManagedTensor* src,
                                                              const tier_tensor_options_t* options,
                                                              tier_tensor_t* out_tensor);

/* Drops every copy of an idle tensor; its handle goes stale. TIER_ERROR_FAILED_PRECONDITION while
 * a lease, ticket or transfer uses it. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_unregister(tier_engine_t* engine, tier_tensor_t tensor);

/* The tensor registered as `name`; TIER_ERROR_NOT_FOUND if there is none. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_find(tier_engine_t* engine, const char* name,
                                                          tier_tensor_t* out_tensor);

/* What tier knows about a tensor, filled in by tier_tensor_info. */
typedef struct tier_tensor_info {
  size_t struct_size; /* sizeof(tier_tensor_info_t); set by TIER_TENSOR_INFO_INIT */
  DLDataType dtype;
  int32_t ndim;
  int64_t shape[TIER_MAX_NDIM]; /* the first ndim entries */
  uint64_t numel;
  uint64_t nbytes;
  tier_tier_t home;
  tier_role_t role;
  int32_t group;
  tier_copy_state_t copies[TIER_NUM_TIERS]; /* indexed by tier_tier_t */
  uint32_t readers;                         /* read leases and internal transfers reading it */
  int32_t writer;                           /* nonzero while a write lease is held or pending */
} tier_tensor_info_t;
/* Every field spelled out: C's -Wmissing-field-initializers and C++17 (no designators) both accept it. */
#define TIER_TENSOR_INFO_INIT \
  { sizeof(tier_tensor_info_t), {0, 0, 0}, 0, {0}, 0, 0, TIER_TIER_HOST, TIER_ROLE_USER, 0, {TIER_COPY_ABSENT}, 0, 0 }

/* Fills *info (whose struct_size the caller has set) with a snapshot of the tensor's state. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_info(tier_engine_t* engine, tier_tensor_t tensor,
                                                          tier_tensor_info_t* info);

/* Copies the tensor's contents (row-major, `bytes` == its size) into host memory `dst`, or
 * replaces them from `src`. Through a host-tier lease; blocking. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_read(tier_engine_t* engine, tier_tensor_t tensor, void* dst,
                                                          size_t bytes);
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_write(tier_engine_t* engine, tier_tensor_t tensor, const void* src,
                                                           size_t bytes);

/* ---------------------------------------------------------------------------------------------
 * Acquire: tickets and DLPack tensors */

/* Starts acquiring `tensor` on `where` (TIER_TIER_DEVICE or TIER_TIER_HOST: a DLPack tensor needs
 * addressable memory) for `access`, and returns at once with a ticket owned by the caller
 * (tier_ticket_destroy). The copy is brought in the background; the ticket hands out the lease as
 * a DLPack tensor.
 *
 * `stream` is the consumer's stream (a cudaStream_t; NULL is the legacy default stream) on which
 * it will use the tensor. The contents are complete before the ticket is ready, so work queued on
 * any stream after the wait sees them. When the tensor's deleter is called, tier records an event
 * on `stream` and ends the lease only once that event has completed: everything queued on
 * `stream` before the deleter call has finished reading (or, for a write lease, writing) the
 * memory before tier copies it anywhere, drops it or hands it to another lease. Work on other
 * streams is the consumer's to order before `stream`. On the emulated device the caller's thread
 * is the stream and the lease ends inside the deleter, unless tier.emulated.delayed_streams makes
 * each stream handle a worker that runs its work later (for tests), as a GPU does.
 *
 * Errors here: TIER_ERROR_INVALID_ARGUMENT (NULL argument, bad enum, TIER_TIER_NVME),
 * TIER_ERROR_NOT_FOUND (stale or foreign handle). Errors of the acquire itself (budget too small,
 * I/O) are reported by the wait. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_acquire(tier_engine_t* engine, tier_tensor_t tensor,
                                                             tier_tier_t where, tier_access_t access, void* stream,
                                                             tier_ticket_t** out_ticket);

/* A read of `tensor`'s device copy for a consumer that uses it on `stream` only (a cudaStream_t;
 * NULL is the legacy default stream): as tier_tensor_acquire(engine, tensor, TIER_TIER_DEVICE,
 * TIER_ACCESS_READ, stream, ...), except that the ticket is ready once the copy's transfer to the
 * device is queued rather than done, with `stream` made to wait for it. Work queued on `stream`
 * after the wait sees the contents; the host and other streams must not read them before `stream`
 * has passed that point. So a consumer fetching the next layer's tensors goes on queueing work
 * while they are copied. If the transfer fails, `stream`'s later work fails with it (a CUDA error)
 * and the tensor keeps its other copies. A copy already on the device is handed out as
 * tier_tensor_acquire hands it out. On a device without GPU streams (the emulated device, unless
 * tier.emulated.delayed_streams) the contents are complete when the ticket is ready.
 * Errors here: those of tier_tensor_acquire. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_tensor_acquire_on_stream(tier_engine_t* engine, tier_tensor_t tensor,
                                                                       void* stream, tier_ticket_t** out_ticket);

/* *out_ready = 1 when the acquire has completed (successfully or not), 0 while it is pending.
 * Never blocks. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_ticket_poll(tier_ticket_t* ticket, int* out_ready);

/* Waits for the acquire and hands out its lease as a DLPack tensor, once per ticket:
 *  - data: the copy on the tier asked for, dl_tensor.byte_offset 0, compact row-major strides;
 *  - device: {kDLCUDA, id} for the device tier on a GPU, {kDLCUDAHost, 0} for the host tier when
 *    its pinned memory is registered with CUDA, {kDLCPU, 0} otherwise;
 *  - dtype and shape as registered.
 * The caller owns the tensor and calls its deleter exactly once, from any thread, after its last
 * use (see tier_tensor_acquire for streams). The deleter ends the lease: for a write lease, the
 * memory's contents become the tensor's contents then. Writing through a read lease is not
 * allowed (DLPack 0.6 has no read-only flag to say so): other copies would not see the change.
 * Errors: the acquire's (TIER_ERROR_RESOURCE_EXHAUSTED when the tensor is larger than the tier's
 * budget, TIER_ERROR_TIMED_OUT when no room came free within tier.acquire_timeout_ms,
 * TIER_ERROR_IO, ...), TIER_ERROR_FAILED_PRECONDITION for a ticket already waited on. On error
 * *out_tensor is NULL. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_ticket_wait(tier_ticket_t* ticket, DLManagedTensor** out_tensor);

/* As tier_ticket_wait, giving up after `timeout_ms` with TIER_ERROR_TIMED_OUT; the acquire stays
 * pending and may be waited on again. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_ticket_wait_for(tier_ticket_t* ticket, uint64_t timeout_ms,
                                                              DLManagedTensor** out_tensor);

/* Gives the ticket back. A DLPack tensor already handed out is unaffected. An acquire whose
 * tensor was not taken yet is given up: once granted (or at once, if it was), its lease ends
 * unused and a write lease is abandoned, so the tensor keeps the contents it had and writers
 * queued behind it are not held up. NULL is ignored. */
TIER_API void tier_ticket_destroy(tier_ticket_t* ticket);

/* ---------------------------------------------------------------------------------------------
 * Communicators: collectives across data-parallel ranks (tier/comm.hpp; docs/distributed.md)
 *
 * A communicator is NCCL's (tier_comm_create_nccl: device memory of one GPU per rank, built when
 * NCCL was found) or a host framework's own collectives given as a table of callbacks
 * (tier_comm_create_callbacks: torch.distributed, MPI, Gloo, ...). Every rank calls the same
 * collectives in the same order with the same counts and dtypes. A communicator is used by one
 * thread at a time. */

/* Element types of collectives (tier::DType, value for value). */
typedef enum tier_dtype {
  TIER_DTYPE_F32 = 0,
  TIER_DTYPE_F16 = 1,
  TIER_DTYPE_BF16 = 2,
  TIER_DTYPE_F64 = 3,
  TIER_DTYPE_I8 = 4,
  TIER_DTYPE_U8 = 5,
  TIER_DTYPE_I32 = 6,
  TIER_DTYPE_I64 = 7
} tier_dtype_t;

typedef enum tier_reduce_op { TIER_REDUCE_SUM = 0, TIER_REDUCE_MAX = 1, TIER_REDUCE_MIN = 2 } tier_reduce_op_t;

/* Which memory a communicator's collectives take (bits of tier_comm_callbacks_t::memory). */
#define TIER_COMM_MEMORY_HOST 1u   /* host pointers (pageable or pinned) */
#define TIER_COMM_MEMORY_DEVICE 2u /* pointers to the rank's CUDA device memory */

/* A communicator. Opaque. */
typedef struct tier_comm tier_comm_t;

/* A host framework's collectives. Each callback gets `user` first and returns 0 (TIER_OK) on
 * success or a TIER_ERROR_* code (e.g. TIER_ERROR_TIMED_OUT when a peer did not answer; any other
 * nonzero value is reported as TIER_ERROR_IO). They are called on the thread that called the
 * tier_comm_* function (or the tier step that uses the communicator) and must not return before
 * the collective's result is in the output buffer. Buffers are memory of the kinds `memory` says.
 * Counts are elements, never 0. */
typedef struct tier_comm_callbacks {
  size_t struct_size; /* sizeof(tier_comm_callbacks_t); set by TIER_COMM_CALLBACKS_INIT */
  void* user;         /* handed to every callback; tier never reads it */
  int32_t rank;       /* this rank, in [0, world) */
  int32_t world;      /* ranks, at least 1 */
  uint32_t memory;    /* TIER_COMM_MEMORY_* bits; default TIER_COMM_MEMORY_HOST */
  /* Required. In place: buf becomes the reduction over ranks of every rank's buf. */
  int (*all_reduce)(void* user, void* buf, uint64_t count, tier_dtype_t dtype, tier_reduce_op_t op);
  /* (optional) in: world * count elements; out: count, the reduction of this rank's block. NULL:
   * built from all_reduce on a host copy of in (host memory only). */
  int (*reduce_scatter)(void* user, const void* in, void* out, uint64_t count, tier_dtype_t dtype, tier_reduce_op_t op);
  /* (optional) in: count elements; out: world * count, rank r's in at block r; in may be this
   * rank's block of out (in place). NULL: built from a sum all_reduce of out with zeros outside
   * this rank's block (host memory only). */
  int (*all_gather)(void* user, const void* in, void* out, uint64_t count, tier_dtype_t dtype);
  /* (optional) buf becomes root's buf. NULL: a sum all_reduce where ranks but root give zeros. */
  int (*broadcast)(void* user, void* buf, uint64_t count, tier_dtype_t dtype, int32_t root);
  /* (optional) Returns once every rank entered it. NULL: an all_reduce of one int32. */
  int (*barrier)(void* user);
  /* (optional) The text of the last failure, put into tier_last_error(); valid until the next
   * callback. NULL: the message names the collective and the code only. */
  const char* (*error_message)(void* user);
  /* (optional) Called exactly once, when the communicator is destroyed (not when its creation
   * fails: `user` then stays the caller's). */
  void (*destroy)(void* user);
} tier_comm_callbacks_t;
#define TIER_COMM_CALLBACKS_INIT \
  { sizeof(tier_comm_callbacks_t), NULL, 0, 1, TIER_COMM_MEMORY_HOST, NULL, NULL, NULL, NULL, NULL, NULL, NULL }

/* A communicator over `callbacks` (copied; the functions and `user` must stay valid until the
 * communicator is destroyed). On success *out_comm is owned by the caller (tier_comm_destroy).
 * Errors: TIER_ERROR_INVALID_ARGUMENT (NULL argument, wrong struct_size, rank outside [0, world),
 * no all_reduce, no memory bits). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_create_callbacks(const tier_comm_callbacks_t* callbacks,
                                                                    tier_comm_t** out_comm);

/* Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES). */
#define TIER_COMM_UNIQUE_ID_BYTES 128

/* Makes the unique id of a new NCCL communicator (one rank does, then sends the bytes to the
 * others). Errors: TIER_ERROR_UNSUPPORTED (built without NCCL, or libnccl.so.2 cannot be loaded:
 * the message says which), TIER_ERROR_DEVICE. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_nccl_unique_id(uint8_t out_id[TIER_COMM_UNIQUE_ID_BYTES]);

typedef struct tier_comm_nccl_config {
  size_t struct_size;                           /* sizeof(tier_comm_nccl_config_t); set by TIER_COMM_NCCL_CONFIG_INIT */
  uint8_t unique_id[TIER_COMM_UNIQUE_ID_BYTES]; /* from tier_comm_nccl_unique_id on one rank */
  int32_t rank;
  int32_t world;
  int32_t device; /* this rank's CUDA device */
  void* stream;   /* the cudaStream_t collectives run on; NULL: the communicator's own stream */
  /* How long joining and each collective may take before the communicator is aborted and the call
   * fails with TIER_ERROR_TIMED_OUT; 0: 10 minutes; UINT64_MAX: no limit. */
  uint64_t timeout_ms;
} tier_comm_nccl_config_t;
#define TIER_COMM_NCCL_CONFIG_INIT \
  { sizeof(tier_comm_nccl_config_t), {0}, 0, 1, 0, NULL, 0 }

/* Joins the NCCL communicator of config->world ranks sharing config->unique_id (blocks until all
 * joined, up to the timeout). Its collectives take device memory of config->device; host memory
 * is staged through the device. Each collective returns once it has completed; a peer that failed
 * comes back as TIER_ERROR_TIMED_OUT or TIER_ERROR_DEVICE, after which the communicator is
 * aborted and every call on it fails with TIER_ERROR_FAILED_PRECONDITION. Errors:
 * TIER_ERROR_UNSUPPORTED (built without NCCL: configure with -DTIER_WITH_NCCL=ON; or libnccl.so.2
 * not found: set TIER_NCCL_LIBRARY), TIER_ERROR_INVALID_ARGUMENT, TIER_ERROR_TIMED_OUT,
 * TIER_ERROR_DEVICE. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_create_nccl(const tier_comm_nccl_config_t* config,
                                                               tier_comm_t** out_comm);

/* Gives a communicator back (NCCL: finalizes and destroys it; callbacks: calls destroy). NULL is
 * ignored. */
TIER_API void tier_comm_destroy(tier_comm_t* comm);

/* This rank and the number of ranks. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_rank_world(tier_comm_t* comm, int32_t* out_rank, int32_t* out_world);

/* The collectives (tier::Communicator's; count in elements, 0 does nothing). all_reduce is in
 * place; reduce_scatter: in world * count, out count; all_gather: in count, out world * count. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_all_reduce(tier_comm_t* comm, void* buf, uint64_t count,
                                                              tier_dtype_t dtype, tier_reduce_op_t op);
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_reduce_scatter(tier_comm_t* comm, const void* in, void* out,
                                                                  uint64_t count, tier_dtype_t dtype,
                                                                  tier_reduce_op_t op);
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_all_gather(tier_comm_t* comm, const void* in, void* out,
                                                              uint64_t count, tier_dtype_t dtype);
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_broadcast(tier_comm_t* comm, void* buf, uint64_t count,
                                                             tier_dtype_t dtype, int32_t root);
TIER_API TIER_CHECK_RESULT tier_status_t tier_comm_barrier(tier_comm_t* comm);

/* The ZeRO shard layout every rank agrees on (tier::ShardMap, and tier.torch's): a flat tensor of
 * `numel` elements over `world` ranks in shards of ceil(numel / world); rank `rank` owns
 * [*out_offset, *out_offset + *out_count), where *out_count may be 0 for the last ranks.
 * Collectives run on buffers padded to world * ceil(numel / world) elements (rank 0's count is the
 * shard size). Errors: TIER_ERROR_INVALID_ARGUMENT (NULL output, world < 1, rank outside
 * [0, world)). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_shard_range(uint64_t numel, int32_t world, int32_t rank,
                                                          uint64_t* out_offset, uint64_t* out_count);

/* ---------------------------------------------------------------------------------------------
 * Training: an optimizer over offloaded state (tier::step::StepDriver; docs/c_api.md)
 *
 * The fp32 master params and the optimizer's moments live where the config puts them
 * (zero_optimization.offload_optimizer.device "nvme" with nvme_path, or "cpu"); the caller keeps
 * its own params (fp32, bf16 or fp16) for the forward and backward, hands in each step's
 * gradients, and gets the updated params written into its tensors by the step. Every input is
 * checked against the parameter it is for before anything changes: on any error the state, the
 * gradients taken so far and the step counters are as they were, and tier_last_error() names the
 * parameter. An optimizer is used by one thread at a time. */

/* An optimizer. Opaque. */
typedef struct tier_optimizer tier_optimizer_t;

typedef struct tier_optimizer_config {
  size_t struct_size;    /* sizeof(tier_optimizer_config_t); set by TIER_OPTIMIZER_CONFIG_INIT */
  const char* json;      /* DeepSpeed's JSON plus tier's section (as tier_engine_config_t), or NULL */
  const char* json_path; /* or a path to a JSON file, or NULL; giving both is an error */
  int32_t strict;        /* nonzero: keys neither tier nor DeepSpeed knows are errors */
  int32_t ignore_env;    /* nonzero: do not apply the TIER_* environment overrides */
  /* The elements of every parameter together (at most): sizes the swap files' cap when the state
   * is on NVMe (required then; the files grow as parameters are added). */
  uint64_t max_elements;
  /* The number of parameters (at most), for int8 state's alignment; 0: unknown. */
  uint64_t max_params;
  /* An engine to serve beside, or NULL: the optimizer's pinned buffers then come out of its host
   * budget, and with the state on NVMe its chunks go in the engine's swap files (one set of files
   * and I/O threads for both; the engine needs an NVMe tier, else the optimizer keeps files of its
   * own), their room reserved in tier.budgets.nvme (TIER_ERROR_RESOURCE_EXHAUSTED when it lacks
   * it). The optimizer holds the engine: tier_engine_destroy may come first, the engine goes with
   * the optimizer. */
  tier_engine_t* engine;
  /* With `engine`, nonzero: the parameters are fp32 engine tensors that are their own masters
   * (tier.optimizer.params_are_masters' form for a framework whose parameters live in the engine):
   * each is added with tier_optimizer_add_engine_param, the optimizer keeps no master of its own
   * (4 bytes per parameter less on disk and written per step) and each step updates the tensors in
   * place. Needs the state on NVMe kept once (tier.optimizer.state_copies 1, no speculation_chunks),
   * not Lamb. */
  int32_t engine_masters;
} tier_optimizer_config_t;
#define TIER_OPTIMIZER_CONFIG_INIT \
  { sizeof(tier_optimizer_config_t), NULL, NULL, 0, 0, 0, 0, NULL, 0 }

/* Builds an optimizer from the config's "optimizer" section (Adam, AdamW, Adagrad, Lion, Lamb),
 * zero_optimization.offload_optimizer, gradient_clipping, fp16 loss scaling,
 * gradient_accumulation_steps and the tier section. On failure *out_optimizer is NULL. Errors:
 * TIER_ERROR_INVALID_ARGUMENT (a bad key or value; NVMe state without max_elements),
 * TIER_ERROR_NOT_FOUND (json_path), TIER_ERROR_IO / TIER_ERROR_NO_SPACE (the swap path). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_create(const tier_optimizer_config_t* config,
                                                               tier_optimizer_t** out_optimizer);
/* Gives the optimizer back: its threads, buffers and swap files go. NULL is ignored. */
TIER_API void tier_optimizer_destroy(tier_optimizer_t* optimizer);

/* Adds a parameter named `name` (unique) with the shape, dtype (float32, bfloat16 or float16) and
 * values of `initial` (host memory: kDLCPU or kDLCUDAHost, compact row-major; copied, the caller
 * keeps it) to parameter group `group` (0, or one from tier_optimizer_add_group). Its index (0, 1,
 * ... in order) goes to *out_index (may be NULL). Only before the first gradient. Errors:
 * TIER_ERROR_ALREADY_EXISTS (the name), TIER_ERROR_INVALID_ARGUMENT (dtype, layout, device, no
 * elements, unknown group), TIER_ERROR_FAILED_PRECONDITION (after the first gradient). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_add_param(tier_optimizer_t* optimizer, const char* name,
                                                                  const DLTensor* initial, int32_t group,
                                                                  uint32_t* out_index);

/* A parameter group's hyper-parameters. */
typedef struct tier_param_group {
  size_t struct_size; /* sizeof(tier_param_group_t); set by TIER_PARAM_GROUP_INIT */
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} tier_param_group_t;
#define TIER_PARAM_GROUP_INIT \
  { sizeof(tier_param_group_t), 1e-3, 0.9, 0.999, 1e-8, 0.0 }

/* Adds a parameter group of the same kind as the config's optimizer; its index goes to
 * *out_group. Errors: TIER_ERROR_INVALID_ARGUMENT (a non-finite or negative value, a beta outside
 * [0, 1)). */
/* (An optimizer made with engine_masters.) Adds an fp32 parameter named `name` of shape
 * shape[0..ndim) whose values, and fp32 master, are elements [offset, offset + numel) of fp32
 * tensor `tensor` of the optimizer's engine: nothing is copied, and each step updates the tensor in
 * place (chunk by chunk, once the chunk's state is on disk). Its index goes to *out_index (may be
 * NULL). Errors: those of tier_optimizer_add_param, and TIER_ERROR_INVALID_ARGUMENT for a tensor
 * that is not fp32 or too short, or an optimizer without engine_masters. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_add_engine_param(tier_optimizer_t* optimizer, const char* name,
                                                                         const int64_t* shape, int32_t ndim,
                                                                         tier_tensor_t tensor, uint64_t offset,
                                                                         int32_t group, uint32_t* out_index);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_add_group(tier_optimizer_t* optimizer,
                                                                  const tier_param_group_t* group, int32_t* out_group);

/* The number of parameters, and the index of the one named `name` (TIER_ERROR_NOT_FOUND). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_param_count(tier_optimizer_t* optimizer, uint32_t* out_count);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_find_param(tier_optimizer_t* optimizer, const char* name,
                                                                   uint32_t* out_index);

/* One micro-step's gradient of parameter `index`: the parameter's shape, float32, bfloat16 or
 * float16, host memory (kDLCPU or kDLCUDAHost) compact row-major, or kDLCUDA memory when the library
 * was built with CUDA (copied to the host first). Added into the parameter's fp32 accumulator at
 * once (its sum of squares in the same pass); the caller's memory is free when the call returns.
 * gradient_accumulation_steps calls per parameter make a step's gradient. Errors:
 * TIER_ERROR_INVALID_ARGUMENT (shape, dtype, device or layout: the message names the parameter;
 * an unknown index), TIER_ERROR_FAILED_PRECONDITION (more micro-steps than
 * gradient_accumulation_steps). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_add_grad(tier_optimizer_t* optimizer, uint32_t index,
                                                                 const DLTensor* grad);
/* As tier_optimizer_add_grad, but borrowed instead of copied: the update reads `grad` in place,
 * which saves a pass over it (one host pass per gradient element instead of two). `grad` must be
 * host memory (kDLCPU or kDLCUDAHost), compact row-major, and stay valid and unchanged until the
 * step (tier_optimizer_step, tier_optimizer_finish_overlap) or tier_optimizer_clear_grads returns;
 * the step's whole gradient, so only with gradient_accumulation_steps 1
 * (TIER_ERROR_INVALID_ARGUMENT otherwise). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_add_grad_borrowed(tier_optimizer_t* optimizer, uint32_t index,
                                                                          const DLTensor* grad);
/* Forgets the gradients taken since the last step (and drops an overlapped step in flight). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_clear_grads(tier_optimizer_t* optimizer);
/* Declares parameter `index`'s gradient for this step as summed by the caller in an engine tensor
 * (the step's options->grad_tensors[index]), its float64 sum of squares being `sumsq` (inf or nan:
 * an overflow; the gradient as it is, loss scale included). The step reads the tensor then; nothing
 * is read now. Errors: TIER_ERROR_INVALID_ARGUMENT (index, a negative sumsq),
 * TIER_ERROR_FAILED_PRECONDITION (the parameter already has its gradients this step). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_declare_grad(tier_optimizer_t* optimizer, uint32_t index,
                                                                     double sumsq);
/* The float64 sum of squares of a float32, bfloat16 or float16 host tensor (compact), the way the
 * optimizer sums a gradient it is handed (fixed blocks, so the same value each time): what to
 * declare for a gradient summed outside the optimizer. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_sum_of_squares(const DLTensor* x, double* out_sumsq);

typedef struct tier_step_options {
  size_t struct_size; /* sizeof(tier_step_options_t); set by TIER_STEP_OPTIONS_INIT */
  int32_t set_lr;     /* nonzero: every group's learning rate becomes `lr` from this step on */
  double lr;
  /* NULL, or num_params_out == the parameter count: where each parameter's updated values go
   * (NULL entries are skipped), each with the parameter's shape and dtype, in host memory. */
  DLTensor* const* params_out;
  uint32_t num_params_out;
  /* nonzero: a parameter without a gradient this step is left as it is (values and moments, no
   * weight decay), as torch.optim skips a parameter whose grad is None; 0: such a step is refused
   * (TIER_ERROR_FAILED_PRECONDITION naming the parameter). */
  int32_t skip_missing;
  /* NULL, or the data-parallel ranks when each rank's optimizer holds its shards of the model
   * (tier_shard_range): the gradient's sum of squares is all-reduced over `comm` (one fp64 per
   * step), so every rank clips by the global norm, reports it, and skips the step when any rank
   * saw an inf/nan. Every rank steps with it, in the same order. It must stay valid until the step
   * returns (an overlapped step: until finish_overlap or cancel_overlap returns); its failure fails
   * the step with nothing applied and the gradients kept. */
  tier_comm_t* comm;
  /* NULL, or an engine whose tensors receive the updated params in place (the framework keeps its
   * params in tier): parameter i's go into param_tensors[i] (id 0: not written; a parameter with
   * a params_out entry goes there instead), from element param_offsets[i] (param_offsets NULL:
   * all 0; a rank's shard of a whole parameter sits at its offset), in the parameter's dtype.
   * num_param_tensors is the parameter count. Each tensor is checked before anything is applied:
   * a live handle of `engine`, the parameter's dtype, room for its elements from the offset
   * (TIER_ERROR_INVALID_ARGUMENT naming the parameter). The engine and its tensors must stay valid
   * until the step (an overlapped one: finish_overlap or cancel_overlap) returns; nothing else
   * may write those tensors meanwhile. */
  tier_engine_t* engine;
  const tier_tensor_t* param_tensors;
  const uint64_t* param_offsets;
  uint32_t num_param_tensors;
  /* With `engine`: NULL, or where each declared gradient (tier_optimizer_declare_grad) is read
   * from: grad_tensors[i] for parameter i (id 0: none), float32, bfloat16 or float16 with the
   * parameter's element count; num_grad_tensors is the parameter count. The step reads each one
   * from the engine just before its first chunk (a host read lease, wherever it lives), so the
   * host memory a step takes does not grow with the model. Checked like param_tensors; the
   * tensors must not be written until the step returns. */
  const tier_tensor_t* grad_tensors;
  uint32_t num_grad_tensors;
} tier_step_options_t;
#define TIER_STEP_OPTIONS_INIT \
  { sizeof(tier_step_options_t), 0, 0.0, NULL, 0, 0, NULL, NULL, NULL, NULL, 0, NULL, 0 }

typedef struct tier_step_report {
  size_t struct_size; /* sizeof(tier_step_report_t); set by TIER_STEP_REPORT_INIT */
  int64_t step;       /* group 0's step counter afterwards */
  int32_t applied;    /* 0: skipped, a gradient was inf/nan (the state is unchanged) */
  double grad_norm;   /* global L2 norm of the unscaled gradient */
  double clip_coefficient;
  double loss_scale; /* the scale the gradients carried */
  double seconds;
  int32_t overlapped; /* the step ran overlapped (tier_optimizer_start_overlap) */
  int32_t redone;     /* ... and its pass was dropped and the step run again serially (e.g. clipped) */
} tier_step_report_t;
#define TIER_STEP_REPORT_INIT \
  { sizeof(tier_step_report_t), 0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0 }

/* One optimizer step over every parameter (options and out_report may be NULL). Checked first:
 * every parameter has its gradient_accumulation_steps gradients, the lr is finite and not
 * negative, each params_out tensor matches its parameter. Then the state is updated where it
 * lives and the new params written into params_out. Errors: TIER_ERROR_FAILED_PRECONDITION (a
 * parameter without its gradient: the message names it), TIER_ERROR_INVALID_ARGUMENT, and the
 * state's I/O errors (TIER_ERROR_IO, TIER_ERROR_NO_SPACE: the previous state is intact and the
 * gradients are kept, so the step can be retried). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_step(tier_optimizer_t* optimizer,
                                                             const tier_step_options_t* options,
                                                             tier_step_report_t* out_report);

/* The step overlapped with the gradients' arrival: start_overlap checks `options` as
 * tier_optimizer_step does (except the gradients, still to come) and starts the update on a thread
 * of the optimizer's, which updates each chunk of the state as soon as its gradients are in;
 * gradients are then handed in (tier_optimizer_add_grad or _borrowed, e.g. as backward produces
 * them, in any order). finish_overlap checks that every gradient is in (as tier_optimizer_step;
 * on an error nothing is applied and the pass keeps running), computes the global norm and
 * commits the pass, or runs the step again serially when clipping or an overflow says so: the
 * result is tier_optimizer_step's, bit for bit. cancel_overlap drops the pass (nothing committed,
 * the gradients kept). The params_out tensors must stay valid until finish or cancel returns;
 * those written by a dropped pass are not written again. Only with the state on NVMe (a host home
 * updates in place: TIER_ERROR_FAILED_PRECONDITION). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_start_overlap(tier_optimizer_t* optimizer,
                                                                      const tier_step_options_t* options);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_finish_overlap(tier_optimizer_t* optimizer,
                                                                       tier_step_report_t* out_report);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_cancel_overlap(tier_optimizer_t* optimizer);

/* A parameter group's hyper-parameters, read or set (from the next step on); setting checks them
 * first (TIER_ERROR_INVALID_ARGUMENT, nothing changed). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_get_group(tier_optimizer_t* optimizer, int32_t group,
                                                                  tier_param_group_t* out_group);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_set_group(tier_optimizer_t* optimizer, int32_t group,
                                                                  const tier_param_group_t* group_params);

/* The parameter's current values (from its fp32 master) into `dst`: its shape, float32, bfloat16
 * or float16, host memory. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_read_param(tier_optimizer_t* optimizer, uint32_t index,
                                                                   DLTensor* dst);

/* The three fp32 arrays of a parameter's state. */
typedef enum tier_state_kind {
  TIER_STATE_MASTER = 0,
  TIER_STATE_EXP_AVG = 1,
  TIER_STATE_EXP_AVG_SQ = 2
} tier_state_kind_t;

/* A parameter's state array, read into or overwritten from a float32 host tensor of its shape. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_read_state(tier_optimizer_t* optimizer, uint32_t index,
                                                                   tier_state_kind_t kind, DLTensor* dst);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_write_state(tier_optimizer_t* optimizer, uint32_t index,
                                                                    tier_state_kind_t kind, const DLTensor* src);

/* A group's step counter (the steps applied, which bias correction uses), read or set. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_group_step(tier_optimizer_t* optimizer, int32_t group,
                                                                   int64_t* out_step);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_set_group_step(tier_optimizer_t* optimizer, int32_t group,
                                                                       int64_t step);

/* The loss scale to multiply the loss by before backward (1 without fp16 dynamic scaling). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_loss_scale(tier_optimizer_t* optimizer, double* out_scale);

/* Saves the state (masters, moments, hyper-parameters, step counters, loss scale) to `path`:
 * written beside it and renamed, with checksums; `path` is the old file or the whole new one.
 * Loading checks the checksums and that the parameters match (count, sizes, groups, names);
 * TIER_ERROR_DATA_LOSS for a damaged file, and the current state is kept. */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_save(tier_optimizer_t* optimizer, const char* path);
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_load(tier_optimizer_t* optimizer, const char* path);

/* The optimizer's statistics as one JSON object (free with tier_string_free). */
TIER_API TIER_CHECK_RESULT tier_status_t tier_optimizer_stats_json(tier_optimizer_t* optimizer, char** out_json);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TIER_TIER_H_ */
