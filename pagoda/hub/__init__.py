"""Finding and reading model files, for the tokenizer (the API process) and the loader (the
engine core) alike, without torch: where a model is (``paths``: the bundled default, a path;
``stores``: a name in the models folder, the Hugging Face cache or Ollama's store, and an
Ollama model's defaults), a GGUF file's header, metadata and tensor bytes (``gguf_file``) and
Ollama's chat templates translated to Jinja (``ollama_template``). Turning tensors into torch
ones is the loader's (pagoda/model/gguf_tensors.py)."""
