"""Make a tiny Hugging Face model folder offline: random weights of a family, a trained chat tokenizer.

    python scripts/make_tiny_hf_model.py OUT_DIR [--family llama3|qwen3] [--hidden_size 256] [--layers 2]
        [--vocab_size 1024] [--seed 0]

OUT_DIR gets what a downloaded Instruct model's folder holds, at a size that trains in seconds on a
CPU: ``config.json``, ``model.safetensors`` and ``generation_config.json`` (a random
``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` that ``transformers`` saved), ``tokenizer.json`` (a
byte-level BPE trained on this Python's standard library, with the family's special tokens; Llama
3's adds ``<|begin_of_text|>`` to a text as the published one does), ``tokenizer_config.json``
(BOS, EOS) and ``chat_template.jinja`` (the family's chat template). Nothing is downloaded. Train
from it as from a download: ``--model.name llama3 --model.flavor from_checkpoint
--model.tokenizer_path OUT_DIR --checkpoint.initial_load_path OUT_DIR --checkpoint.initial_load_in_hf``
(docs/fine-tuning.md). The default shape (width 256, feed-forward 512, 4 heads, 2 key-value heads)
splits into NF4's blocks, so QLoRA takes it too.

:func:`write_chat_tokenizer` is also what the tests build their chat tokenizers with.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "make_tiny_hf_model", "write_chat_tokenizer", "write_tiny_model"]

TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "assets" / "chat_templates"

# family: (the transformers classes' prefix, chat template file, special tokens in id order, bos, eos,
# config fields beyond the shape)
FAMILIES: dict[str, tuple[str, str, tuple[str, ...], str | None, str, dict[str, Any]]] = {
    "llama3": ("Llama", "llama3.jinja",
               ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               "<|begin_of_text|>", "<|eot_id|>", {"rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                                                    "tie_word_embeddings": False}),
    "qwen3": ("Qwen3", "qwen3.jinja",
              ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
               "<tool_response>", "</tool_response>"),
              None, "<|im_end|>", {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
}


def write_chat_tokenizer(folder: Path, *, texts: Sequence[str], special_tokens: Sequence[str], bos: str | None,
                         eos: str, chat_template: str, vocab_size: int = 400) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained (by the ``tokenizers`` library) on ``texts``,
    ``special_tokens`` first in the vocabulary, and a ``tokenizer_config.json`` naming BOS, EOS
    and ``chat_template``; the tokenizer.json's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "chat_template": chat_template}))
    return folder / "tokenizer.json"


def write_tiny_model(folder: Path, family: str, *, vocab_size: int, bos_id: int | None, eos_id: int,
                     hidden_size: int = 256, intermediate_size: int = 512, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, max_position_embeddings: int = 2048, seed: int = 0) -> Path:
    """A random ``{Llama,Qwen3}ForCausalLM`` of this shape that ``transformers`` saves into ``folder``
    (safetensors, ``config.json``, ``generation_config.json``)."""
    import torch
    import transformers

    prefix, _, _, _, _, extra = FAMILIES[family]
    fields = {"hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab_size,
              "max_position_embeddings": max_position_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
              **extra}
    if family == "qwen3":
        fields["head_dim"] = hidden_size // heads
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(**fields)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    model.save_pretrained(str(folder))
    return folder


def _stdlib_texts(limit_bytes: int = 2_000_000) -> list[str]:
    """This Python's standard-library modules (the default job's corpus), about ``limit_bytes``."""
    from torchtitan_lite.data.stdlib import find_files

    texts, size = [], 0
    for file in find_files("python_stdlib", None, section="training", key="training.dataset"):
        if size >= limit_bytes:
            break
        text = file.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    return texts


def make_tiny_hf_model(folder: Path, *, family: str = "llama3", vocab_size: int = 1024, hidden_size: int = 256,
                       intermediate_size: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                       seed: int = 0) -> Path:
    """The folder (see the module's text): the tokenizer first, then a model of its vocabulary."""
    from tokenizers import Tokenizer, processors

    _, template_file, special, bos, eos, _ = FAMILIES[family]
    template = (TEMPLATES / template_file).read_text(encoding="utf-8")
    path = write_chat_tokenizer(folder, texts=_stdlib_texts(), special_tokens=special, bos=bos, eos=eos,
                                chat_template=template, vocab_size=vocab_size)
    # As transformers 5 saves a folder: the chat template in its own file.
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(settings.pop("chat_template"), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    tok = Tokenizer.from_file(str(path))
    if bos is not None:  # Llama 3's tokenizer.json puts BOS before a text (transformers' tokenizer(text))
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
        tok.save(str(path))
    vocab = tok.get_vocab(with_added_tokens=True)
    write_tiny_model(folder, family, vocab_size=max(vocab.values()) + 1, bos_id=vocab.get(bos) if bos else None,
                     eos_id=vocab[eos], hidden_size=hidden_size, intermediate_size=intermediate_size, layers=layers,
                     heads=heads, kv_heads=kv_heads, seed=seed)
    return folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the folder to write (new, or empty)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama3",
                        help="the model family and its chat template (default: llama3)")
    parser.add_argument("--vocab_size", type=int, default=1024, help="the tokenizer's vocabulary (default: 1024)")
    parser.add_argument("--hidden_size", type=int, default=256, help="the model's width (default: 256)")
    parser.add_argument("--intermediate_size", type=int, default=512, help="the feed-forward's width (default: 512)")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (default: 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--kv_heads", type=int, default=2, help="key-value heads (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: out_dir: {str(out)!r} exists and is not an empty folder; name a new one", file=sys.stderr)
        return 2
    for name in ("vocab_size", "hidden_size", "intermediate_size", "layers", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            print(f"error: --{name}: invalid value {getattr(args, name)}; expected a positive integer", file=sys.stderr)
            return 2
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        print(f"error: --hidden_size {args.hidden_size}, --heads {args.heads}, --kv_heads {args.kv_heads}: the width "
              "must divide into the heads and the heads into the key-value heads", file=sys.stderr)
        return 2
    make_tiny_hf_model(out, family=args.family, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                       intermediate_size=args.intermediate_size, layers=args.layers, heads=args.heads,
                       kv_heads=args.kv_heads, seed=args.seed)
    config = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: {args.family}, {config['num_hidden_layers']} layers of width {config['hidden_size']}, "
          f"vocabulary {config['vocab_size']} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    print(f"train from it: --model.name {args.family} --model.flavor from_checkpoint --model.tokenizer_path {out} "
          f"--checkpoint.initial_load_path {out} --checkpoint.initial_load_in_hf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
