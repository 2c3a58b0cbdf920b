// The step driver over engine tensors (StepArgs::engine), as tier.torch's engine steps: params
// that live in an Engine get their updated values written into their tensors, gradients declared
// with declare_grad are read from theirs; the serial, overlapped ("exact") and asynchronous
// ("delayed") forms give the same bits; an asynchronous step refuses every other call until it is
// finished; a parameter without a gradient is refused, skipped or updated with zeros as asked;
// bad targets are refused with nothing applied.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nvme/nvme_test_util.hpp"
#include "optim/step_driver_test_util.hpp"
#include "tier/comm.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/engine.hpp"
#include "tier/ext/device.hpp"
#include "tier/step_driver.hpp"

namespace tier::step {
namespace {

using nvme::test::ScratchDir;

using test::kLr;
using test::kWd;
using test::RefAdamW;
using test::values;

std::unique_ptr<StepDriver> make_driver(const std::string& nvme_dir, std::uint64_t elements) {
  const std::string offload =
      nvme_dir.empty() ? R"({"device": "cpu"})" : R"({"device": "nvme", "nvme_path": ")" + nvme_dir + R"("})";
  auto cfg = EngineConfig::from_json(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
          "weight_decay": 0.01}}, "zero_optimization": {"stage": 3, "offload_optimizer": )" +
      offload + R"(}, "tier": {"io": {"use_direct": false}, "optimizer": {"chunk_elements": 1024}}})");
  EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto d = StepDriver::create(*cfg, elements);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return d.ok() ? std::move(d).value() : nullptr;
}

std::unique_ptr<Engine> make_engine(bool delayed_streams = false) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.emulated.delayed_streams = delayed_streams;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 16u << 20;
  c.tier.debug_checks = true;
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e).value() : nullptr;
}

// Three parameters in an engine and their fp32 gradient sums in engine tensors beside them, with
// the driver that steps them.
struct EngineParams {
  std::vector<std::uint64_t> numels{2000, 370, 1300};  // 4 chunks of 1024: parameters span them
  Engine* engine = nullptr;
  std::unique_ptr<StepDriver> driver;
  std::vector<std::int64_t> param_tensors, grad_tensors;

  explicit EngineParams(Engine& e) : engine(&e) {}
  StepArgs args() const {
    StepArgs a;
    a.engine = EngineTargets{engine, param_tensors, {}, grad_tensors};
    return a;
  }
  // Writes parameter k's gradient into its engine tensor; returns its sum of squares.
  double put_grad(std::size_t k, const std::vector<float>& g) {
    EXPECT_TRUE(engine->write(static_cast<TensorId>(grad_tensors[k]), g.data()).ok());
    return cpu::sum_of_squares(cpu::ConstTensorRef(g.data(), DType::kF32, g.size())).value();
  }
  // Parameter k's engine tensor, as elements of T.
  template <class T>
  std::vector<T> tensor_as(std::size_t k) const {
    std::vector<T> out(numels[k]);
    EXPECT_TRUE(engine->read(static_cast<TensorId>(param_tensors[k]), out.data()).ok());
    return out;
  }
  std::vector<float> state(std::size_t k, optim::StateKind kind) const {
    std::vector<float> out(numels[k]);
    EXPECT_TRUE(driver->read_state(k, kind, out.data()).ok());
    return out;
  }
};

// Three bf16 parameters (flat, as a framework's shards), and a driver whose masters are the fp32
// values they were made from.
struct Rig : EngineParams {
  std::vector<std::vector<float>> init;
  std::vector<std::vector<std::int64_t>> shapes;

  Rig(Engine& e, const std::string& nvme_dir, const std::string& tag) : EngineParams(e) {
    std::uint64_t total = 0;
    for (auto n : numels) total += n;
    driver = make_driver(nvme_dir, total);
    for (std::size_t k = 0; k < numels.size(); ++k) {
      init.push_back(values(numels[k], 0.5f, float(k)));
      shapes.push_back({static_cast<std::int64_t>(numels[k])});
      std::vector<std::uint16_t> low(numels[k]);
      EXPECT_TRUE(cpu::convert(cpu::ConstTensorRef(init[k].data(), DType::kF32, numels[k]),
                               cpu::TensorRef{low.data(), DType::kBF16, numels[k]})
                      .ok());
      const std::string name = tag + "/p" + std::to_string(k);
      auto p = e.register_tensor(TensorDesc{name, DType::kBF16, numels[k], Role::kParam}, Tier::kHost, low.data());
      auto g = e.register_tensor(TensorDesc{"grad/" + name, DType::kF32, numels[k], Role::kGrad}, Tier::kHost);
      EXPECT_TRUE(p.ok() && g.ok());
      param_tensors.push_back(*p);
      grad_tensors.push_back(*g);
      auto idx = driver->add_param(name, HostTensor{init[k].data(), DType::kF32, shapes[k]}, 0, DType::kBF16);
      EXPECT_TRUE(idx.ok()) << idx.status().to_string();
    }
  }

