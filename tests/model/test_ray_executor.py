"""The Ray backends on a local single-node Ray cluster started by this module.

--distributed-executor-backend ray (TP=2: rank 1 is a Ray actor) gives the mp launch's
tokens and logprobs bit for bit (the same gloo group, the same sums); --data-parallel-backend
ray (two engine cores in actors) gives one engine's greedy tokens. A Ray actor killed under
an engine ends its in-flight request with an error and marks the engine dead (TP) or the
replica down (DP). After each engine shuts down its placement group is gone (the cluster's
CPUs are all free again).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from tests.model.test_tensor_parallel import _PROMPTS, _restore_threads  # noqa: F401 - autouse fixture

_CPUS = 4
_GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
_ENGINE = dict(num_kv_blocks=96, max_model_len=1024, show_progress=False)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node in this process: 4 CPUs, a 100 MB object store, no dashboard. Yields its
    address (for engine cores in other processes)."""
    ray = pytest.importorskip("ray", reason="the Ray backends need Ray: pip install 'pagoda[ray]'")
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    ray.init(num_cpus=_CPUS, include_dashboard=False, object_store_memory=100 << 20, _temp_dir=tmp,
             namespace="pagoda-tests")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_llama_tok_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with a word-level tokenizer (AsyncLLM loads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = str(tmp_path_factory.mktemp("tiny-llama-tok") / "model")
    shutil.copytree(tiny_llama_dir, path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def _all_cpus_free(ray, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) < _CPUS:
        assert time.monotonic() < deadline, f"Ray resources still held: {ray.available_resources()}"
        time.sleep(0.2)


def _offline(path: str, **kw):
    """Greedy outputs of the offline engine, and its workers' types."""
    llm = LLM(path, skip_tokenizer_init=True, **_ENGINE, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], _GREEDY, use_tqdm=False)
        driver = llm.engine.tp_driver
        kinds = {type(w).__name__ for w in driver.workers} if driver else set()
        return [o.outputs[0] for o in outs], kinds
    finally:
        llm.shutdown()


@pytest.mark.slow   # (CI time: the Ray DP test below runs ranks as Ray actors too)
def test_ray_tp2_equals_the_mp_launch(tiny_llama_dir, ray_cluster):
    import ray

    mp, mp_kinds = _offline(tiny_llama_dir, tensor_parallel_size=2)
    got, kinds = _offline(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert (mp_kinds, kinds) == ({"Popen"}, {"RayWorker"})
    assert [o.token_ids for o in got] == [o.token_ids for o in mp]
    assert [o.logprobs for o in got] == [o.logprobs for o in mp]
    _all_cpus_free(ray)


async def _tokens(engine, request_id: str, prompt: list[int]) -> list[int]:
    final = None
    async for out in engine.generate(request_id, None, prompt, _GREEDY):
        final = out
    return list(final.outputs[0].token_ids)


def test_ray_dp2_equals_one_engine_and_survives_a_killed_replica(tiny_llama_tok_dir, ray_cluster):
    import ray

    from pagoda.engine.dp_client import DataParallelLLM
    from pagoda.executor.ray_executor import NAMESPACE, RayCoreProcess

    base, _ = _offline(tiny_llama_tok_dir)
    config = EngineConfig(model=tiny_llama_tok_dir, data_parallel_size=2, data_parallel_backend="ray",
                          ray_address=ray_cluster, **_ENGINE)

    async def run() -> None:
        engine = DataParallelLLM.from_config(config, log_stats=False, log_requests=False)
        try:
            procs = [r._proc for r in engine.replicas]
            assert all(isinstance(p, RayCoreProcess) for p in procs)
            assert os.getpid() not in {p.pid for p in procs}
            got = await asyncio.gather(*(_tokens(engine, f"r{i}", p) for i, p in enumerate(_PROMPTS)))
            assert got == [list(o.token_ids) for o in base]
            ray.kill(ray.get_actor(procs[1].name, namespace=NAMESPACE))
            deadline = time.monotonic() + 20
            while "replica 1" not in (engine.degraded_reason or ""):
                assert time.monotonic() < deadline, "the killed replica is still counted as healthy"
                await asyncio.sleep(0.1)
            assert engine.is_healthy
            assert await _tokens(engine, "after", _PROMPTS[1]) == list(base[1].token_ids)
        finally:
            await engine.shutdown()

    asyncio.run(run())
    _all_cpus_free(ray)


@pytest.mark.slow   # (CI time: the Ray DP test below also kills a replica)
def test_killed_ray_worker_ends_the_request_with_an_error(tiny_llama_tok_dir, ray_cluster):
    """The engine core runs in its own process (it connects to the cluster by address);
    rank 1's actor is killed while a long request decodes."""
    import ray

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.client import EngineDeadError
    from pagoda.executor.ray_executor import NAMESPACE

    config = EngineConfig(model=tiny_llama_tok_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
                          ray_address=ray_cluster, distributed_timeout=30.0, **_ENGINE)
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM.from_config(config, log_stats=False, log_requests=False)
        try:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["namespace"] == NAMESPACE and "-tp-" in a["name"]]
            assert len(names) == 1 and names[0].endswith("-rank-1"), names
            actor = ray.get_actor(names[0], namespace=NAMESPACE)
            stream = engine.generate("long", None, list(range(3, 9)), long)
            first = await asyncio.wait_for(stream.__anext__(), 60)
            assert not first.finished
            ray.kill(actor)

            async def drain() -> None:
                async for out in stream:
                    assert not out.finished, "the request finished although its worker was killed"

            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(drain(), 30)
            assert not engine.is_healthy
            assert "parallel peer failed" in engine.dead_reason or "parallel worker" in engine.dead_reason, \
                engine.dead_reason
        finally:
            await engine.shutdown()

    asyncio.run(run())
    _all_cpus_free(ray)


def test_ray_address_of_another_cluster_is_refused(ray_cluster):
    """This process is connected to the test's cluster; an engine may not name another."""
    from pagoda.executor.ray_executor import start_ray_workers

    host, port = ray_cluster.rsplit(":", 1)
    other = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray",
                         ray_address=f"{host}:{int(port) + 1}")
    with pytest.raises(ValueError, match="connected to the Ray cluster at"):
        start_ray_workers(other, 0)


def test_a_placement_the_cluster_cannot_hold_is_an_error(ray_cluster):
    """Two ranks of 3 CPUs on a 4-CPU cluster: refused after --distributed-timeout, saying
    what is free, and nothing stays reserved."""
    import ray

    from pagoda.executor.ray_executor import start_ray_workers

    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray", threads_per_rank=3,
                          distributed_timeout=2.0)
    with pytest.raises(RuntimeError, match=r"Ray could not place 2 tensor-parallel ranks .*free in the cluster"):
        start_ray_workers(config, 0)
    _all_cpus_free(ray)
