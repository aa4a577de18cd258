"""sudu: speed-first LLM inference and an honest benchmark. `from sudu import LLM, SamplingParams`."""
from sudu.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # the engine pulls in torch; keep `import sudu` (and the bench CLI) light
    if name == "LLM":
        from sudu.engine.llm import LLM

        return LLM
    raise AttributeError(name)
