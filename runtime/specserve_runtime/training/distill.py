"""Self-distilled training data: the target's own greedy responses to the training prompts.

The drafter must predict what the target will say, so it learns from the target's outputs
(chat template applied, as served), not from human-written answers. Generation runs on the
serving engine itself, greedy, `batch_size` sequences decoding at once with a finished one's
place going to the next prompt at once (continuous batching: each response is exactly what its
prompt decodes alone, and what the runtime serves). On 2 cores, at batch 16, that is 4.6x the
tokens per second of transformers' batched generate, which waits for a batch's longest response
and pads its prompts; batch 128 adds 1.31x (docs/training.md). It writes one JSONL shard per
chunk of prompts: an interrupted run resumes at the first missing shard. `distill.json` beside
the shards records the settings (target, vocabulary, prompt file, split, length, generator) and
each shard's size and hash: a resume with other settings, or over a truncated or edited shard, is
refused with the file named, and nothing written is touched. The target hidden states a drafter needs are not stored here:
training computes them once per tap set and caches them beside the shards (train.py).

More data from the same prompts (`continue_from`): every response a distilled folder cut at its
length limit is decoded further, its prompt and response becoming the new prompt. The prompt set
has no more first turns to give, and a cut response's next tokens are the target's own text in the
very context the drafter serves in: what it says past the limit.
"""

import hashlib
import json
import time
from pathlib import Path

import torch

from ..engine import Engine, Request
from ..loader import build_engine, load_model
from ..store import write_atomically
from .prompts import PROMPTS_FILE, read_prompts

SHARD_SIZE = 128
MANIFEST = "distill.json"
GENERATOR = "specserve-engine"  # recorded in the settings: shards of another generator are not mixed in


def distill(
    out_dir: str | Path,
    prompts_file: str | Path | None = None,
    split: str = "train",
    model: str = "SmolLM2-135M-Instruct",
    max_new_tokens: int = 160,
    batch_size: int = 128,
    limit: int | None = None,
    continue_from: str | Path | None = None,
    log=print,
) -> Path:
    """Distil the prompts of `split` into `out_dir`, or with `continue_from` (a distilled folder)
    the responses it cut at its length limit, up to `max_new_tokens` more each; `limit`: only the
    first N prompts (responses)."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    loaded = load_model(model)
    engine = build_engine(loaded, "ar")
    # The target's arithmetic decides its greedy responses: int8 shards never continue float32 ones.
    settings = {"model": str(model), "vocab_size": len(loaded.tokenizer), "target_activations": loaded.target.activations}
    if continue_from is None:
        prompts_file = prompts_file or PROMPTS_FILE
        records = read_prompts(prompts_file, split=split)[:limit]
        if not records:
            raise ValueError(f"{prompts_file}: no prompts in split {split!r}")
        settings |= {"prompts_sha256": _sha256(Path(prompts_file).read_bytes()), "split": split}
        shards = [(f"shard-{n:05d}.jsonl", records[i : i + SHARD_SIZE], None)
                  for n, i in enumerate(range(0, len(records), SHARD_SIZE))]

        def prompt_ids(record: dict) -> list[int]:  # as served: the chat template over the conversation so far
            return loaded.encode_chat(record.get("context", []) + [{"role": "user", "content": record["prompt"]}])
    else:
        source_settings, shards = _cut_responses(Path(continue_from), len(loaded.tokenizer), loaded.eos_ids, limit)
        settings |= {"continues": source_settings}

        def prompt_ids(record: dict) -> list[int]:  # the cut sequence, decoded further
            return record["prompt_ids"] + record["response_ids"]
    settings |= {"max_new_tokens": max_new_tokens, "generator": GENERATOR}
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _open_manifest(out_dir, settings)
    done = 0
    for name, shard, source_sha256 in shards:
        if (out_dir / name).exists():
            _check_shard(out_dir / name, manifest, planned=len(shard), source_sha256=source_sha256)
            done += len(shard)
    total = sum(len(shard) for _, shard, _ in shards)
    what = f"{total} {split} prompts" if continue_from is None else f"{total} responses of {continue_from} cut at its limit"
    log(f"distilling {what} into {out_dir} ({done} done)")
    progress = tqdm(total=total, initial=done, unit="prompt", dynamic_ncols=True)
    generated, started, cpu_started = 0, time.perf_counter(), time.process_time()
    for name, shard, source_sha256 in shards:
        path = out_dir / name
        if path.exists() or not shard:
            continue
        prompts = [prompt_ids(record) for record in shard]

        def finished(response: list[int]) -> None:
            nonlocal generated
            generated += len(response)
            progress.update(1)
            progress.set_postfix(tokens_per_s=f"{generated / (time.perf_counter() - started):.0f}",
                                 per_cpu_s=f"{generated / max(time.process_time() - cpu_started, 1e-9):.0f}")

        responses = greedy_responses(engine, prompts, max_new_tokens, batch_size, finished)
        shard_tokens = sum(len(response) for response in responses)
        lines = [json.dumps({**record, "prompt_ids": prompt, "response_ids": response})
                 for record, prompt, response in zip(shard, prompts, responses)]
        text = "\n".join(lines) + "\n"
        write_atomically(path, lambda partial: partial.write_text(text))  # a shard is complete or absent
        manifest["shards"][name] = {"records": len(lines), "sha256": _sha256(text.encode())}
        if source_sha256 is not None:  # a continuation is of one version of its source shard
            manifest["shards"][name]["source_sha256"] = source_sha256
        manifest["response_tokens"] = manifest.get("response_tokens", 0) + shard_tokens
        write_atomically(out_dir / MANIFEST, lambda partial: partial.write_text(json.dumps(manifest, indent=1) + "\n"))
    progress.close()
    if generated:
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        log(f"generated {generated} tokens in {wall:.0f} s: {generated / wall:.1f} tokens/s, "
            f"{generated / max(cpu, 1e-9):.1f} tokens per CPU-second")
    return out_dir


def _cut_responses(source: Path, vocab_size: int, eos_ids: set[int], limit: int | None):
    """A distilled folder's settings, and per shard of it the records whose response stopped at the
    length limit rather than at an end token: (shard name, records, the source shard's SHA-256)."""
    manifest_path = source / MANIFEST
    if not manifest_path.exists():
        raise ValueError(f"{source}: no {MANIFEST} (not a folder written by `specserve distill`)")
    manifest = json.loads(manifest_path.read_text())
    length = manifest["settings"]["max_new_tokens"]
    shards, left = [], limit
    for path, records in read_shards(source, vocab_size):  # each checked against its hash in the manifest
        cut = [{**record, "continues": f"{path.name}:{line}"} for line, record in enumerate(records, 1)
               if len(record["response_ids"]) == length and record["response_ids"][-1] not in eos_ids][:left]
        shards.append((path.name, cut, manifest["shards"][path.name]["sha256"]))
        if left is not None and (left := left - len(cut)) == 0:
            break
    return manifest["settings"], shards


@torch.inference_mode()
def greedy_responses(engine: Engine, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                     finished=lambda response: None) -> list[list[int]]:
    """Each prompt's greedy response, the EOS token kept (the drafter should learn to predict it
    too), with `batch_size` sequences decoding at once and a finished one's place going to the next
    prompt; `finished(response)` is called as each completes."""
    responses: list[list[int] | None] = [None] * len(prompts)
    waiting = list(enumerate(prompts))[::-1]  # popped from the end: in order
    running = []  # (prompt's index, its sequence)
    while waiting or running:
        while waiting and len(running) < batch_size:
            index, prompt = waiting.pop()
            running.append((index, engine.add(Request(prompt, max_new_tokens))))
        engine.step([sequence for _, sequence in running])
        for index, sequence in running:
            if sequence.finish_reason:
                responses[index] = sequence.tokens[len(prompts[index]):]  # committed tokens, EOS included
                finished(responses[index])
        running = [(index, sequence) for index, sequence in running if sequence.finish_reason is None]
    return responses


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _open_manifest(out_dir: Path, settings: dict) -> dict:
    """The folder's manifest, new or resumed; a resume with other settings is refused."""
    path = out_dir / MANIFEST
    if not path.exists():
        if any(out_dir.glob("shard-*.jsonl")):
            raise ValueError(f"{out_dir}: shards without a {MANIFEST} (written by another tool or version); "
                             "use a new --out folder")
        return {"settings": settings, "shards": {}}
    try:
        manifest = json.loads(path.read_text())
        stored = manifest["settings"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc}); restore it or use a new --out folder") from exc
    stored.setdefault("target_activations", "float32")  # every folder distilled before the int8 target
    changed = [f"{key} {stored.get(key)!r} -> {value!r}" for key, value in settings.items() if stored.get(key) != value]
    if changed:
        raise ValueError(f"{path} was written with other settings ({'; '.join(changed)}): resume with the same "
                         "target (and SPECSERVE_TARGET_INT8), prompts and flags, or use a new --out folder")
    return manifest


