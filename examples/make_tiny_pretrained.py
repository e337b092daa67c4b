"""Make a tiny pretrained-model directory to try the fine-tuning config on, with no download.

    python examples/make_tiny_pretrained.py tiny-pretrained
    lightning-par fit --config configs/finetune_hf.yaml

writes ``tiny-pretrained/model`` (a small Llama pretrained here for a few seconds on a few proverbs and saved with
``save_pretrained``, and a BPE tokenizer trained by ``tokenizers`` on them, with a chat template), so that fine-tuning
it visibly learns; ``tiny-pretrained/train.jsonl`` (records
with a ``text`` field), which is where ``configs/finetune_hf.yaml`` looks, and ``tiny-pretrained/instructions.jsonl``
(prompt/response records) and ``chats.jsonl``, where ``configs/finetune_lora.yaml`` looks. With a real model,
change the config's two paths instead. The tests make their model directories with these functions too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VOCAB = 64

FAMILIES = {
    # Llama with its head tied to the embedding (safetensors stores the tensor once).
    "llama-tied": dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen2: biases on the query/key/value projections, an untied head.
    "qwen2": dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # Gemma: its head tied to the embedding, which it scales by sqrt(hidden size).
    "gemma": dict(model_type="gemma", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True),
}

LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "the early bird catches the worm",
    "actions speak louder than words",
    "better late than never, but never late is better",
    "every cloud has a silver lining",
    "fortune favours the bold and the brave",
]


def save_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    """A BPE tokenizer of at most ``vocab_size`` tokens, with ``<s>``/``</s>``, trained on :data:`LINES` and saved
    as ``save_pretrained`` saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tokenizer.train_from_iterator(LINES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def make_model_directory(directory: Path, family: str = "llama-tied", *, tokenizer: bool = True,
                         seed: int = 0) -> Path:
    """``directory`` holding a randomly initialised ``family`` model (see :data:`FAMILIES`) and, by default, its
    tokenizer."""
    import transformers

    arguments = dict(FAMILIES[family])
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(arguments.pop("model_type"), **arguments)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if tokenizer:
        save_tokenizer(directory)
    return directory


def write_corpus(directory: Path, repeats: int = 6) -> dict[str, Path]:
    """``proverbs.txt`` (one proverb per paragraph) and ``proverbs.jsonl`` (records ``{"id", "text"}``): the
    proverbs ``repeats`` times."""
    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "proverbs.txt"
    text.write_text("\n\n".join(LINES * repeats) + "\n")
    records = directory / "proverbs.jsonl"
    records.write_text("".join(json.dumps({"id": i, "text": line}) + "\n" for i, line in enumerate(LINES * repeats)))
    return {"text": text, "jsonl": records}


# A chat template for the tiny tokenizer (real chat models ship their own with their tokenizer).
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def write_instructions(directory: Path, repeats: int = 6) -> dict[str, Path]:
    """``instructions.jsonl`` (``{"prompt", "response"}``: the first words of a proverb, the rest of it) and
    ``chats.jsonl`` (``{"messages"}``: a user asking for a proverb's end, the assistant giving it, twice), from the
    proverbs ``repeats`` times."""
    directory.mkdir(parents=True, exist_ok=True)
    pairs = [(" ".join(line.split()[:3]), " ".join(line.split()[3:])) for line in LINES * repeats]
    instructions = directory / "instructions.jsonl"
    instructions.write_text("".join(json.dumps({"prompt": f"finish: {start}", "response": end}) + "\n"
                                    for start, end in pairs))
    chats = directory / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"finish: {start}"}, {"role": "assistant", "content": end},
        {"role": "user", "content": f"finish: {pairs[i - 1][0]}"}, {"role": "assistant", "content": pairs[i - 1][1]},
    ]}) + "\n" for i, (start, end) in enumerate(pairs)))
    return {"instructions": instructions, "chats": chats}


def pretrain(directory: Path, steps: int = 200, learning_rate: float = 1e-2) -> float:
    """Train the model in ``directory`` on :data:`LINES` (each with its tokenizer's BOS and EOS) for ``steps`` full-batch
    AdamW steps, save it back, and return the last loss: a base that knows the proverbs, as a real pretrained model
    knows its language, so that fine-tuning it on instructions learns the format rather than the words."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    batch = tokenizer([f"{line}{tokenizer.eos_token}" for line in LINES], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return float(loss.detach())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, nargs="?", default=Path("tiny-pretrained"))
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama-tied")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    make_model_directory(args.output / "model", args.family)
    loss = pretrain(args.output / "model")
    write_corpus(args.output, repeats=40)["jsonl"].rename(args.output / "train.jsonl")
    write_instructions(args.output, repeats=40)
    print(f"wrote {args.output / 'model'} (pretrained to a loss of {loss:.2f}), {args.output / 'train.jsonl'} (text), "
          f"{args.output / 'instructions.jsonl'} "
          f"(prompt/response) and {args.output / 'chats.jsonl'} (chats)")


if __name__ == "__main__":
    main()
