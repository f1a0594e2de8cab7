"""Prefill-decode disaggregation at the engine-core level (tiny random models, in-process).

A request prefilled by a ``--kv-role prefill`` core, its KV fetched by a ``--kv-role decode``
core, must generate the same greedy tokens as one colocated core; every block must be free
on both sides afterwards, also after an abort mid-transfer, a vanished prefill instance and a
decode-side prefix cache that was evicted while the KV travelled. A windowed model (Gemma 3,
several KV groups) checks that only the blocks the window needs travel and suffice.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _core(model: str, role: str | None = None, **kw) -> EngineCore:
    config = EngineConfig(model=model, kv_role=role, num_kv_blocks=512, block_size=4, max_model_len=256,
                          show_progress=False, **kw)
    return EngineCore(config, collect_stats=False)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_gemma3_dir"])
def cores(request):
    model = request.getfixturevalue(request.param)
    made = [_core(model), _core(model, "prefill", kv_transfer_config={"timeout_s": 5}), _core(model, "decode")]
    yield made
    for core in made:
        core.shutdown()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 1 for i in range(n)]


def _drain(*cores: EngineCore, until, timeout: float = 30.0) -> dict[str, list]:
    """Step the cores until ``until(outputs)``; outputs per request id."""
    outs: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    while not until(outs):
        assert time.monotonic() < deadline, f"timed out; outputs so far {outs}"
        stepped = False
        for core in cores:
            if core.has_unfinished_requests():
                for o in core.step().outputs:
                    outs.setdefault(o.request_id, []).append(o)
                stepped = True
        if not stepped:
            time.sleep(0.002)
    return outs


def _finished(rid: str):
    return lambda outs: any(o.finished for o in outs.get(rid, []))


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def colocated(core: EngineCore, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    rid = uuid.uuid4().hex
    core.add_request(EngineCoreRequest(rid, prompt, params))
    return _tokens(_drain(core, until=_finished(rid))[rid])


def disaggregated(prefill: EngineCore, decode: EngineCore, prompt: list[int], params: SamplingParams = GREEDY,
                  ) -> tuple[list, list]:  # fmt: skip
    tid = uuid.uuid4().hex
    p_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                   kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    prefill.add_request(EngineCoreRequest("p" + tid, prompt, p_params))
    first = _drain(prefill, until=_finished("p" + tid))["p" + tid]
    d_params = dataclasses.replace(params, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": tid, "remote_address": prefill.kv_transfer.address})
    decode.add_request(EngineCoreRequest("d" + tid, prompt, d_params))
    outs = _drain(prefill, decode, until=_finished("d" + tid))
    return first, outs["d" + tid]


def _all_free(*cores: EngineCore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(c.kv_manager.num_free_blocks != c.kv_manager.num_blocks for c in cores):
        assert time.monotonic() < deadline, [(c.kv_manager.num_free_blocks, c.kv_manager.num_blocks) for c in cores]
        for c in cores:
            if c.has_unfinished_requests():
                c.step()
        time.sleep(0.005)
    for c in cores:
        c.check_integrity()
        assert not c.scheduler.parked


@pytest.mark.parametrize("length", [3, 8, 37])
def test_greedy_tokens_equal_colocated(cores, length):
    coloc, prefill, decode = cores
    prompt = _prompt(length, seed=length)
    want = colocated(coloc, prompt)
    first, outs = disaggregated(prefill, decode, prompt)
    assert _tokens(first) == want[:1]                    # the prefill instance samples the first token
    assert _tokens(outs) == want                         # the decode instance emits it, then the rest
    assert outs[-1].finish_reason == "length"
    _all_free(prefill, decode)


def test_decode_side_prefix_cache_hit_skips_blocks(cores):
    coloc, prefill, decode = cores
    prompt = _prompt(40, seed=3)
    disaggregated(prefill, decode, prompt)               # the decode side now caches this prompt's blocks
    longer = prompt + _prompt(9, seed=4)
    want = colocated(coloc, prompt) and colocated(coloc, longer)
    sent_before = prefill.kv_transfer.sender.num_sent
    first, outs = disaggregated(prefill, decode, longer)
    assert _tokens(outs) == want
    assert prefill.kv_transfer.sender.num_sent == sent_before + 1
    _all_free(prefill, decode)


def test_logprobs_of_the_first_token_come_from_the_prefill_instance(cores):
    coloc, prefill, decode = cores
    params = dataclasses.replace(GREEDY, logprobs=2, max_tokens=4)
    prompt = _prompt(10, seed=5)
    rid = "c-lp"
    coloc.add_request(EngineCoreRequest(rid, prompt, params))
    want = _drain(coloc, until=_finished(rid))[rid]
    _, outs = disaggregated(prefill, decode, prompt, params)
    got_lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    want_lps = [lp for o in want for lp in (o.new_logprobs or [])]
    assert [lp.top_token_ids for lp in got_lps] == [lp.top_token_ids for lp in want_lps]
    assert [round(lp.logprob, 4) for lp in got_lps] == [round(lp.logprob, 4) for lp in want_lps]


def test_max_tokens_one_and_stop_token_end_on_arrival(cores):
    coloc, prefill, decode = cores
    prompt = _prompt(6, seed=6)
    one = dataclasses.replace(GREEDY, max_tokens=1)
    _, outs = disaggregated(prefill, decode, prompt, one)
    assert _tokens(outs) == colocated(coloc, prompt, one) and outs[-1].finish_reason == "length"
    t0 = colocated(coloc, prompt, one)[0]
    stop = dataclasses.replace(GREEDY, stop_token_ids=[t0], ignore_eos=False)
    _, outs = disaggregated(prefill, decode, prompt, stop)
    assert _tokens(outs) == [t0] and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == t0
    _all_free(prefill, decode)


def test_abort_while_the_kv_travels_frees_both_sides(cores):
    _, prefill, decode = cores
    prompt = _prompt(30, seed=7)
    tid = uuid.uuid4().hex
    prefill.add_request(EngineCoreRequest("p" + tid, prompt, dataclasses.replace(
        GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})))
    _drain(prefill, until=_finished("p" + tid))
    assert prefill.scheduler.parked                      # held for the decode side
    decode.add_request(EngineCoreRequest("d" + tid, prompt, dataclasses.replace(GREEDY, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": tid, "remote_address": prefill.kv_transfer.address})))
    aborted = decode.abort_requests(["d" + tid])
    assert [o.finish_reason for o in aborted] == ["abort"]
    _all_free(prefill, decode)


def test_prefill_side_abort_of_a_parked_request_frees_it(cores):
    _, prefill, _ = cores
    tid = uuid.uuid4().hex
    prefill.add_request(EngineCoreRequest("p" + tid, _prompt(9), dataclasses.replace(
        GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})))
    _drain(prefill, until=_finished("p" + tid))
    assert prefill.kv_manager.num_free_blocks < prefill.kv_manager.num_blocks
    prefill.abort_requests(["p" + tid])
    _all_free(prefill)


def test_unknown_transfer_ends_the_request_with_an_error(cores):
    _, prefill, decode = cores
    decode.add_request(EngineCoreRequest("d-none", _prompt(5), dataclasses.replace(GREEDY, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": "nope", "remote_address": prefill.kv_transfer.address})))
    outs = _drain(decode, until=_finished("d-none"))["d-none"]
    assert outs[-1].finish_reason == "abort" and "no parked transfer" in outs[-1].error
    _all_free(decode)


def test_evicted_decode_prefix_falls_back_to_recompute(cores):
    coloc, prefill, decode = cores
    prompt = _prompt(24, seed=8)
    disaggregated(prefill, decode, prompt)
    longer = prompt + _prompt(6, seed=9)
    want = colocated(coloc, longer)
    tid = uuid.uuid4().hex
    prefill.add_request(EngineCoreRequest("p" + tid, longer, dataclasses.replace(
        GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})))
    _drain(prefill, until=_finished("p" + tid))
    decode.add_request(EngineCoreRequest("d" + tid, longer, dataclasses.replace(GREEDY, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": tid, "remote_address": prefill.kv_transfer.address})))
    assert decode.kv_transfer._fetching["d" + tid][2] > 0   # it skips the blocks cached here...
    assert decode.kv_manager.reset_prefix_cache()            # ...which are gone before it arrives
    outs = _drain(prefill, decode, until=_finished("d" + tid))["d" + tid]
    assert _tokens(outs) == want
    _all_free(prefill, decode)


def test_roles_refuse_the_other_side_s_requests(cores):
    coloc, prefill, decode = cores
    to_decode = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                               "transfer_id": "x"})
    with pytest.raises(ValueError, match="decode instance"):
        decode.add_request(EngineCoreRequest("a", _prompt(3), to_decode))
    with pytest.raises(ValueError, match="max_tokens=1"):
        prefill.add_request(EngineCoreRequest("b", _prompt(3), dataclasses.replace(to_decode, max_tokens=2)))
    with pytest.raises(ValueError, match="kv-role"):
        coloc.add_request(EngineCoreRequest("c", _prompt(3), to_decode))


def test_vanished_prefill_instance_fails_fast(tiny_llama_dir):
    prefill, decode = _core(tiny_llama_dir, "prefill"), _core(tiny_llama_dir, "decode")
    try:
        address = prefill.kv_transfer.address
        prefill.shutdown()
        start = time.monotonic()
        decode.add_request(EngineCoreRequest("d", _prompt(5), dataclasses.replace(GREEDY, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": "t", "remote_address": address})))
        outs = _drain(decode, until=_finished("d"))["d"]
        assert outs[-1].error and "refused" in outs[-1].error
        assert time.monotonic() - start < 5
        _all_free(decode)
    finally:
        decode.shutdown()
