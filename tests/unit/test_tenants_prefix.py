"""The API keys file, the shared prefix file and its matching, priority checks, per-class metrics."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from pagoda.core.block_hash import hash_request_blocks
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import EngineCoreOutput, SchedulerStats
from pagoda.core.request import Request
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.metrics.prometheus import make_registry, render
from pagoda.metrics.stats import EngineMetrics
from pagoda.sampling_params import SamplingParams
from pagoda.shared_prefix import SharedPrefixes, read_shared_prefix_file
from pagoda.tenants import TenantSpec, load_api_keys_file, tenants_of
from pagoda.validation import check_priority


def test_api_keys_file_json_and_toml(tmp_path) -> None:
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"sk-a": {"tenant": "alice", "weight": 2, "max_running": 4, "max_queued": 8},
                             "sk-a2": {"tenant": "alice", "weight": 2, "max_running": 4, "max_queued": 8},
                             "sk-b": "bob"}))  # fmt: skip
    keys = load_api_keys_file(str(j))
    assert keys["sk-a"] == TenantSpec("alice", 2, 4, 8) and keys["sk-b"] == TenantSpec("bob")
    assert set(tenants_of(keys)) == {"alice", "bob"}
    t = tmp_path / "keys.toml"
    t.write_text('["sk-c"]\ntenant = "carol"\nweight = 0.5\n')
    assert load_api_keys_file(str(t)) == {"sk-c": TenantSpec("carol", 0.5)}
    assert EngineConfig(api_keys_file=str(t)).api_keys_file == str(t)


@pytest.mark.parametrize("content, match", [
    ("[1, 2]", "mapping"),
    ("{not json", "not valid JSON"),
    ('{"k": {"tenant": "a", "weight": 0}}', "weight must be"),
    ('{"k": {"tenant": "a", "max_running": 0}}', "max_running"),
    ('{"k": {"tenant": "a", "priority": 1}}', "unknown tenant setting"),
    ('{"k": {"weight": 1}}', "tenant"),
    ('{"k1": {"tenant": "a"}, "k2": {"tenant": "a", "weight": 3}}', "disagree"),
])  # fmt: skip
def test_api_keys_file_errors(tmp_path, content: str, match: str) -> None:
    f = tmp_path / "keys.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_api_keys_file(str(f))
    with pytest.raises(ValueError, match=match):
        EngineConfig(api_keys_file=str(f))
    with pytest.raises(FileNotFoundError):
        EngineConfig(api_keys_file=str(tmp_path / "missing.json"))


def test_priority_checks() -> None:
    fcfs, priority = EngineConfig().scheduling_policy, EngineConfig(scheduling_policy="priority").scheduling_policy
    check_priority(0, fcfs)
    with pytest.raises(ValueError, match="fcfs"):
        check_priority(2, fcfs)
    check_priority(-3, priority)
    with pytest.raises(ValueError, match="integer"):
        check_priority(True, priority)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="round-robin")
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(max_long_partial_prefills=0)


def test_shared_prefix_file_formats(tmp_path) -> None:
    j = tmp_path / "p.json"
    j.write_text(json.dumps(["You are helpful.", "  ", "Be terse.\nReally."]))
    assert read_shared_prefix_file(str(j)) == ["You are helpful.", "Be terse.\nReally."]
    t = tmp_path / "p.txt"
    t.write_text("First prompt\nline two\n---\nSecond prompt\n")
    assert read_shared_prefix_file(str(t)) == ["First prompt\nline two", "Second prompt"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="array of strings"):
        read_shared_prefix_file(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no shared prefix"):
        EngineConfig(shared_prefix_file=str(empty))


def test_shared_len_is_the_common_prefix_in_whole_blocks() -> None:
    shared = SharedPrefixes([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], [7, 7, 7, 7, 7]], block_size=4)
    assert shared.shared_len([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 8
    assert shared.shared_len([1, 2, 3, 4, 5, 0]) == 4
    assert shared.shared_len([1, 2, 3, 0]) == 0
    assert shared.shared_len([7, 7, 7, 7, 7, 7]) == 4
    assert shared.shared_len([9]) == 0 and shared.shared_len([]) == 0


def _hashes(salt: str | None, shared_tokens: int, tokens: list[int]) -> list:
    kv = KVCacheManager(16, 4)
    req = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    req.num_shared_prefix_tokens = shared_tokens
    return kv.block_hashes(req)


def test_salt_goes_into_the_first_block_after_the_shared_prefix() -> None:
    tokens = list(range(100, 116))  # four blocks of 4
    plain = _hashes(None, 0, tokens)
    a = _hashes("a", 8, tokens)
    b = _hashes("b", 8, tokens)
    assert a[:2] == plain[:2] == b[:2]            # the shared prefix: same keys for everyone
    assert a[2] != b[2] and a[3] != b[3]          # after it, each salt has its own chain
    assert a[2] != plain[2]
    assert _hashes("a", 0, tokens)[0] != plain[0]  # no shared prefix: salted from block 0
    assert hash_request_blocks(tokens, 4, [], ("a",), 0) == _hashes("a", 0, tokens)


def test_metrics_by_tenant_and_priority() -> None:
    m = EngineMetrics(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    m.add_request("a", 10.0, 5, tenant="alice", priority=0)
    m.add_request("b", 10.0, 3, tenant="bob", priority=2)
    m.add_request("c", 10.0, 4)
    outs = [EngineCoreOutput("a", [1, 2], scheduled_time=10.5), EngineCoreOutput("b", [3], scheduled_time=11.0)]
    m.on_engine_outputs(EngineCoreOutputs(outputs=outs, timestamp=12.0), 12.0)
    assert m.by_tenant.by_label["alice"].generation_tokens == 2
    assert m.by_tenant.by_label["alice"].prompt_tokens == 5
    assert m.by_tenant.by_label["alice"].ttft.sum == pytest.approx(2.0)
    assert m.by_tenant.by_label["default"].requests == 1
    assert m.by_priority.by_label["2"].generation_tokens == 1

    class Stub:
        metrics = m
        config = EngineConfig()
        replicas = ()
        lora_token_counts: dict[str, list[int]] = {}

        def latest_stats(self) -> SchedulerStats:
            return SchedulerStats()

    families = {f.name: f for f in text_string_to_metric_families(render(make_registry(Stub(), "x")).decode())}
    reqs = {s.labels["tenant"]: s.value for s in families["pagoda:tenant_requests"].samples}
    assert reqs == {"alice": 1.0, "bob": 1.0, "default": 1.0}
    gen = {s.labels["priority"]: s.value for s in families["pagoda:priority_generation_tokens"].samples}
    assert gen == {"0": 2.0, "2": 1.0}
    assert "pagoda:tenant_time_to_first_token_seconds" in families
    # Client-chosen labels are bounded: beyond the limit they share "other".
    for i in range(40):
        m.add_request(f"x{i}", 0.0, 1, tenant=f"t{i}")
    assert len(m.by_tenant.by_label) <= m.by_tenant.max_labels + 1
    assert m.by_tenant.by_label["other"].requests > 0
