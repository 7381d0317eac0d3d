"""Count the operations of one QLoRA micro-step (compute_loss + backward) on CPU, patched or stock.

Design decision: a step-time difference between two commits measured in different GPU sessions cannot tell the code
from the machine; the operation counts of the same step on a tiny NF4 model can (bitsandbytes' CPU backend, every
training feature on). Run it once per commit and compare the JSON files:

    PYTHONPATH=<checkout of commit A> python benchmarks/qlora_op_counts.py a.json
    PYTHONPATH=<checkout of commit B> python benchmarks/qlora_op_counts.py b.json

`--stock` counts stock TRL's step (the patches removed) instead, so the two can be compared op by op; bitsandbytes'
own operations are counted by name and by the packed weight's shape (each decoder matrix has its own), which shows
how often each 4-bit weight is dequantized. `--tile-tokens` and `--forward-token-budget` set the split: 16 and 32 put
the 21-token sequences (5 prompt + 16 completion) into one group each of two MLP tiles, as the bench's 8 x 20736
tokens run with the defaults (32768-token groups, 16384-token tiles); `--memory-plan min` checkpoints every layer, as
"auto" does on a GPU under a ceiling that no kept layer fits (without a GPU "auto" keeps every layer).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import warnings

import torch

import trl_turbo
from trl_turbo.testing import parity

NF4_DOUBLE = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
              "bnb_4bit_compute_dtype": "float32"}
SEQUENCES, PROMPT_TOKENS, COMPLETION_TOKENS = 8, 5, 16


def main(out: str, stock: bool, tile_tokens: int, forward_token_budget: int, memory_plan: str) -> None:
    warnings.simplefilter("ignore")
    if stock:
        trl_turbo.unpatch()
    turbo_fields = {} if stock else {"turbo_tiled_mlp_tokens": tile_tokens, "turbo_memory_plan": memory_plan,
                                     "turbo_forward_token_budget": forward_token_budget}
    with tempfile.TemporaryDirectory() as tmp:
        config = parity.base_config_kwargs(tmp, gradient_checkpointing=True, max_completion_length=COMPLETION_TOKENS,
                                           per_device_train_batch_size=SEQUENCES, num_generations=SEQUENCES,
                                           **turbo_fields)
        torch.manual_seed(0)
        trainer = parity.build_trainer(config, peft=True, quantization=NF4_DOUBLE,
                                       model_kwargs={"tie_word_embeddings": False})
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = parity.synthetic_batch(trainer, batch=SEQUENCES, prompt_len=PROMPT_TOKENS,
                                        completion_len=COMPLETION_TOKENS)

        def step() -> torch.Tensor:
            trainer.model.zero_grad(set_to_none=True)
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(trainer.model, dict(inputs))
            loss.backward()
            return loss

        step()  # warm-up: one-off work (buffers, patches installed on first call) stays out of the counts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
            loss = step()
    events = profile.events()
    counts = collections.Counter(event.name for event in events if event.name.startswith("aten::"))
    bitsandbytes = collections.Counter(f"{event.name} {event.input_shapes[0] if event.input_shapes else []}"
                                       for event in events if event.name.startswith("bitsandbytes::"))
    grads = {name: p.grad.norm().item() for name, p in trainer.model.named_parameters() if p.grad is not None}
    with open(out, "w") as handle:
        split = None if stock else {"tile_tokens": tile_tokens, "forward_token_budget": forward_token_budget,
                                    "memory_plan": memory_plan}
        json.dump({"variant": "stock" if stock else "turbo", "split": split,
                   "loss": loss.item(), "grad_norms": grads, "aten_counts": dict(sorted(counts.items())),
                   "bitsandbytes_counts": dict(sorted(bitsandbytes.items()))}, handle, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--stock", action="store_true", help="count stock TRL's step (trl_turbo unpatched)")
    parser.add_argument("--tile-tokens", type=int, default=5, help="turbo_tiled_mlp_tokens (default 5)")
    parser.add_argument("--forward-token-budget", type=int, default=400,
                        help="turbo_forward_token_budget (default 400)")
    parser.add_argument("--memory-plan", default="auto", choices=("auto", "min"),
                        help="turbo_memory_plan; without a GPU 'auto' keeps every layer's activations, 'min' "
                             "checkpoints every layer as a GPU run under a tight ceiling does")
    args = parser.parse_args()
    main(args.out, args.stock, args.tile_tokens, args.forward_token_budget, args.memory_plan)
