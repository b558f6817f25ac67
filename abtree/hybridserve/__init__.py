"""hybridserve: inference and serving for hybrid LLMs (ZAYA1, Ling-2.6)."""
from hybridserve.llm import LLM
from hybridserve.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from hybridserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
