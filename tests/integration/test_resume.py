"""Resuming from a checkpoint with trl_turbo's defaults (fused loss, lean norms, tiled MLP, checkpointing on; CPU,
no vLLM): the resumed run's loss, reward and grad-norm curves equal the uninterrupted run's, and the saved adapter
loads in plain PEFT + transformers, without trl_turbo, giving the trainer's log-probs. The vLLM side of resuming
(shared weights, standby, merged sampling) needs the GPU: tests/sampler/test_vllm_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from transformers import TrainerCallback

from trl_turbo.testing import parity
from trl_turbo.testing.models import tiny_model
from trl_turbo.testing.tokenizer import VOCAB

STEPS, SAVE_AT = 6, 3
CURVES = ("loss", "reward", "grad_norm")


def _trainer(output_dir):
    kwargs = parity.base_config_kwargs(
        str(output_dir), max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, gradient_checkpointing=True,
        optim="adamw_torch", learning_rate=5e-3,
    )
    torch.manual_seed(0)  # the LoRA initialisation
    return parity.build_trainer(kwargs, peft=True)


def _curves(trainer):
    return {log["step"]: {k: log[k] for k in CURVES} for log in trainer.state.log_history if "loss" in log}


class _StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == SAVE_AT:
            control.should_training_stop = True


_PLAIN_LOGPROBS = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
assert "trl_turbo" not in sys.modules
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = PeftModel.from_pretrained(base, sys.argv[2]).eval()
ids = torch.tensor(json.loads(sys.argv[3]))
with torch.no_grad():
    logps = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
print(json.dumps(logps.tolist()))
"""


def test_resumed_run_follows_the_uninterrupted_one_and_its_adapter_loads_without_trl_turbo(tmp_path):
    whole = _trainer(tmp_path / "whole")
    whole.train()
    expected = _curves(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))

    first = _trainer(tmp_path / "interrupted")
    first.add_callback(_StopAt())
    first.train()
    assert first.state.global_step == SAVE_AT
    resumed = _trainer(tmp_path / "interrupted")
    resumed.train(resume_from_checkpoint=str(tmp_path / "interrupted" / f"checkpoint-{SAVE_AT}"))
    got = _curves(resumed)  # the checkpoint's history (steps 1-3) and the resumed steps
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        for name in CURVES:
            torch.testing.assert_close(values[name], expected[step][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, step=step, name=name: f"step {step} {name}: {m}")

    # The final adapter, loaded by PEFT + transformers alone over the same base weights
    base_dir = tmp_path / "base"
    tiny_model("llama", vocab_size=len(VOCAB)).save_pretrained(base_dir)  # the weights build_trainer starts from
    checkpoint = tmp_path / "interrupted" / f"checkpoint-{STEPS}"
    ids = [[(7 * i + 3) % len(VOCAB) for i in range(8)]]
    plain = subprocess.run([sys.executable, "-c", _PLAIN_LOGPROBS, str(base_dir), str(checkpoint), json.dumps(ids)],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    model = resumed.model.eval()
    tensor = torch.tensor(ids)
    with torch.no_grad():
        ours = model(input_ids=tensor).logits.float().log_softmax(-1)[0, :-1].gather(-1, tensor[0, 1:, None])
    torch.testing.assert_close(torch.tensor(json.loads(plain.stdout.strip().splitlines()[-1])), ours.squeeze(-1),
                               rtol=1e-5, atol=1e-6)
    trained = any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    assert trained, "the adapter never moved: the comparison would not tell a saved adapter from a fresh one"
