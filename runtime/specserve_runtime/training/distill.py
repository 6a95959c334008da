"""Self-distilled training data: the target's own greedy responses to the training prompts.

The drafter must predict what the target will say, so it learns from the target's outputs
(chat template applied, as served), not from human-written answers. Generation runs in
batches with transformers (batched greedy decoding is several times faster on CPU than one
sequence at a time), and writes one JSONL shard per chunk of prompts: an interrupted run
resumes at the first missing shard. The target hidden states a drafter needs are not stored
here: training computes them once per tap set and caches them beside the shards (train.py).
"""

import json
import time
from pathlib import Path

import torch

from ..store import resolve_model
from .prompts import PROMPTS_FILE, read_prompts

SHARD_SIZE = 128


def distill(
    out_dir: str | Path,
    prompts_file: str | Path | None = None,
    split: str = "train",
    model: str = "SmolLM2-135M-Instruct",
    max_new_tokens: int = 160,
    batch_size: int = 32,
    limit: int | None = None,
    log=print,
) -> Path:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_file = prompts_file or PROMPTS_FILE
    records = read_prompts(prompts_file, split=split)[:limit]
    if not records:
        raise ValueError(f"{prompts_file}: no prompts in split {split!r}")
    folder = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    shards = [records[i : i + SHARD_SIZE] for i in range(0, len(records), SHARD_SIZE)]
    done = sum((out_dir / f"shard-{n:05d}.jsonl").exists() for n in range(len(shards)))
    log(f"distilling {len(records)} {split} prompts into {out_dir} ({done}/{len(shards)} shards already done)")
    progress = tqdm(total=len(records), initial=done * SHARD_SIZE, unit="prompt", dynamic_ncols=True)
    generated, started = 0, time.perf_counter()
    for number, shard in enumerate(shards):
        path = out_dir / f"shard-{number:05d}.jsonl"
        if path.exists():
            continue
        lines = []
        # Similar lengths in one batch waste less compute on padding.
        ordered = sorted(shard, key=lambda r: len(r["prompt"]))
        for start in range(0, len(ordered), batch_size):
            batch = ordered[start : start + batch_size]
            prompts = [[{"role": "user", "content": r["prompt"]}] for r in batch]
            encoded = tokenizer.apply_chat_template(
                prompts, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
            )
            with torch.inference_mode():
                output = target.generate(
                    **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            width = encoded["input_ids"].shape[1]
            for row, record in enumerate(batch):
                prompt_ids = encoded["input_ids"][row][encoded["attention_mask"][row].bool()].tolist()
                response = output[row, width:].tolist()
                if eos in response:  # keep the EOS token: the drafter should learn to predict it too
                    response = response[: response.index(eos) + 1]
                generated += len(response)
                lines.append(json.dumps({**record, "prompt_ids": prompt_ids, "response_ids": response}))
            progress.update(len(batch))
            progress.set_postfix(tokens_per_s=f"{generated / (time.perf_counter() - started):.0f}")
        partial = path.with_suffix(".partial")
        partial.write_text("\n".join(lines) + "\n")
        partial.rename(path)  # a shard is complete or absent
    progress.close()
    return out_dir


def read_sequences(data_dir: str | Path) -> list[dict]:
    """All distilled records of a data folder, in shard order."""
    files = sorted(Path(data_dir).glob("shard-*.jsonl"))
    if not files:
        raise ValueError(f"{data_dir}: no shard-*.jsonl files (run `specserve distill` first)")
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