  std::vector<std::uint16_t> engine_param(std::size_t k) const { return tensor_as<std::uint16_t>(k); }
};

std::vector<float> grad_of(std::size_t k, std::uint64_t n, int step) {
  return values(n, 0.01f * float(k + 1), 0.5f * float(step));
}

TEST(StepDriverEngine, ASerialStepReadsDeclaredGradientsAndWritesTheParamsIntoTheirTensors) {
  ScratchDir dir(nvme::test::shm_base(), "driver-engine");
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Rig rig(*engine, dir.path(), "serial");
  ASSERT_NE(rig.driver, nullptr);
  std::vector<RefAdamW> ref;
  for (const auto& v : rig.init) ref.emplace_back(v);
  for (int step = 1; step <= 3; ++step) {
    for (std::size_t k = 0; k < rig.numels.size(); ++k) {
      const auto g = grad_of(k, rig.numels[k], step);
      ASSERT_TRUE(rig.driver->declare_grad(k, rig.put_grad(k, g)).ok());
      ref[k].step(g);
    }
    auto r = rig.driver->step(rig.args());
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->step, step);
  }
  for (std::size_t k = 0; k < rig.numels.size(); ++k) {
    const auto master = rig.state(k, optim::StateKind::kMaster);
    for (std::size_t i = 0; i < master.size(); ++i) {
      ASSERT_NEAR(master[i], ref[k].p[i], 1e-6 + 1e-5 * std::abs(ref[k].p[i])) << "param " << k << " [" << i << "]";
    }
    // The tensor holds the master in bf16, as read_param converts it.
    std::vector<std::uint16_t> want(rig.numels[k]);
    ASSERT_TRUE(rig.driver->read_param(k, DType::kBF16, want.data()).ok());
    EXPECT_EQ(rig.engine_param(k), want) << "param " << k;
  }
  // Declared gradients are read by the update alone: one host pass per element.
  EXPECT_DOUBLE_EQ(rig.driver->host_passes_per_grad_element(), 1.0);
}

