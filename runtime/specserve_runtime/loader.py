"""From user-facing names (model, method, drafter) to a ready Engine."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .config import DEFAULT_TOKEN_BUDGET, BatchSizeRange
from .drafters import ProposerOptions, build_proposer
from .drafters.dflash import MASK_TOKEN
from .engine import Engine
from .errors import ModelError
from .model import Transformer, load_target
from .store import resolve_model


@dataclass
class LoadedModel:
    folder: Path
    target: Transformer
    tokenizer: object
    eos_ids: set[int]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ModelError(f"{self.folder} has no chat template: send raw prompts instead")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        if raw:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def mask_token_id(self) -> int:
        """The DFlash mask token for a new drafter of this target (see drafters/dflash.py)."""
        token_id = self.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id and token_id not in self.eos_ids:
            return token_id
        if self.target.config.vocab_size > len(self.tokenizer):  # an embedding row no token uses
            return self.target.config.vocab_size - 1
        raise ModelError(f"{self.folder}: no {MASK_TOKEN} token and no spare embedding row for a DFlash mask token")


def load_model(name_or_path: str) -> LoadedModel:
    from transformers import AutoTokenizer

    folder = resolve_model(name_or_path)
    target = load_target(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises many types for a missing or broken tokenizer
        raise ModelError(f"{folder}: cannot load the tokenizer ({exc})") from exc
    return LoadedModel(folder, target, tokenizer, _eos_ids(folder, tokenizer))


def _eos_ids(folder: Path, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return ids


def build_engine(model: LoadedModel, method: str, options: ProposerOptions = ProposerOptions(),
                 token_budget: int = DEFAULT_TOKEN_BUDGET, adaptive: bool = False,
                 schedule: list[BatchSizeRange] | None = None) -> Engine:
    if method == "dflash" and options.drafter == "random" and options.mask_token_id is None:
        options = replace(options, mask_token_id=model.mask_token_id())
    proposer = build_proposer(method, model.target, options)
    return Engine(model.target, model.tokenizer, proposer, model.eos_ids, token_budget, adaptive, schedule)
