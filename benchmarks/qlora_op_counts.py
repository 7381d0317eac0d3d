"""Count the aten operations of one QLoRA micro-step (compute_loss + backward) of the patched trainer, on CPU.

Design decision: a step-time difference between two commits measured in different GPU sessions cannot tell the code
from the machine; the operation counts of the same step on a tiny NF4 model can (bitsandbytes' CPU backend, every
training feature on). Run it once per commit and compare the JSON files:

    PYTHONPATH=<checkout of commit A> python benchmarks/qlora_op_counts.py a.json
    PYTHONPATH=<checkout of commit B> python benchmarks/qlora_op_counts.py b.json
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import warnings

import torch

import trl_turbo  # noqa: F401
from trl_turbo.testing import parity

NF4_DOUBLE = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
              "bnb_4bit_compute_dtype": "float32"}


def main(out: str) -> None:
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        config = parity.base_config_kwargs(tmp, gradient_checkpointing=True, max_completion_length=16,
                                           turbo_tiled_mlp_tokens=5, turbo_forward_token_budget=400)
        torch.manual_seed(0)
        trainer = parity.build_trainer(config, peft=True, quantization=NF4_DOUBLE,
                                       model_kwargs={"tie_word_embeddings": False})
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = parity.synthetic_batch(trainer, batch=4, prompt_len=5, completion_len=16)

        def step() -> torch.Tensor:
            trainer.model.zero_grad(set_to_none=True)
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(trainer.model, dict(inputs))
            loss.backward()
            return loss

        step()  # warm-up: one-off work (buffers, patches installed on first call) stays out of the counts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            loss = step()
    counts = collections.Counter(event.name for event in profile.events() if event.name.startswith("aten::"))
    grads = {name: p.grad.norm().item() for name, p in trainer.model.named_parameters() if p.grad is not None}
    with open(out, "w") as handle:
        json.dump({"loss": loss.item(), "grad_norms": grads, "aten_counts": dict(sorted(counts.items()))}, handle,
                  indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
