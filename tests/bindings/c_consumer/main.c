/* Uses the installed libtier from C: an engine on the emulated device, one tensor in and out. */
#include <tier/tier.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  char json[1024];
  snprintf(json, sizeof json,
           "{\"tier\": {\"device\": \"emulated\", \"budgets\": {\"device\": 1048576, \"host\": 1048576},"
           " \"swap_paths\": [\"%s\"], \"huge_pages\": \"off\", \"io\": {\"bounce_unaligned\": true}}}",
           argc > 1 ? argv[1] : "/tmp");
  tier_engine_config_t config = TIER_ENGINE_CONFIG_INIT;
  config.json = json;
  config.ignore_env = 1;
  tier_engine_t* engine = NULL;
  if (tier_engine_create(&config, &engine) != TIER_OK) {
    fprintf(stderr, "%s\n", tier_last_error());
    return 1;
  }
  float values[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  DLManagedTensor src;
  memset(&src, 0, sizeof src);
  src.dl_tensor.data = values;
  src.dl_tensor.device.device_type = kDLCPU;
  src.dl_tensor.ndim = 1;
  src.dl_tensor.dtype.code = kDLFloat;
  src.dl_tensor.dtype.bits = 32;
  src.dl_tensor.dtype.lanes = 1;
  src.dl_tensor.shape = shape;
  tier_tensor_options_t options = TIER_TENSOR_OPTIONS_INIT;
  options.home = TIER_TIER_NVME;
  tier_tensor_t tensor;
  tier_ticket_t* ticket = NULL;
  DLManagedTensor* on_device = NULL;
  char* stats = NULL;
  if (tier_tensor_register(engine, "v", &src, &options, &tensor) != TIER_OK ||
      tier_tensor_acquire(engine, tensor, TIER_TIER_DEVICE, TIER_ACCESS_READ, NULL, &ticket) != TIER_OK ||
      tier_ticket_wait(ticket, &on_device) != TIER_OK || tier_engine_stats_json(engine, &stats) != TIER_OK) {
    fprintf(stderr, "%s\n", tier_last_error());
    return 1;
  }
  const int same = memcmp(on_device->dl_tensor.data, values, sizeof values) == 0;
  on_device->deleter(on_device);
  tier_ticket_destroy(ticket);
  printf("tier %s from C: %s %s\n", tier_version_string(), same ? "bytes match" : "BYTES DIFFER", stats);
  tier_string_free(stats);
  tier_engine_destroy(engine);
  return same ? 0 : 1;
}
