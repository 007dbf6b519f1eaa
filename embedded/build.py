"""Build the embedded default target: a tiny tokenizer and a tiny hybrid (Gated DeltaNet) model.

Both are written as ordinary HuggingFace directories and are loaded later through the same
`from_pretrained` path as any real checkpoint. The build is deterministic (fixed seeds, fixed data,
single-threaded training) and cached under `$DFLASH_HOME/embedded/<BUILD_VERSION>`; it takes ~10-20 s
on 2 CPU cores the first time.

The model is trained on the bundled conversations so that its greedy continuations are structured,
prompt-dependent text rather than noise: a drafter can only show a meaningful acceptance gain on a
target that behaves like a language model. That training takes minutes on a CPU, so its result is
shipped in embedded/data/target/ (2 MB, made by `python -m embedded.build --ship`), and a build only
trains in place if the shipped weights do not belong to the tokenizer built here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipeline.embedded import SHIPPED_TARGET
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.storage.commit import taking_turns

if TYPE_CHECKING:  # torch is imported where a model is trained: the CLI's pre-flight imports this module (check_home)
    import torch

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
CONVERSATIONS = DATA_DIR / "conversations_sharegpt.jsonl"
CONVERSATIONS_MESSAGES = DATA_DIR / "conversations_messages.jsonl"
HELDOUT_PROMPTS = DATA_DIR / "heldout_prompts.jsonl"
BUILD_VERSION = "v2"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]

# ChatML, Qwen-style. Assistant content (and its <|im_end|>, which the model must generate) is
# wrapped in {% generation %} so `return_assistant_tokens_mask=True` works. Like Qwen3's template,
# <think> blocks of assistant turns before the last one are not rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}"
    "{%- if '</think>' in content and not loop.last -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{% generation %}{{- content + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=8,  # layer_types: every 4th layer full attention (3, 7), the rest Gated DeltaNet
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TRAIN_STEPS = 800
TRAIN_SEQ = 192
TRAIN_BATCH = 8


def dflash_home() -> Path:
    return Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash-pipeline"))


def default_dir() -> Path:
    return dflash_home() / "embedded" / BUILD_VERSION


def check_home(root: Path | None = None) -> None:
    """Unless the embedded target is built already: where it is built ($DFLASH_HOME) can be created and written,
    else one ConfigError naming DFLASH_HOME (a read-only one was a 62-line traceback from the probe)."""
    root = root or default_dir()
    if (root / "BUILD_OK").exists():
        return
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root.parent, prefix=".write-test-"):
            pass
    except OSError as e:
        home = os.environ.get("DFLASH_HOME")
        raise ConfigError(
            f"the embedded target cannot be built under {root.parent} ({e.strerror or e}): set DFLASH_HOME (now "
            f"{home if home else 'unset: ~/.cache/dflash-pipeline'}) to a writable directory, the cache where it is "
            "built once"
        ) from None


def ensure_built(root: Path | None = None) -> Path:
    """Return the directory of the embedded target (tokenizer files + model), building it once."""
    root = root or default_dir()
    if (root / "BUILD_OK").exists():
        return root
    check_home(root)
    # Runs started at once on a fresh machine take turns: one builds, the others wait and find it built.
    with taking_turns(root.parent / f".{root.name}.lock", f"another process is building {root}; waiting for it"):
        if (root / "BUILD_OK").exists():
            return root
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
        try:
            _build(tmp)
            (tmp / "BUILD_OK").write_text(BUILD_VERSION)
            if root.exists():  # an interrupted earlier build; never partially visible
                shutil.rmtree(root)
            os.replace(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def _texts() -> list[str]:
    out = []
    for line in CONVERSATIONS.read_text().splitlines():
        for turn in json.loads(line)["conversations"]:
            out.append(turn["value"])
    return out


def build_tokenizer(out: Path, texts: list[str] | None = None, vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained in-process on `texts` (default: the bundled conversations), with our
    special tokens and ChatML template, saved to `out` (bench/realtext trains its target's the same way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_texts() if texts is None else texts) + ["system user assistant"], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>", "<|mask|>"],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    return hf


def _training_ids(tokenizer) -> torch.Tensor:
    import torch

    ids: list[int] = []
    for line in CONVERSATIONS_MESSAGES.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        ids.extend(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def tokenizer_sha(tokenizer) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def build_model(out: Path, tokenizer, steps: int = TRAIN_STEPS) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **MODEL_CONFIG,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical builds across machines with different core counts
    try:
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config)
        ids = _training_ids(tokenizer)
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / steps))
        )
        model.train()
        for step in range(steps):
            starts = torch.randint(0, len(ids) - TRAIN_SEQ - 1, (TRAIN_BATCH,), generator=gen)
            batch = torch.stack([ids[s : s + TRAIN_SEQ] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step % 50 == 0 or step == steps - 1:
                log.info("embedded target training step %d/%d loss %.3f", step + 1, steps, loss.item())
        model.eval()
        model.save_pretrained(out)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path) -> None:
    tokenizer = build_tokenizer(out)
    shipped_sha = SHIPPED_TARGET / "TOKENIZER_SHA"
    if shipped_sha.exists() and shipped_sha.read_text().strip() == tokenizer_sha(tokenizer):
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(SHIPPED_TARGET / name, out / name)
        return
    log.warning(
        "the shipped embedded target does not match this tokenizer (another `tokenizers` version?); "
        "training it here, which takes several minutes"
    )
    build_model(out, tokenizer)


def ship() -> None:
    """Train the embedded target and store it in embedded/data/target (committed)."""
    import tempfile as _tf

    with _tf.TemporaryDirectory() as d:
        tokenizer = build_tokenizer(Path(d))
        SHIPPED_TARGET.mkdir(parents=True, exist_ok=True)
        build_model(SHIPPED_TARGET, tokenizer)
        (SHIPPED_TARGET / "TOKENIZER_SHA").write_text(tokenizer_sha(tokenizer) + "\n")


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    if "--ship" in sys.argv:
        ship()
    else:
        print(ensure_built())
