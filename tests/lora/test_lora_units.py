"""LoRA pieces on their own: adapter reading, the LoRA layer, resident slots, scheduling, cache keys."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

from pagoda.core.block_hash import request_extra_keys
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAModuleWeights, load_adapter
from pagoda.lora.layers import LoRABatch, LoRALinear
from pagoda.lora.manager import LoRAManager
from pagoda.lora.request import LoRARequest
from pagoda.model.arch import ModelArchConfig
from pagoda.model.models.llama import LlamaForCausalLM
from pagoda.sampling_params import SamplingParams
from tests.lora.helpers import make_adapter
from tests.unit.test_scheduler import run_to_completion, step


def _arch(model_dir: str) -> ModelArchConfig:
    with open(os.path.join(model_dir, "config.json")) as f:
        return ModelArchConfig.from_hf_config(json.load(f))


# ---- reading adapters --------------------------------------------------------------------


def test_load_adapter_scaling_and_ranks(tiny_llama_dir, tiny_adapters):
    from safetensors.torch import load_file

    arch = _arch(tiny_llama_dir)
    cases = [("all", 16 / 8, "q_proj", 8), ("kv-rslora", 8 / 4 ** 0.5, "v_proj", 4),
             ("mlp", 8 / 4, "down_proj", 4), ("mlp", 8 / 16, "up_proj", 16)]
    for name, scaling, module, rank in cases:
        adapter = load_adapter(LoRARequest(name, 1, tiny_adapters[name]), arch, max_rank=16)
        raw = load_file(os.path.join(tiny_adapters[name], "adapter_model.safetensors"))
        prefix = f"base_model.model.model.layers.1.{'mlp' if 'proj' in module and module[0] in 'gud' else 'self_attn'}.{module}"
        w = adapter.modules[(1, module)]
        assert w.rank == rank
        torch.testing.assert_close(w.a, raw[f"{prefix}.lora_A.weight"])
        torch.testing.assert_close(w.b, raw[f"{prefix}.lora_B.weight"] * scaling)
    only_kv = load_adapter(LoRARequest("kv", 2, tiny_adapters["kv-rslora"]), arch, max_rank=16)
    assert {m for _, m in only_kv.modules} == {"k_proj", "v_proj"}


def test_adapter_errors_name_the_module(tiny_llama_dir, tiny_qwen2_dir, tiny_hf, tiny_adapters, tmp_path):
    arch = _arch(tiny_llama_dir)
    head = make_adapter(tiny_hf, str(tmp_path / "head"), seed=5, targets=("q_proj", "lm_head"))
    with pytest.raises(LoRAAdapterError, match="unsupported target module 'lm_head'"):
        load_adapter(LoRARequest("h", 1, head), arch, max_rank=16)
    # Made for the tiny Llama (2 KV heads), loaded on a Qwen2 with 1 KV head.
    with pytest.raises(LoRAAdapterError, match=r"module layers\.0\.k_proj has lora_A"):
        load_adapter(LoRARequest("a", 1, tiny_adapters["all"]), _arch(tiny_qwen2_dir), max_rank=16)
    with pytest.raises(LoRAAdapterError, match=r"layers\.0\.\w+_proj has rank 8, above --max-lora-rank 4"):
        load_adapter(LoRARequest("a", 1, tiny_adapters["all"]), arch, max_rank=4)

    dora = tmp_path / "dora"
    shutil.copytree(tiny_adapters["q-o"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAAdapterError, match="use_dora=True"):
        load_adapter(LoRARequest("d", 1, str(dora)), arch, max_rank=16)
    (dora / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "embed_tokens"]}))
    with pytest.raises(LoRAAdapterError, match="unsupported target module 'embed_tokens'"):
        load_adapter(LoRARequest("d", 1, str(dora)), arch, max_rank=16)

    from safetensors.torch import load_file, save_file

    half = tmp_path / "half"
    shutil.copytree(tiny_adapters["q-o"], half)
    tensors = load_file(str(half / "adapter_model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.endswith("layers.1.self_attn.o_proj.lora_B.weight")}
    save_file(tensors, str(half / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"module layers\.1\.o_proj has no lora_B"):
        load_adapter(LoRARequest("x", 1, str(half)), arch, max_rank=16)
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_adapter(LoRARequest("x", 1, str(tmp_path)), arch, max_rank=16)


# ---- the LoRA layer ------------------------------------------------------------------------


def test_lora_linear_applies_each_tokens_adapter_to_its_slices():
    torch.manual_seed(0)
    base = nn.Linear(8, 8, bias=False)
    batch = LoRABatch(torch.device("cpu"))
    layer = LoRALinear(base, [4, 2, 2], max_loras=3, max_rank=4, batch=batch,
                       dtype=torch.float32, device=torch.device("cpu"))
    a0, b0 = torch.randn(2, 8), torch.randn(4, 2)     # slot 0: slice 0 (rank 2) and slice 2 (rank 4)
    a2, b2 = torch.randn(4, 8), torch.randn(2, 4)
    a1, b1 = torch.randn(3, 8), torch.randn(2, 3)     # slot 1: slice 1 (rank 3)
    layer.set_slot(0, [(a0, b0), None, (a2, b2)])
    layer.set_slot(1, [None, (a1, b1), None])
    x = torch.randn(5, 8)

    def reference(xt, slot):
        y = base(xt)
        if slot == 0:
            y = y + torch.cat([b0 @ (a0 @ xt), torch.zeros(2), b2 @ (a2 @ xt)])
        elif slot == 1:
            y = y + torch.cat([torch.zeros(4), b1 @ (a1 @ xt), torch.zeros(2)])
        return y

    slots = [-1, 0, 1, 0, -1]
    batch.set_token_slots(slots)
    assert [s for s, _ in batch.groups] == [0, 1]
    got = layer(x)
    want = torch.stack([reference(x[t], s) for t, s in enumerate(slots)])
    torch.testing.assert_close(got, want)
    batch.set_token_slots([1] * 5)       # every token on one adapter: no gather
    assert batch.groups[0][1] is None
    torch.testing.assert_close(layer(x), torch.stack([reference(x[t], 1) for t in range(5)]))
    batch.clear()
    torch.testing.assert_close(layer(x), base(x))


# ---- resident slots ------------------------------------------------------------------------


def _adapter(arch: ModelArchConfig, lora_id: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(lora_id)
    h = arch.hidden_size
    a, b = torch.randn(2, h, generator=g), torch.randn(h, 2, generator=g)
    return LoRAAdapter(LoRARequest(f"a{lora_id}", lora_id, "/unused"), 2, {(0, "o_proj"): LoRAModuleWeights(a, b, 2)})


def test_slots_are_lru_and_never_evict_a_pinned_adapter(tiny_llama_dir):
    arch = _arch(tiny_llama_dir)
    model = LlamaForCausalLM(arch)
    manager = LoRAManager(model, arch, max_loras=2, max_rank=4)
    for i in (1, 2, 3):
        manager.adapters[i] = _adapter(arch, i)
    o_proj = manager.wrapped[(0, "o_proj")]

    def holds(slot: int, lora_id: int) -> bool:
        return torch.equal(o_proj.lora_b[slot][:, :2], manager.adapters[lora_id].modules[(0, "o_proj")].b)

    manager.prepare([1, 1, 0, 2], pinned={1, 2})
    assert dict(manager.slots) == {1: 0, 2: 1}
    assert holds(0, 1) and holds(1, 2)
    manager.prepare([0, 2])                       # 2 used again: 1 is now least recent
    manager.prepare([3], pinned={3})
    assert dict(manager.slots) == {2: 1, 3: 0} and holds(0, 3)
    # 3 was used last, but it is pinned (a running request's): 2 goes instead.
    manager.prepare([1], pinned={1, 3})
    assert dict(manager.slots) == {3: 0, 1: 1} and holds(1, 1)
    assert manager.num_loads == 4
    with pytest.raises(RuntimeError, match="hold adapters of running requests"):
        manager.prepare([2], pinned={1, 2, 3})
    assert manager.remove(1) and not manager.remove(1)
    manager.prepare([2], pinned={2, 3})           # the freed slot is reused
    assert dict(manager.slots) == {3: 0, 2: 1}


# ---- scheduling and prefix-cache keys ------------------------------------------------------


def _lora_req(sched: Scheduler, rid: str, prompt: list[int], lora_id: int, max_tokens: int = 3) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, "/unused") if lora_id else None
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                  max_model_len=sched.config.max_model_len, lora_request=lora)
    sched.add_request(req)
    return req


def test_scheduler_runs_at_most_max_loras_adapters_at_once():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, max_loras=2),
                      KVCacheManager(64, 4))
    for rid, lora_id in [("r1", 1), ("r2", 2), ("r3", 3), ("base", 0), ("r1b", 1), ("r3b", 3)]:
        _lora_req(sched, rid, [100 + len(rid), 7, 8, 9, 10], lora_id, max_tokens=3 if lora_id != 2 else 5)
    so, _, _ = step(sched)
    # r3 / r3b wait (a third adapter); the base request and r1b behind them go first.
    assert list(so.num_scheduled_tokens) == ["r1", "r2", "base", "r1b"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r3b"]
    assert {n.req_id: n.lora_int_id for n in so.scheduled_new_reqs} == {"r1": 1, "r2": 2, "base": 0, "r1b": 1}
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"a1": 2, "a2": 1} and stats.waiting_lora_adapters == {"a3": 2}
    seen_adapter_sets = []
    while sched.has_unfinished_requests():
        step(sched)
        active = {r.lora_int_id for r in sched.running if r.lora_int_id}
        assert len(active) <= 2
        seen_adapter_sets.append(active)
    assert {3} <= set().union(*seen_adapter_sets)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_scheduler_without_lora_rejects_an_adapter_request():
    sched = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(16, 4))
    with pytest.raises(ValueError, match="without LoRA"):
        _lora_req(sched, "r", [1, 2, 3], 1)
    run_to_completion(sched)


def test_prefix_cache_keys_include_the_adapter():
    assert request_extra_keys() == ()
    assert request_extra_keys("salt", 0) == ("salt",)
    assert request_extra_keys(None, 3) == (("lora", 3),)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, max_loras=4),
                      KVCacheManager(64, 4))
    prompt = list(range(50, 63))
    reqs = [_lora_req(sched, f"r{i}", prompt, lora_id) for i, lora_id in enumerate([1, 2, 0, 1])]
    hashes = [sched.kv.block_hashes(r) for r in reqs]
    assert len(hashes[0]) == 3
    assert hashes[0] == hashes[3]
    assert len({h[0].value for h in hashes[:3]}) == 3
    assert all(a.value != b.value for a, b in zip(hashes[0], hashes[1]))   # the chain carries it on
    outs, _ = run_to_completion(sched)
    # r3 (adapter 1 again, admitted after r0 in the same step) shares r0's full blocks;
    # r1 (adapter 2) and r2 (base) share nothing.
    assert outs["r3"][0].num_cached_tokens == 12
    assert all(o.num_cached_tokens == 0 for o in outs["r1"] + outs["r2"])
