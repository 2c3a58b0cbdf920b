// The dynamic loss scale follows DeepSpeed's rule: hysteresis before backing off, growth after a
// window of clean steps, a floor at min_scale; static and disabled scales never move.
#include <gtest/gtest.h>

#include "tier/loss_scaler.hpp"

namespace tier::optim {
namespace {

LossScaleOptions dynamic_opts(int window, int hysteresis, bool consecutive = false) {
  LossScaleOptions o;
  o.enabled = true;
  o.dynamic = true;
  o.initial_scale = 1024;
  o.window = window;
  o.hysteresis = hysteresis;
  o.consecutive_hysteresis = consecutive;
  o.min_scale = 64;
  return o;
}

TEST(LossScaler, DisabledIsOneForever) {
  auto s = LossScaler::create({});
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->enabled());
  EXPECT_EQ(s->scale(), 1);
  EXPECT_EQ(s->update(true), 1);
  EXPECT_EQ(s->update(false), 1);
}

TEST(LossScaler, StaticNeverMoves) {
  LossScaleOptions o;
  o.enabled = true;
  o.dynamic = false;
  o.static_scale = 128;
  auto s = LossScaler::create(o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->scale(), 128);
  EXPECT_EQ(s->update(true), 128);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s->update(false), 128);
}

TEST(LossScaler, GrowsAfterEachFullWindowOfCleanSteps) {
  auto s = LossScaler::create(dynamic_opts(3, 1)).value();
  // Iterations 0..2 clean: the window counts clean steps since "overflow at -1", this one excluded.
  EXPECT_EQ(s.update(false), 1024);  // iteration 0: 0 clean before
  EXPECT_EQ(s.update(false), 1024);  // 1
  EXPECT_EQ(s.update(false), 1024);  // 2
  EXPECT_EQ(s.update(false), 2048);  // 3: three clean before it
  EXPECT_EQ(s.update(false), 2048);
  EXPECT_EQ(s.update(false), 2048);
  EXPECT_EQ(s.update(false), 4096);
}

TEST(LossScaler, HysteresisDelaysTheBackoffAndTheFloorHolds) {
  auto s = LossScaler::create(dynamic_opts(1000, 3)).value();
  EXPECT_EQ(s.update(true), 1024);  // hysteresis 3 -> 2
  EXPECT_EQ(s.update(true), 1024);  // 2 -> 1
  EXPECT_EQ(s.update(true), 512);   // at 1: halve
  EXPECT_EQ(s.update(true), 256);   // stays at 1 until a growth refills it
  EXPECT_EQ(s.update(true), 128);
  EXPECT_EQ(s.update(true), 64);
  EXPECT_EQ(s.update(true), 64);  // min_scale
  EXPECT_EQ(s.state().last_overflow, 6);
  EXPECT_EQ(s.state().iteration, 7);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  auto s = LossScaler::create(dynamic_opts(1000, 2, true)).value();
  EXPECT_EQ(s.update(true), 1024);   // 2 -> 1
  EXPECT_EQ(s.update(false), 1024);  // refilled to 2
  EXPECT_EQ(s.update(true), 1024);   // 2 -> 1 again: no backoff
  EXPECT_EQ(s.update(true), 512);

  auto t = LossScaler::create(dynamic_opts(1000, 2, false)).value();
  EXPECT_EQ(t.update(true), 1024);
  EXPECT_EQ(t.update(false), 1024);  // not refilled
  EXPECT_EQ(t.update(true), 512);
}

TEST(LossScaler, GrowthCountsFromTheLastOverflow) {
  auto s = LossScaler::create(dynamic_opts(2, 1)).value();
  EXPECT_EQ(s.update(false), 1024);
  EXPECT_EQ(s.update(true), 512);    // iteration 1 overflows
  EXPECT_EQ(s.update(false), 512);   // 0 clean before
  EXPECT_EQ(s.update(false), 512);   // 1
  EXPECT_EQ(s.update(false), 1024);  // 2 clean before: grow
}

TEST(LossScaler, RestoreAndValidation) {
  auto s = LossScaler::create(dynamic_opts(2, 2)).value();
  LossScaleState st;
  st.scale = 32768;
  st.iteration = 10;
  st.last_overflow = 8;
  st.hysteresis_left = 1;
  ASSERT_TRUE(s.restore(st).ok());
  EXPECT_EQ(s.scale(), 32768);
  EXPECT_EQ(s.update(true), 16384);  // hysteresis_left was 1
  st.scale = -1;
  EXPECT_EQ(s.restore(st).code(), StatusCode::kInvalidArgument);
  LossScaleOptions bad = dynamic_opts(0, 1);
  EXPECT_EQ(LossScaler::create(bad).status().code(), StatusCode::kInvalidArgument);
  bad = dynamic_opts(1, 0);
  EXPECT_EQ(LossScaler::create(bad).status().code(), StatusCode::kInvalidArgument);
  bad = dynamic_opts(1, 1);
  bad.factor = 1;
  EXPECT_EQ(LossScaler::create(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(LossScaler, FromConfig) {
  Fp16Config f;
  f.enabled = true;
  f.loss_scale = 0;
  f.initial_scale_power = 5;
  f.loss_scale_window = 7;
  f.hysteresis = 4;
  f.min_loss_scale = 0.25;
  const auto o = LossScaleOptions::from_config(f);
  EXPECT_TRUE(o.enabled && o.dynamic);
  EXPECT_EQ(o.initial_scale, 32);
  EXPECT_EQ(o.window, 7);
  EXPECT_EQ(o.hysteresis, 4);
  EXPECT_EQ(o.min_scale, 0.25);
  f.loss_scale = 512;
  const auto st = LossScaleOptions::from_config(f);
  EXPECT_FALSE(st.dynamic);
  EXPECT_EQ(LossScaler::create(st)->scale(), 512);
}

}  // namespace
}  // namespace tier::optim
