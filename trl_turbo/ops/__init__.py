from .fused_logprob import fused_logprobs, reference_logprobs

__all__ = ["fused_logprobs", "reference_logprobs"]
