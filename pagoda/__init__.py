"""pagoda: an LLM inference and serving engine."""

from pagoda.sampling_params import SamplingParams
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.lora.request import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so light imports stay light.
    if name == "LLM":
        from pagoda.engine.llm import LLM

        return LLM
    raise AttributeError(name)