// Training steps whose "kernels" run on a delayed stream (tier.emulated.delayed_streams), later
// than the host queues them, as a GPU runs them: forward reads each parameter's device copy
// (stream-ordered acquires, as tier.torch fetches on a GPU), backward fetches it again (the saved weight) and writes
// its gradient into the gradient tensor's device copy; every lease ends in stream order. The host runs ahead to the
// optimizer's step, which must read the gradients the stream wrote and write the params back only after the stream read
// them. Each kernel sees the params of its step, and the result is the plain engine's bits. Ending the gradient leases
// with release() instead fails here (the step reads gradients the stream has not written yet). Nothing reuses a
// parameter's device memory before the stream reads it in this loop, so a read lease's early end is caught by
// engine_stream_order_test.cpp instead.
TEST(StepDriverEngine, ATrainingLoopOnDelayedStreamsGivesThePlainEnginesBits) {
  const std::string base = nvme::test::shm_base();
  ScratchDir dir_a(base, "driver-plain"), dir_b(base, "driver-streams");
  auto plain_engine = make_engine();
  auto engine = make_engine(/*delayed_streams=*/true);
  ASSERT_TRUE(plain_engine && engine);
  ASSERT_TRUE(engine->device().has(DeviceCap::kGpuStreams));
  Rig plain(*plain_engine, dir_a.path(), "plain");
  Rig rig(*engine, dir_b.path(), "streams");
  ASSERT_TRUE(plain.driver && rig.driver);
  Device& dev = engine->device();
  const DeviceStream s = reinterpret_cast<DeviceStream>(0x5);
  const std::size_t n = rig.numels.size();
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::vector<std::uint16_t>> before(n), fwd(n), bwd(n);
    for (std::size_t k = 0; k < n; ++k) {
      before[k] = rig.engine_param(k);
      fwd[k].resize(rig.numels[k]);
      bwd[k].resize(rig.numels[k]);
      ASSERT_TRUE(plain.driver->declare_grad(k, plain.put_grad(k, grad_of(k, plain.numels[k], step))).ok());
    }
    ASSERT_TRUE(plain.driver->step(plain.args()).ok());

    // The stream is held until the host has queued the whole step and gone on to the optimizer.
    auto gate = std::make_shared<std::promise<void>>();
    ASSERT_TRUE(dev.enqueue_host(s, [f = gate->get_future().share()] { f.wait(); }).ok());
    for (std::size_t k = 0; k < n; ++k) {  // forward: stream-ordered fetches, granted on the queued copies
      auto w = engine->acquire_on_stream(static_cast<TensorId>(rig.param_tensors[k]), s).wait();
      ASSERT_TRUE(w.ok()) << w.status();
      const void* src = w->data();
      std::uint16_t* out = fwd[k].data();
      const std::uint64_t bytes = rig.numels[k] * 2;
      ASSERT_TRUE(dev.enqueue_host(s, [=] { std::memcpy(out, src, bytes); }).ok());
      ASSERT_TRUE(w->release_after(s).ok());
    }
    std::vector<double> sumsq(n);
    for (std::size_t k = n; k-- > 0;) {  // backward, in reverse
      auto w = engine->acquire_on_stream(static_cast<TensorId>(rig.param_tensors[k]), s).wait();
      auto g = engine->acquire(static_cast<TensorId>(rig.grad_tensors[k]), Tier::kDevice, Access::kWrite).wait();
      ASSERT_TRUE(w.ok() && g.ok());
      auto grad = std::make_shared<std::vector<float>>(grad_of(k, rig.numels[k], step));
      sumsq[k] = cpu::sum_of_squares(cpu::ConstTensorRef(grad->data(), DType::kF32, grad->size())).value();
      const void* src = w->data();
      void* dst = g->data();
      std::uint16_t* out = bwd[k].data();
      const std::uint64_t bytes = rig.numels[k] * 2;
      ASSERT_TRUE(dev.enqueue_host(s,
                                   [=] {
                                     std::memcpy(out, src, bytes);
                                     std::memcpy(dst, grad->data(), grad->size() * 4);
                                   })
                      .ok());
      ASSERT_TRUE(w->release_after(s).ok());
      ASSERT_TRUE(g->release_after(s).ok());
    }
    for (std::size_t k = 0; k < n; ++k) ASSERT_TRUE(rig.driver->declare_grad(k, sumsq[k]).ok());
    std::thread opener([gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      gate->set_value();
    });
    auto r = rig.driver->step(rig.args());  // waits for the stream's gradients, not for the gate
    opener.join();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied);
    ASSERT_TRUE(dev.synchronize().ok());
    for (std::size_t k = 0; k < n; ++k) {
      EXPECT_EQ(fwd[k], before[k]) << "step " << step << ", forward of param " << k;
      EXPECT_EQ(bwd[k], before[k]) << "step " << step << ", backward of param " << k;
      EXPECT_EQ(rig.engine_param(k), plain.engine_param(k)) << "step " << step << ", param " << k;
      EXPECT_NE(rig.engine_param(k), before[k]) << "step " << step << ", param " << k << " did not change";
    }
  }
}

