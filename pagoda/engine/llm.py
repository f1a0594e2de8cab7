"""The offline API: ``LLM(model).generate(prompts, params)`` and ``.chat(...)``."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from tqdm import tqdm

from pagoda.config import EngineConfig
from pagoda.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    finish_text,
    top_candidates,
)
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from pagoda.engine.output_processor import OutputProcessor, make_core_requests
from pagoda.hub.fetch import localize
from pagoda.hub.stores import model_defaults
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import MultiModalLimits
from pagoda.multimodal.processors import load_image_processor
from pagoda.multimodal.prompts import has_image_parts, image_prompt, take_images
from pagoda.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagoda.pooling import PoolingParams, placeholder_sampling_params, truncate_prompt
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer, build_tokenizer
from pagoda.validation import RequestLimits, validate_pooling_request, validate_request

PromptType = str | dict[str, Any]


class LLM:
    """Generate from many prompts at once, batched by the same scheduler the server uses.

    >>> llm = LLM()                      # the bundled SmolLM2-135M-Instruct
    >>> out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8))

    With ``task="embed"`` (automatic for embedding checkpoints, pagoda/pooling.py) it embeds:
    ``LLM(task="embed").embed(["a sentence"])[0].outputs.embedding``; generate() and chat()
    of an embedding engine (and embed() of a generating one) raise WrongTaskError.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # A Hub name (ORG/NAME) that no store holds is fetched first (pagoda/hub/fetch.py).
        self.config = localize(EngineConfig(model=model, **kwargs), progress=kwargs.get("show_progress", True))
        self.engine = EngineCore(self.config, collect_stats=False)  # no metrics consumer offline
        # An Ollama model's params, system prompt and template (pagoda/hub/stores.py).
        self.defaults = model_defaults(self.config.model)
        self.tokenizer: Tokenizer | None = None
        if not self.config.skip_tokenizer_init:
            self.tokenizer = build_tokenizer(self.engine.loaded, self.config.chat_template, self.defaults.template)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        self.processor = OutputProcessor(self.tokenizer)
        # A vision-language model's image processor (pagoda/multimodal); None: text only.
        vision = self.engine.loaded.arch.vision
        self.image_token_id = vision.get("image_token_id") if vision else None
        # (Not with skip_tokenizer_init: prompts come as token ids, and images cannot be read.)
        self.image_processor = load_image_processor(self.engine.loaded.path, mmproj=self.config.mmproj) \
            if vision and self.tokenizer is not None else None
        self.mm_limits = MultiModalLimits(max_images=self.config.max_images)
        self.limits = RequestLimits(self.engine.max_model_len, self.engine.vocab_size,
                                    self.config.scheduling_policy, self.config.enable_lora,
                                    max_logprobs=self.config.max_logprobs, pooler=self.engine.pooler_config,
                                    logits_processors=tuple(self.config.logits_processors or ()))

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op for one process)."""
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without ``sampling_params`` uses: SamplingParams' defaults, over which
        the model's own (an Ollama model's params layer: stop strings, temperature...) apply."""
        return SamplingParams(**self.defaults.sampling)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("the engine was started with skip_tokenizer_init=True")
        return self.tokenizer

    # ---- public API ----------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one per prompt, lower runs first (needs scheduling_policy
        "priority" or "fair"). A dict prompt may carry a ``cache_salt`` (prefix-cache
        isolation, docs/scheduling.md) and, for a vision-language model, vLLM's
        ``multi_modal_data``: ``{"image": <PIL image or a list of them>}``, one per image
        marker (``<image>``) in its ``prompt``. ``lora_request``: one adapter for every prompt,
        or one (or None = base model) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        items = []
        salts: list[str | None] = []
        for p in prompts:
            item, salt = self._prompt_item(p)
            items.append(item)
            salts.append(salt)
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(items):
                raise ValueError(f"got {len(priority)} priorities for {len(items)} prompts")
        return self._run(items, sampling_params, use_tqdm, priority, salts, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt, the best ``params.beam_width`` sequences
        (pagoda/engine/beam_search.py). Every step runs the live beams of all prompts as one
        batch of one-token requests; they share their KV blocks through the prefix cache."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        items = [self._prompt_item(p)[0] for p in prompts]
        if any(item[2] for item in items):
            raise ValueError("beam search with images is not supported")
        items = [item[:2] for item in items]
        probe = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature)
        for _, token_ids in items:
            validate_request(token_ids, probe, self.limits, lora_request=lora_request)
        searches = [BeamSearch(ids, params, self.eos_token_ids) for _, ids in items]
        step = params.step_params()
        while any(not s.done for s in searches):
            owners = [(s, tokens) for s in searches for tokens in s.pending()]
            outs = self._run([(None, tokens) for _, tokens in owners], step, use_tqdm, lora_request=lora_request,
                             checked=True)  # fmt: skip
            at = 0
            for s in searches:
                n = len(s.pending())
                s.advance([top_candidates(o, step.logprobs or 0) for o in outs[at:at + n]])
                at += n
        results = []
        for s in searches:
            beams = s.result()
            for beam in beams:
                beam.text = finish_text(beam, params, self._decode, self.eos_token_ids) if self.tokenizer else None
            results.append(BeamSearchOutput(beams))
        return results

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.get_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _prompt_item(self, p: PromptType) -> tuple[tuple[str | None, list[int], list], str | None]:
        """A prompt as ((text, token ids, image inputs), cache salt)."""
        salt = None
        if isinstance(p, dict):
            unknown = set(p) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}")
            salt = p.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
            if p.get("multi_modal_data") is not None:
                return self._image_item(p), salt
        if isinstance(p, str):
            return (p, self.get_tokenizer().encode(p), []), salt
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return (p.get("prompt"), list(p["prompt_token_ids"]), []), salt
        if isinstance(p, dict) and "prompt" in p:
            return (p["prompt"], self.get_tokenizer().encode(p["prompt"]), []), salt
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {p!r}")

    def _image_item(self, p: dict[str, Any]) -> tuple[str, list[int], list]:
        data = p["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes {{'image': ...}}; got keys {sorted(data) if isinstance(data, dict) else data!r}")
        if "prompt" not in p or "prompt_token_ids" in p:
            raise ValueError("a prompt with images needs its 'prompt' text (with one image marker per image), "
                             "not prompt_token_ids")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        parts = take_images([{"role": "user", "content": [{"type": "image_pil", "image_pil": img} for img in images]}],
                            self.mm_limits)
        ids, inputs = image_prompt(p["prompt"], parts.images, self.image_processor,
                                   lambda t: self.get_tokenizer().encode(t), self.image_token_id, "multi_modal_data")
        return p["prompt"], ids, inputs

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """A conversation without a system message gets the model's default one, if it has
        one (an Ollama model's system layer)."""
        tokenizer = self.get_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        items = []
        for conv in conversations:
            conv = self.defaults.with_system(list(conv))
            images = None
            if self.image_processor is not None or has_image_parts(conv):
                # A vision-language model's template reads content parts, images among them.
                images = take_images(conv, self.mm_limits)
                conv = images.messages
            text = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                 tools=tools, chat_template=chat_template)
            # The template already writes any BOS token it wants.
            def encode(t: str) -> list[int]:
                return tokenizer.encode(t, add_special_tokens=False)
            if images is not None and images.images:
                items.append((text, *image_prompt(text, images.images, self.image_processor, encode,
                                                  self.image_token_id)))
            else:
                items.append((text, encode(text), []))
        return self._run(items, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, or a dict with ``prompt_token_ids``), batched by
        the same scheduler; ``truncate_prompt_tokens``: keep each prompt's last k tokens."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids_list = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.get_tokenizer().encode(p)
            elif isinstance(p, dict) and set(p) <= {"prompt", "prompt_token_ids"} and "prompt_token_ids" in p:
                ids = list(p["prompt_token_ids"])
            else:
                raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {p!r}")
            ids_list.append(truncate_prompt(ids, truncate_prompt_tokens, self.engine.max_model_len))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(ids_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(ids_list):
                raise ValueError(f"got {len(params_list)} pooling params for {len(ids_list)} prompts")
        for ids, params in zip(ids_list, params_list):
            validate_pooling_request(ids, params, self.limits, 0, lora_request)
        if lora_request is not None:
            self.engine.add_lora(lora_request)
        rids = [f"embed-{uuid.uuid4().hex[:12]}" for _ in ids_list]
        results: dict[str, EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(rids), desc="Embedding", unit="req", disable=not use_tqdm, leave=False)
        try:
            for rid, ids, params in zip(rids, ids_list, params_list):
                self.engine.add_request(EngineCoreRequest(rid, ids, placeholder_sampling_params(),
                                                          lora_request=lora_request, pooling_params=params))
            while len(results) < len(rids) and self.engine.has_unfinished_requests():
                for out in self.engine.step().outputs:
                    if out.pooled is not None:
                        results[out.request_id] = EmbeddingRequestOutput(
                            out.request_id, [], EmbeddingOutput(out.pooled), num_cached_tokens=out.num_cached_tokens)
                        bar.update(1)
        except BaseException:
            self.engine.abort_requests([r for r in rids if r not in results])
            raise
        finally:
            bar.close()
        for rid, ids in zip(rids, ids_list):
            results[rid].prompt_token_ids = ids
        return [results[rid] for rid in rids]

    # ---- the loop ------------------------------------------------------------------

    def _run(
        self,
        items: list[tuple],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priorities: list[int] | None = None,
        salts: list[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        checked: bool = False,
    ) -> list[RequestOutput]:
        """``items``: (text, token ids[, image inputs]) per prompt. ``checked``: the requests
        were validated already (beam search's step requests, whose 2 x beam_width logprobs
        are the search's own, not bounded by --max-logprobs)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(items)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(items)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(items):
                raise ValueError(f"got {len(lora_list)} LoRA requests for {len(items)} prompts")
        for lora in {r for r in lora_list if r is not None}:
            self.engine.add_lora(lora)  # a bad adapter fails here, before any request runs
        ids: list[str] = []
        try:
            for k, ((prompt, token_ids, *images), params, lora) in enumerate(zip(items, params_list, lora_list)):
                rid = f"offline-{uuid.uuid4().hex[:12]}"
                priority = priorities[k] if priorities is not None else 0
                if not checked:
                    validate_request(token_ids, params, self.limits, priority, lora,
                                     validate_grammar=lambda g: self.engine.structured.validate(g))
                self.processor.add_request(rid, prompt, token_ids, params)
                ids.append(rid)
                for req in make_core_requests(rid, token_ids, params, self.eos_token_ids, priority=priority,
                                              cache_salt=salts[k] if salts is not None else None,
                                              lora_request=lora, mm_inputs=images[0] if images else ()):
                    self.engine.add_request(req)
        except Exception:
            self._abort(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished_requests():
                step = self.engine.step()
                outputs, to_stop = self.processor.process_outputs(step.outputs)
                if to_stop:
                    self.engine.finish_stopped(to_stop)
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self._abort(ids)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            children = self.processor.child_ids(rid)
            self.processor.abort_request(rid)
            self.engine.abort_requests(children)
