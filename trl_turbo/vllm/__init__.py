"""A colocated vLLM engine that shares the training model's frozen weights, takes the LoRA adapter as tensors and
stands by (KV cache released) while training runs.

Pure planning (which HF tensor is which slice of which vLLM tensor, what the adapter looks like to vLLM, how big
the KV cache may be) lives in `weight_views`, `adapter` and `kv_budget` and is tested on CPU. `engine` is the only
module here that reaches into a live `vllm.LLM`; TRL's seams are in `trl_turbo.patches.trl_vllm`.
"""
