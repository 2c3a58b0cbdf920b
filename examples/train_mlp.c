/* examples/train_mlp.c — training through the C ABI: a small MLP whose forward and backward are
 * plain C, with its AdamW state (fp32 masters and both moments) on NVMe in a swap folder.
 *
 *   train_mlp [--check] [swap_dir]
 *
 * The program keeps its parameters in its own float arrays and hands tier only DLTensors over
 * them: once to add each parameter, then every step its gradients; tier_optimizer_step runs AdamW
 * where the state lives (read from the swap file, updated, written back) and writes the new
 * parameters straight into the program's arrays.
 *
 * swap_dir defaults to train_mlp-swap in the current directory (in $TIER_TEST_DIR when set) and
 * is then removed at the end if nothing else is in it; tier creates it when missing, and its swap
 * files go when the optimizer does.
 *
 * --check turns the example into a test (ctest runs both): every step is compared with a reference
 * AdamW in double precision run on the same gradients, the optimizer's moments and its step report
 * are compared too, the swap folder is looked into, and bad calls (a gradient of the wrong shape,
 * a missing gradient, a NaN learning rate, a name given twice, ...) must fail with the documented
 * code and change nothing. Exit status: 0 pass, 1 failure.
 *
 * The training path uses only tier/tier.h and the C standard library; --check also uses POSIX
 * (mkdtemp, opendir, stat) to make a private folder and see the swap files on disk. */
#define _POSIX_C_SOURCE 200809L

#include <tier/tier.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dirent.h>   /* --check only */
#include <sys/stat.h> /* --check only */

/* ---------------------------------------------------------------------------------------------
 * The model: IN -> HID (tanh) -> OUT, mean squared error on one fixed batch. The parameters sit
 * in one flat float array, in the order they are added to the optimizer. */

enum { IN = 8, HID = 16, OUT = 4, BATCH = 32, STEPS = 30, NPARAMS = 4 };
enum {
  OFF_W1 = 0,
  OFF_B1 = OFF_W1 + HID * IN,
  OFF_W2 = OFF_B1 + HID,
  OFF_B2 = OFF_W2 + OUT * HID,
  NUMEL = OFF_B2 + OUT
};

static const char* const kNames[NPARAMS] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
static const int kOffset[NPARAMS] = {OFF_W1, OFF_B1, OFF_W2, OFF_B2};
static const int32_t kNdim[NPARAMS] = {2, 1, 2, 1};
static int64_t kShape[NPARAMS][2] = {{HID, IN}, {HID, 0}, {OUT, HID}, {OUT, 0}}; /* DLTensor wants int64_t* */

static const double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWeightDecay = 0.01;

/* A tiny deterministic PRNG (xorshift32), so every run sees the same data and initial weights. */
static uint32_t rng_state = 0x12345678u;
static float uniform(float lo, float hi) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 17;
  rng_state ^= rng_state << 5;
  return lo + (hi - lo) * (float)(rng_state >> 8) / (float)(1u << 24);
}

typedef struct batch {
  float x[BATCH][IN];
  float y[BATCH][OUT];
} batch_t;

/* Inputs in [-1, 1]; targets from a fixed random "teacher": y = tanh(T x). */
static void make_batch(batch_t* b) {
  float teacher[OUT][IN];
  for (int k = 0; k < OUT; ++k)
    for (int j = 0; j < IN; ++j) teacher[k][j] = uniform(-1.0f, 1.0f);
  for (int n = 0; n < BATCH; ++n) {
    for (int j = 0; j < IN; ++j) b->x[n][j] = uniform(-1.0f, 1.0f);
    for (int k = 0; k < OUT; ++k) {
      float z = 0.0f;
      for (int j = 0; j < IN; ++j) z += teacher[k][j] * b->x[n][j];
      b->y[n][k] = tanhf(z);
    }
  }
}

/* torch.nn.Linear's default: uniform in +-1/sqrt(fan_in), weights and biases alike. */
static void init_params(float* p) {
  const float a1 = 1.0f / sqrtf((float)IN), a2 = 1.0f / sqrtf((float)HID);
  for (int i = OFF_W1; i < OFF_W2; ++i) p[i] = uniform(-a1, a1);
  for (int i = OFF_W2; i < NUMEL; ++i) p[i] = uniform(-a2, a2);
}