def _check_shard(path: Path, manifest: dict, planned: int, source_sha256: str | None = None) -> None:
    """A shard already written must be the one the manifest recorded, as large as this run plans
    (and a continuation must continue the source shard as it is now)."""
    recorded = manifest["shards"].get(path.name)
    if recorded is None:
        raise ValueError(f"{path} is not in {MANIFEST} (left by an interrupted or other run?): move it away to regenerate it")
    if _sha256(path.read_bytes()) != recorded["sha256"]:
        raise ValueError(f"{path} does not match the hash in {MANIFEST} (truncated or edited): move it away to regenerate it")
    if recorded.get("source_sha256") != source_sha256:
        raise ValueError(f"{path} continues another version of its source shard (regenerated since?): "
                         "move it away to regenerate it")
    if recorded["records"] != planned:
        raise ValueError(f"{path} holds {recorded['records']} prompts where this run plans {planned} "
                         "(an earlier --limit?): move it away to regenerate it")


def read_shards(data_dir: str | Path, vocab_size: int | None = None) -> list[tuple[Path, list[dict]]]:
    """Each shard of a data folder with its records, checked against the folder's manifest.

    With `vocab_size` (the target's), data distilled from another vocabulary is refused.
    """
    folder = Path(data_dir)
    files = sorted(folder.glob("shard-*.jsonl"))
    if not files:
        raise ValueError(f"{folder}: no shard-*.jsonl files (run `specserve distill` first)")
    manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).exists() else None
    if manifest is not None and vocab_size is not None and manifest["settings"]["vocab_size"] != vocab_size:
        raise ValueError(f"{folder / MANIFEST}: distilled with a {manifest['settings']['vocab_size']}-token vocabulary, "
                         f"but the target has {vocab_size} (data of another target?)")
    shards = []
    for path in files:
        data = path.read_bytes()
        if manifest is not None and manifest["shards"].get(path.name, {}).get("sha256") != _sha256(data):
            raise ValueError(f"{path} does not match the hash in {folder / MANIFEST} (truncated, edited or foreign)")
        records = []
        for number, line in enumerate(data.decode().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                tokens = record["prompt_ids"] + record["response_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a distilled record ({exc})") from exc
            if vocab_size is not None and not all(0 <= t < vocab_size for t in tokens):
                raise ValueError(f"{path}:{number}: token ids outside the target's vocabulary of {vocab_size} "
                                 "(data of another target?)")
            records.append(record)
        shards.append((path, records))
    return shards
