"""Build the tiny test model: a random-weight Llama with 2 KV heads and a locally trained tokenizer.

Integration tests that need shapes the demo model cannot give (SmolLM2-135M has
3 KV heads, so no TP size of 2) use this one: 4 layers, hidden size 128,
4 attention heads over 2 KV heads, a byte-level BPE tokenizer of 512 tokens
trained here on a few sentences. Nothing is downloaded. Its greedy output is
gibberish but deterministic, which is all a test comparing two serving paths
needs. Cached under ``orchestrator.models.model_cache_dir()``; a second run is
a no-op.

Usage: python scripts/make_tiny_model.py [--force]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.models import KNOWN_MODELS, TINY_MODEL_NAME, model_cache_dir  # noqa: E402

PREPARED_MARK = ".pdserve-prepared-v1"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill engines compute the prompt; decode engines generate the answer.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "KV cache blocks move between engines over NIXL, UCX and shared memory.",
] * 20


def build(target: Path) -> None:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=512, min_frequency=1, special_tokens=["<s>", "</s>", "<unk>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="build again even if cached")
    args = parser.parse_args()
    target = model_cache_dir() / KNOWN_MODELS[TINY_MODEL_NAME].dir_name
    if (target / PREPARED_MARK).exists() and not args.force:
        print(f"tiny test model {TINY_MODEL_NAME} ready at {target}")
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        build(Path(scratch) / "model")
        (Path(scratch) / "model" / PREPARED_MARK).touch()
        shutil.rmtree(target, ignore_errors=True)
        (Path(scratch) / "model").rename(target)
    print(f"tiny test model {TINY_MODEL_NAME} ready at {target}")


if __name__ == "__main__":
    main()