/* The batch's loss; its gradient with respect to every parameter goes to `g` (NUMEL floats). */
static double forward_backward(const float* p, const batch_t* b, float* g) {
  const float* w1 = p + OFF_W1;
  const float* b1 = p + OFF_B1;
  const float* w2 = p + OFF_W2;
  const float* b2 = p + OFF_B2;
  memset(g, 0, NUMEL * sizeof *g);
  double loss = 0.0;
  for (int n = 0; n < BATCH; ++n) {
    const float* x = b->x[n];
    float h[HID], d_out[OUT];
    for (int i = 0; i < HID; ++i) {
      float z = b1[i];
      for (int j = 0; j < IN; ++j) z += w1[i * IN + j] * x[j];
      h[i] = tanhf(z);
    }
    for (int k = 0; k < OUT; ++k) {
      float o = b2[k];
      for (int i = 0; i < HID; ++i) o += w2[k * HID + i] * h[i];
      const float e = o - b->y[n][k];
      loss += (double)e * e;
      d_out[k] = 2.0f * e / (float)(BATCH * OUT);
    }
    for (int k = 0; k < OUT; ++k) {
      g[OFF_B2 + k] += d_out[k];
      for (int i = 0; i < HID; ++i) g[OFF_W2 + k * HID + i] += d_out[k] * h[i];
    }
    for (int i = 0; i < HID; ++i) {
      float d_h = 0.0f;
      for (int k = 0; k < OUT; ++k) d_h += w2[k * HID + i] * d_out[k];
      const float d_z = d_h * (1.0f - h[i] * h[i]);
      g[OFF_B1 + i] += d_z;
      for (int j = 0; j < IN; ++j) g[OFF_W1 + i * IN + j] += d_z * x[j];
    }
  }
  return loss / (BATCH * OUT);
}

/* ---------------------------------------------------------------------------------------------
 * tier: DLTensors over our arrays, and every call's status checked. */

static DLTensor f32_tensor(float* data, int32_t ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = NULL; /* compact row-major */
  t.byte_offset = 0;
  return t;
}

