"""Structured output through the offline API on the default model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pets", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, num_kv_blocks=512, max_model_len=2048)


@pytest.mark.slow
def test_json_schema_outputs_validate(llm):
    convs = [[{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}] for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for i in range(6)]
    for out in llm.chat(convs, params, use_tqdm=False):
        doc = json.loads(out.outputs[0].text)
        jsonschema.validate(doc, SCHEMA)
    llm.engine.check_integrity()


def test_regex_and_choice_are_obeyed(llm):
    date = llm.generate("Today's date is", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text)
    assert date.finish_reason == "stop"
    pick = llm.chat([{"role": "user", "content": "Is water wet?"}], SamplingParams(
        max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])), use_tqdm=False)
    assert pick[0].outputs[0].text in ("yes", "no", "maybe")
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/\n'
    out = llm.generate("Q: what is 2+2? A:", SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(
        grammar=grammar)), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"The answer is [0-9]+\.", out.text)


# Exact token equality across batch shapes: a fp32 near-tie can flip (seen once on a
# fresh CI run); needs the near-tie excuse of tests/model/test_invariance.py. Slow set.
@pytest.mark.slow
def test_unconstrained_requests_unchanged_by_constrained_neighbours(llm):
    plain = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in
             ("The history of Rome", "My favourite recipe is", "In the year 3000")]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, greedy, use_tqdm=False)]
    constrained = SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(plain + [{"prompt": "A person:"}] * 2, [greedy] * 3 + [constrained] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone


def test_invalid_specifications_raise(llm):
    with pytest.raises(GrammarError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), use_tqdm=False)
    with pytest.raises(GrammarError):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"})),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
