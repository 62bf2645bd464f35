"""A deterministic tiny Qwen2 causal LM with a locally trained byte-level BPE tokenizer.

Trained briefly on a learnable corpus (counting and alphabet runs) so that its next-token
distributions are peaked: greedy decoding is then stable across engines and dtypes. Built once
per recipe and cached on disk under a key of the recipe's content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

EOS, PAD = "<|endoftext|>", "<|pad|>"
#: A ChatML-style template (turns end with the EOS token) that offers ``tools`` in a system turn and
#: writes an assistant's tool calls as JSON in ``<tool_call>`` tags, as Hermes and Qwen templates do.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|endoftext|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|endoftext|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_RECIPE_VERSION = 3


@dataclass(frozen=True)
class TinyModelRecipe:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    train_steps: int = 300
    batch_size: int = 32
    seq_len: int = 48
    learning_rate: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        import torch

        blob = json.dumps(
            {
                **asdict(self),
                "v": _RECIPE_VERSION,
                "chat": CHAT_TEMPLATE,
                "torch": torch.__version__.split("+")[0],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Counting and alphabet runs, e.g. ``count: 3 4 5 6`` and ``abc: c d e f``."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(lines):
        if rng.random() < 0.5:
            start = rng.randrange(0, 60)
            out.append("count: " + " ".join(str(n) for n in range(start, start + rng.randrange(4, 14))))
        else:
            start = rng.randrange(0, 20)
            run = letters[start : start + rng.randrange(4, 12)]
            out.append("abc: " + " ".join(run))
    return out


def cache_root() -> Path:
    return Path(os.environ.get("ROLLGEN_CACHE_DIR", Path.home() / ".cache" / "rollgen"))


def tiny_model_dir(recipe: TinyModelRecipe | None = None, trained: bool = True) -> str:
    """Path of the tiny model folder for ``recipe`` (built on first use, then cached)."""
    recipe = recipe or TinyModelRecipe()
    if not trained:
        recipe = TinyModelRecipe(**{**asdict(recipe), "train_steps": 0})
    target = cache_root() / "models" / f"tiny-qwen2-{recipe.key()}"
    if (target / "model.safetensors").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        build = Path(tmp) / "model"
        _build(recipe, build)
        try:
            build.rename(target)
        except OSError:  # another process finished first; theirs is identical
            logger.info("tiny model %s was built concurrently; keeping the first", recipe.key())
    return str(target)


def with_generation_config(model_dir: str, dest: str | Path, **fields: object) -> str:
    """``model_dir`` as a new folder ``dest`` whose ``generation_config.json`` has ``fields``
    overridden (the other files are linked, not copied)."""
    src, out = Path(model_dir), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    generation = src / "generation_config.json"
    base = json.loads(generation.read_text()) if generation.is_file() else {}
    (out / "generation_config.json").write_text(json.dumps({**base, **fields}, indent=2))
    return str(out)


def _build(recipe: TinyModelRecipe, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    logger.info("building tiny model %s in %s", recipe.key(), out)
    text = corpus(recipe.seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=recipe.vocab_size - 8,
            special_tokens=[EOS, PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert eos_id is not None and pad_id is not None  # the trainer added both special tokens

    config = Qwen2Config(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=recipe.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = Qwen2ForCausalLM(config)
    if recipe.train_steps:
        _train(model, tokenizer, text, recipe, eos_id)
    model.eval()
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)


def _train(model, tokenizer, text: list[str], recipe: TinyModelRecipe, eos_id: int) -> None:  # type: ignore[no-untyped-def]
    import torch

    stream: list[int] = []
    for line in text:
        stream.extend(tokenizer(line, add_special_tokens=False)["input_ids"] + [eos_id])
    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    model.train()
    for _ in range(recipe.train_steps):
        starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + recipe.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    logger.info("tiny model trained %d steps, final loss %.3f", recipe.train_steps, loss.item())
