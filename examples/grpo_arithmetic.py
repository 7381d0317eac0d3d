"""GRPO on the shipped arithmetic task: a stock TRL script, sped up by the single ``import trl_turbo`` line.

Design decision: the defaults run fully offline on a CPU in a few minutes (a tiny random-init Llama and the
character-level testbed tokenizer from :mod:`trl_turbo.testing`, the shipped dataset) and end by printing the mean
reward of the first and last logging windows, so a single run shows the policy learning. ``--model`` and
``--dataset`` switch to real checkpoints and datasets (Hub ids or local paths) through the ordinary loaders; a custom
dataset needs a conversational ``prompt`` column and an ``answer`` column of integer strings.

    python examples/grpo_arithmetic.py                      # tiny model, CPU, ~200 steps
    python examples/grpo_arithmetic.py --model Qwen/Qwen3-0.6B --use-vllm --lora
"""

import argparse
import statistics
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import GRPOConfig, GRPOTrainer

import trl_turbo  # noqa: F401  (patches TRL's GRPOTrainer on import)
from trl_turbo.tasks import arithmetic
from trl_turbo.testing import build_tokenizer, tiny_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hub id or local path; default: a tiny random-init Llama built offline")
    parser.add_argument("--dataset", help="Hub id, local directory or .json/.jsonl file; default: the shipped task")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--output-dir", default="out/grpo_arithmetic")
    parser.add_argument("--use-vllm", action="store_true", help="generate with vLLM (colocated)")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (r=16, all linear layers)")
    parser.add_argument("--learning-rate", type=float, help="default: 3e-3 for the tiny model, 1e-6 otherwise")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the first-vs-last reward summary")
    return parser.parse_args()


def load_model(name: str | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if name is None:
        tokenizer = build_tokenizer()
        return tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64, layers=2), tokenizer
    return AutoModelForCausalLM.from_pretrained(name, dtype="auto"), AutoTokenizer.from_pretrained(name)


def load_train_dataset(name: str | None) -> datasets.Dataset:
    if name is None:
        return arithmetic.load_dataset("train")
    if Path(name).suffix in (".json", ".jsonl"):
        return datasets.load_dataset("json", data_files=name, split="train")
    return datasets.load_dataset(name, split="train")


def main() -> None:
    args = parse_args()
    model, tokenizer = load_model(args.model)
    learning_rate = args.learning_rate or (3e-3 if args.model is None else 1e-6)
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        learning_rate=learning_rate,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=arithmetic.LENGTH_CAP,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        use_vllm=args.use_vllm,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[arithmetic.format_reward, arithmetic.correctness_reward],
        args=config,
        train_dataset=load_train_dataset(args.dataset),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        if args.lora
        else None,
    )
    trainer.train()

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    window = min(args.window, len(rewards) // 2) or 1
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    print(f"mean reward, first {window} steps: {first:.3f}  last {window} steps: {last:.3f}  ({last - first:+.3f})")


if __name__ == "__main__":
    main()