TEST(StepDriverEngine, OverlappedAndAsynchronousStepsGiveTheSerialStepsBits) {
  const std::string base = nvme::test::shm_base();
  ScratchDir dir_a(base, "driver-serial"), dir_b(base, "driver-overlap"), dir_c(base, "driver-async");
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Rig serial(*engine, dir_a.path(), "serial");
  Rig overlapped(*engine, dir_b.path(), "overlapped");
  Rig async(*engine, dir_c.path(), "async");
  ASSERT_TRUE(serial.driver && overlapped.driver && async.driver);
  for (int step = 1; step <= 3; ++step) {
    // Serial.
    for (std::size_t k = 0; k < serial.numels.size(); ++k) {
      ASSERT_TRUE(serial.driver->declare_grad(k, serial.put_grad(k, grad_of(k, serial.numels[k], step))).ok());
    }
    auto rs = serial.driver->step(serial.args());
    ASSERT_TRUE(rs.ok()) << rs.status().to_string();

    // Overlapped: the pass starts first, the gradients come in reverse order, as backward makes them.
    ASSERT_TRUE(overlapped.driver->start_overlap(overlapped.args()).ok());
    EXPECT_TRUE(overlapped.driver->overlap_running());
    for (std::size_t k = overlapped.numels.size(); k-- > 0;) {
      const auto g = grad_of(k, overlapped.numels[k], step);
      ASSERT_TRUE(overlapped.driver->declare_grad(k, overlapped.put_grad(k, g)).ok());
    }
    auto ro = overlapped.driver->finish_overlap();
    ASSERT_TRUE(ro.ok()) << ro.status().to_string();
    EXPECT_TRUE(ro->overlapped);
    EXPECT_FALSE(overlapped.driver->overlap_running());

    // Asynchronous: while it runs, everything else is refused and nothing changes.
    for (std::size_t k = 0; k < async.numels.size(); ++k) {
      ASSERT_TRUE(async.driver->declare_grad(k, async.put_grad(k, grad_of(k, async.numels[k], step))).ok());
    }
    StepArgs a = async.args();
    a.engine->params.clear();  // "delayed": the masters only; the params are derived afterwards
    ASSERT_TRUE(async.driver->start_async(a).ok());
    EXPECT_TRUE(async.driver->async_running());
    std::vector<float> scratch(async.numels[0]);
    EXPECT_EQ(async.driver->step(a).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(async.driver->start_async(a).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(async.driver->declare_grad(0, 1.0).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(async.driver->read_state(0, optim::StateKind::kMaster, scratch.data()).code(),
              StatusCode::kFailedPrecondition);
    EXPECT_EQ(async.driver->set_lr(0, 0.5).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(async.driver->save(dir_c.path() + "/ckpt").code(), StatusCode::kFailedPrecondition);
    async.driver->clear_grads();  // (a no-op: the step's gradients are its own)
    auto ra = async.driver->finish_async();
    ASSERT_TRUE(ra.ok()) << ra.status().to_string();
    EXPECT_FALSE(async.driver->async_running());
    EXPECT_EQ(async.driver->finish_async().status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(rs->grad_norm, ro->grad_norm);
    EXPECT_EQ(rs->grad_norm, ra->grad_norm);
    for (std::size_t k = 0; k < serial.numels.size(); ++k) {
      std::vector<std::uint16_t> low(async.numels[k]);
      ASSERT_TRUE(async.driver->read_param(k, DType::kBF16, low.data()).ok());
      ASSERT_TRUE(async.engine->write(static_cast<TensorId>(async.param_tensors[k]), low.data()).ok());
    }
  }
  for (std::size_t k = 0; k < serial.numels.size(); ++k) {
    for (auto kind : {optim::StateKind::kMaster, optim::StateKind::kExpAvg, optim::StateKind::kExpAvgSq}) {
      const auto want = serial.state(k, kind);
      EXPECT_EQ(overlapped.state(k, kind), want) << "param " << k;
      EXPECT_EQ(async.state(k, kind), want) << "param " << k;
    }
    EXPECT_EQ(overlapped.engine_param(k), serial.engine_param(k)) << "param " << k;
    EXPECT_EQ(async.engine_param(k), serial.engine_param(k)) << "param " << k;
  }
}

// fp32 parameters whose engine tensors are their masters (StepDriver::create with engine_masters,
// add_engine_param): the tensors are updated in place, to the bits of a driver that keeps masters
// of its own and writes its outputs into the same kind of tensors, serial and overlapped; the
// optimizer's records hold the moments only; the checkpoint is the same file.
struct Fp32Rig : EngineParams {
  Fp32Rig(Engine& e, const std::string& nvme_dir, const std::string& tag, bool masters_in_tensors) : EngineParams(e) {
    auto cfg = EngineConfig::from_json(
        R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
        nvme_dir + R"("}}, "tier": {"io": {"use_direct": false}, "optimizer": {"chunk_elements": 1024}}})");
    EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
    auto o = optim::OffloadedOptimizerOptions::from_config(*cfg, 2000 + 370 + 1300);
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    auto d = StepDriver::create(*o, masters_in_tensors ? &e : nullptr);
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    if (!d.ok()) return;
    driver = std::move(d).value();
    EXPECT_EQ(driver->engine_masters(), masters_in_tensors);
    for (std::size_t k = 0; k < numels.size(); ++k) {
      const auto init = values(numels[k], 0.5f, float(k));
      const std::string name = tag + "/p" + std::to_string(k);
      auto p = e.register_tensor(TensorDesc{name, DType::kF32, numels[k], Role::kParam}, Tier::kHost, init.data());
      auto g = e.register_tensor(TensorDesc{"grad/" + name, DType::kF32, numels[k], Role::kGrad}, Tier::kHost);
      EXPECT_TRUE(p.ok() && g.ok());
      param_tensors.push_back(*p);
      grad_tensors.push_back(*g);
      const std::vector<std::int64_t> shape{static_cast<std::int64_t>(numels[k])};
      auto idx = masters_in_tensors ? driver->add_engine_param(name, shape, 0, static_cast<TensorId>(*p))
                                    : driver->add_param(name, HostTensor{init.data(), DType::kF32, shape});
      EXPECT_TRUE(idx.ok()) << idx.status().to_string();
    }
  }
  std::vector<float> tensor(std::size_t k) const { return tensor_as<float>(k); }
  void declare(int step) {
    for (std::size_t k = numels.size(); k-- > 0;) {  // (backward's order)
      ASSERT_TRUE(driver->declare_grad(k, put_grad(k, grad_of(k, numels[k], step))).ok());
    }
  }
};

TEST(StepDriverEngine, Fp32ParamsThatAreTheirMastersAreUpdatedInPlaceToTheSameBits) {
  const std::string base = nvme::test::shm_base();
  ScratchDir dir_a(base, "driver-own-masters"), dir_b(base, "driver-engine-masters");
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Fp32Rig own(*engine, dir_a.path(), "own", false);
  Fp32Rig in_place(*engine, dir_b.path(), "in-place", true);
  ASSERT_TRUE(own.driver && in_place.driver);
  for (int step = 1; step <= 4; ++step) {
    for (Fp32Rig* r : {&own, &in_place}) {
      if (step % 2 == 1) {
        r->declare(step);
        auto rep = r->driver->step(r->args());
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
      } else {
        ASSERT_TRUE(r->driver->start_overlap(r->args()).ok());
        r->declare(step);
        auto rep = r->driver->finish_overlap();
        ASSERT_TRUE(rep.ok()) << rep.status().to_string();
        EXPECT_TRUE(rep->overlapped);
      }
    }
    for (std::size_t k = 0; k < own.numels.size(); ++k) {
      const auto want = own.tensor(k);
      EXPECT_EQ(in_place.tensor(k), want) << "param " << k << " after step " << step;
      EXPECT_EQ(in_place.state(k, optim::StateKind::kMaster), want) << "param " << k;
      for (auto kind : {optim::StateKind::kExpAvg, optim::StateKind::kExpAvgSq}) {
        EXPECT_EQ(in_place.state(k, kind), own.state(k, kind)) << "param " << k;
      }
    }
  }
  // The records hold the moments only: 8 bytes per element instead of 12.
  const auto stats = [](const Fp32Rig& r) { return nlohmann::json::parse(r.driver->stats_json()); };
  EXPECT_EQ(stats(in_place)["record_bytes"].get<std::uint64_t>() * 3,
            stats(own)["record_bytes"].get<std::uint64_t>() * 2);
  // The same checkpoint file: saved from the tensors, loaded by a driver with masters of its own.
  const std::string ckpt = dir_b.path() + "/ckpt";
  ASSERT_TRUE(in_place.driver->save(ckpt).ok());
  ScratchDir dir_c(base, "driver-loads");
  auto engine2 = make_engine();  // (the same names: a checkpoint checks them)
  ASSERT_NE(engine2, nullptr);
  Fp32Rig other(*engine2, dir_c.path(), "in-place", false);
  const Status loaded = other.driver->load(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  for (std::size_t k = 0; k < own.numels.size(); ++k) {
    EXPECT_EQ(other.state(k, optim::StateKind::kMaster), in_place.tensor(k)) << "param " << k;
  }
  // What a driver with engine masters cannot do is refused.
  const std::vector<std::int64_t> shape{4};
  std::vector<float> four(4, 1.0f);
  EXPECT_EQ(in_place.driver->add_param("late", HostTensor{four.data(), DType::kF32, shape}).status().code(),
            StatusCode::kInvalidArgument);
  in_place.declare(5);
  EXPECT_EQ(in_place.driver->start_async(in_place.args()).code(), StatusCode::kFailedPrecondition);
}

TEST(StepDriverEngine, AParameterWithoutAGradientIsRefusedSkippedOrZeroedAsAsked) {
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Rig rig(*engine, "", "missing");
  ASSERT_NE(rig.driver, nullptr);
  const std::size_t last = rig.numels.size() - 1;
  for (std::size_t k = 0; k < last; ++k) {
    ASSERT_TRUE(rig.driver->declare_grad(k, rig.put_grad(k, grad_of(k, rig.numels[k], 1))).ok());
  }
  StepArgs a = rig.args();
  auto refused = rig.driver->step(a);
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("missing/p2"), std::string::npos) << refused.status().to_string();
  a.skip_missing = a.zero_missing = true;
  EXPECT_EQ(rig.driver->step(a).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*rig.driver->group_step(0), 0);
  {
    // The norm across ranks is reduced one way: a communicator and a reducer together are refused.
    CommCallbacks cb;
    cb.all_reduce = [](void*, std::uint64_t, DType, ReduceOp) { return Status::Ok(); };
    auto comm = make_callback_communicator(cb);
    ASSERT_TRUE(comm.ok()) << comm.status();
    CommunicatorNorm norm(**comm);
    StepArgs both = a;
    both.skip_missing = false;
    both.comm = comm->get();
    both.norm = &norm;
    auto r = rig.driver->step(both);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("comm and norm together"), std::string::npos) << r.status();
    EXPECT_EQ(*rig.driver->group_step(0), 0);
  }

  // Zeroed: the weight decay moves it, the moments stay zero.
  a.skip_missing = false;
  ASSERT_TRUE(rig.driver->step(a).ok());
  const auto master = rig.state(last, optim::StateKind::kMaster);
  const auto m = rig.state(last, optim::StateKind::kExpAvg);
  for (std::size_t i = 0; i < master.size(); ++i) {
    ASSERT_FLOAT_EQ(master[i], float(double(rig.init[last][i]) * (1 - kLr * kWd))) << i;
    ASSERT_EQ(m[i], 0.0f);
  }
  // Skipped: untouched.
  for (std::size_t k = 0; k < last; ++k) {
    ASSERT_TRUE(rig.driver->declare_grad(k, rig.put_grad(k, grad_of(k, rig.numels[k], 2))).ok());
  }
  a.zero_missing = false;
  a.skip_missing = true;
  ASSERT_TRUE(rig.driver->step(a).ok());
  EXPECT_EQ(rig.state(last, optim::StateKind::kMaster), master);
}

TEST(StepDriverEngine, BadTargetsAndDeclarationsAreRefusedWithNothingApplied) {
  ScratchDir dir(nvme::test::shm_base(), "driver-bad");
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Rig rig(*engine, dir.path(), "bad");
  ASSERT_NE(rig.driver, nullptr);
  for (std::size_t k = 0; k < rig.numels.size(); ++k) {
    ASSERT_TRUE(rig.driver->declare_grad(k, rig.put_grad(k, grad_of(k, rig.numels[k], 1))).ok());
  }
  // A parameter declared twice, an unknown one, a negative sum of squares.
  Status twice = rig.driver->declare_grad(1, 1.0);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.message().find("bad/p1"), std::string::npos) << twice.to_string();
  EXPECT_EQ(rig.driver->declare_grad(7, 1.0).code(), StatusCode::kInvalidArgument);

  const auto before = rig.state(0, optim::StateKind::kMaster);
  const auto tensor_before = rig.engine_param(0);
  StepArgs a = rig.args();
  a.engine->params.pop_back();  // one target short
  auto short_list = rig.driver->step(a);
  EXPECT_EQ(short_list.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_list.status().message().find("2 params for 3 parameters"), std::string::npos)
      << short_list.status().to_string();
  a = rig.args();
  a.engine->engine = nullptr;
  EXPECT_EQ(rig.driver->step(a).status().code(), StatusCode::kInvalidArgument);
  a = rig.args();
  a.engine->grads.assign(rig.numels.size(), -1);  // declared, but no tensor to read them from
  auto no_source = rig.driver->step(a);
  EXPECT_FALSE(no_source.ok());
  EXPECT_EQ(*rig.driver->group_step(0), 0);
  EXPECT_EQ(rig.state(0, optim::StateKind::kMaster), before);
  EXPECT_EQ(rig.engine_param(0), tensor_before);

  // The declarations stand: the right targets step.
  auto ok = rig.driver->step(rig.args());
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(*rig.driver->group_step(0), 1);
  EXPECT_NE(rig.engine_param(0), tensor_before);
}

}  // namespace
}  // namespace tier::step
