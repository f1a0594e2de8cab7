"""Gemma 4 assistant drafts (``{"model": "<gemma4_assistant checkpoint>", ...}``): the
assistant's queries over the target's KV cache. Its drafts and logits equal transformers'
(``Gemma4AssistantForCausalLM`` fed as its ``SinglePositionMultiTokenCandidateGenerator``
feeds it), with the ordered (centroid-masked) head; the output with drafts equals the output
without; a wrong pairing is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.model.loader import load_model
from pagoda.model.models import UnsupportedModelError
from pagoda.sampling_params import SamplingParams
from tests.model.test_spec_decode import engine, run, spec_stats

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

_COMMON = dict(vocab_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=32,
               global_head_dim=64, sliding_window=16, hidden_size_per_layer_input=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, assistant folder): a 4-layer Gemma 4 (windowed layers, a global last
    layer with wider heads, values from keys) and a 2-layer assistant (one of each kind) with
    ordered embeddings (16 centroids, the best 4 kept)."""
    t = transformers
    root = tmp_path_factory.mktemp("gemma4-assistant")
    target_config = t.Gemma4TextConfig(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_global_key_value_heads=1, attention_k_eq_v=True,
                                       final_logit_softcapping=30.0, architectures=["Gemma4ForCausalLM"])
    torch.manual_seed(0)
    t.AutoModelForCausalLM.from_config(target_config).float().save_pretrained(root / "target")
    text = t.Gemma4TextConfig(**_COMMON, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=0)
    config = t.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=True,
                                     num_centroids=16, centroid_intermediate_top_k=4,
                                     architectures=["Gemma4AssistantForCausalLM"])
    assistant = t.Gemma4AssistantForCausalLM(config).float()
    with torch.no_grad():
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(512, generator=torch.Generator().manual_seed(3)))
        for name, p in assistant.named_parameters():   # norms and scalars away from their initial values
            if p.dim() <= 1:
                p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    assistant.save_pretrained(root / "assistant")
    return str(root / "target"), str(root / "assistant")


def _reference(target_path: str, assistant_path: str, prompt: list[int], k: int):
    """transformers: the target's greedy token after ``prompt`` and the assistant's k drafts
    after it, with their logits (the candidate generator's loop, one sequence)."""
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path).float().eval()
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(assistant_path).float().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        token = out.logits[:, -1:].argmax(-1)
        hidden = out.hidden_states[-1][:, -1:]
        shared = out.shared_kv_states
        position = torch.tensor([[len(prompt)]])
        drafts, logits = [], []
        for _ in range(k):
            embeds = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
            a = assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=shared, use_cache=False)
            token = a.logits.argmax(-1)
            hidden = a.last_hidden_state
            drafts.append(int(token))
            logits.append(a.logits[0, 0])
    return int(out.logits[0, -1].argmax()), drafts, torch.stack(logits)


def test_drafts_equal_transformers_assistant(pair):
    target_path, assistant_path = pair
    prompt = [1, 17, 250, 33, 9, 401, 77, 5, 120, 64]   # shorter than the window: every key in view
    first, want_drafts, want_logits = _reference(target_path, assistant_path, prompt, 3)
    loaded = load_model(target_path, torch.float32, torch.device("cpu"))
    core = engine(loaded, {"model": assistant_path, "num_speculative_tokens": 3})
    proposer = core.runner.proposer
    calls = []
    draft = proposer.draft

    def recorded(*args):
        out = draft(*args)
        calls.append(out)
        return out

    proposer.draft = recorded
    tokens, _ = run(core, [prompt], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    assert tokens[0][0] == first
    got_drafts, got_logits = calls[0]
    assert got_drafts == [want_drafts]
    assert torch.allclose(got_logits[:, 0], want_logits, atol=1e-4, rtol=1e-4)
    # The ordered head: the best 4 centroids' 32 tokens scored, the others below them all.
    row = got_logits[0, 0]
    assert (row == row.min()).sum() == 512 - 4 * 32 and (row > row.min()).sum() == 4 * 32


def test_output_with_assistant_equals_output_without(pair):
    target_path, assistant_path = pair
    loaded = load_model(target_path, torch.float32, torch.device("cpu"))
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 40)]   # past the window of 16
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want, _ = run(engine(loaded), prompts, params)
    core = engine(loaded, {"method": "draft_model", "model": assistant_path, "num_speculative_tokens": 2})
    got, _ = run(core, prompts, params)
    assert got == want
    assert spec_stats(core)[1] > 0
    assert core.runner.proposer.sources == [2, 3]   # the target's last windowed and last global layers
    sampled = [SamplingParams(temperature=0.8, top_k=50, max_tokens=12, ignore_eos=True, seed=i) for i in range(3)]
    got, _ = run(core, prompts, sampled)
    assert [len(t) for t in got] == [12] * 3


def test_assistant_beside_another_target_is_refused(pair, tiny_llama_dir, tmp_path):
    target_path, assistant_path = pair
    llama = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="not Gemma 4"):
        engine(llama, {"model": assistant_path, "num_speculative_tokens": 2})
    import shutil

    other = tmp_path / "assistant"
    shutil.copytree(assistant_path, other)
    config = json.loads((other / "config.json").read_text())
    config["backbone_hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(config))
    loaded = load_model(target_path, torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="hidden size 128"):
        engine(loaded, {"model": str(other), "num_speculative_tokens": 2})
