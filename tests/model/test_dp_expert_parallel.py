"""Expert parallelism across data-parallel replicas (--data-parallel-size 2
--enable-expert-parallel) on tiny random MoE checkpoints.

- dispatch_combine alone over 2 gloo processes against the one-process MoE block, with
  a rank that has no tokens;
- DataParallelLLM with 2 replicas each holding half the experts: the greedy tokens of
  one process, with requests of different lengths so that the replicas step different
  token counts and one is often idle (its dummy pass); every KV block free afterwards;
- the combinations it refuses.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from tests.model.helpers import compare_greedy, logprob_gap


@pytest.fixture(autouse=True)
def _restore_threads():
    # (The tests' groups wait up to 600 s: a test process paused by the machine's other work
    # must not time out; the killed replica's peer fails at once, its sockets closed.)
    # The replicas' engine cores (threads of this process here) set one torch thread each.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- dispatch / combine alone ----------------------------------------------------------

# Tokens per rank in each case: uneven, one rank without tokens, single tokens.
_CASES = [(5, 3), (0, 4), (3, 0), (1, 1), (1, 0), (0, 0)]


def _inputs(case: int, rank: int, hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * case + rank)
    return torch.randn(_CASES[case][rank], hidden, generator=gen)


def _ep_worker(rank: int, path: str, port: int, out_dir: str) -> None:
    from pagoda.distributed.group import EPGroup
    from pagoda.model.layers.expert_parallel import shard_experts
    from pagoda.model.loader import load_model

    torch.set_num_threads(1)
    model = load_model(path, show_progress=False).model
    group = EPGroup(f"tcp://127.0.0.1:{port}", rank, 2, torch.device("cpu"), 600.0)
    e0, e1 = shard_experts(model, group)
    block = model.model.layers[0].mlp
    hidden = block.gate.in_features
    results = []
    with torch.inference_mode():
        for case in range(len(_CASES)):
            results.append(block(_inputs(case, rank, hidden)))
    torch.save({"experts": (e0, e1), "out": results, "rounds": group.rounds}, f"{out_dir}/rank{rank}.pt")


def test_dispatch_combine_matches_one_process(tiny_mixtral_dir, tmp_path):
    """Each rank routes its own tokens, its experts compute the rows both ranks send, and
    its tokens' sums come back: the one-process block on all tokens at once, bitwise (each
    expert's rows in the same order, the same additions per token) but where a rank has
    one token (see below)."""
    from pagoda.model.loader import load_model

    torch.multiprocessing.spawn(_ep_worker, args=(tiny_mixtral_dir, _free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["experts"] for r in ranks] == [(0, 2), (2, 4)]
    assert all(r["rounds"] == len(_CASES) for r in ranks)
    block = load_model(tiny_mixtral_dir, show_progress=False).model.model.layers[0].mlp
    hidden = block.gate.in_features
    with torch.inference_mode():
        for case, sizes in enumerate(_CASES):
            x = torch.cat([_inputs(case, r, hidden) for r in range(2)])
            if x.shape[0] == 0:
                continue
            want = block(x)
            got = torch.cat([ranks[r]["out"][case] for r in range(2)])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            # Bitwise where every product has the same shape kind as in one process: a rank's
            # single token goes through the router (and the one-process block's single token
            # through its experts) as a matrix-vector product, whose float32 bits differ from a
            # matrix product's row (BLAS), so those cases are equal within 1e-5 only.
            if 1 not in sizes and x.shape[0] > 1:
                assert torch.equal(got, want), f"case {sizes}: max diff {(got - want).abs().max()}"


# ---- the engine --------------------------------------------------------------------------


def _with_tokenizer(src: str, tmp_path_factory, name: str) -> str:
    """A copy of a tiny checkpoint with a word-level tokenizer (AsyncLLM loads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = str(tmp_path_factory.mktemp(name) / "model")
    shutil.copytree(src, path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def mixtral_tok_dir(tiny_mixtral_dir, tmp_path_factory) -> str:
    return _with_tokenizer(tiny_mixtral_dir, tmp_path_factory, "mixtral-tok")


@pytest.fixture(scope="module")
def gptoss_tok_dir(tiny_gptoss_dir, tmp_path_factory) -> str:
    return _with_tokenizer(tiny_gptoss_dir, tmp_path_factory, "gptoss-tok")


@pytest.fixture(scope="module")
def qwen3moe_tok_dir(tiny_qwen3moe_dir, tmp_path_factory) -> str:
    return _with_tokenizer(tiny_qwen3moe_dir, tmp_path_factory, "qwen3moe-tok")


@pytest.fixture(scope="module")
def moe_gguf_path(tmp_path_factory) -> str:
    """A Qwen3-MoE-shaped GGUF file (4 experts, 2 per token) whose weights, router included,
    pagoda keeps in the file's blocks (the exact mode's kept layers have buffers, not
    parameters)."""
    from pagoda.bench.gguf_files import ModelShape, write_model

    shape = ModelShape("qwen3moe", 256, 2, 4, 2, 512, False, 1000000.0, head_dim=64, qk_norm=True, experts=4,
                       experts_used=2, expert_ffn=256)
    return write_model(str(tmp_path_factory.mktemp("dp-ep-gguf") / "moe.gguf"), shape, "Q8_0",
                       show_progress=False, quantized=True)


_PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 40, 9, 70, 1, 25))]
_MAX_TOKENS = [12, 4, 20, 6, 16, 2]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True)


