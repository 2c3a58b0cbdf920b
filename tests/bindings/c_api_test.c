/* The C ABI from C: this file includes only tier/tier.h (and the C library), is compiled as C11
 * with -Wall -Wextra -Werror and links only libtier.so. Each case is its own ctest entry
 * (`c_api_test <case>`): 0 is a pass, 1 a failure, 77 a skip.
 *
 * Every engine runs on the emulated device with small budgets and a swap directory in a fresh
 * temporary directory, so eviction, NVMe and budget errors are all reachable. */
#define _XOPEN_SOURCE 700

#include <tier/tier.h>

#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------
 * Checks: print where and why, with the thread's last tier error, and fail the case. */

#define CHECK(cond)                                                                                                 \
  do {                                                                                                              \
    if (!(cond)) {                                                                                                  \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n  last error: %s\n", __FILE__, __LINE__, #cond, tier_last_error()); \
      return 1;                                                                                                     \
    }                                                                                                               \
  } while (0)

#define CHECK_STATUS(call, want)                                                                           \
  do {                                                                                                     \
    tier_status_t got_ = (call);                                                                           \
    if (got_ != (want)) {                                                                                  \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s\n  last error: %s\n", __FILE__, __LINE__, #call, \
              tier_status_string(got_), tier_status_string(want), tier_last_error());                      \
      return 1;                                                                                            \
    }                                                                                                      \
  } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, TIER_OK)

/* The last error mentions `text`. */
#define CHECK_ERROR_SAYS(text)                                                                          \
  do {                                                                                                  \
    if (strstr(tier_last_error(), (text)) == NULL) {                                                    \
      fprintf(stderr, "%s:%d: last error does not mention \"%s\":\n  %s\n", __FILE__, __LINE__, (text), \
              tier_last_error());                                                                       \
      return 1;                                                                                         \
    }                                                                                                   \
  } while (0)

/* ---------------------------------------------------------------------------------------------
 * A DLPack producer: a tensor in malloc'ed host memory whose deleter counts its calls. */

typedef struct producer {
  DLManagedTensor managed;
  int64_t shape[TIER_MAX_NDIM + 1];
  int64_t strides[TIER_MAX_NDIM + 1];
  void* alloc;
  int* deleted;
} producer;

static void producer_deleter(DLManagedTensor* self) {
  producer* p = (producer*)self->manager_ctx;
  ++*p->deleted;
  free(p->alloc);
  free(p);
}

/* A tensor of `dtype` with `ndim` dimensions over `alloc_bytes` of memory filled by the caller
 * (strides NULL: compact). */
static DLManagedTensor* make_tensor(DLDataType dtype, int ndim, const int64_t* shape, const int64_t* strides,
                                    size_t alloc_bytes, int* deleted) {
  producer* p = (producer*)calloc(1, sizeof(producer));
  if (p == NULL) return NULL;
  p->alloc = calloc(1, alloc_bytes ? alloc_bytes : 1);
  p->deleted = deleted;
  for (int i = 0; i < ndim && i <= TIER_MAX_NDIM; ++i) {
    p->shape[i] = shape[i];
    p->strides[i] = strides ? strides[i] : 0;
  }
  p->managed.dl_tensor.data = p->alloc;
  p->managed.dl_tensor.device.device_type = kDLCPU;
  p->managed.dl_tensor.device.device_id = 0;
  p->managed.dl_tensor.ndim = ndim;
  p->managed.dl_tensor.dtype = dtype;
  p->managed.dl_tensor.shape = p->shape;
  p->managed.dl_tensor.strides = strides ? p->strides : NULL;
  p->managed.dl_tensor.byte_offset = 0;
  p->managed.manager_ctx = p;
  p->managed.deleter = producer_deleter;
  return &p->managed;
}

static const DLDataType kF32 = {kDLFloat, 32, 1};
static const DLDataType kI32 = {kDLInt, 32, 1};
static const DLDataType kI64 = {kDLInt, 64, 1};
static const DLDataType kBF16 = {kDLBfloat, 16, 1};

/* A compact float32 tensor of `n` elements, element i = i * 0.5 + seed. */
static DLManagedTensor* make_f32(int64_t n, float seed, int* deleted) {
  DLManagedTensor* t = make_tensor(kF32, 1, &n, NULL, (size_t)n * sizeof(float), deleted);
  float* d = (float*)t->dl_tensor.data;
  for (int64_t i = 0; i < n; ++i) d[i] = (float)i * 0.5f + seed;
  return t;
}

/* ---------------------------------------------------------------------------------------------
 * The engine fixture: a temporary swap directory and an emulated-device engine. */

typedef struct fixture {
  char dir[512];
  tier_engine_t* engine;
} fixture;

static int remove_entry(const char* path, const struct stat* sb, int flag, struct FTW* ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void make_temp_dir(char* out, size_t cap) {
  const char* root = getenv("TMPDIR");
  snprintf(out, cap, "%s/tier-c-api-XXXXXX", root && *root ? root : "/tmp");
  if (mkdtemp(out) == NULL) {
    perror("mkdtemp");
    exit(1);
  }
}

/* Budgets in bytes: device 1 MiB, host 4 MiB, NVMe 16 MiB unless given. */
static tier_status_t engine_in(const char* dir, uint64_t device, uint64_t host, tier_engine_t** out) {
  char json[1024];
  snprintf(json, sizeof json,
           "{\"tier\": {\"device\": \"emulated\", \"budgets\": {\"device\": %llu, \"host\": %llu, \"nvme\": %llu},"
           " \"swap_paths\": [\"%s\"], \"huge_pages\": \"off\", \"debug_checks\": true,"
           " \"acquire_timeout_ms\": 5000, \"log_level\": \"warn\", \"io\": {\"bounce_unaligned\": true}}}",
           (unsigned long long)device, (unsigned long long)host, 16ull << 20, dir);
  tier_engine_config_t config = TIER_ENGINE_CONFIG_INIT;
  config.json = json;
  config.ignore_env = 1;
  return tier_engine_create(&config, out);
}

static int setup(fixture* f) {
  make_temp_dir(f->dir, sizeof f->dir);
  f->engine = NULL;
  CHECK_OK(engine_in(f->dir, 1u << 20, 4u << 20, &f->engine));
  CHECK(f->engine != NULL);
  return 0;
}

static void teardown(fixture* f) {
  tier_engine_destroy(f->engine);
  f->engine = NULL;
  nftw(f->dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Registers `n` float32 elements (i * 0.5 + seed) as `name` homed on `home`. */
static int register_f32(tier_engine_t* e, const char* name, int64_t n, float seed, tier_tier_t home,
                        tier_tensor_t* out) {
  int deleted = 0;
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = home;
  CHECK_OK(tier_tensor_register(e, name, make_f32(n, seed, &deleted), &opt, out));
  CHECK(deleted == 1);
  return 0;
}

/* Acquires and waits; *out is the DLPack tensor. */
static int acquire(tier_engine_t* e, tier_tensor_t t, tier_tier_t where, tier_access_t access, DLManagedTensor** out) {
  tier_ticket_t* ticket = NULL;
  CHECK_OK(tier_tensor_acquire(e, t, where, access, NULL, &ticket));
  CHECK_OK(tier_ticket_wait(ticket, out));
  tier_ticket_destroy(ticket);
  CHECK(*out != NULL);
  return 0;
}

static int expect_f32(const float* got, int64_t n, float seed) {
  for (int64_t i = 0; i < n; ++i) {
    if (got[i] != (float)i * 0.5f + seed) {
      fprintf(stderr, "element %lld is %g, expected %g\n", (long long)i, (double)got[i], (double)i * 0.5 + seed);
      return 1;
    }
  }
  return 0;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Cases */

static int test_version(void) {
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", TIER_VERSION_MAJOR, TIER_VERSION_MINOR, TIER_VERSION_PATCH);
  CHECK(tier_version() == TIER_VERSION);
  CHECK(strcmp(tier_version_string(), want) == 0);
  return 0;
}

static int test_optimizer_types(void) {
  CHECK(strcmp(tier_optimizer_types(), "adam,adamw,adagrad,lion,lamb") == 0);
  CHECK(tier_optimizer_supported("Lamb") == 1);
  CHECK(tier_optimizer_supported("ADAGRAD") == 1);
  CHECK(tier_optimizer_supported("lion") == 1);
  CHECK(tier_optimizer_supported("AdamW") == 1);
  CHECK(tier_optimizer_supported("OneBitLamb") == 0);
  CHECK(tier_optimizer_supported("") == 0);
  CHECK(tier_optimizer_supported(NULL) == 0);
  return 0;
}

static int test_status_strings(void) {
  CHECK(strcmp(tier_status_string(TIER_OK), "ok") == 0);
  CHECK(strcmp(tier_status_string(TIER_ERROR_INVALID_ARGUMENT), "invalid_argument") == 0);
  CHECK(strcmp(tier_status_string(TIER_ERROR_NO_SPACE), "no_space") == 0);
  for (int a = TIER_OK; a <= TIER_ERROR_INTERNAL; ++a) {
    CHECK(strcmp(tier_status_string((tier_status_t)a), "unknown") != 0);
    for (int b = a + 1; b <= TIER_ERROR_INTERNAL; ++b) {
      CHECK(strcmp(tier_status_string((tier_status_t)a), tier_status_string((tier_status_t)b)) != 0);
    }
  }
  CHECK(strcmp(tier_status_string((tier_status_t)99), "unknown") == 0);
  CHECK(strcmp(tier_status_string((tier_status_t)-1), "unknown") == 0);
  /* Nothing has failed on this thread yet. */
  CHECK(strcmp(tier_last_error(), "") == 0);
  return 0;
}

static int test_engine_create_errors(void) {
  char dir[512];
  make_temp_dir(dir, sizeof dir);
  tier_engine_t* e = (tier_engine_t*)&e; /* not NULL: a failed create must reset it */
  tier_engine_config_t config = TIER_ENGINE_CONFIG_INIT;

  CHECK_STATUS(tier_engine_create(NULL, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK(e == NULL);
  CHECK_ERROR_SAYS("tier_engine_create");
  CHECK_ERROR_SAYS("'config'");
  CHECK_STATUS(tier_engine_create(&config, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_engine'");

  config.struct_size = 0;
  CHECK_STATUS(tier_engine_create(&config, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("struct_size");
  CHECK_ERROR_SAYS("TIER_ENGINE_CONFIG_INIT");
  config.struct_size = sizeof(tier_engine_config_t) - 1;
  CHECK_STATUS(tier_engine_create(&config, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK(e == NULL);

  /* A newer caller's larger struct: fine while the fields this library does not know are 0. */
  char json[512];
  snprintf(json, sizeof json,
           "{\"tier\": {\"device\": \"emulated\", \"budgets\": {\"device\": 1048576, \"host\": 1048576},"
           " \"huge_pages\": \"off\"}}");
  struct {
    tier_engine_config_t config;
    uint64_t newer_field;
  } big;
  memset(&big, 0, sizeof big);
  big.config.struct_size = sizeof big;
  big.config.json = json;
  big.config.ignore_env = 1;
  CHECK_OK(tier_engine_create(&big.config, &e));
  CHECK(e != NULL);
  tier_engine_destroy(e);
  big.newer_field = 1;
  CHECK_STATUS(tier_engine_create(&big.config, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("fields it does not know");

  tier_engine_config_t both = TIER_ENGINE_CONFIG_INIT;
  both.json = json;
  both.json_path = "/nonexistent.json";
  CHECK_STATUS(tier_engine_create(&both, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("not both");

  tier_engine_config_t bad = TIER_ENGINE_CONFIG_INIT;
  bad.json = "{\"tier\": {\"budgetz\": {\"host\": 1048576}}}";
  bad.ignore_env = 1;
  CHECK_STATUS(tier_engine_create(&bad, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("budgetz");
  bad.json = "{\"tier\": {\"budgets\": {\"host\": \"lots\"}}}";
  CHECK_STATUS(tier_engine_create(&bad, &e), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("tier.budgets.host");
  bad.json = "{ not json";
  CHECK_STATUS(tier_engine_create(&bad, &e), TIER_ERROR_INVALID_ARGUMENT);

  tier_engine_config_t missing = TIER_ENGINE_CONFIG_INIT;
  missing.json_path = "/nonexistent/tier-config.json";
  CHECK_STATUS(tier_engine_create(&missing, &e), TIER_ERROR_NOT_FOUND);
  CHECK_ERROR_SAYS("/nonexistent/tier-config.json");

  /* From a file. */
  char path[600];
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE* f = fopen(path, "w");
  CHECK(f != NULL);
  fputs(json, f);
  fclose(f);
  tier_engine_config_t from_file = TIER_ENGINE_CONFIG_INIT;
  from_file.json_path = path;
  from_file.ignore_env = 1;
  CHECK_OK(tier_engine_create(&from_file, &e));
  char* resolved = NULL;
  CHECK_OK(tier_engine_config_json(e, &resolved));
  CHECK(strstr(resolved, "\"emulated\"") != NULL);
  tier_string_free(resolved);
  tier_engine_destroy(e);

  /* Asking for CUDA: a GPU machine builds it, any other says why not. */
  tier_engine_config_t cuda = TIER_ENGINE_CONFIG_INIT;
  cuda.json = "{\"tier\": {\"device\": \"cuda\", \"budgets\": {\"host\": 1048576}, \"huge_pages\": \"off\"}}";
  cuda.ignore_env = 1;
  tier_status_t s = tier_engine_create(&cuda, &e);
  CHECK(s == TIER_OK || s == TIER_ERROR_UNSUPPORTED);
  if (s == TIER_OK) {
    DLDevice d;
    CHECK_OK(tier_engine_device(e, &d));
    CHECK(d.device_type == kDLCUDA);
    tier_engine_destroy(e);
  } else {
    CHECK(e == NULL);
  }
  tier_engine_destroy(NULL); /* ignored */
  nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return 0;
}

static int test_register_and_read(void) {
  fixture f;
  if (setup(&f)) return 1;
  DLDevice device;
  CHECK_OK(tier_engine_device(f.engine, &device));
  CHECK(device.device_type == kDLCPU && device.device_id == 0);

  /* A 2-D float32 tensor homed on each tier, with a role and group. */
  const tier_tier_t homes[3] = {TIER_TIER_HOST, TIER_TIER_NVME, TIER_TIER_DEVICE};
  const char* names[3] = {"w.host", "w.nvme", "w.device"};
  for (int h = 0; h < 3; ++h) {
    int deleted = 0;
    const int64_t shape[2] = {4, 8};
    DLManagedTensor* src = make_tensor(kF32, 2, shape, NULL, 32 * sizeof(float), &deleted);
    float* d = (float*)src->dl_tensor.data;
    for (int i = 0; i < 32; ++i) d[i] = (float)i * 0.5f + (float)h;
    tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
    opt.home = homes[h];
    opt.role = TIER_ROLE_PARAM;
    opt.group = 3;
    tier_tensor_t t = {0};
    CHECK_OK(tier_tensor_register(f.engine, names[h], src, &opt, &t));
    CHECK(deleted == 1);
    CHECK(t.id != 0);

    tier_tensor_info_t info = TIER_TENSOR_INFO_INIT;
    CHECK_OK(tier_tensor_info(f.engine, t, &info));
    CHECK(info.dtype.code == kDLFloat && info.dtype.bits == 32 && info.dtype.lanes == 1);
    CHECK(info.ndim == 2 && info.shape[0] == 4 && info.shape[1] == 8);
    CHECK(info.numel == 32 && info.nbytes == 128);
    CHECK(info.home == homes[h]);
    CHECK(info.role == TIER_ROLE_PARAM && info.group == 3);
    CHECK(info.copies[homes[h]] == TIER_COPY_VALID_CLEAN);
    CHECK(info.readers == 0 && info.writer == 0);

    float back[32];
    CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
    if (expect_f32(back, 32, (float)h)) return 1;

    tier_tensor_t found = {0};
    CHECK_OK(tier_tensor_find(f.engine, names[h], &found));
    CHECK(found.id == t.id);
  }

  /* A 0-d int64 scalar, and bfloat16. */
  int deleted = 0;
  DLManagedTensor* scalar = make_tensor(kI64, 0, NULL, NULL, sizeof(int64_t), &deleted);
  *(int64_t*)scalar->dl_tensor.data = -1234567890123LL;
  tier_tensor_t ts = {0};
  CHECK_OK(tier_tensor_register(f.engine, "step", scalar, NULL, &ts));
  CHECK(deleted == 1);
  int64_t step = 0;
  CHECK_OK(tier_tensor_read(f.engine, ts, &step, sizeof step));
  CHECK(step == -1234567890123LL);
  tier_tensor_info_t info = TIER_TENSOR_INFO_INIT;
  CHECK_OK(tier_tensor_info(f.engine, ts, &info));
  CHECK(info.ndim == 0 && info.numel == 1 && info.home == TIER_TIER_HOST && info.role == TIER_ROLE_USER);

  deleted = 0;
  const int64_t n3 = 3;
  DLManagedTensor* bf = make_tensor(kBF16, 1, &n3, NULL, 6, &deleted);
  const uint16_t bits[3] = {0x3f80, 0x4000, 0xbf80}; /* 1, 2, -1 */
  memcpy(bf->dl_tensor.data, bits, sizeof bits);
  tier_tensor_t tb = {0};
  CHECK_OK(tier_tensor_register(f.engine, "bf", bf, NULL, &tb));
  uint16_t bits_back[3] = {0, 0, 0};
  CHECK_OK(tier_tensor_read(f.engine, tb, bits_back, sizeof bits_back));
  CHECK(memcmp(bits, bits_back, sizeof bits) == 0);
  CHECK_OK(tier_tensor_info(f.engine, tb, &info));
  CHECK(info.dtype.code == kDLBfloat && info.dtype.bits == 16 && info.nbytes == 6);

  /* A producer without a deleter is fine too. */
  float plain[4] = {1, 2, 3, 4};
  int64_t n4 = 4;
  DLManagedTensor raw;
  memset(&raw, 0, sizeof raw);
  raw.dl_tensor.data = plain;
  raw.dl_tensor.device.device_type = kDLCPU;
  raw.dl_tensor.ndim = 1;
  raw.dl_tensor.dtype = kF32;
  raw.dl_tensor.shape = &n4;
  tier_tensor_t tr = {0};
  CHECK_OK(tier_tensor_register(f.engine, "plain", &raw, NULL, &tr));
  float plain_back[4];
  CHECK_OK(tier_tensor_read(f.engine, tr, plain_back, sizeof plain_back));
  CHECK(memcmp(plain, plain_back, sizeof plain) == 0);

  /* An info struct from a newer header: the bytes this library does not know stay untouched. */
  struct {
    tier_tensor_info_t info;
    uint64_t newer_field;
  } big;
  memset(&big, 0, sizeof big);
  big.info.struct_size = sizeof big;
  big.newer_field = 0xabcdefu;
  CHECK_OK(tier_tensor_info(f.engine, ts, &big.info));
  CHECK(big.newer_field == 0xabcdefu && big.info.numel == 1 && big.info.struct_size == sizeof big);
  info.struct_size = 8;
  CHECK_STATUS(tier_tensor_info(f.engine, ts, &info), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("TIER_TENSOR_INFO_INIT");
  CHECK_STATUS(tier_tensor_info(f.engine, ts, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'info'");

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

static int test_register_strided(void) {
  fixture f;
  if (setup(&f)) return 1;
  int deleted = 0;

  /* The transpose of a row-major 4x3 buffer: shape {3, 4}, strides {1, 3}. */
  const int64_t shape[2] = {3, 4};
  const int64_t strides[2] = {1, 3};
  DLManagedTensor* tr = make_tensor(kI32, 2, shape, strides, 12 * sizeof(int32_t), &deleted);
  int32_t* buf = (int32_t*)tr->dl_tensor.data;
  for (int i = 0; i < 12; ++i) buf[i] = 100 + i;
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t = {0};
  CHECK_OK(tier_tensor_register(f.engine, "transposed", tr, &opt, &t));
  CHECK(deleted == 1);
  int32_t back[12];
  CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) CHECK(back[i * 4 + j] == 100 + i + 3 * j);
  }

  /* Reversed through a negative stride, starting at a byte offset. */
  const int64_t n = 5;
  const int64_t minus_one = -1;
  DLManagedTensor* rev = make_tensor(kI32, 1, &n, &minus_one, 8 * sizeof(int32_t), &deleted);
  int32_t* rbuf = (int32_t*)rev->dl_tensor.data;
  for (int i = 0; i < 8; ++i) rbuf[i] = i;
  rev->dl_tensor.byte_offset = 6 * sizeof(int32_t); /* element 6 first: 6, 5, 4, 3, 2 */
  CHECK_OK(tier_tensor_register(f.engine, "reversed", rev, NULL, &t));
  CHECK(deleted == 2);
  int32_t rback[5];
  CHECK_OK(tier_tensor_read(f.engine, t, rback, sizeof rback));
  for (int i = 0; i < 5; ++i) CHECK(rback[i] == 6 - i);

  /* Every other column of a 2x6 buffer (inner stride 2, outer 6), homed on the device. */
  const int64_t shape2[2] = {2, 3};
  const int64_t strides2[2] = {6, 2};
  DLManagedTensor* cols = make_tensor(kI32, 2, shape2, strides2, 12 * sizeof(int32_t), &deleted);
  int32_t* cbuf = (int32_t*)cols->dl_tensor.data;
  for (int i = 0; i < 12; ++i) cbuf[i] = i;
  opt.home = TIER_TIER_DEVICE;
  CHECK_OK(tier_tensor_register(f.engine, "columns", cols, &opt, &t));
  int32_t cback[6];
  CHECK_OK(tier_tensor_read(f.engine, t, cback, sizeof cback));
  const int32_t cwant[6] = {0, 2, 4, 6, 8, 10};
  CHECK(memcmp(cback, cwant, sizeof cwant) == 0);

  /* A transpose larger than the gather's tiles, with partial tiles at both edges: 37 x 53 viewed
   * from a row-major 53 x 37 buffer. */
  const int64_t shape4[2] = {37, 53};
  const int64_t strides4[2] = {1, 37};
  DLManagedTensor* wide = make_tensor(kI32, 2, shape4, strides4, 37 * 53 * sizeof(int32_t), &deleted);
  for (int i = 0; i < 37 * 53; ++i) ((int32_t*)wide->dl_tensor.data)[i] = i;
  CHECK_OK(tier_tensor_register(f.engine, "wide", wide, NULL, &t));
  static int32_t wide_back[37 * 53];
  CHECK_OK(tier_tensor_read(f.engine, t, wide_back, sizeof wide_back));
  for (int i = 0; i < 37; ++i) {
    for (int j = 0; j < 53; ++j) CHECK(wide_back[i * 53 + j] == i + 37 * j);
  }

  /* Three dimensions, permuted: shape {2, 3, 4} over a row-major {4, 2, 3} buffer (b, i, j) ->
   * element (i, j, b) at b * 6 + i * 3 + j, i.e. strides {3, 1, 6}. */
  const int64_t shape5[3] = {2, 3, 4};
  const int64_t strides5[3] = {3, 1, 6};
  DLManagedTensor* perm = make_tensor(kI32, 3, shape5, strides5, 24 * sizeof(int32_t), &deleted);
  for (int i = 0; i < 24; ++i) ((int32_t*)perm->dl_tensor.data)[i] = 1000 + i;
  CHECK_OK(tier_tensor_register(f.engine, "permuted", perm, NULL, &t));
  int32_t perm_back[24];
  CHECK_OK(tier_tensor_read(f.engine, t, perm_back, sizeof perm_back));
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) {
      for (int b = 0; b < 4; ++b) CHECK(perm_back[(i * 3 + j) * 4 + b] == 1000 + b * 6 + i * 3 + j);
    }
  }

  /* Explicit row-major strides, with an odd stride on a dimension of extent 1: compact. */
  const int64_t shape3[2] = {1, 4};
  const int64_t strides3[2] = {999, 1};
  DLManagedTensor* row = make_tensor(kI32, 2, shape3, strides3, 4 * sizeof(int32_t), &deleted);
  for (int i = 0; i < 4; ++i) ((int32_t*)row->dl_tensor.data)[i] = 7 * i;
  CHECK_OK(tier_tensor_register(f.engine, "row", row, NULL, &t));
  int32_t row_back[4];
  CHECK_OK(tier_tensor_read(f.engine, t, row_back, sizeof row_back));
  for (int i = 0; i < 4; ++i) CHECK(row_back[i] == 7 * i);
  CHECK(deleted == 6);

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

/* Registering `src` fails with `want`; its deleter ran once; nothing named `name` is left. */
static int expect_register_fails(tier_engine_t* e, const char* name, DLManagedTensor* src,
                                 const tier_tensor_options_t* opt, tier_status_t want, const char* says, int* deleted) {
  const int before = *deleted;
  tier_tensor_t t = {42};
  CHECK_STATUS(tier_tensor_register(e, name, src, opt, &t), want);
  CHECK(t.id == 0);
  CHECK(*deleted == before + (src != NULL ? 1 : 0));
  if (says != NULL) CHECK_ERROR_SAYS(says);
  CHECK_ERROR_SAYS("tier_tensor_register");
  if (e != NULL && name != NULL) {
    tier_tensor_t found;
    CHECK_STATUS(tier_tensor_find(e, name, &found), TIER_ERROR_NOT_FOUND);
  }
  return 0;
}

static int test_register_errors(void) {
  fixture f;
  if (setup(&f)) return 1;
  int deleted = 0;
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  tier_tensor_t t;

  if (expect_register_fails(f.engine, "x", NULL, NULL, TIER_ERROR_INVALID_ARGUMENT, "'src'", &deleted)) return 1;
  if (expect_register_fails(NULL, "x", make_f32(4, 0, &deleted), NULL, TIER_ERROR_INVALID_ARGUMENT, "'engine'",
                            &deleted))
    return 1;
  if (expect_register_fails(f.engine, NULL, make_f32(4, 0, &deleted), NULL, TIER_ERROR_INVALID_ARGUMENT, "'name'",
                            &deleted))
    return 1;
  CHECK_STATUS(tier_tensor_register(f.engine, "x", make_f32(4, 0, &deleted), NULL, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_tensor'");
  CHECK(deleted == 3);

  opt.struct_size = 0;
  if (expect_register_fails(f.engine, "x", make_f32(4, 0, &deleted), &opt, TIER_ERROR_INVALID_ARGUMENT,
                            "options->struct_size", &deleted))
    return 1;
  opt.struct_size = sizeof opt;
  opt.home = (tier_tier_t)7;
  if (expect_register_fails(f.engine, "x", make_f32(4, 0, &deleted), &opt, TIER_ERROR_INVALID_ARGUMENT, "options->home",
                            &deleted))
    return 1;
  opt.home = TIER_TIER_HOST;
  opt.role = (tier_role_t)42;
  if (expect_register_fails(f.engine, "x", make_f32(4, 0, &deleted), &opt, TIER_ERROR_INVALID_ARGUMENT, "options->role",
                            &deleted))
    return 1;

  /* Layouts and dtypes tier does not take. */
  const int64_t four = 4;
  const DLDataType complex64 = {kDLComplex, 64, 1};
  const DLDataType float4 = {kDLFloat, 32, 4};
  const DLDataType int16 = {kDLInt, 16, 1};
  if (expect_register_fails(f.engine, "x", make_tensor(complex64, 1, &four, NULL, 32, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "dtype", &deleted))
    return 1;
  if (expect_register_fails(f.engine, "x", make_tensor(float4, 1, &four, NULL, 64, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "lanes 4", &deleted))
    return 1;
  if (expect_register_fails(f.engine, "x", make_tensor(int16, 1, &four, NULL, 8, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "bits 16", &deleted))
    return 1;
  const int64_t empty[2] = {3, 0};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 2, empty, NULL, 0, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "no elements", &deleted))
    return 1;
  const int64_t negative[2] = {3, -2};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 2, negative, NULL, 0, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "shape[1] is -2", &deleted))
    return 1;
  int64_t many[TIER_MAX_NDIM + 1];
  for (int i = 0; i <= TIER_MAX_NDIM; ++i) many[i] = 1;
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, TIER_MAX_NDIM + 1, many, NULL, 4, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "ndim", &deleted))
    return 1;
  DLManagedTensor* no_data = make_f32(4, 0, &deleted);
  no_data->dl_tensor.data = NULL;
  /* (the deleter frees the producer's own allocation, which still holds the memory) */
  if (expect_register_fails(f.engine, "x", no_data, NULL, TIER_ERROR_INVALID_ARGUMENT, "data is NULL", &deleted))
    return 1;
  DLManagedTensor* vulkan = make_f32(4, 0, &deleted);
  vulkan->dl_tensor.device.device_type = kDLVulkan;
  if (expect_register_fails(f.engine, "x", vulkan, NULL, TIER_ERROR_UNSUPPORTED, "device_type", &deleted)) return 1;
  DLManagedTensor* made_up = make_f32(4, 0, &deleted);
  made_up->dl_tensor.device.device_type = (DLDeviceType)99;
  if (expect_register_fails(f.engine, "x", made_up, NULL, TIER_ERROR_UNSUPPORTED, "device_type is 99", &deleted))
    return 1;

  /* A CUDA tensor: with no GPU (or no CUDA in the build) it fails, saying why; this pointer is
   * host memory, so on a GPU the copy fails too. Either way nothing stays registered. */
  DLManagedTensor* cuda = make_f32(4, 0, &deleted);
  cuda->dl_tensor.device.device_type = kDLCUDA;
  const int before = deleted;
  CHECK(tier_tensor_register(f.engine, "cuda", cuda, NULL, &t) != TIER_OK);
  CHECK(deleted == before + 1 && t.id == 0);
  CHECK(tier_tensor_find(f.engine, "cuda", &t) == TIER_ERROR_NOT_FOUND);

  /* A name taken twice. */
  CHECK_OK(tier_tensor_register(f.engine, "taken", make_f32(4, 0, &deleted), NULL, &t));
  {
    tier_tensor_t u = {42};
    const int d0 = deleted;
    CHECK_STATUS(tier_tensor_register(f.engine, "taken", make_f32(4, 1, &deleted), NULL, &u),
                 TIER_ERROR_ALREADY_EXISTS);
    CHECK(deleted == d0 + 1 && u.id == 0);
    CHECK_ERROR_SAYS("'taken'");
    float back[4];
    CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
    if (expect_f32(back, 4, 0)) return 1; /* the first one's contents are untouched */
  }

  /* Larger than the host budget (4 MiB), which stages every copy. */
  if (expect_register_fails(f.engine, "huge", make_f32((8 << 20) / 4, 0, &deleted), NULL, TIER_ERROR_RESOURCE_EXHAUSTED,
                            "budget", &deleted))
    return 1;
  /* Larger than the device budget (1 MiB), homed there. */
  opt = (tier_tensor_options_t)TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_DEVICE;
  if (expect_register_fails(f.engine, "big", make_f32((2 << 20) / 4, 0, &deleted), &opt, TIER_ERROR_RESOURCE_EXHAUSTED,
                            "budget", &deleted))
    return 1;

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

static int test_acquire_dlpack(void) {
  fixture f;
  if (setup(&f)) return 1;
  int deleted = 0;
  const int64_t shape[2] = {16, 16};
  DLManagedTensor* src = make_tensor(kF32, 2, shape, NULL, 256 * sizeof(float), &deleted);
  for (int i = 0; i < 256; ++i) ((float*)src->dl_tensor.data)[i] = (float)i * 0.5f + 9;
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t = {0};
  CHECK_OK(tier_tensor_register(f.engine, "m", src, &opt, &t));

  const tier_tier_t wheres[2] = {TIER_TIER_DEVICE, TIER_TIER_HOST};
  for (int w = 0; w < 2; ++w) {
    DLManagedTensor* dl = NULL;
    if (acquire(f.engine, t, wheres[w], TIER_ACCESS_READ, &dl)) return 1;
    const DLTensor* x = &dl->dl_tensor;
    CHECK(x->device.device_type == kDLCPU && x->device.device_id == 0); /* the emulated device */
    CHECK(x->ndim == 2 && x->shape[0] == 16 && x->shape[1] == 16);
    CHECK(x->strides != NULL && x->strides[0] == 16 && x->strides[1] == 1);
    CHECK(x->dtype.code == kDLFloat && x->dtype.bits == 32 && x->dtype.lanes == 1);
    CHECK(x->byte_offset == 0 && x->data != NULL);
    if (expect_f32((const float*)x->data, 256, 9)) return 1;

    tier_tensor_info_t info = TIER_TENSOR_INFO_INIT;
    CHECK_OK(tier_tensor_info(f.engine, t, &info));
    CHECK(info.readers == 1);
    CHECK(info.copies[wheres[w]] == TIER_COPY_VALID_CLEAN);
    /* A second reader at the same time. */
    DLManagedTensor* dl2 = NULL;
    if (acquire(f.engine, t, wheres[w], TIER_ACCESS_READ, &dl2)) return 1;
    CHECK(dl2->dl_tensor.data == x->data);
    CHECK_OK(tier_tensor_info(f.engine, t, &info));
    CHECK(info.readers == 2);
    dl2->deleter(dl2);
    dl->deleter(dl);
    CHECK_OK(tier_tensor_info(f.engine, t, &info));
    CHECK(info.readers == 0 && info.writer == 0);
  }

  tier_ticket_t* ticket = (tier_ticket_t*)&ticket;
  CHECK_STATUS(tier_tensor_acquire(f.engine, t, TIER_TIER_NVME, TIER_ACCESS_READ, NULL, &ticket),
               TIER_ERROR_INVALID_ARGUMENT);
  CHECK(ticket == NULL);
  CHECK_ERROR_SAYS("TIER_TIER_NVME");
  CHECK_STATUS(tier_tensor_acquire(f.engine, t, (tier_tier_t)5, TIER_ACCESS_READ, NULL, &ticket),
               TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'where' is 5");
  CHECK_STATUS(tier_tensor_acquire(f.engine, t, TIER_TIER_HOST, (tier_access_t)9, NULL, &ticket),
               TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'access' is 9");
  CHECK_STATUS(tier_tensor_acquire(NULL, t, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, &ticket),
               TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'engine'");
  CHECK_STATUS(tier_tensor_acquire(f.engine, t, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, NULL),
               TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_ticket'");

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

static int test_write_through_lease(void) {
  fixture f;
  if (setup(&f)) return 1;
  int deleted = 0;
  const int64_t n = 1024;
  DLManagedTensor* src = make_tensor(kI32, 1, &n, NULL, (size_t)n * 4, &deleted);
  tier_tensor_options_t opt = TIER_TENSOR_OPTIONS_INIT;
  opt.home = TIER_TIER_NVME;
  tier_tensor_t t = {0};
  CHECK_OK(tier_tensor_register(f.engine, "counts", src, &opt, &t));

  /* Overwrite on the device; the deleter publishes it. */
  DLManagedTensor* dl = NULL;
  if (acquire(f.engine, t, TIER_TIER_DEVICE, TIER_ACCESS_WRITE, &dl)) return 1;
  tier_tensor_info_t info = TIER_TENSOR_INFO_INIT;
  CHECK_OK(tier_tensor_info(f.engine, t, &info));
  CHECK(info.writer == 1);
  for (int i = 0; i < n; ++i) ((int32_t*)dl->dl_tensor.data)[i] = 7 * i;
  dl->deleter(dl);
  int32_t back[1024];
  CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
  for (int i = 0; i < n; ++i) CHECK(back[i] == 7 * i);

  /* Read-modify-write on the host. */
  if (acquire(f.engine, t, TIER_TIER_HOST, TIER_ACCESS_READ_WRITE, &dl)) return 1;
  for (int i = 0; i < n; ++i) ((int32_t*)dl->dl_tensor.data)[i] += 1;
  dl->deleter(dl);
  CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
  for (int i = 0; i < n; ++i) CHECK(back[i] == 7 * i + 1);
  CHECK_OK(tier_tensor_info(f.engine, t, &info));
  CHECK(info.copies[TIER_TIER_NVME] == TIER_COPY_STALE);

  /* flush writes it home. */
  CHECK_OK(tier_engine_flush(f.engine));
  CHECK_OK(tier_tensor_info(f.engine, t, &info));
  CHECK(info.copies[TIER_TIER_NVME] == TIER_COPY_VALID_CLEAN);

  /* tier_tensor_write, then read back through a device lease. */
  for (int i = 0; i < n; ++i) back[i] = -i;
  CHECK_OK(tier_tensor_write(f.engine, t, back, sizeof back));
  if (acquire(f.engine, t, TIER_TIER_DEVICE, TIER_ACCESS_READ, &dl)) return 1;
  CHECK(memcmp(dl->dl_tensor.data, back, sizeof back) == 0);
  dl->deleter(dl);

  /* Sizes and buffers that do not match. */
  CHECK_STATUS(tier_tensor_read(f.engine, t, back, sizeof back - 4), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'bytes' is 4092");
  CHECK_STATUS(tier_tensor_write(f.engine, t, back, sizeof back + 4), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_tensor_read(f.engine, t, NULL, sizeof back), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'dst'");
  CHECK_STATUS(tier_tensor_write(f.engine, t, NULL, sizeof back), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'src'");

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

static int test_tickets(void) {
  fixture f;
  if (setup(&f)) return 1;
  tier_tensor_t a = {0};
  if (register_f32(f.engine, "a", 256, 1, TIER_TIER_NVME, &a)) return 1;

  /* A reader waits behind a writer. */
  tier_ticket_t* writer = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_WRITE, NULL, &writer));
  DLManagedTensor* w = NULL;
  CHECK_OK(tier_ticket_wait(writer, &w));
  int ready = -1;
  CHECK_OK(tier_ticket_poll(writer, &ready));
  CHECK(ready == 1);
  for (int i = 0; i < 256; ++i) ((float*)w->dl_tensor.data)[i] = (float)i * 0.5f + 2;

  tier_ticket_t* reader = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_DEVICE, TIER_ACCESS_READ, NULL, &reader));
  sleep_ms(20);
  CHECK_OK(tier_ticket_poll(reader, &ready));
  CHECK(ready == 0);
  DLManagedTensor* r = (DLManagedTensor*)&r;
  CHECK_STATUS(tier_ticket_wait_for(reader, 50, &r), TIER_ERROR_TIMED_OUT);
  CHECK(r == NULL);
  CHECK_ERROR_SAYS("tier_ticket_wait_for");
  CHECK_OK(tier_ticket_poll(reader, &ready));
  CHECK(ready == 0); /* still pending after the timeout */

  w->deleter(w); /* the write ends; the reader sees its bytes */
  CHECK_OK(tier_ticket_wait_for(reader, 5000, &r));
  CHECK(r != NULL);
  if (expect_f32((const float*)r->dl_tensor.data, 256, 2)) return 1;
  CHECK_OK(tier_ticket_poll(reader, &ready));
  CHECK(ready == 1);
  DLManagedTensor* again = (DLManagedTensor*)&again;
  CHECK_STATUS(tier_ticket_wait(reader, &again), TIER_ERROR_FAILED_PRECONDITION);
  CHECK(again == NULL);
  CHECK_ERROR_SAYS("already waited on");
  /* The tensor outlives its ticket. */
  tier_ticket_destroy(reader);
  tier_ticket_destroy(writer);
  if (expect_f32((const float*)r->dl_tensor.data, 256, 2)) return 1;
  r->deleter(r);

  /* A ticket dropped while pending: its lease, once granted, ends by itself, so a writer queued
   * after it is not held up. */
  tier_ticket_t* t1 = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_WRITE, NULL, &t1));
  DLManagedTensor* held = NULL;
  CHECK_OK(tier_ticket_wait(t1, &held));
  for (int i = 0; i < 256; ++i) ((float*)held->dl_tensor.data)[i] = (float)i * 0.5f + 2;
  tier_ticket_t* dropped = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, &dropped));
  tier_ticket_destroy(dropped);
  held->deleter(held);
  tier_ticket_destroy(t1);
  tier_ticket_t* t2 = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_WRITE, NULL, &t2));
  CHECK_OK(tier_ticket_wait_for(t2, 5000, &held));
  for (int i = 0; i < 256; ++i) ((float*)held->dl_tensor.data)[i] = (float)i * 0.5f + 2;
  held->deleter(held);
  tier_ticket_destroy(t2);

  /* A read-write ticket that completed but was never waited on: same, and the contents stay. */
  tier_ticket_t* unused = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_DEVICE, TIER_ACCESS_READ_WRITE, NULL, &unused));
  for (int i = 0; i < 500; ++i) {
    CHECK_OK(tier_ticket_poll(unused, &ready));
    if (ready) break;
    sleep_ms(2);
  }
  CHECK(ready == 1);
  tier_ticket_destroy(unused);
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_WRITE, NULL, &t2));
  CHECK_OK(tier_ticket_wait_for(t2, 5000, &held));
  if (expect_f32((const float*)held->dl_tensor.data, 256, 2)) return 1;
  held->deleter(held);
  tier_ticket_destroy(t2);

  /* A write ticket dropped before its tensor was taken is abandoned: the contents stay. */
  tier_ticket_t* dropped_writer = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_DEVICE, TIER_ACCESS_WRITE, NULL, &dropped_writer));
  tier_ticket_destroy(dropped_writer);
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, &t2));
  CHECK_OK(tier_ticket_wait_for(t2, 5000, &held));
  if (expect_f32((const float*)held->dl_tensor.data, 256, 2)) return 1;
  held->deleter(held);
  tier_ticket_destroy(t2);

  /* A failed acquire reports through the wait: larger than the device budget (1 MiB). */
  tier_tensor_t big = {0};
  if (register_f32(f.engine, "big", (2 << 20) / 4, 0, TIER_TIER_HOST, &big)) return 1;
  tier_ticket_t* failing = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, big, TIER_TIER_DEVICE, TIER_ACCESS_READ, NULL, &failing));
  DLManagedTensor* none = (DLManagedTensor*)&none;
  CHECK_STATUS(tier_ticket_wait(failing, &none), TIER_ERROR_RESOURCE_EXHAUSTED);
  CHECK(none == NULL);
  CHECK_ERROR_SAYS("tier.budgets.device");
  CHECK_OK(tier_ticket_poll(failing, &ready));
  CHECK(ready == 1);
  CHECK_STATUS(tier_ticket_wait(failing, &none), TIER_ERROR_FAILED_PRECONDITION);
  tier_ticket_destroy(failing);

  /* NULL arguments. */
  CHECK_STATUS(tier_ticket_poll(NULL, &ready), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'ticket'");
  CHECK_STATUS(tier_ticket_wait(NULL, &none), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_ticket_wait_for(NULL, 1, &none), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_OK(tier_tensor_acquire(f.engine, a, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, &t2));
  CHECK_STATUS(tier_ticket_poll(t2, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_ready'");
  CHECK_STATUS(tier_ticket_wait(t2, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_tensor'");
  tier_ticket_destroy(t2);
  tier_ticket_destroy(NULL); /* ignored */

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

static int test_unknown_tensor(void) {
  fixture f;
  if (setup(&f)) return 1;
  const tier_tensor_t bogus = {12345};
  const tier_tensor_t zero = {0};
  tier_tensor_info_t info = TIER_TENSOR_INFO_INIT;
  tier_ticket_t* ticket = NULL;
  float buf[16];
  CHECK_STATUS(tier_tensor_info(f.engine, bogus, &info), TIER_ERROR_NOT_FOUND);
  CHECK_ERROR_SAYS("names no registered tensor");
  CHECK_STATUS(tier_tensor_info(f.engine, zero, &info), TIER_ERROR_NOT_FOUND);
  CHECK_STATUS(tier_tensor_acquire(f.engine, bogus, TIER_TIER_HOST, TIER_ACCESS_READ, NULL, &ticket),
               TIER_ERROR_NOT_FOUND);
  CHECK(ticket == NULL);
  CHECK_STATUS(tier_tensor_read(f.engine, bogus, buf, sizeof buf), TIER_ERROR_NOT_FOUND);
  CHECK_STATUS(tier_tensor_unregister(f.engine, bogus), TIER_ERROR_NOT_FOUND);
  tier_tensor_t found = {7};
  CHECK_STATUS(tier_tensor_find(f.engine, "nobody", &found), TIER_ERROR_NOT_FOUND);
  CHECK(found.id == 0);
  CHECK_ERROR_SAYS("'nobody'");
  CHECK_STATUS(tier_tensor_find(f.engine, NULL, &found), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_tensor_find(f.engine, "nobody", NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_tensor_unregister(NULL, bogus), TIER_ERROR_INVALID_ARGUMENT);

  /* Unregister; the old handle goes stale even when the engine reuses its slot for a new tensor. */
  tier_tensor_t old = {0};
  if (register_f32(f.engine, "v", 16, 0, TIER_TIER_NVME, &old)) return 1;
  DLManagedTensor* dl = NULL;
  if (acquire(f.engine, old, TIER_TIER_HOST, TIER_ACCESS_READ, &dl)) return 1;
  CHECK_STATUS(tier_tensor_unregister(f.engine, old), TIER_ERROR_FAILED_PRECONDITION);
  CHECK_ERROR_SAYS("'v'");
  dl->deleter(dl);
  CHECK_OK(tier_tensor_unregister(f.engine, old));
  CHECK_STATUS(tier_tensor_info(f.engine, old, &info), TIER_ERROR_NOT_FOUND);
  CHECK_STATUS(tier_tensor_unregister(f.engine, old), TIER_ERROR_NOT_FOUND);
  tier_tensor_t renewed = {0};
  if (register_f32(f.engine, "v", 16, 5, TIER_TIER_HOST, &renewed)) return 1;
  CHECK(renewed.id != old.id);
  CHECK_STATUS(tier_tensor_read(f.engine, old, buf, sizeof buf), TIER_ERROR_NOT_FOUND);
  CHECK_OK(tier_tensor_read(f.engine, renewed, buf, sizeof buf));
  if (expect_f32(buf, 16, 5)) return 1;

  /* A handle from another engine. */
  char dir2[512];
  make_temp_dir(dir2, sizeof dir2);
  tier_engine_t* other = NULL;
  CHECK_OK(engine_in(dir2, 1u << 20, 1u << 20, &other));
  CHECK_STATUS(tier_tensor_read(other, renewed, buf, sizeof buf), TIER_ERROR_NOT_FOUND);
  tier_tensor_t mine = {0};
  if (register_f32(other, "v", 16, 0, TIER_TIER_HOST, &mine)) return 1;
  CHECK(mine.id != renewed.id);
  CHECK_STATUS(tier_tensor_info(f.engine, mine, &info), TIER_ERROR_NOT_FOUND);
  tier_engine_destroy(other);
  nftw(dir2, remove_entry, 16, FTW_DEPTH | FTW_PHYS);

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

/* The number after `key` (and then after `field`, when given) in `json`; -1 when absent. */
static double json_number(const char* json, const char* key, const char* field) {
  const char* at = strstr(json, key);
  if (at != NULL && field != NULL) at = strstr(at, field);
  if (at == NULL || (at = strchr(at, ':')) == NULL) return -1;
  return strtod(at + 1, NULL);
}

static int test_stats_and_steps(void) {
  fixture f;
  if (setup(&f)) return 1;
  tier_tensor_t t[3];
  const char* names[3] = {"l0", "l1", "l2"};
  for (int i = 0; i < 3; ++i) {
    if (register_f32(f.engine, names[i], (256 << 10) / 4, (float)i, TIER_TIER_NVME, &t[i])) return 1;
  }
  /* Three steps over three 256 KiB layers: the first records the order, the next ones replay it. */
  for (int step = 0; step < 3; ++step) {
    CHECK_OK(tier_engine_begin_step(f.engine));
    for (int i = 0; i < 3; ++i) {
      DLManagedTensor* dl = NULL;
      if (acquire(f.engine, t[i], TIER_TIER_DEVICE, TIER_ACCESS_READ, &dl)) return 1;
      if (expect_f32((const float*)dl->dl_tensor.data, (256 << 10) / 4, (float)i)) return 1;
      dl->deleter(dl);
    }
    CHECK_OK(tier_engine_end_step(f.engine));
  }
  char* json = NULL;
  CHECK_OK(tier_engine_stats_json(f.engine, &json));
  CHECK(json != NULL && json[0] == '{');
  CHECK(strstr(json, "\"tiers\"") != NULL && strstr(json, "\"links\"") != NULL);
  CHECK(strstr(json, "\"host_to_device\"") != NULL);
  const char* key = strstr(json, "\"prefetch.trace_length\"");
  CHECK(key != NULL);
  const char* colon = strchr(key, ':');
  CHECK(colon != NULL && strtod(colon + 1, NULL) == 3.0);
  /* At least the nine acquires of the steps (registering counts its own), and the three layers
   * crossed host -> device once: they stayed resident on the device for the later steps. */
  CHECK(json_number(json, "\"engine.acquires\"", NULL) >= 9.0);
  CHECK(json_number(json, "\"host_to_device\"", "\"bytes\"") == 3.0 * (256 << 10));
  CHECK(json_number(json, "\"device\"", "\"budget_bytes\"") == (double)(1u << 20));
  tier_string_free(json);

  json = (char*)&json;
  CHECK_STATUS(tier_engine_stats_json(NULL, &json), TIER_ERROR_INVALID_ARGUMENT);
  CHECK(json == NULL);
  CHECK_STATUS(tier_engine_stats_json(f.engine, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_json'");
  CHECK_STATUS(tier_engine_config_json(NULL, &json), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_engine_flush(NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_engine_begin_step(NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_engine_end_step(NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_engine_check(NULL), TIER_ERROR_INVALID_ARGUMENT);
  DLDevice d;
  CHECK_STATUS(tier_engine_device(NULL, &d), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_engine_device(f.engine, NULL), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("'out_device'");
  tier_string_free(NULL); /* ignored */

  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

typedef struct thread_result {
  int empty_at_start;
  int failed_as_expected;
  char message[256];
} thread_result;

static void* fail_on_another_thread(void* arg) {
  thread_result* r = (thread_result*)arg;
  r->empty_at_start = strcmp(tier_last_error(), "") == 0;
  r->failed_as_expected = tier_tensor_find(NULL, "x", NULL) == TIER_ERROR_INVALID_ARGUMENT;
  snprintf(r->message, sizeof r->message, "%s", tier_last_error());
  return NULL;
}

static int test_last_error_per_thread(void) {
  CHECK_STATUS(tier_engine_flush(NULL), TIER_ERROR_INVALID_ARGUMENT);
  char mine[256];
  snprintf(mine, sizeof mine, "%s", tier_last_error());
  CHECK(strcmp(mine, "tier_engine_flush: invalid_argument: argument 'engine' is NULL") == 0);

  thread_result r;
  memset(&r, 0, sizeof r);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, fail_on_another_thread, &r) == 0);
  CHECK(pthread_join(th, NULL) == 0);
  CHECK(r.empty_at_start);
  CHECK(r.failed_as_expected);
  CHECK(strstr(r.message, "tier_tensor_find") != NULL);
  CHECK(strcmp(tier_last_error(), mine) == 0); /* the other thread's failure is its own */

  /* A successful call leaves the last error alone. */
  CHECK(tier_version() == TIER_VERSION);
  CHECK(strcmp(tier_status_string(TIER_OK), "ok") == 0);
  CHECK(strcmp(tier_last_error(), mine) == 0);
  return 0;
}

static int test_engine_outlives_handle(void) {
  fixture f;
  if (setup(&f)) return 1;
  tier_tensor_t t = {0};
  if (register_f32(f.engine, "kept", 1024, 3, TIER_TIER_NVME, &t)) return 1;
  DLManagedTensor* dl = NULL;
  if (acquire(f.engine, t, TIER_TIER_DEVICE, TIER_ACCESS_READ, &dl)) return 1;
  tier_ticket_t* pending = NULL;
  CHECK_OK(tier_tensor_acquire(f.engine, t, TIER_TIER_HOST, TIER_ACCESS_READ_WRITE, NULL, &pending));

  /* The handle goes; the tensor and the ticket keep the engine. */
  tier_engine_destroy(f.engine);
  f.engine = NULL;
  if (expect_f32((const float*)dl->dl_tensor.data, 1024, 3)) return 1;
  dl->deleter(dl); /* the read lease ends, so the pending writer gets the tensor */
  DLManagedTensor* w = NULL;
  CHECK_OK(tier_ticket_wait_for(pending, 5000, &w));
  if (expect_f32((const float*)w->dl_tensor.data, 1024, 3)) return 1;
  tier_ticket_destroy(pending);
  w->deleter(w); /* the last reference: the engine shuts down here */
  teardown(&f);
  return 0;
}

/* Strides, shapes and offsets whose byte arithmetic overflows or reaches past any buffer are
 * refused naming the dimension; before the checks a stride of 2^60 read far outside the buffer and
 * one of 2^62 wrapped to offset 0 and registered silently. */
static int test_register_overflowing_layouts(void) {
  fixture f;
  if (setup(&f)) return 1;
  int deleted = 0;
  const int64_t two = 2;
  const int64_t past[1] = {(int64_t)1 << 60};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 1, &two, past, 8, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "strides[0] is 1152921504606846976", &deleted))
    return 1;
  const int64_t wraps[1] = {(int64_t)1 << 62};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 1, &two, wraps, 8, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "strides[0] is 4611686018427387904", &deleted))
    return 1;
  const int64_t backwards[1] = {-((int64_t)1 << 60)};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 1, &two, backwards, 8, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "strides[0]", &deleted))
    return 1;
  const int64_t shape2[2] = {3, 2};
  const int64_t max_stride[2] = {INT64_MAX, 1};
  if (expect_register_fails(f.engine, "x", make_tensor(kI64, 2, shape2, max_stride, 48, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "strides[0] is 9223372036854775807 with shape[0] 3", &deleted))
    return 1;
  /* Two strides that each fit but together span past any buffer. */
  const int64_t each_fits[2] = {(int64_t)1 << 51, (int64_t)1 << 52};
  if (expect_register_fails(f.engine, "x", make_tensor(kI64, 2, shape2, each_fits, 48, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "strides[1]", &deleted))
    return 1;
  const int64_t huge_shape[3] = {(int64_t)1 << 30, (int64_t)1 << 30, 4};
  if (expect_register_fails(f.engine, "x", make_tensor(kF32, 3, huge_shape, NULL, 4, &deleted), NULL,
                            TIER_ERROR_INVALID_ARGUMENT, "shape[2] is 4: the tensor's byte size overflows", &deleted))
    return 1;
  DLManagedTensor* far = make_f32(4, 0, &deleted);
  far->dl_tensor.byte_offset = (uint64_t)1 << 63;
  if (expect_register_fails(f.engine, "x", far, NULL, TIER_ERROR_INVALID_ARGUMENT, "byte_offset is 9223372036854775808",
                            &deleted))
    return 1;

  /* A real reversed view still registers: shape {4}, stride -1, starting at the last element. */
  const int64_t four = 4;
  const int64_t reverse[1] = {-1};
  DLManagedTensor* rev = make_tensor(kI32, 1, &four, reverse, 4 * sizeof(int32_t), &deleted);
  for (int i = 0; i < 4; ++i) ((int32_t*)rev->dl_tensor.data)[i] = 10 + i;
  rev->dl_tensor.byte_offset = 3 * sizeof(int32_t);
  tier_tensor_t t;
  CHECK_OK(tier_tensor_register(f.engine, "reversed", rev, NULL, &t));
  int32_t back[4];
  CHECK_OK(tier_tensor_read(f.engine, t, back, sizeof back));
  for (int i = 0; i < 4; ++i) CHECK(back[i] == 13 - i);
  CHECK_OK(tier_engine_check(f.engine));
  teardown(&f);
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Communicators from C: a one-rank "framework" whose all_reduce is the identity, and which can be
 * told to fail; the shard layout; NCCL's argument checks (the NCCL runs need a GPU: tests/comm). */

typedef struct one_rank {
  int calls;
  int destroyed;
  int fail;
} one_rank;

static int one_all_reduce(void* user, void* buf, uint64_t count, tier_dtype_t dtype, tier_reduce_op_t op) {
  one_rank* r = (one_rank*)user;
  (void)buf;
  (void)count;
  (void)dtype;
  (void)op;
  ++r->calls;
  return r->fail ? TIER_ERROR_TIMED_OUT : TIER_OK;
}

static const char* one_error(void* user) {
  return ((one_rank*)user)->fail ? "rank 1 did not answer (from the framework)" : "";
}

static void one_destroy(void* user) {
  ++((one_rank*)user)->destroyed;
}

static int test_communicators(void) {
  one_rank state = {0, 0, 0};
  tier_comm_callbacks_t cb = TIER_COMM_CALLBACKS_INIT;
  cb.user = &state;
  cb.all_reduce = one_all_reduce;
  cb.error_message = one_error;
  cb.destroy = one_destroy;
  tier_comm_t* comm = NULL;
  CHECK_OK(tier_comm_create_callbacks(&cb, &comm));
  int32_t rank = -1, world = -1;
  CHECK_OK(tier_comm_rank_world(comm, &rank, &world));
  CHECK(rank == 0 && world == 1);

  float x[3] = {1.0f, 2.0f, 3.0f}, y[3] = {0};
  CHECK_OK(tier_comm_all_reduce(comm, x, 3, TIER_DTYPE_F32, TIER_REDUCE_SUM));
  CHECK_OK(tier_comm_reduce_scatter(comm, x, y, 3, TIER_DTYPE_F32, TIER_REDUCE_MAX));
  CHECK(y[0] == 1.0f && y[1] == 2.0f && y[2] == 3.0f);
  CHECK_OK(tier_comm_all_gather(comm, x, y, 3, TIER_DTYPE_F32));
  CHECK(y[2] == 3.0f);
  CHECK_OK(tier_comm_broadcast(comm, x, 3, TIER_DTYPE_F32, 0));
  CHECK_OK(tier_comm_barrier(comm));
  CHECK(state.calls == 5); /* the missing callbacks were built from all_reduce */
  CHECK_STATUS(tier_comm_broadcast(comm, x, 3, TIER_DTYPE_F32, 1), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_STATUS(tier_comm_all_reduce(comm, x, 3, (tier_dtype_t)99, TIER_REDUCE_SUM), TIER_ERROR_INVALID_ARGUMENT);
  CHECK_ERROR_SAYS("argument 'dtype' is 99");

  /* The framework's failure comes back with its code and its message. */
  state.fail = 1;
  CHECK_STATUS(tier_comm_all_reduce(comm, x, 3, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_ERROR_TIMED_OUT);
  CHECK_ERROR_SAYS("tier_comm_all_reduce: timed_out");
  CHECK_ERROR_SAYS("rank 1 did not answer (from the framework)");
  CHECK(state.destroyed == 0);
  tier_comm_destroy(comm);
  CHECK(state.destroyed == 1);
  tier_comm_destroy(NULL);

  cb.all_reduce = NULL;
  CHECK_STATUS(tier_comm_create_callbacks(&cb, &comm), TIER_ERROR_INVALID_ARGUMENT);
  CHECK(comm == NULL);
  CHECK(state.destroyed == 1);

  uint64_t offset = 0, count = 0;
  CHECK_OK(tier_shard_range(10, 4, 3, &offset, &count));
  CHECK(offset == 9 && count == 1);
  CHECK_OK(tier_shard_range(3, 8, 5, &offset, &count));
  CHECK(offset == 3 && count == 0);
  CHECK_STATUS(tier_shard_range(3, 8, 8, &offset, &count), TIER_ERROR_INVALID_ARGUMENT);

  tier_comm_nccl_config_t nc = TIER_COMM_NCCL_CONFIG_INIT;
  nc.world = 2;
  nc.rank = 2;
  CHECK_STATUS(tier_comm_create_nccl(&nc, &comm), TIER_ERROR_INVALID_ARGUMENT);
  CHECK(comm == NULL);
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The optimizer's overlapped step, borrowed gradients, skipped parameters and group
 * hyper-parameters: a serial optimizer and an overlapped one stepped side by side give the same
 * bytes, one step clipped (its overlapped pass is then run again serially). */

enum { kOvParams = 2 };
static const int64_t kOvNumel[kOvParams] = {3072, 2048};
static const char* const kOvNames[kOvParams] = {"w0", "w1"};

static DLTensor host_f32(float* data, const int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype = kF32;
  t.shape = (int64_t*)shape;
  return t;
}

static int overlap_optimizer(const char* dir, const char* sub, tier_optimizer_t** out) {
  char path[600];
  char json[1400];
  snprintf(path, sizeof path, "%s/%s", dir, sub);
  snprintf(
      json, sizeof json,
      "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.01}},"
      " \"gradient_clipping\": 1.0,"
      " \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
      " \"tier\": {\"io\": {\"use_direct\": false}, \"optimizer\": {\"chunk_elements\": 1024}}}",
      path);
  tier_optimizer_config_t c = TIER_OPTIMIZER_CONFIG_INIT;
  c.json = json;
  c.ignore_env = 1;
  c.max_elements = 8192;
  CHECK_OK(tier_optimizer_create(&c, out));
  for (int k = 0; k < kOvParams; ++k) {
    float init[3072];
    for (int64_t i = 0; i < kOvNumel[k]; ++i) init[i] = 0.5f * sinf(0.37f * (float)i + (float)k);
    DLTensor t = host_f32(init, &kOvNumel[k]);
    CHECK_OK(tier_optimizer_add_param(*out, kOvNames[k], &t, 0, NULL));
  }
  return 0;
}

static int test_optimizer_overlap(void) {
  char dir[512];
  make_temp_dir(dir, sizeof dir);
  tier_optimizer_t *serial = NULL, *over = NULL;
  int rc = overlap_optimizer(dir, "serial", &serial);
  if (rc == 0) rc = overlap_optimizer(dir, "overlap", &over);
  if (rc != 0) return rc;
  static float grads[kOvParams][3072], out_s[kOvParams][3072], out_o[kOvParams][3072];
  DLTensor g[kOvParams], os[kOvParams], oo[kOvParams];
  DLTensor *os_p[kOvParams], *oo_p[kOvParams];
  for (int k = 0; k < kOvParams; ++k) {
    g[k] = host_f32(grads[k], &kOvNumel[k]);
    os[k] = host_f32(out_s[k], &kOvNumel[k]);
    oo[k] = host_f32(out_o[k], &kOvNumel[k]);
    os_p[k] = &os[k];
    oo_p[k] = &oo[k];
  }
  tier_step_options_t so = TIER_STEP_OPTIONS_INIT, oo_opts = TIER_STEP_OPTIONS_INIT;
  so.params_out = os_p;
  so.num_params_out = kOvParams;
  oo_opts.params_out = oo_p;
  oo_opts.num_params_out = kOvParams;
  for (int step = 1; step <= 3; ++step) {
    /* Step 2's gradients are large: clipped at 1.0 (norm about 2000); the others are not (0.2). */
    const float scale = step == 2 ? 40.0f : 0.004f;
    for (int k = 0; k < kOvParams; ++k) {
      for (int64_t i = 0; i < kOvNumel[k]; ++i) grads[k][i] = scale * sinf(0.11f * (float)i + (float)(step * 3 + k));
    }
    if (step == 3) { /* a schedule: both take a new lr and betas through their group */
      tier_param_group_t gp = TIER_PARAM_GROUP_INIT, got = TIER_PARAM_GROUP_INIT;
      CHECK_OK(tier_optimizer_get_group(serial, 0, &got));
      CHECK(got.lr == 0.01 && got.weight_decay == 0.01);
      gp = got;
      gp.lr = 0.005;
      gp.beta1 = 0.8;
      CHECK_OK(tier_optimizer_set_group(serial, 0, &gp));
      CHECK_OK(tier_optimizer_set_group(over, 0, &gp));
      CHECK_OK(tier_optimizer_get_group(over, 0, &got));
      CHECK(got.lr == 0.005 && got.beta1 == 0.8);
      gp.beta1 = 1.5;
      CHECK_STATUS(tier_optimizer_set_group(over, 0, &gp), TIER_ERROR_INVALID_ARGUMENT);
      CHECK_OK(tier_optimizer_get_group(over, 0, &got));
      CHECK(got.beta1 == 0.8); /* the refused values changed nothing */
    }
    for (int k = 0; k < kOvParams; ++k) CHECK_OK(tier_optimizer_add_grad_borrowed(serial, (uint32_t)k, &g[k]));
    tier_step_report_t rs = TIER_STEP_REPORT_INIT, ro = TIER_STEP_REPORT_INIT;
    CHECK_OK(tier_optimizer_step(serial, &so, &rs));
    CHECK(rs.overlapped == 0 && (rs.clip_coefficient < 1.0) == (step == 2));

    CHECK_OK(tier_optimizer_start_overlap(over, &oo_opts));
    CHECK_STATUS(tier_optimizer_start_overlap(over, &oo_opts), TIER_ERROR_FAILED_PRECONDITION);
    CHECK_OK(tier_optimizer_add_grad_borrowed(over, 1, &g[1])); /* backward's order: the last first */
    CHECK_STATUS(tier_optimizer_finish_overlap(over, &ro), TIER_ERROR_FAILED_PRECONDITION);
    CHECK_ERROR_SAYS("'w0'");
    CHECK_OK(tier_optimizer_add_grad_borrowed(over, 0, &g[0]));
    CHECK_OK(tier_optimizer_finish_overlap(over, &ro));
    CHECK(ro.overlapped == 1 && ro.redone == (step == 2) && ro.step == rs.step);
    for (int k = 0; k < kOvParams; ++k) {
      CHECK(memcmp(out_s[k], out_o[k], (size_t)kOvNumel[k] * sizeof(float)) == 0);
    }
  }
  /* A cancelled overlap keeps the gradients; the step then runs serially, to the same bytes. */
  for (int k = 0; k < kOvParams; ++k) CHECK_OK(tier_optimizer_add_grad(serial, (uint32_t)k, &g[k]));
  CHECK_OK(tier_optimizer_step(serial, &so, NULL));
  CHECK_OK(tier_optimizer_start_overlap(over, &oo_opts));
  for (int k = kOvParams - 1; k >= 0; --k) CHECK_OK(tier_optimizer_add_grad(over, (uint32_t)k, &g[k]));
  CHECK_OK(tier_optimizer_cancel_overlap(over));
  CHECK_STATUS(tier_optimizer_finish_overlap(over, NULL), TIER_ERROR_FAILED_PRECONDITION);
  CHECK_OK(tier_optimizer_step(over, &oo_opts, NULL));
  for (int k = 0; k < kOvParams; ++k) CHECK(memcmp(out_s[k], out_o[k], (size_t)kOvNumel[k] * sizeof(float)) == 0);
  /* Skipped parameters: w1 gets no gradient; refused unless skip_missing, then left as it was. */
  static float w1_before[2048];
  memcpy(w1_before, out_o[1], sizeof w1_before);
  CHECK_OK(tier_optimizer_add_grad(over, 0, &g[0]));
  CHECK_STATUS(tier_optimizer_step(over, &oo_opts, NULL), TIER_ERROR_FAILED_PRECONDITION);
  CHECK_ERROR_SAYS("'w1'");
  oo_opts.skip_missing = 1;
  CHECK_OK(tier_optimizer_step(over, &oo_opts, NULL));
  CHECK(memcmp(w1_before, out_o[1], sizeof w1_before) == 0);
  CHECK(memcmp(out_s[0], out_o[0], sizeof(float) * 3072) != 0); /* w0 moved */
  tier_optimizer_destroy(serial);
  tier_optimizer_destroy(over);
  nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Driver */

typedef struct test_case {
  const char* name;
  int (*fn)(void);
} test_case;

static const test_case kCases[] = {
    {"version", test_version},
    {"optimizer_types", test_optimizer_types},
    {"status_strings", test_status_strings},
    {"engine_create_errors", test_engine_create_errors},
    {"register_and_read", test_register_and_read},
    {"register_strided", test_register_strided},
    {"register_errors", test_register_errors},
    {"register_overflowing_layouts", test_register_overflowing_layouts},
    {"acquire_dlpack", test_acquire_dlpack},
    {"write_through_lease", test_write_through_lease},
    {"tickets", test_tickets},
    {"unknown_tensor", test_unknown_tensor},
    {"stats_and_steps", test_stats_and_steps},
    {"last_error_per_thread", test_last_error_per_thread},
    {"engine_outlives_handle", test_engine_outlives_handle},
    {"communicators", test_communicators},
    {"optimizer_overlap", test_optimizer_overlap},
};

int main(int argc, char** argv) {
  const size_t n = sizeof kCases / sizeof kCases[0];
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    for (size_t i = 0; i < n; ++i) printf("%s\n", kCases[i].name);
    return 0;
  }
  if (argc != 2) {
    fprintf(stderr, "usage: %s <case> | --list\n", argv[0]);
    return 2;
  }
  for (size_t i = 0; i < n; ++i) {
    if (strcmp(argv[1], kCases[i].name) == 0) {
      const int rc = kCases[i].fn();
      printf("%s: %s\n", kCases[i].name, rc == 0 ? "passed" : rc == 77 ? "skipped" : "FAILED");
      return rc;
    }
  }
  fprintf(stderr, "no case named '%s' (--list shows them)\n", argv[1]);
  return 2;
}
