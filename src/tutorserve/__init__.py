"""tutorserve: an LLM serving and tutoring stack for personalized education at scale."""

from tutorserve.engine.llm import LLM
from tutorserve.engine.outputs import RequestMetrics, RequestOutput
from tutorserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