def _one_process(path: str):
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, show_progress=False, skip_tokenizer_init=True)
    try:
        outs = [llm.generate([{"prompt_token_ids": p}], _params(n), use_tqdm=False)[0]
                for p, n in zip(_PROMPTS, _MAX_TOKENS)]
        return [o.outputs[0] for o in outs]
    finally:
        llm.shutdown()


async def _dp_ep_run(path: str, multiprocess: bool):
    from pagoda.engine.dp_client import DataParallelLLM

    config = EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=64,
                          max_model_len=256, show_progress=False, skip_tokenizer_init=True,
                          max_num_batched_tokens=32, distributed_timeout=600.0)
    engine = DataParallelLLM(config, multiprocess, log_stats=False, log_requests=False)
    try:
        async def one(i: int):
            await asyncio.sleep(0.05 * i)   # staggered: the replicas' batches differ from step to step
            last = None
            async for out in engine.generate(f"r{i}", None, _PROMPTS[i], _params(_MAX_TOKENS[i])):
                last = out
            return last.outputs[0]

        outs = await asyncio.gather(*(one(i) for i in range(len(_PROMPTS))))
        served = [sum(r.metrics.request_success.values()) for r in engine.replicas]
        # Every block back in the pools, and the expert load reported (about once a second):
        # wait for the idle heartbeats.
        for _ in range(100):
            stats = engine.replica_stats()
            if all(s.kv_cache_usage == 0 and s.num_running_reqs == 0 for s in stats) \
                    and all(r.metrics.expert_load for r in engine.replicas):
                break
            await asyncio.sleep(0.05)
        integrity = await engine.check_integrity()
        loads = [r.metrics.expert_load for r in engine.replicas]
        return outs, stats, integrity, served, loads, engine.is_healthy
    finally:
        await engine.shutdown()


def _assert_same_greedy(got, want) -> None:
    """The same greedy tokens (a near-tie excused), and up to the first divergence the same
    top-2 logprobs within 5e-5. Not bitwise: the replicas' batches differ from one
    process's, so the float32 sums differ in their last bits (docs/parallel.md), as they do
    in one process alone: on these tiny random models (logits in the tens) the one-process
    engine's logprobs move by up to 2.2e-5 between running these requests one at a time
    and batched, so 1e-5 would be tighter than the engine itself is."""
    for i, (a, b) in enumerate(zip(got, want)):
        cmp = compare_greedy(a.token_ids, b.token_ids,
                             lambda pos: min(logprob_gap(a, pos), logprob_gap(b, pos)), f"prompt {i}")
        assert cmp.equal, cmp.excused
        for pos, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            la, lb = a.logprobs[pos], b.logprobs[pos]
            assert la.keys() == lb.keys() or cmp.excused, (i, pos, la, lb)
            for tok in la.keys() & lb.keys():
                assert abs(la[tok].logprob - lb[tok].logprob) <= 5e-5, (i, pos, tok, la[tok], lb[tok])


