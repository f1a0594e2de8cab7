"""Ollama's API on pagoda's server, so that tools written for Ollama (Open WebUI, editors,
the ``ollama`` Python client) work unchanged: ``add_ollama_routes(app, chat)``.

Routes: ``POST /api/generate`` and ``/api/chat`` (NDJSON streaming unless ``"stream": false``),
``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``, ``GET``/``HEAD /``.
``/api/pull``, ``/push``, ``/create``, ``/copy`` and ``/delete`` answer 403: pagoda serves the
model it was started with. ``POST /api/embed`` and the older ``/api/embeddings`` run as
/v1/embeddings does (a server started with ``--task embed``; ``truncate`` defaults to true,
``options`` with any field set is a 400: none changes a vector).
Errors are ``{"error": "message"}`` with the status: 400 bad input, 401 auth (the server's
API key is required on /api/* as on /v1/*), 403 model management, 404 unknown model,
413 body too large, 429 queue full, 503 draining or engine down, 500 a bug. An error
after a stream started is its last line, ``{"error": ...}``.

``model``: the served model name, or a loaded LoRA adapter's; a name without a tag also
answers to ``name:latest`` (Ollama clients append it), and is listed that way.

``keep_alive`` is checked (a number of seconds or a duration) and has no effect: the
model is always loaded. ``think``: true puts the reasoning in ``thinking`` (``message.thinking``
on /api/chat, streamed as it comes), read by the server's ``--reasoning-parser`` (without one,
a 400), with ``format`` applied after the reasoning; true and false reach the chat template
as ``enable_thinking`` (Qwen3's switch); absent: the whole output is content. Levels
('low', 'medium', 'high', GPT-OSS's) are a 400.
``logprobs`` / ``top_logprobs``: supported (Ollama's shape, as OpenAI's chat logprobs).

/api/generate: ``prompt`` is rendered with the model's chat template as one user turn
(after ``system``, if given); ``raw: true`` sends it as is. An empty prompt loads the
model, as in Ollama (``done_reason: "load"``; so does /api/chat with no messages).
``context`` (returned on the last line: the prompt's and the output's token ids) is
accepted back and put before the new prompt's tokens. ``template`` (a Go template),
``suffix``, ``images`` and the image-generation fields are rejected with a 400.

/api/chat: ``messages`` (system/user/assistant/tool; ``tool_calls`` with object arguments,
``tool_name`` / ``tool_call_id`` on tool results; ``images`` and ``thinking`` rejected) and
``tools`` go through the chat endpoint's template and tool parser; calls come back as
``message.tool_calls``: ``[{"id", "function": {"index", "name", "arguments": {...}}}]``,
each whole (while streaming, in a line of its own once the call is complete).

``format``: ``"json"`` (any JSON object) or a JSON schema, as structured output.

``options``:

- sampling: ``num_predict`` (-1 or absent: until a stop or the end of the context; 0 and
  other negatives are a 400), ``temperature``, ``top_k``, ``top_p``, ``min_p``,
  ``repeat_penalty`` (repetition_penalty), ``presence_penalty``, ``frequency_penalty``,
  ``stop``, ``seed``. Absent ones take Ollama's defaults: temperature 0.8, top_k 40,
  top_p 0.9 (repeat_penalty stays 1.0: Ollama's 1.1 applies to a window of 64 tokens).
- ``repeat_last_n``: pagoda's penalties see the whole sequence (Ollama's -1); 0 turns the
  penalties off, as in Ollama; another window is a 400 when a penalty is set (it would
  change nothing otherwise, and is accepted).
- ``num_ctx``: a bound on prompt + output, capped at the server's context length (as
  Ollama caps it at the model's). A prompt that does not fit is a 400: pagoda never
  truncates a prompt (``truncate: true`` is a 400 too, as is ``shift: true``).
- samplers pagoda does not have, accepted only at their "off" value: ``typical_p`` 1.0,
  ``tfs_z`` 1.0, ``mirostat`` 0 (then ``mirostat_tau`` / ``mirostat_eta`` do nothing, as
  in Ollama), ``penalize_newline`` false.
- runner options, accepted with no per-request effect (the engine's threads, batch,
  devices and memory are set when the server starts): ``num_keep`` (pagoda never shifts
  the context), ``num_batch``, ``num_gpu``, ``main_gpu``, ``num_thread``, ``use_mmap``,
  ``use_mlock``, ``numa``, ``low_vram``, ``f16_kv``, ``logits_all``, ``vocab_only``,
  ``embedding_only``.
- any other name: a 400 naming it.
"""

from __future__ import annotations

from pagoda.entrypoints.ollama.routes import add_ollama_routes

__all__ = ["add_ollama_routes"]
