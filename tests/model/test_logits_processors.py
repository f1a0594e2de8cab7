"""Logits processors as plug-ins (pagoda/sample/logits_processor.py) on the bundled model,
loaded by name from tests/model/logits_processor_plugins.py: offline through ``LLM`` with
requests that join and finish at different times (rows stay each request's own through
added / removed / moved), the per-request callables of AdapterLogitsProcessor, what a grammar
or allowed_token_ids bans staying banned, and over HTTP with the official client's
``vllm_xargs`` (the engine core in its own process, the classes loaded there by name)."""

from __future__ import annotations

import itertools

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sample.logits_processor import MoveDirectionality
from pagoda.validation import InvalidRequestError
from tests.model import logits_processor_plugins as plugins

PROMPT = "The capital of France is"
MODULE = "tests.model.logits_processor_plugins"
NAMES = [f"{MODULE}:ForceTokens", f"{MODULE}.BatchRecorder", f"{MODULE}:TokenBias", f"{MODULE}:RepeatPrompt"]


@pytest.fixture(scope="module")
def llm():
    # At most 3 requests at once: later ones join as earlier ones finish.
    return LLM(show_progress=False, num_kv_blocks=64, block_size=16, max_num_seqs=3, logits_processors=NAMES)


def _cycled(tokens: list[int], n: int) -> list[int]:
    return list(itertools.islice(itertools.cycle(tokens), n))


def test_rows_stay_each_requests_own(llm) -> None:
    recorder = plugins.RECORDERS[-1]
    assert type(recorder.config).__name__ == "EngineConfig" and recorder.config.logits_processors == tuple(NAMES)
    before = len(recorder.updates)
    # (forced tokens, max_tokens): finishing at different steps, the unforced one random.
    plans = [([10, 20, 30], 3), ([40, 50], 7), (None, 5), ([60], 2), ([70, 80, 90, 100], 9), ([110, 120], 4)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True,
                             extra_args={"tag": f"r{i}", **({"force_tokens": " ".join(map(str, f))} if f else {})})
              for i, (f, n) in enumerate(plans)]
    outs = llm.generate([PROMPT] * len(plans), params, use_tqdm=False)
    for (forced, n), out in zip(plans, outs):
        if forced:
            assert out.outputs[0].token_ids == _cycled(forced, n)
    # The unforced request drew as it would alone: the processors left its row alone.
    [alone] = llm.generate(PROMPT, params[2], use_tqdm=False)
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids
    updates = [u for u in recorder.updates[before:] if u is not None]
    added = [params.extra_args["tag"] for u in updates for _, params, _, _ in u.added]
    assert sorted(added[:len(plans)]) == [f"r{i}" for i in range(len(plans))]   # each once, in the shared run
    assert any(u.removed for u in updates)
    assert any(m[2] is MoveDirectionality.UNIDIRECTIONAL for u in updates for m in u.moved)
    assert any(u.removed and u.added for u in updates)   # a new request took a finished one's row
    assert recorder.max_batch_size == 3 and recorder.num_applied > 0
    assert None in recorder.updates[before:]   # steady steps: no change, update_state(None)


def test_logprobs_show_the_processors_that_change_the_argmax(llm) -> None:
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                extra_args={"force_tokens": "7 8"}), use_tqdm=False)
    assert out.outputs[0].token_ids == [7, 8, 7]
    for entry, token in zip(out.outputs[0].logprobs, [7, 8, 7]):
        assert entry[token].logprob == 0.0   # the only token left


def test_adapter_callables(llm) -> None:
    def greedy(**extra_args) -> list[int]:
        [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    extra_args=extra_args or None), use_tqdm=False)
        return out.outputs[0].token_ids

    free = greedy()
    banned = greedy(bias_token=free[0], bias=-1000.0)
    assert banned[0] != free[0] and free[0] not in banned
    assert greedy(bias_token=1234) == [1234] * 6
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert greedy(repeat_prompt=True) == _cycled(prompt_ids, 6)


def test_what_the_request_bans_stays_banned(llm) -> None:
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                allowed_token_ids=[42, 1000], extra_args={"bias_token": 7}),
                         use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= {42, 1000}


def test_requests_are_checked_by_the_processors(llm) -> None:
    with pytest.raises(InvalidRequestError, match="force_tokens must be token ids"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, extra_args={"force_tokens": "a b"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args values must be strings, numbers or booleans"):
        SamplingParams(extra_args={"force_tokens": [1, 2]})


def test_a_bad_class_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="has no 'Missing'"):
        LLM(show_progress=False, logits_processors=[f"{MODULE}:Missing"])
    with pytest.raises(ValueError, match="is not a subclass of"):
        LLM(show_progress=False, logits_processors=[f"{MODULE}:forced_tokens"])


def test_over_http_with_vllm_xargs() -> None:
    openai = pytest.importorskip("openai")
    from pagoda.config import EngineConfig
    from tests.e2e.server_utils import real_engine_server

    config = EngineConfig(show_progress=False, num_kv_blocks=64, block_size=16, max_model_len=512,
                          logits_processors=[f"{MODULE}:ForceTokens", f"{MODULE}:TokenBias"])
    with real_engine_server(config, served_model_name="m") as (_, running):
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none")
        done = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0,
                                         extra_body={"vllm_xargs": {"force_tokens": "100 200"},
                                                     "ignore_eos": True, "return_token_ids": True})
        assert done.choices[0].model_extra["token_ids"] == [100, 200, 100, 200, 100]
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0,
                                              extra_body={"vllm_xargs": {"bias_token": 300, "bias": 1000.0},
                                                          "ignore_eos": True, "return_token_ids": True})
        assert chat.choices[0].model_extra["token_ids"] == [300, 300, 300]
        for xargs, param in (({"force_tokens": "x"}, "extra_args"), ({"force_tokens": {"a": 1}}, "vllm_xargs")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="m", prompt=PROMPT, max_tokens=2, extra_body={"vllm_xargs": xargs})
            assert param in str(e.value)
