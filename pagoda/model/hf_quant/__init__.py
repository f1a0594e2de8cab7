"""Pre-quantized HF checkpoints: ``quantization_config`` in config.json picks one
``QuantMethod`` (a class per format, registered by its ``quant_method`` name; the registry and
the base class live in ``base.py``, each format in its own module, imported here so that
they register).
"""

from pagoda.model.hf_quant import awq, compressed_tensors, fp8, gptq  # noqa: F401 (each registers its method; compressed_tensors reads float schemes via compressed_tensors_float)
from pagoda.model.hf_quant.base import (  # noqa: F401 (the package's interface)
    FAMILY_FORMATS,
    METHODS,
    Checkpoint,
    QuantConfigError,
    QuantMethod,
    method_for,
    register,
)
