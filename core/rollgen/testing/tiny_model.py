"""A deterministic tiny Qwen2 causal LM with a locally trained byte-level BPE tokenizer.

Trained briefly on a learnable corpus (counting and alphabet runs) so that its next-token
distributions are peaked: greedy decoding is then stable across engines and dtypes. Built once
per recipe and cached on disk under a key of the recipe's content.

The agent variant (``AgentModelRecipe``, ``tiny_model_dir(agent=True)``) is a recipe of its own:
a 2,048-position context and a chat template with tools, trained on conversations of the
calculator task (``rollgen.testing.tool_use``) in which it calls the tool some of the time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

from rollgen.errors import ConfigError

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
#: The agent model's template: the same ChatML turns and tools, and an assistant's tool calls as
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` with the arguments written once
#: (OpenAI's arguments are JSON text: written as they are; a dict: as JSON), which is what the
#: server's ``hermes`` tool parser reads.
AGENT_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|endoftext|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": '
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "<|endoftext|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_RECIPE_VERSION = 3
#: Part of the agent model's key: raise it when the conversations it is trained on change
#: (``rollgen.testing.tool_use``), so that a cached build of the old ones is not taken for it.
_AGENT_RECIPE_VERSION = 1


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

    #: The folder's name, before the key.
    name = "tiny-qwen2"

    def key(self) -> str:
        import torch

        blob = json.dumps(
            {
                **asdict(self),
                **self._versions(),
                "chat": self.chat_template(),
                "torch": torch.__version__.split("+")[0],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _versions(self) -> dict[str, Any]:
        return {"v": _RECIPE_VERSION}

    def chat_template(self) -> str:
        return CHAT_TEMPLATE

    def documents(self) -> list[str]:
        """The training texts: the tokenizer learns its merges from them, the model to continue
        them."""
        return corpus(self.seed)

    def tokenizer_texts(self, documents: list[str]) -> list[str]:
        """What the tokenizer learns its merges from (no special tokens in them)."""
        return documents

    def token_stream(self, tokenizer: Any, documents: list[str], eos_id: int) -> list[int]:
        """The documents' tokens, one after another, as the model is trained on them."""
        stream: list[int] = []
        for line in documents:
            stream.extend(tokenizer(line, add_special_tokens=False)["input_ids"] + [eos_id])
        return stream

    def training_tokenizer(self, trained: Any, folder: Path) -> Any:
        """The tokenizer that encodes the documents for training (``trained``: the one just
        trained, saved in ``folder``)."""
        return trained


@dataclass(frozen=True)
class AgentModelRecipe(TinyModelRecipe):
    """The agent tiny model: a 2,048-position context, ``AGENT_CHAT_TEMPLATE``, trained on
    conversations of the calculator task (``rollgen.testing.tool_use``) where it answers
    through the tool with probability ``tool_share`` and guesses otherwise."""

    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    train_steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    conversations: int = 3000
    max_questions: int = 1
    tool_share: float = 0.35

    name = "tiny-qwen2-agent"

    def _versions(self) -> dict[str, Any]:
        from rollgen.testing.tool_use import TOOLS

        return {"v": _RECIPE_VERSION, "agent_v": _AGENT_RECIPE_VERSION, "tools": TOOLS}

    def chat_template(self) -> str:
        return AGENT_CHAT_TEMPLATE

    def documents(self) -> list[str]:
        """Conversations of one to ``max_questions`` questions, rendered by the chat template with the
        calculator offered."""
        from transformers.utils.chat_template_utils import render_jinja_template

        from rollgen.testing.tool_use import TOOLS, conversation, questions

        rng = random.Random(self.seed)
        chats = [
            conversation(rng, questions(rng, rng.randint(1, self.max_questions)), self.tool_share)
            for _ in range(self.conversations)
        ]
        # (texts, generation indices), though annotated as a str
        rendered = cast(Any, render_jinja_template)(chats, tools=TOOLS, chat_template=self.chat_template())
        return list(rendered[0])

    def tokenizer_texts(self, documents: list[str]) -> list[str]:
        return [piece for d in documents for piece in d.split(EOS)]

    def token_stream(self, tokenizer: Any, documents: list[str], eos_id: int) -> list[int]:
        stream: list[int] = []
        for d in documents:  # each ends its turns with the EOS token already
            stream.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        return stream

    def training_tokenizer(self, trained: Any, folder: Path) -> Any:
        """The tokenizer that engines load from the folder (with its model's config): transformers'
        Qwen2 tokenizer splits numbers into digits, unlike the one the merges were learnt with,
        and the model must be trained on the tokens it will be served."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)


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


def tiny_model_dir(recipe: TinyModelRecipe | None = None, trained: bool = True, agent: bool = False) -> str:
    """Path of the tiny model folder for ``recipe`` (built on first use, then cached under
    ``cache_root()``): by default the tiny model every test uses; ``agent=True``: the agent
    variant (``AgentModelRecipe``); ``trained=False``: the recipe's weights untrained."""
    if recipe is not None and agent:
        raise ConfigError("tiny_model_dir: give a recipe or agent=True, not both")
    recipe = recipe or (AgentModelRecipe() if agent else TinyModelRecipe())
    if not trained:
        recipe = replace(recipe, train_steps=0)
    target = cache_root() / "models" / f"{recipe.name}-{recipe.key()}"
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
    text = recipe.documents()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        recipe.tokenizer_texts(text),
        trainers.BpeTrainer(
            vocab_size=recipe.vocab_size - 8,
            special_tokens=[EOS, PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = recipe.chat_template()
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
    config.save_pretrained(out)  # the model's type: which tokenizer class transformers loads for it
    torch.manual_seed(recipe.seed)
    model = Qwen2ForCausalLM(config)
    if recipe.train_steps:
        _train(model, recipe.token_stream(recipe.training_tokenizer(tokenizer, out), text, eos_id), recipe)
    model.eval()
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)


def _train(model, stream: list[int], recipe: TinyModelRecipe) -> None:  # type: ignore[no-untyped-def]
    import torch

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