@pytest.mark.parametrize("model", ["mixtral_tok_dir", "qwen3moe_tok_dir", "gptoss_tok_dir", "moe_gguf_path"])
def test_dp2_expert_parallel_matches_one_process(model, request, monkeypatch):
    """Two replicas (engine-core threads), each with half of every layer's experts, serve
    six concurrent requests of different lengths: the tokens of one process (a near-tie
    excused, see helpers.compare_greedy), both replicas serving, an idle replica's dummy
    passes, every KV block free after, each replica's expert load in its metrics."""
    from pagoda.model.layers import expert_parallel

    path = request.getfixturevalue(model)
    want = _one_process(path)
    dummies, shards = [], []
    real_dummy, real_shard = expert_parallel.dummy_pass, expert_parallel.shard_experts
    monkeypatch.setattr(expert_parallel, "dummy_pass", lambda m: (dummies.append(1), real_dummy(m)))
    monkeypatch.setattr(expert_parallel, "shard_experts", lambda m, g: shards.append(real_shard(m, g)) or shards[-1])
    got, stats, integrity, served, loads, healthy = asyncio.run(_dp_ep_run(path, multiprocess=False))
    _assert_same_greedy(got, want)
    assert [len(o.token_ids) for o in got] == _MAX_TOKENS
    num_experts = len(loads[0][0])
    assert sorted(shards) == [(0, num_experts // 2), (num_experts // 2, num_experts)]
    assert all(n > 0 for n in served) and sum(served) == len(_PROMPTS), served
    assert dummies, "no replica was ever idle while the other stepped"
    assert all(s.kv_cache_usage == 0 and s.num_running_reqs == 0 for s in stats), stats
    assert integrity["ok"], integrity
    # Per replica, per MoE layer: top-k picks of its own tokens, over all the experts.
    top_k = 2
    for load, n in zip(loads, served):
        assert all(len(layer) == num_experts for layer in load)
        assert len({sum(layer) for layer in load}) == 1 and sum(load[0]) % top_k == 0
    assert healthy


def test_dp2_expert_parallel_processes_match_one_process(mixtral_tok_dir):
    """The same with the replicas' engine cores in their own processes (as `pagoda serve`)."""
    want = _one_process(mixtral_tok_dir)
    got, stats, integrity, served, _, healthy = asyncio.run(_dp_ep_run(mixtral_tok_dir, multiprocess=True))
    _assert_same_greedy(got, want)
    assert all(s.kv_cache_usage == 0 for s in stats), stats
    assert all(n > 0 for n in served), served
    assert integrity["ok"] and healthy


async def _kill_one_replica(path: str):
    from pagoda.engine.client import EngineDeadError
    from pagoda.engine.dp_client import DataParallelLLM

    config = EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=64,
                          max_model_len=256, show_progress=False, skip_tokenizer_init=True, distributed_timeout=600.0)
    engine = DataParallelLLM(config, log_stats=False, log_requests=False)
    started = asyncio.Event()
    try:
        async def one(i: int):
            n = 0
            async for _ in engine.generate(f"r{i}", None, _PROMPTS[i], _params(200)):
                n += 1
                if n == 3:
                    started.set()
                await asyncio.sleep(0.01)   # slow consumer: the requests are still running at the kill
            return n

        tasks = [asyncio.ensure_future(one(i)) for i in range(2)]
        await asyncio.wait_for(started.wait(), 60)
        assert sorted(engine._owner.values()) == [0, 1]   # one request on each replica
        engine.replicas[0]._proc.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert not engine.is_healthy and engine.dead_reason and engine.degraded_reason is None
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("after", None, _PROMPTS[0], _params(2)):
                pass
        # The survivor's engine core leaves its loop (its exchange fails): nothing left hanging.
        engine.replicas[1]._proc.join(60)
        assert not engine.replicas[1]._proc.is_alive()
    finally:
        await engine.shutdown()


def test_dp_expert_parallel_one_replica_dies(mixtral_tok_dir):
    """The group runs whole or not at all: a killed replica's peer ends its requests with
    EngineDeadError too, the server turns unhealthy, new requests are refused, and the
    peer's engine core exits (its exchange fails) instead of hanging."""
    asyncio.run(_kill_one_replica(mixtral_tok_dir))


# ---- what it refuses -----------------------------------------------------------------------


@pytest.mark.parametrize("extra,named", [
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size > 1"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size > 1"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative-config"),
    ({"data_parallel_backend": "ray"}, "--data-parallel-backend ray"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "--distributed-executor-backend ray"),
])
def test_dp_expert_parallel_refuses(extra, named):
    with pytest.raises(ValueError, match="with --enable-expert-parallel") as info:
        EngineConfig(data_parallel_size=2, enable_expert_parallel=True, **extra)
    assert named in str(info.value)


def test_expert_parallel_needs_tp_or_dp():
    with pytest.raises(ValueError, match="needs --tensor-parallel-size > 1 or --data-parallel-size > 1"):
        EngineConfig(enable_expert_parallel=True)
    EngineConfig(data_parallel_size=2, enable_expert_parallel=True)   # accepted


def test_dp_expert_parallel_needs_the_dp_client(tiny_mixtral_dir):
    """One engine cannot form the replicas' group: the offline LLM refuses the mode."""
    with pytest.raises(ValueError, match="DataParallelLLM"):
        LLM(tiny_mixtral_dir, data_parallel_size=2, enable_expert_parallel=True, skip_tokenizer_init=True,
            show_progress=False)


def test_dp_expert_parallel_needs_moe(tiny_llama_dir):
    from pagoda.engine.engine_core import EngineCore

    config = EngineConfig(model=tiny_llama_dir, data_parallel_size=2, enable_expert_parallel=True,
                          expert_parallel_init_method=f"tcp://127.0.0.1:{_free_port()}", show_progress=False,
                          skip_tokenizer_init=True, num_kv_blocks=8)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        EngineCore(config)
