"""The step timeline ("tier": {"trace_file": ...}, engine.start_trace/save_trace): Chrome
trace-event JSON with every transfer of every link (their bytes add up to the engine's own link
counters), the stalls, and the adapter's forward/backward/step and the optimizer's spans."""

import collections
import json
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tier.torch  # noqa: E402
from test_torch_llama import make_model, tier_config, tier_losses  # noqa: E402


def spans(trace):
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    out = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            out[lanes[e["tid"]]].append(e)
    return out


def test_trace_file_holds_every_transfer_and_the_training_spans(swap_dir, tmp_path):
    path = tmp_path / "step.json"
    cfg = tier_config(swap_dir, gas=2)
    cfg["tier"]["trace_file"] = str(path)
    engine, *_ = tier.torch.initialize(make_model(), cfg)
    tier_losses(engine, 3)
    # The prefetcher may have started the next step's loads as the last one ended: the counts are
    # taken once they are done, so that both sides hold the same transfers.
    deadline = time.monotonic() + 10
    while engine.stats()["metrics"].get("prefetch.inflight_bytes", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    links = engine.stats()["links"]
    engine.destroy()  # the engine writes the file as it closes
    trace = json.loads(path.read_text())
    lanes = spans(trace)
    assert trace["otherData"]["dropped_events"] == 0
    # Every byte the engine (and the optimizer's swap space) counted on a link is in the timeline.
    moved = 0
    for link, usage in links.items():
        traced = sum(e["args"]["bytes"] for e in lanes.get(f"link {link}", []) if not e["args"].get("failed"))
        assert traced == usage["bytes"], (link, traced, usage["bytes"])
        moved += traced
    assert moved > 0
    assert lanes.get("link nvme_to_host") and lanes.get("link host_to_nvme")
    names = collections.Counter(e["name"] for e in lanes["compute"])
    assert names["forward"] == 6 and names["backward"] == 6  # 3 steps of 2 micro-steps
    assert names["step"] == 3  # one span per optimizer step (the other micro-steps only count)
    opt = lanes["optimizer"]
    assert [e["name"] for e in opt] == ["optimizer step 1", "optimizer step 2", "optimizer step 3"]
    assert all(e["args"]["bytes"] > 0 for e in opt)
    # Spans nest in time as the loop ran them: the optimizer's steps fall inside engine steps.
    steps = [e for e in lanes["compute"] if e["name"] == "step"]
    for o in opt:
        assert any(s["ts"] <= o["ts"] and o["ts"] + o["dur"] <= s["ts"] + s["dur"] + 1 for s in steps)
    # A stall names the parameter the loop waited for, not the engine's tensor number.
    stalls = lanes.get("stalls", [])
    assert stalls
    assert all(e["name"].startswith("stall on '") for e in stalls), stalls[0]["name"]


def test_start_and_save_trace_from_python(swap_dir, tmp_path):
    engine, *_ = tier.torch.initialize(make_model(), tier_config(swap_dir, gas=1))
    tier_losses(engine, 1, gas=1)
    assert not engine.native.tracing
    engine.start_trace()
    tier_losses(engine, 1, gas=1)
    path = tmp_path / "later.json"
    engine.save_trace(path)
    lanes = spans(json.loads(path.read_text()))
    assert collections.Counter(e["name"] for e in lanes["compute"])["forward"] == 1
    with pytest.raises(tier.TierError, match="trace"):
        engine.save_trace(tmp_path / "missing-dir" / "x.json")
    engine.destroy()
