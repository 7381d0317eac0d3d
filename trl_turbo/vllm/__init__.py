"""A colocated vLLM engine that shares the training model's frozen weights (or, where it cannot, holds a separate
16-bit copy of them), takes the LoRA adapter as tensors and stands by (KV cache released) while training runs.

Pure planning (which HF tensor is which slice of which vLLM tensor, what the adapter looks like to vLLM, how big
the KV cache may be, whether the weights can be shared, what vLLM gets of a quantized model) lives in `weight_views`,
`adapter`, `kv_budget`, `sharing`, `quantized` and `dequantized` and is tested on CPU.
`trl_turbo.vllm.engine` is the only module that reaches into a live `vllm.LLM`; TRL's seams are in
`trl_turbo.patches.trl_vllm`.
"""