/* Prints the failed call with tier's message; 1 when the call succeeded. */
static int ok(tier_status_t status, const char* call) {
  if (status == TIER_OK) return 1;
  fprintf(stderr, "train_mlp: %s failed: %s: %s\n", call, tier_status_string(status), tier_last_error());
  return 0;
}
#define TRY(call)                      \
  do {                                 \
    if (!ok((call), #call)) goto done; \
  } while (0)

typedef struct trainer {
  tier_optimizer_t* opt;
  float params[NUMEL]; /* ours: the forward reads them, the step writes them */
  float grads[NUMEL];
  DLTensor param_t[NPARAMS];
  DLTensor grad_t[NPARAMS];
  DLTensor* params_out[NPARAMS];
} trainer_t;

static void trainer_views(trainer_t* t) {
  for (int i = 0; i < NPARAMS; ++i) {
    t->param_t[i] = f32_tensor(t->params + kOffset[i], kNdim[i], kShape[i]);
    t->grad_t[i] = f32_tensor(t->grads + kOffset[i], kNdim[i], kShape[i]);
    t->params_out[i] = &t->param_t[i];
  }
}

static tier_status_t create_optimizer(const char* swap_dir, int ignore_env, tier_optimizer_t** out) {
  char json[2048];
  const int n = snprintf(json, sizeof json,
                         "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": %g, \"betas\": [%g, %g],"
                         " \"eps\": %g, \"weight_decay\": %g}},"
                         " \"zero_optimization\": {\"stage\": 3,"
                         " \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
                         " \"tier\": {\"log_level\": \"warn\"}}",
                         kLr, kBeta1, kBeta2, kEps, kWeightDecay, swap_dir);
  if (n < 0 || (size_t)n >= sizeof json || strpbrk(swap_dir, "\"\\") != NULL) {
    fprintf(stderr, "train_mlp: swap folder '%s': too long or holds a quote or backslash\n", swap_dir);
    return TIER_ERROR_INVALID_ARGUMENT;
  }
  tier_optimizer_config_t config = TIER_OPTIMIZER_CONFIG_INIT;
  config.json = json;
  config.strict = 1;              /* a misspelt key is an error, not a note */
  config.ignore_env = ignore_env; /* --check: the TIER_* environment cannot change the numbers */
  config.max_elements = NUMEL;    /* required with NVMe state: sizes the swap files' cap */
  config.max_params = NPARAMS;
  return tier_optimizer_create(&config, out);
}

/* The gradients of parameters [from, to) into the optimizer. */
static tier_status_t give_grads(trainer_t* t, int from, int to) {
  for (int i = from; i < to; ++i) {
    const tier_status_t st = tier_optimizer_add_grad(t->opt, (uint32_t)i, &t->grad_t[i]);
    if (st != TIER_OK) return st;
  }
  return TIER_OK;
}

/* One AdamW step; the updated parameters land in t->params. */
static tier_status_t take_step(trainer_t* t, tier_step_report_t* report) {
  tier_step_options_t options = TIER_STEP_OPTIONS_INIT;
  options.params_out = t->params_out;
  options.num_params_out = NPARAMS;
  return tier_optimizer_step(t->opt, &options, report);
}

/* ---------------------------------------------------------------------------------------------
 * --check: the reference AdamW (torch.optim.AdamW's update, in double) and the checks. */

typedef struct reference {
  double p[NUMEL], m[NUMEL], v[NUMEL];
  int64_t step;
} reference_t;

static void reference_step(reference_t* r, const float* g) {
  r->step += 1;
  const double bc1 = 1.0 - pow(kBeta1, (double)r->step), bc2 = 1.0 - pow(kBeta2, (double)r->step);
  for (int i = 0; i < NUMEL; ++i) {
    r->p[i] -= kLr * kWeightDecay * r->p[i]; /* decoupled weight decay */
    r->m[i] = kBeta1 * r->m[i] + (1.0 - kBeta1) * g[i];
    r->v[i] = kBeta2 * r->v[i] + (1.0 - kBeta2) * (double)g[i] * g[i];
    r->p[i] -= kLr * (r->m[i] / bc1) / (sqrt(r->v[i] / bc2) + kEps);
  }
}

static int failures = 0;

#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fflush(stdout);                                                          \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* `call` returned `want`, and, when `names` is given, tier_last_error() names it. */
static int expect_status(tier_status_t got, tier_status_t want, const char* call, const char* names) {
  fflush(stdout);
  if (got != want) {
    fprintf(stderr, "check failed: %s returned %s, expected %s (last error: %s)\n", call, tier_status_string(got),
            tier_status_string(want), tier_last_error());
    ++failures;
    return 0;
  }
  if (names != NULL && strstr(tier_last_error(), names) == NULL) {
    fprintf(stderr, "check failed: %s: the message does not name '%s': %s\n", call, names, tier_last_error());
    ++failures;
    return 0;
  }
  printf("  refused as expected: %s -> %s: %s\n", call, tier_status_string(got), tier_last_error());
  return 1;
}
#define EXPECT_STATUS(call, want, names) expect_status((call), (want), #call, (names))

/* |tier - reference| over every parameter; a failure when above 1e-5 relative (1e-5 absolute
 * below 1). */
static double compare_params(const trainer_t* t, const reference_t* r, int step) {
  double max_diff = 0.0;
  int bad = -1;
  for (int i = 0; i < NUMEL; ++i) {
    const double d = fabs((double)t->params[i] - r->p[i]);
    if (d > max_diff) max_diff = d;
    if (bad < 0 && !(d <= 1e-5 * fmax(1.0, fabs(r->p[i])))) bad = i;
  }
  EXPECT(bad < 0, "step %d: element %d is %.9g, the reference %.9g", step, bad, bad < 0 ? 0.0 : t->params[bad],
         bad < 0 ? 0.0 : r->p[bad]);
  return max_diff;
}

/* A state array read back from the optimizer (tier_optimizer_read_state) into `out`. */
static int read_state(trainer_t* t, tier_state_kind_t kind, float* out) {
  for (int i = 0; i < NPARAMS; ++i) {
    DLTensor dst = f32_tensor(out + kOffset[i], kNdim[i], kShape[i]);
    if (!ok(tier_optimizer_read_state(t->opt, (uint32_t)i, kind, &dst), "tier_optimizer_read_state")) return 0;
  }
  return 1;
}

/* The optimizer's moments against the reference's m and v, and its fp32 masters against our
 * params (the step wrote the latter from the former: equal bit for bit). Returns max |exp_avg - m|.
 * m is a running mean of gradients of both signs, so an element can be small by cancellation:
 * the tolerance is 1e-5 of the largest |m| (|v|), not of the element's own. */
static double compare_state(trainer_t* t, const reference_t* r, int step) {
  static const char* const names[2] = {"exp_avg", "exp_avg_sq"};
  const tier_state_kind_t kinds[2] = {TIER_STATE_EXP_AVG, TIER_STATE_EXP_AVG_SQ};
  const double* refs[2] = {r->m, r->v};
  float got[NUMEL];
  double max_exp_avg_diff = 0.0;
  for (int s = 0; s < 2; ++s) {
    if (!read_state(t, kinds[s], got)) {
      ++failures;
      return INFINITY;
    }
    double scale = 0.0;
    for (int i = 0; i < NUMEL; ++i) scale = fmax(scale, fabs(refs[s][i]));
    for (int i = 0; i < NUMEL; ++i) {
      const double d = fabs((double)got[i] - refs[s][i]);
      if (s == 0 && d > max_exp_avg_diff) max_exp_avg_diff = d;
      EXPECT(d <= 1e-5 * scale, "step %d: %s[%d] is %.9g, the reference %.9g (largest %.3g)", step, names[s], i, got[i],
             refs[s][i], scale);
    }
  }
  if (!read_state(t, TIER_STATE_MASTER, got)) {
    ++failures;
    return INFINITY;
  }
  EXPECT(memcmp(got, t->params, sizeof got) == 0, "step %d: the fp32 masters are not the params written out", step);
  return max_exp_avg_diff;
}

/* The step counter of group 0, or -1. */
static int64_t group_step(trainer_t* t) {
  int64_t step = -1;
  if (!ok(tier_optimizer_group_step(t->opt, 0, &step), "tier_optimizer_group_step")) ++failures;
  return step;
}

/* Bytes in tier's swap files (tier-swap-*.bin) in `dir`, or -1 when it cannot be read. */
static long long swap_file_bytes(const char* dir, int* files) {
  DIR* d = opendir(dir);
  if (d == NULL) return -1;
  long long bytes = 0;
  *files = 0;
  for (struct dirent* e; (e = readdir(d)) != NULL;) {
    const size_t len = strlen(e->d_name);
    if (strncmp(e->d_name, "tier-swap-", 10) != 0 || len < 4 || strcmp(e->d_name + len - 4, ".bin") != 0) continue;
    char path[1024];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (stat(path, &st) == 0) {
      bytes += (long long)st.st_size;
      *files += 1;
    }
  }
  closedir(d);
  return bytes;
}

/* The params are as `before` (bit for bit), in our arrays and in the optimizer's masters, and
 * the step counter is `step`: what a refused call must leave. */
static void expect_unchanged(trainer_t* t, const float* before, int64_t step, const char* after) {
  EXPECT(memcmp(t->params, before, sizeof t->params) == 0, "after %s: our params changed", after);
  float master[NUMEL];
  for (int i = 0; i < NPARAMS; ++i) {
    DLTensor dst = f32_tensor(master + kOffset[i], kNdim[i], kShape[i]);
    if (!ok(tier_optimizer_read_param(t->opt, (uint32_t)i, &dst), "tier_optimizer_read_param")) ++failures;
  }
  EXPECT(memcmp(master, before, sizeof master) == 0, "after %s: the optimizer's params changed", after);
  EXPECT(group_step(t) == step, "after %s: the step counter moved", after);
}

/* Bad calls made during step `step`, before its good gradients and step. Each is refused and
 * leaves everything as it was; the step the caller then takes must still match the reference. */
static int refused_calls(trainer_t* t, int step) {
  float before[NUMEL];
  memcpy(before, t->params, sizeof before);
  const int64_t steps_so_far = step - 1;
  switch (step) {
    case 3: { /* gradients of the wrong shape; one gradient given twice */
      if (!ok(give_grads(t, 0, 2), "give_grads")) return 0;
      int64_t transposed[2] = {HID, OUT}; /* fc2.weight is {OUT, HID}: same numel, other shape */
      DLTensor bad = f32_tensor(t->grads + OFF_W2, 2, transposed);
      EXPECT_STATUS(tier_optimizer_add_grad(t->opt, 2, &bad), TIER_ERROR_INVALID_ARGUMENT, "fc2.weight");
      int64_t short_shape[1] = {OUT - 1};
      bad = f32_tensor(t->grads + OFF_B2, 1, short_shape);
      EXPECT_STATUS(tier_optimizer_add_grad(t->opt, 3, &bad), TIER_ERROR_INVALID_ARGUMENT, "fc2.bias");
      bad = f32_tensor(t->grads + OFF_W2, 1, kShape[2]); /* {OUT} for a 2-d parameter */
      EXPECT_STATUS(tier_optimizer_add_grad(t->opt, 2, &bad), TIER_ERROR_INVALID_ARGUMENT, "fc2.weight");
      EXPECT_STATUS(tier_optimizer_add_grad(t->opt, NPARAMS, &t->grad_t[0]), TIER_ERROR_INVALID_ARGUMENT, NULL);
      /* gradient_accumulation_steps is 1: a second gradient for fc1.weight is one too many. */
      EXPECT_STATUS(tier_optimizer_add_grad(t->opt, 0, &t->grad_t[0]), TIER_ERROR_FAILED_PRECONDITION, "fc1.weight");
      if (!ok(give_grads(t, 2, NPARAMS), "give_grads")) return 0;
      break;
    }
    case 5: { /* a step with a gradient missing; it may be given afterwards */
      if (!ok(give_grads(t, 0, NPARAMS - 1), "give_grads")) return 0;
      tier_step_report_t report = TIER_STEP_REPORT_INIT;
      EXPECT_STATUS(take_step(t, &report), TIER_ERROR_FAILED_PRECONDITION, "fc2.bias");
      expect_unchanged(t, before, steps_so_far, "a step without fc2.bias's gradient");
      if (!ok(give_grads(t, NPARAMS - 1, NPARAMS), "give_grads")) return 0;
      break;
    }
    case 7: { /* a NaN learning rate, then a negative one */
      if (!ok(give_grads(t, 0, NPARAMS), "give_grads")) return 0;
      tier_step_options_t options = TIER_STEP_OPTIONS_INIT;
      options.params_out = t->params_out;
      options.num_params_out = NPARAMS;
      options.set_lr = 1;
      options.lr = NAN;
      EXPECT_STATUS(tier_optimizer_step(t->opt, &options, NULL), TIER_ERROR_INVALID_ARGUMENT, NULL);
      expect_unchanged(t, before, steps_so_far, "a NaN lr");
      options.lr = -1e-3;
      EXPECT_STATUS(tier_optimizer_step(t->opt, &options, NULL), TIER_ERROR_INVALID_ARGUMENT, NULL);
      expect_unchanged(t, before, steps_so_far, "a negative lr");
      break;
    }
    case 9: { /* outputs that do not fit: a wrong count, a wrong shape */
      if (!ok(give_grads(t, 0, NPARAMS), "give_grads")) return 0;
      tier_step_options_t options = TIER_STEP_OPTIONS_INIT;
      options.params_out = t->params_out;
      options.num_params_out = NPARAMS - 1;
      EXPECT_STATUS(tier_optimizer_step(t->opt, &options, NULL), TIER_ERROR_INVALID_ARGUMENT, NULL);
      expect_unchanged(t, before, steps_so_far, "params_out of the wrong count");
      int64_t bigger[1] = {OUT + 1};
      DLTensor wrong = f32_tensor(t->params + OFF_B2 - 1, 1, bigger); /* inside our array: harmless if written */
      DLTensor* outs[NPARAMS] = {&t->param_t[0], &t->param_t[1], &t->param_t[2], &wrong};
      options.params_out = outs;
      options.num_params_out = NPARAMS;
      EXPECT_STATUS(tier_optimizer_step(t->opt, &options, NULL), TIER_ERROR_INVALID_ARGUMENT, "fc2.bias");
      expect_unchanged(t, before, steps_so_far, "a params_out tensor of the wrong shape");
      break;
    }
    case 11: { /* gradients given, then forgotten: the step must use only those given afterwards */
      float saved[NUMEL];
      memcpy(saved, t->grads, sizeof saved);
      for (int i = 0; i < NUMEL; ++i) t->grads[i] = 100.0f;
      if (!ok(give_grads(t, 0, 2), "give_grads")) return 0;
      if (!ok(tier_optimizer_clear_grads(t->opt), "tier_optimizer_clear_grads")) return 0;
      memcpy(t->grads, saved, sizeof saved);
      if (!ok(give_grads(t, 0, NPARAMS), "give_grads")) return 0;
      break;
    }
    default:
      if (!ok(give_grads(t, 0, NPARAMS), "give_grads")) return 0;
      break;
  }
  return 1;
}

/* ---------------------------------------------------------------------------------------------
 * The training loop (both modes). */

int main(int argc, char** argv) {
  int check = 0;
  const char* dir_arg = NULL;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--check") == 0) {
      check = 1;
    } else if (argv[i][0] == '-' || dir_arg != NULL) {
      fprintf(stderr, "usage: %s [--check] [swap_dir]\n", argv[0]);
      return 2;
    } else {
      dir_arg = argv[i];
    }
  }

  /* The swap folder: as given; else under $TIER_TEST_DIR (where the tests put files that must be
   * on a real disk) or the current directory. --check makes a fresh one there (mkdtemp). */
  char swap_dir[512];
  const char* base = getenv("TIER_TEST_DIR");
  if (base == NULL || *base == '\0') base = ".";
  if (dir_arg != NULL) {
    snprintf(swap_dir, sizeof swap_dir, "%s", dir_arg);
  } else if (check) {
    snprintf(swap_dir, sizeof swap_dir, "%s/train_mlp-check-XXXXXX", base);
    if (mkdtemp(swap_dir) == NULL) {
      perror("train_mlp: mkdtemp");
      return 1;
    }
  } else {
    snprintf(swap_dir, sizeof swap_dir, "%s/train_mlp-swap", base);
  }
  char checkpoint[600];
  snprintf(checkpoint, sizeof checkpoint, "%s/optimizer.ckpt", swap_dir);

  static trainer_t t; /* static: zeroed, and off the stack */
  static batch_t batch;
  static reference_t ref;
  int rc = 1;
  double first_loss = 0.0, loss = 0.0, max_param_diff = 0.0, max_exp_avg_diff = 0.0;
  long long swap_bytes = -1;
  int swap_files = 0;

  make_batch(&batch);
  init_params(t.params);
  trainer_views(&t);

  TRY(create_optimizer(swap_dir, check, &t.opt));
  for (int i = 0; i < NPARAMS; ++i) {
    uint32_t index = 0;
    TRY(tier_optimizer_add_param(t.opt, kNames[i], &t.param_t[i], 0, &index));
    if (check) EXPECT(index == (uint32_t)i, "%s got index %u", kNames[i], index);
  }
  if (check) {
    for (int i = 0; i < NUMEL; ++i) ref.p[i] = t.params[i];
    EXPECT_STATUS(tier_optimizer_add_param(t.opt, "fc1.weight", &t.param_t[0], 0, NULL), TIER_ERROR_ALREADY_EXISTS,
                  "fc1.weight");
    uint32_t count = 0, found = 0;
    TRY(tier_optimizer_param_count(t.opt, &count));
    EXPECT(count == NPARAMS, "%u parameters after the refused duplicate", count);
    TRY(tier_optimizer_find_param(t.opt, "fc2.weight", &found));
    EXPECT(found == 2, "fc2.weight is parameter %u", found);
    EXPECT_STATUS(tier_optimizer_find_param(t.opt, "fc3.weight", &found), TIER_ERROR_NOT_FOUND, "fc3.weight");
  }

  printf("train_mlp: %d -> %d -> %d MLP, %d parameters, AdamW state on NVMe in %s\n", IN, HID, OUT, NUMEL, swap_dir);
  for (int step = 1; step <= STEPS; ++step) {
    loss = forward_backward(t.params, &batch, t.grads);
    if (step == 1) first_loss = loss;

    if (check) {
      if (!refused_calls(&t, step)) goto done;
      if (step == 13) TRY(tier_optimizer_save(t.opt, checkpoint));
    } else {
      TRY(give_grads(&t, 0, NPARAMS));
    }
    float before[NUMEL];
    memcpy(before, t.params, sizeof before);
    tier_step_report_t report = TIER_STEP_REPORT_INIT;
    TRY(take_step(&t, &report));
    printf("step %2d  loss %.6f", step, loss);

    if (check) {
      reference_step(&ref, t.grads);
      double norm = 0.0;
      for (int i = 0; i < NUMEL; ++i) norm += (double)t.grads[i] * t.grads[i];
      norm = sqrt(norm);
      EXPECT(report.step == step && report.applied == 1, "step %d: report says step %lld, applied %d", step,
             (long long)report.step, report.applied);
      EXPECT(fabs(report.grad_norm - norm) <= 1e-5 * norm, "step %d: grad_norm %.9g, ours %.9g", step, report.grad_norm,
             norm);
      const double d = compare_params(&t, &ref, step);
      const double dm = compare_state(&t, &ref, step);
      if (d > max_param_diff) max_param_diff = d;
      if (dm > max_exp_avg_diff) max_exp_avg_diff = dm;
      printf("  grad_norm %.6f  max|tier - reference| %.2e  max|exp_avg - m| %.2e", report.grad_norm, d, dm);

      if (step == 1) {
        swap_bytes = swap_file_bytes(swap_dir, &swap_files);
        EXPECT(swap_files >= 1 && swap_bytes > 0, "no tier swap file with data in %s (%d files, %lld bytes)", swap_dir,
               swap_files, swap_bytes);
      }
      if (step == 13) {
        /* Back to the state saved before this step, then the same step again: the same result,
         * bit for bit. The reference took the step once. */
        float after[NUMEL], saved_exp_avg[NUMEL];
        memcpy(after, t.params, sizeof after);
        if (!read_state(&t, TIER_STATE_EXP_AVG, saved_exp_avg)) goto done;
        TRY(tier_optimizer_load(t.opt, checkpoint));
        float master[NUMEL];
        for (int i = 0; i < NPARAMS; ++i) {
          DLTensor dst = f32_tensor(master + kOffset[i], kNdim[i], kShape[i]);
          TRY(tier_optimizer_read_param(t.opt, (uint32_t)i, &dst));
        }
        EXPECT(memcmp(master, before, sizeof master) == 0, "load did not bring back the saved params");
        EXPECT(group_step(&t) == step - 1, "load: the step counter is not the saved one");
        TRY(give_grads(&t, 0, NPARAMS));
        TRY(take_step(&t, &report));
        EXPECT(memcmp(t.params, after, sizeof after) == 0, "the step redone after load differs from the first");
        float exp_avg[NUMEL];
        if (!read_state(&t, TIER_STATE_EXP_AVG, exp_avg)) goto done;
        EXPECT(memcmp(exp_avg, saved_exp_avg, sizeof exp_avg) == 0, "exp_avg after the redone step differs");
        EXPECT(report.step == step, "the redone step is step %lld", (long long)report.step);
        printf("  (saved, loaded, redone: identical)");
        if (remove(checkpoint) != 0) perror("train_mlp: removing the checkpoint");
      }
    }
    printf("\n");
  }
  loss = forward_backward(t.params, &batch, t.grads);
  printf("train_mlp: %d steps, loss %.6f -> %.6f (%.1f%% of the first)\n", STEPS, first_loss, loss,
         100.0 * loss / first_loss);

  if (check) {
    EXPECT(loss < 0.5 * first_loss, "the loss went from %.6f to %.6f only", first_loss, loss);
    /* Parameters come only before the first gradient. */
    EXPECT_STATUS(tier_optimizer_add_param(t.opt, "fc3.weight", &t.param_t[0], 0, NULL), TIER_ERROR_FAILED_PRECONDITION,
                  NULL);
    char* stats = NULL;
    TRY(tier_optimizer_stats_json(t.opt, &stats));
    printf("optimizer stats: %s\n", stats);
    EXPECT(strstr(stats, "\"home\"") != NULL && strstr(stats, "\"nvme\"") != NULL, "the stats do not say nvme");
    tier_string_free(stats);
    printf("max |tier - reference| over %d steps: params %.3e, exp_avg %.3e; swap files after step 1: %d, %lld bytes\n",
           STEPS, max_param_diff, max_exp_avg_diff, swap_files, swap_bytes);
  }
  rc = 0;

done:
  tier_optimizer_destroy(t.opt);
  if (check) {
    int left = 0;
    remove(checkpoint); /* already gone unless a check failed first */
    swap_file_bytes(swap_dir, &left);
    EXPECT(left == 0, "%d swap files left in %s after tier_optimizer_destroy", left, swap_dir);
  }
  /* The folder we chose goes when empty (nothing of anyone else's goes); one given stays. */
  if (dir_arg == NULL) remove(swap_dir);
  if (rc == 0 && failures > 0) rc = 1;
  if (check) printf("train_mlp --check: %s (%d failed checks)\n", rc == 0 ? "PASS" : "FAIL", failures);
  return rc;
}
