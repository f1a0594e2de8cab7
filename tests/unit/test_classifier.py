"""Classifiers without a model (pagoda/pooling.py, pagoda/worker/pooler.py): what a checkpoint's
config says its logits mean, the activations, the task rules, the checks of a classify request,
and an encoder's prompts scheduled whole (SchedulerConfig.whole_prompts)."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.config.pooling import parse_token_list
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.pooling import (
    PoolerConfig,
    PoolingParams,
    activate,
    classifier_from_config,
    placeholder_sampling_params,
    resolve_task,
)
from pagoda.validation import InvalidRequestError, RequestLimits, WrongTaskError, validate_pooling_request
from pagoda.worker.pooler import Pooler, pair_token_types


def test_activations():
    assert activate([0.0, 0.0], "softmax") == [0.5, 0.5]
    assert activate([1000.0, 0.0], "softmax") == [1.0, 0.0]   # no overflow
    assert activate([0.0], "sigmoid") == [0.5]
    assert activate([-1000.0, 1000.0], "sigmoid") == [0.0, 1.0]
    assert activate([2.0, -3.0], "sigmoid") == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(3))])
    assert activate([2.5], "identity") == [2.5]
    assert activate([0.5], "tanh") == [math.tanh(0.5)]
    with pytest.raises(ValueError, match="activation"):
        activate([1.0], "relu")


def test_labels_and_activations_from_the_config():
    c = classifier_from_config({"id2label": {"0": "neg", "1": "pos"}}, 2)
    assert (c.labels, c.classify_activation, c.score_activation) == (("neg", "pos"), "softmax", "softmax")
    c = classifier_from_config({}, 1)   # a cross-encoder: sigmoid, as sentence-transformers' default
    assert (c.labels, c.classify_activation, c.score_activation) == (("LABEL_0",), "sigmoid", "sigmoid")
    # ms-marco-MiniLM-L-6-v2's config: its CrossEncoder returns the raw logit.
    c = classifier_from_config({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, 1)
    assert (c.classify_activation, c.score_activation) == ("sigmoid", "identity")
    c = classifier_from_config({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, 1)
    assert c.score_activation == "sigmoid"
    c = classifier_from_config({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Softmax"}, 1)
    assert c.score_activation == "sigmoid"   # vLLM's reading: a softmax over one logit would always be 1
    assert classifier_from_config({"problem_type": "regression"}, 1).classify_activation == "identity"
    assert classifier_from_config({"problem_type": "multi_label_classification"}, 3).classify_activation == "sigmoid"
    with pytest.raises(ValueError, match="not supported"):
        classifier_from_config({"sbert_ce_default_activation_function": "os.system"}, 1)
    # A causal LM's tokens: two make one label named by the second; others a label each.
    c = classifier_from_config({"id2label": {"0": "x"}}, 0, ("no", "yes"), (7, 9))
    assert (c.labels, c.two_way, c.from_token_ids, c.score_activation) == (("yes",), True, (7, 9), "sigmoid")
    c = classifier_from_config({}, 0, ("a", "b", "c"), (1, 2, 3))
    assert (c.labels, c.two_way, c.classify_activation) == (("a", "b", "c"), False, "softmax")


def test_tasks():
    assert resolve_task("auto", "/nowhere", has_lm_head=False, classifier=True) == "classify"
    assert resolve_task("score", "/nowhere", has_lm_head=True, classifier=True) == "classify"
    assert resolve_task("auto", "/nowhere", has_lm_head=True) == "generate"
    with pytest.raises(ValueError, match="cannot generate"):
        resolve_task("generate", "/nowhere", has_lm_head=True, classifier=True)
    with pytest.raises(ValueError, match="no classification head"):
        resolve_task("classify", "/nowhere", has_lm_head=True)
    assert parse_token_list("classifier_from_token", "no, yes") == ("no", "yes")
    assert parse_token_list("classifier_from_token", '["no", "yes"]') == ("no", "yes")
    for bad in ("", "no,no", "[1]"):
        with pytest.raises(ValueError, match="classifier_from_token"):
            parse_token_list("classifier_from_token", bad)


def _limits(pooler: PoolerConfig) -> RequestLimits:
    return RequestLimits(64, 1000, "fcfs", False, pooler=pooler)


def test_request_checks():
    bert = PoolerConfig("CLS", False, 8, classifier=classifier_from_config({}, 1, token_types=True))
    decoder = PoolerConfig("LAST", False, 8, classifier=classifier_from_config({}, 3))
    embed = PoolerConfig("LAST", True, 8)
    validate_pooling_request([1, 2, 3, 4], PoolingParams(task="classify", pair_start=2), _limits(bert))
    with pytest.raises(WrongTaskError, match="wants an embedding, but this model is a classifier"):
        validate_pooling_request([1, 2], PoolingParams(), _limits(decoder))
    with pytest.raises(WrongTaskError, match="wants a classification, but this model serves embeddings"):
        validate_pooling_request([1, 2], PoolingParams(task="classify"), _limits(embed))
    with pytest.raises(InvalidRequestError, match="reads no token type ids"):
        validate_pooling_request([1, 2, 3], PoolingParams(task="classify", pair_start=1), _limits(decoder))
    with pytest.raises(InvalidRequestError, match="between 1 and 3"):
        validate_pooling_request([1, 2, 3, 4], PoolingParams(task="classify", pair_start=4), _limits(bert))
    with pytest.raises(ValueError, match="dimensions and normalize apply to embeddings"):
        PoolingParams(task="classify", normalize=True)
    with pytest.raises(ValueError, match="not normalised or truncated"):
        PoolerConfig("LAST", True, 8, classifier=classifier_from_config({}, 1))


def test_pooler_applies_the_head():
    classifier = classifier_from_config({}, 2)
    config = PoolerConfig("LAST", False, 3, classifier=classifier)
    weight = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    pooler = Pooler(config, head=lambda v: weight @ v)
    rows = torch.tensor([[9.0, 9.0, 9.0], [1.0, 2.0, 3.0]])
    assert pooler.add("r", rows, 0, 2, PoolingParams(task="classify")) == [1.0, 4.0]   # raw logits, last row
    with pytest.raises(ValueError, match="needs its head"):
        Pooler(config)
    assert pair_token_types(6, [(1, 0, 5, 3)], torch.device("cpu")).tolist() == [0, 0, 0, 0, 1, 1]


def test_encoder_prompts_run_whole():
    """With whole_prompts a prompt never splits over steps: one that does not fit what is left
    of a step's budget waits for the next step (and nothing behind it jumps ahead)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=16, whole_prompts=True,
                                      long_prefill_token_threshold=4),
                      KVCacheManager(32, 4, enable_caching=False))
    lens = {"a": 10, "b": 10, "c": 5, "d": 16}
    for rid, n in lens.items():
        sched.add_request(Request(rid, list(range(10, 10 + n)), placeholder_sampling_params(), max_model_len=16,
                                  pooling_params=PoolingParams(task="classify")))
    steps = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        steps.append(dict(so.num_scheduled_tokens))
        done = [rid for rid, n in so.num_scheduled_tokens.items()]
        sched.update_from_output(so, ModelRunnerOutput(done, [[] for _ in done], pooled={r: [0.0] for r in done}))
        sched.check_integrity()
    # Each prompt whole, past the long-prefill cap of 4; b waits for a step of its own with c.
    assert steps == [{"a": 10}, {"b": 10, "c": 5}, {"d": 16}]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
