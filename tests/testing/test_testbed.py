"""Tests of the offline test bed: tiny models, the testbed tokenizer, the arithmetic task and a 1-step GRPO run.

Design decision: everything is built in-process (no Hub access) and sized so the whole file runs in well under a
minute on two CPU cores; the GRPO smoke test uses the stock ``GRPOTrainer`` API exactly as a user script would.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_turbo.tasks import arithmetic
from trl_turbo.testing import ARCHITECTURES, build_tokenizer, tiny_model, tiny_model_dir
from trl_turbo.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_forward_backward(arch: str) -> None:
    model = tiny_model(arch, vocab_size=len(VOCAB))
    input_ids = torch.randint(0, len(VOCAB), (2, 24), generator=torch.Generator().manual_seed(0))
    output = model(input_ids=input_ids, labels=input_ids)
    assert output.logits.shape == (2, 24, len(VOCAB))
    assert math.isfinite(output.loss.item())
    output.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    again = tiny_model(arch, vocab_size=len(VOCAB))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_tiny_model_options() -> None:
    model = tiny_model("qwen3", vocab_size=len(VOCAB), hidden_size=64, layers=3, dtype=torch.bfloat16, seed=1)
    assert model.config.num_hidden_layers == 3 and model.config.num_attention_heads == 8
    assert next(model.parameters()).dtype == torch.bfloat16
    assert tiny_model("gemma", vocab_size=len(VOCAB)).config.tie_word_embeddings
    assert not tiny_model("llama", vocab_size=len(VOCAB)).config.tie_word_embeddings
    with pytest.raises(ValueError):
        tiny_model("gpt2", vocab_size=len(VOCAB))


def test_tokenizer_round_trip_and_chat_template() -> None:
    tokenizer = build_tokenizer()
    assert len(tokenizer) == len(VOCAB) < 128
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    text = "<answer>-12</answer> (3*4)+5=17\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<answer>", "-"]
    assert tokenizer.decode(tokenizer("<answer>7</answer><eos>")["input_ids"], skip_special_tokens=True) == (
        "<answer>7</answer>"
    )

    messages = [{"role": "user", "content": "1+2="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><|user|>1+2=<|assistant|>"
    reply = {"role": "assistant", "content": "<answer>3</answer>"}
    full = tokenizer.apply_chat_template([*messages, reply], tokenize=False)
    assert full == "<bos><|user|>1+2=<|assistant|><answer>3</answer><eos>"
    batch = tokenizer.apply_chat_template(
        [messages, messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert batch["input_ids"][0] == tokenizer(prompt)["input_ids"] and len(batch["input_ids"][0]) == 7


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_dir_loads_with_auto_classes(arch: str, tmp_path: Path) -> None:
    path = tiny_model_dir(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # transformers 5 picks Qwen2Tokenizer for qwen2 directories
    assert model.config.model_type == arch
    reference = build_tokenizer()
    for text in ("<bos><|user|>48-26=<|assistant|><answer>22</answer><eos>", "1 + (2*3)\n-4 <answer> 5 </answer>"):
        ids = reference(text)["input_ids"]
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template == reference.chat_template
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (PAD_ID, EOS_ID, "left")


def test_format_reward() -> None:
    completions = [
        "<answer>12</answer>",
        " <answer>-3</answer>\n",
        "1<answer>12</answer>",
        "<answer>1 2</answer>",
        "<answer>12",
        "12</answer>",
        "12",
        [{"role": "assistant", "content": "<answer>7</answer>"}],
    ]
    rewards = arithmetic.format_reward(prompts=[None] * 8, completions=completions, answer=["0"] * 8)
    assert rewards == [1.0, 1.0, 0.75, 0.75, 0.25, 0.0, 0.0, 1.0]


def test_correctness_reward() -> None:
    completions = [
        "<answer>19</answer>",
        [{"role": "assistant", "content": "<answer> -25 </answer>"}],
        "<answer>18</answer>",
        "<answer>15</answer>",
        "19",
        "<answer>nineteen</answer>",
    ]
    answers = ["19", "-25", "19", "19", "19", "19"]
    rewards = arithmetic.correctness_reward(prompts=[None] * 6, completions=completions, answer=answers)
    assert rewards == [1.0, 1.0, 0.25, 0.1, 0.0, 0.0]


def test_length_reward() -> None:
    completions = ["<answer>1</answer>", "1" * 40]
    by_ids = arithmetic.length_reward(prompts=[None] * 2, completions=completions, completion_ids=[[3] * 4, [3] * 40])
    assert by_ids == [4 / arithmetic.LENGTH_CAP, 1.0]
    by_text = arithmetic.make_length_reward(100)(prompts=[None] * 2, completions=completions, answer=["1", "1"])
    assert by_text == [0.18, 0.4]


def test_dataset_is_shipped_and_deterministic(tmp_path: Path) -> None:
    train, test = arithmetic.load_dataset("train"), arithmetic.load_dataset("test")
    assert (len(train), len(test)) == (arithmetic.SPLIT_SIZES["train"], arithmetic.SPLIT_SIZES["test"])
    assert train.column_names == ["prompt", "answer"]
    assert train[0] == {"prompt": [{"role": "user", "content": "48-26="}], "answer": "22"}
    assert not {row[0]["content"] for row in train["prompt"]} & {row[0]["content"] for row in test["prompt"]}
    tokenizer = build_tokenizer()
    assert all(tokenizer.unk_token_id not in tokenizer(row[0]["content"])["input_ids"] for row in train["prompt"])
    problems = arithmetic.generate_problems(50, seed=3)
    assert problems == arithmetic.generate_problems(50, seed=3)
    assert all(str(eval(p["question"])) == p["answer"] for p in problems)
    regenerated = tmp_path / "arithmetic.jsonl"
    arithmetic.write_data(regenerated)
    assert regenerated.read_bytes() == arithmetic.DATA_PATH.read_bytes()
    with pytest.raises(ValueError):
        arithmetic.load_dataset("validation")


def test_grpo_trainer_one_step(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    config = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[arithmetic.format_reward, arithmetic.correctness_reward, arithmetic.length_reward],
        args=config,
        train_dataset=arithmetic.load_dataset("train").select(range(16)),
    )
    trainer.train()
    assert trainer.state.global_step == 1
    logged = next(entry for entry in trainer.state.log_history if "reward" in entry)
    assert math.isfinite(logged["reward"]) and 0 < logged["completions/mean_length"] <= 8


def test_named_tokens_follow_the_vocabulary() -> None:
    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = build_tokenizer(names)
    plain = build_tokenizer()
    assert (tokenizer.boi_token_id, tokenizer.image_token_id, len(tokenizer)) == (len(VOCAB), len(VOCAB) + 1,
                                                                                  len(VOCAB) + 2)
    assert tokenizer("<start_of_image>12=")["input_ids"] == [len(VOCAB)] + plain("12=")["input_ids"]
    assert tokenizer.decode([len(VOCAB), *plain("7")["input_ids"]], skip_special_tokens=True) == "7"
    with pytest.raises(ValueError, match="_token"):
        build_tokenizer({"boi": "<b>"})


def test_tiny_vlm_processor_and_forward() -> None:
    from trl_turbo.testing import vlm

    processor = vlm.build_vlm_processor()
    prompt = [{"role": "user", "content": [{"type": "image", "image": vlm.random_images(1)[0]},
                                           {"type": "text", "text": "1+2="}]}]
    inputs = processor.apply_chat_template([prompt], add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(processor.tokenizer.image_token_id) == vlm.IMAGE_TOKENS
    assert inputs["pixel_values"].shape == (1, 3, vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)
    model = vlm.tiny_vlm(processor, vocab_size=64)
    assert model.config.image_token_id == processor.tokenizer.image_token_id
    logits = model(**inputs).logits
    assert logits.shape == (1, len(ids), 64) and torch.isfinite(logits).all()
    dataset = vlm.image_dataset(3)
    assert dataset.column_names == ["prompt", "answer", "image"] and dataset[0]["image"].size == (56, 56)
