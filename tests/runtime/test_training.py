"""Training pieces on a tiny target: anchors, block mask, loss weights, and train == inference."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specserve_runtime.drafters import build_proposer
from specserve_runtime.drafters.dflash import DFlashConfig, DFlashProposer, load_dflash, random_drafter, save_dflash
from specserve_runtime.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer, load_eagle3, save_eagle3
from specserve_runtime.drafters.vocab import DraftHead, draft_token_ids, set_draft_vocab
from specserve_runtime.training.recipes import (
    accepted_prefix,
    block_mask,
    dflash_loss,
    eagle3_loss,
    engine_walk,
    position_weights,
    proposer_accepted,
    sample_anchors,
    tree_accepted,
)


def test_anchors_are_distinct_sorted_and_inside_the_response():
    generator = torch.Generator().manual_seed(0)
    anchors = sample_anchors(response_start=10, length=30, count=8, generator=generator)
    assert anchors.tolist() == sorted(set(anchors.tolist())) and len(anchors) == 8
    assert anchors.min() >= 10 and anchors.max() <= 28  # every anchor has a next token
    assert len(sample_anchors(10, 14, 50, generator)) == 3  # capped by the positions available


def test_block_mask_sees_context_before_the_anchor_and_its_own_block():
    mask = block_mask(torch.tensor([2, 4]), context_length=5, block_size=2)
    assert mask.tolist() == [
        # context 0..4              | block 0 | block 1
        [True, True, False, False, False, True, True, False, False],
        [True, True, False, False, False, True, True, False, False],
        [True, True, True, True, False, False, False, True, True],
        [True, True, True, True, False, False, False, True, True],
    ]


def test_position_weights_decay_from_one():
    weights = position_weights(block_size=8, gamma=4.0)
    assert weights.shape == (7,) and weights[0] == 1.0
    torch.testing.assert_close(weights[4], torch.exp(torch.tensor(-1.0)))
    assert accepted_prefix(torch.tensor([[True, True, False, True], [False, True, True, True]])).tolist() == [2, 0]


DRAFT_VOCAB = torch.arange(0, 96, 2)  # every other token of the tiny target's 96


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB], ids=["full-vocab", "reduced-vocab"])
def test_dflash_training_forward_equals_inference_drafts(tiny_llama, draft_vocab):
    """Every packed block of the training forward computes what the proposer computes at that point."""
    vocab_size = None if draft_vocab is None else draft_vocab.numel()
    config = DFlashConfig.for_target(tiny_llama.config, 2, 4, mask_token_id=95, num_taps=3, draft_vocab_size=vocab_size)
    drafter = random_drafter(config, seed=3)
    if draft_vocab is not None:
        set_draft_vocab(drafter, draft_vocab)
    head = DraftHead(tiny_llama.lm_head.weight, draft_token_ids(drafter))
    tokens = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(6))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=config.target_layer_ids).taps
    anchors = torch.tensor([9, 14, 20])
    size = config.block_size
    blocks = torch.full((3, size), 95)
    blocks[:, 0] = tokens[anchors]
    positions = (anchors[:, None] + torch.arange(size)).flatten()
    hidden = drafter(tiny_llama.embed_tokens(blocks.flatten()), positions, [drafter.context_kv(taps, torch.arange(24))],
                     block_mask(anchors, 24, size))
    packed_drafts = head.to_target(head.logits(hidden.view(3, size, -1)[:, 1:]).argmax(-1))
    if draft_vocab is not None:
        assert set(packed_drafts.flatten().tolist()) <= set(draft_vocab.tolist())
    for row, anchor in enumerate(anchors.tolist()):
        proposer = DFlashProposer(tiny_llama, drafter, size - 1)
        proposer.begin(64)
        proposer.extend_context(taps[:anchor])
        assert proposer.propose(tokens[: anchor + 1].tolist(), size - 1) == packed_drafts[row].tolist()


@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB], ids=["full-vocab", "reduced-vocab"])
def test_eagle3_training_time_test_equals_inference_drafting(tiny_llama, draft_vocab):
    """Unrolled training steps compute, at every position, the proposer's chained drafts."""
    torch.manual_seed(4)
    vocab_size = None if draft_vocab is None else draft_vocab.numel()
    drafter = Eagle3Drafter(Eagle3Config.for_target(tiny_llama.config, vocab_size)).eval()
    if draft_vocab is not None:
        set_draft_vocab(drafter, draft_vocab)
    head = DraftHead(tiny_llama.lm_head.weight, draft_token_ids(drafter))
    tokens = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(7))
    taps = tiny_llama(tokens, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    depth = 3
    # Make the data agree with the drafter's own guesses after position 8, so the teacher-forced
    # chain follows the same tokens the proposer feeds itself.
    proposer = Eagle3Proposer(tiny_llama, drafter, depth)
    proposer.begin(64)
    proposer.extend_context(taps[:9])
    drafts = proposer.propose(tokens[:10].tolist(), depth)
    forced = torch.cat([tokens[:10], torch.tensor(drafts)])
    taps_forced = tiny_llama(forced, tiny_llama.new_cache(32), tap_layers=drafter.config.target_layer_ids).taps
    with torch.no_grad():
        _, stats = eagle3_loss(drafter, tiny_llama, head, forced, taps_forced, response_start=10, depth=depth)
    # The drafting position j = 8 starts the chain whose labels are the drafts: all accepted.
    assert stats["tau"] == pytest.approx(1 + depth)
    # The engine's own proposer walked through the same sequence accepts what the unrolled chain does,
    # position by position (eval-drafter grows EAGLE-3's trees this way).
    with torch.no_grad():
        _, from_position_9 = eagle3_loss(drafter, tiny_llama, head, forced, taps_forced, response_start=9, depth=depth)
    walked = proposer_accepted(Eagle3Proposer(tiny_llama, drafter, depth), forced.tolist(), taps_forced, 9, depth)
    assert walked == from_position_9["accepted"] and walked[0] == depth


def test_dflash_loss_trains_a_drafter_to_copy_a_sequence(tiny_llama, tmp_path):
    config = DFlashConfig.for_target(tiny_llama.config, 1, 4, mask_token_id=95, num_taps=3)
    drafter = random_drafter(config, seed=0).train().requires_grad_(True)
    tokens = torch.randint(0, 95, (40,), generator=torch.Generator().manual_seed(8))
    taps = tiny_llama(tokens, tiny_llama.new_cache(64), tap_layers=config.target_layer_ids).taps
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    head = DraftHead(tiny_llama.lm_head.weight, None)
    first = None
    for _ in range(60):
        loss, stats = dflash_loss(drafter, tiny_llama, head, tokens, taps.clone(), 5, 16, 4.0, generator)
        first = first or loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(loss) < first / 3 and stats["tau"] > 1.5


def write_distilled(folder, sequences):
    folder.mkdir()
    lines = [json.dumps({"prompt_ids": s[:5], "response_ids": s[5:]}) for s in sequences]
    (folder / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_a_run_killed_while_it_saves_keeps_its_last_whole_checkpoint(tiny_llama, tmp_path, monkeypatch):
    """Killed halfway through writing the step-4 checkpoint: the step-2 one is still there, whole, and the rerun
    resumes from it and finishes."""
    from specserve_runtime.training import train as training

    generator = torch.Generator().manual_seed(9)
    sequences = [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(6)]
    settings = dict(method="eagle3", data=write_distilled(tmp_path / "data", sequences[:4]),
                    eval_data=write_distilled(tmp_path / "eval", sequences[4:]), steps=4, warmup=1, depth=2,
                    draft_vocab_size=48, eval_every=4, eval_sequences=2, checkpoint_every=2, out=str(tmp_path / "run"))
    state_file = tmp_path / "run" / "train-state.pt"
    real_save, saves = torch.save, []

    def killed_on_the_second_save(obj, path):
        saves.append(path)
        if len(saves) == 2:
            Path(path).write_bytes(b"half a checkpoint")
            raise KeyboardInterrupt
        real_save(obj, path)

    monkeypatch.setattr(torch, "save", killed_on_the_second_save)
    with pytest.raises(KeyboardInterrupt):
        training.train(training.TrainConfig(**settings), tiny_llama, 95, log=lambda message: None)
    monkeypatch.undo()
    assert torch.load(state_file, weights_only=False)["step"] == 2
    messages = []
    summary = training.train(training.TrainConfig(**settings), tiny_llama, 95, log=messages.append)
    assert "resuming eagle3 training at step 2" in messages
    assert [h["step"] for h in summary["history"]] == [4] and torch.load(state_file, weights_only=False)["step"] == 4


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_an_interrupted_run_resumes_to_the_same_drafter(tiny_llama, tmp_path, monkeypatch, method):
    """Checkpoint round trip: crash after the step-3 checkpoint, rerun, and get the uninterrupted run's weights."""
    from specserve_runtime.training import train as training

    generator = torch.Generator().manual_seed(9)
    sequences = [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(6)]
    data = write_distilled(tmp_path / "data", sequences[:4])
    eval_data = write_distilled(tmp_path / "eval", sequences[4:])
    settings = dict(method=method, data=data, eval_data=eval_data, steps=6, warmup=2, block_size=4, num_layers=1,
                    anchors=4, depth=2, draft_vocab_size=48, eval_every=3, eval_sequences=2, checkpoint_every=3)
    quiet = lambda message: None  # noqa: E731
    whole = training.train(training.TrainConfig(out=str(tmp_path / "whole"), **settings), tiny_llama, 95, log=quiet)

    real_loss, training_steps = training.sequence_loss, []

    def crash_at_step_four(*args):
        if torch.is_grad_enabled():  # a training step, not the held-out evaluation
            training_steps.append(1)
            if len(training_steps) == 4:
                raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(training, "sequence_loss", crash_at_step_four)
    config = training.TrainConfig(out=str(tmp_path / "resumed"), **settings)
    with pytest.raises(KeyboardInterrupt):
        training.train(config, tiny_llama, 95, log=quiet)
    assert not (tmp_path / "resumed" / "drafter").exists()
    resumed = training.train(config, tiny_llama, 95, log=quiet)

    assert resumed["history"] == [{**h, "seconds": r["seconds"]} for h, r in zip(whole["history"], resumed["history"])]
    load = load_dflash if method == "dflash" else load_eagle3
    ours, theirs = load(tmp_path / "resumed" / "drafter").state_dict(), load(tmp_path / "whole" / "drafter").state_dict()
    assert ours.keys() == theirs.keys() and "d2t" in ours
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="other settings"):  # a changed recipe never silently continues a run
        training.train(training.TrainConfig(out=str(tmp_path / "resumed"), **{**settings, "steps": 8}), tiny_llama, 95, log=quiet)
    # A run written before a setting existed ran with that setting's default, and resumes under it.
    state_file = tmp_path / "resumed" / "train-state.pt"
    state = torch.load(state_file, weights_only=False)
    del state["config"]["precision"]
    torch.save(state, state_file)
    assert training.train(config, tiny_llama, 95, log=quiet)["history"] == resumed["history"]


def test_the_engine_walk_stops_where_drafts_fail_and_skips_accepted_runs():
    accepted = [3, 9, 9, 9, 0, 1, 0, 5]  # drafts accepted after each of 8 response tokens
    visited = engine_walk(accepted)
    assert visited == [3, 0, 1, 0]  # from 0 to 4 (3 drafts + the target's token), 5, 7; at 7 no room is left
    assert sum(1 + a for a in visited) == len(accepted)  # every token once, as the engine at max_new_tokens


def test_held_out_evaluation_reports_each_category_and_reads_only_the_shards_it_needs(monkeypatch):
    """Per-domain acceptance: each category from its own sequences' positions and walks."""
    from specserve_runtime.training import train as training

    shards = [("a", [{"category": "math", "accepted": [3, 0, 0, 0]}, {"category": "chat", "accepted": [0, 0]}]),
              ("b", [{"category": "math", "accepted": [1, 0, 2, 0]}, {"accepted": [0]}]), ("c", [{"category": "code"}])]
    for _, shard in shards:
        for record in shard:
            record["response_ids"] = [0] * (len(record.get("accepted", [])) + 1)
    needed, records = training.first_sequences(shards, 4)
    assert [name for name, _ in needed] == ["a", "b"] and len(records) == 4  # shard c's features are never computed
    assert training.first_sequences(shards, 3)[1] == records[:3]
    anchors = []

    def stats(cfg, drafter, target, head, record, taps, generator, tree_nodes=None):
        anchors.append(cfg.anchors)
        return torch.tensor(1.0), {"accepted": record["accepted"], "accuracy": 0.5}

    monkeypatch.setattr(training, "sequence_loss", stats)
    cfg = training.TrainConfig(method="dflash", data="d", eval_data="e", out="o", block_size=4)
    result = training.evaluate(cfg, torch.nn.Linear(1, 1), None, None, records, [None] * 4, drafts=2)
    assert anchors == [training.EVERY_POSITION] * 4  # a block after every response token
    # math, capped at 2 drafts: positions [2,0,0,0] and [1,0,2,0]; walks [2,0] and [1,1] (one short of the end)
    math = result["by_category"]["math"]
    assert math["tau"] == pytest.approx(1 + 5 / 8) and math["engine_tau"] == pytest.approx(8 / 4)
    assert math["engine_per_position"] == [pytest.approx(3 / 4), pytest.approx(1 / 4)]
    assert result["by_category"].keys() == {"chat", "math"}  # a record without a category counts in "all" only
    assert result["engine_tau"] == pytest.approx(11 / 7) and result["loss"] == 1.0 and result["accuracy"] == 0.5
    with pytest.raises(ValueError, match="--eval-sequences >= 1"):
        training.TrainConfig(method="dflash", data="d", eval_data="e", out="o", eval_sequences=0)


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_held_out_engine_tau_is_what_the_engine_measures(tiny_llama, method):
    """The teacher-forced walk predicts the engine at T=0: the same verify steps and the same drafts accepted."""
    from specserve_runtime.engine import Engine, Request
    from specserve_runtime.training import train as training

    from .conftest import ByteTokenizer
    from .test_engine import PROMPT

    plain = Engine(tiny_llama, ByteTokenizer(), build_proposer("ar", tiny_llama), set()).generate(Request(PROMPT, 40))
    tokens = torch.tensor(PROMPT + plain.token_ids)  # the target's own greedy response, as distilled data is
    taps = tiny_llama(tokens, tiny_llama.new_cache(64), tap_layers=(1, 2, 3)).taps.clone()  # out of inference mode
    record = {"prompt_ids": PROMPT, "response_ids": plain.token_ids}
    cfg = training.TrainConfig(method=method, data="d", eval_data="e", out="o", block_size=4, num_layers=1, anchors=16,
                               depth=3, draft_vocab_size=0, lr=3e-3)
    drafter = training.new_drafter(cfg, tiny_llama, 95, [record]).train()
    head = DraftHead(tiny_llama.lm_head.weight, None)
    optimizer, generator = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr), torch.Generator().manual_seed(0)
    for _ in range(40):  # learn this response in part, so that runs of every length are accepted
        loss, _ = training.sequence_loss(cfg, drafter, tiny_llama, head, record, taps, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    drafter.eval().requires_grad_(False)

    proposer = (DFlashProposer if method == "dflash" else Eagle3Proposer)(tiny_llama, drafter, 3)
    served = Engine(tiny_llama, ByteTokenizer(), proposer, set()).generate(Request(PROMPT, 40))
    assert served.token_ids == plain.token_ids
    evaluated = training.evaluate(cfg, drafter, tiny_llama, head, [record], [taps])
    assert 1.5 < served.acceptance_length < 4 and served.accepted_per_position[2] > 0
    assert evaluated["engine_tau"] == pytest.approx(served.acceptance_length)
    assert evaluated["engine_per_position"] == pytest.approx([n / served.target_forwards for n in served.accepted_per_position])
    assert evaluated["tau"] > evaluated["engine_tau"]  # here, as with the real drafters, uniform positions overstate it


def test_the_sweep_varies_one_factor_at_a_time_around_the_base():
    from specserve_runtime.training.sweep import sweep_configs
    from specserve_runtime.training.train import TrainConfig

    base = TrainConfig(method="dflash", data="d", eval_data="e", out="sweep", block_size=8, num_layers=2)
    configs = sweep_configs(base, [4, 8, 16], [1, 2, 3])
    assert [(c.block_size, c.num_layers) for c in configs] == [(8, 2), (4, 2), (16, 2), (8, 1), (8, 3)]
    assert configs[1].out == "sweep/b4-l2" and all(c.steps == base.steps for c in configs)


def test_a_draft_vocabulary_larger_than_the_target_is_an_error(tiny_llama, tmp_path):
    from specserve_runtime.drafters import DrafterError
    from specserve_runtime.training import train as training

    data = write_distilled(tmp_path / "data", [list(range(30))])
    config = training.TrainConfig(method="dflash", data=data, eval_data=data, out=str(tmp_path / "run"), draft_vocab_size=97)
    with pytest.raises(DrafterError, match="draft_vocab_size must be within 1..96, got 97"):
        training.train(config, tiny_llama, 95, log=lambda message: None)


def test_logit_targets_are_the_targets_next_token_distribution(tiny_llama):
    """The last tap, normed, times the LM head is the target's own logits: what `--targets logits` learns."""
    from specserve_runtime.training.recipes import token_losses
    from specserve_runtime.training.train import TrainConfig, tap_layers

    config = TrainConfig(method="dflash", data="d", eval_data="e", out="o", targets="logits")
    layers = tap_layers(config, tiny_llama)
    assert layers[-1] == tiny_llama.config.num_hidden_layers - 1 and len(set(layers)) == 4
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(2))
    out = tiny_llama(tokens, tiny_llama.new_cache(16), tap_layers=layers)
    teacher = tiny_llama.norm(out.taps[:, -tiny_llama.config.hidden_size:])
    torch.testing.assert_close(DraftHead(tiny_llama.lm_head.weight, None).logits(teacher), out.logits)

    # Forward KL: a drafter that already predicts the target's distribution gets no gradient,
    # where cross-entropy with the argmax token still pushes it.
    logits = out.logits.clone().requires_grad_(True)
    token_losses(logits, out.logits.argmax(-1), out.logits).sum().backward()
    assert logits.grad.abs().max() < 1e-6
    logits.grad = None
    token_losses(logits, out.logits.argmax(-1), None).sum().backward()
    assert logits.grad.abs().max() > 1e-3


def test_draft_layers_can_start_as_the_targets_top_layers(tiny_llama):
    from specserve_runtime.training.train import TrainConfig, new_drafter

    settings = dict(method="dflash", data="d", eval_data="e", out="o", num_layers=2, block_size=4, draft_vocab_size=0)
    copied = new_drafter(TrainConfig(init="target", **settings), tiny_llama, 95, [])
    fresh = new_drafter(TrainConfig(**settings), tiny_llama, 95, [])
    for draft, source in zip(copied.layers, tiny_llama.layers[-2:]):
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            torch.testing.assert_close(draft.state_dict()[name], source.state_dict()[name], rtol=0, atol=0)
    torch.testing.assert_close(copied.norm.weight, tiny_llama.norm.weight, rtol=0, atol=0)
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.weight, copied.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="--init must be random, or target for dflash"):
        TrainConfig(**{**settings, "method": "eagle3", "init": "target"})


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_a_warm_start_begins_from_the_trained_drafter(tiny_llama, tmp_path, method):
    """--warm-start: the run's drafter is the trained one (weights and draft vocabulary), not a
    fresh one from the run's seed and data; a drafter of another shape or method is refused."""
    from specserve_runtime.drafters import DrafterError
    from specserve_runtime.training.train import TrainConfig, new_drafter

    settings = dict(method=method, data="d", eval_data="e", out="o", num_layers=1, block_size=4, draft_vocab_size=48)
    sequences = [{"response_ids": list(range(60))}]
    trained = new_drafter(TrainConfig(seed=1, **settings), tiny_llama, 95, sequences)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.5)  # no fresh drafter looks like this
    save = save_dflash if method == "dflash" else save_eagle3
    save(trained, tmp_path / "trained", dtype=torch.float16)

    fresh = new_drafter(TrainConfig(**settings), tiny_llama, 95, [{"response_ids": list(range(40, 95))}])
    warm = new_drafter(TrainConfig(warm_start=str(tmp_path / "trained"), **settings), tiny_llama, 95,
                       [{"response_ids": list(range(40, 95))}])
    expected = (load_dflash if method == "dflash" else load_eagle3)(tmp_path / "trained").state_dict()
    assert warm.state_dict().keys() == expected.keys() and "d2t" in expected
    for name, tensor in warm.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert not torch.equal(fresh.state_dict()["d2t"], expected["d2t"])  # the vocabulary came from the drafter too

    other_shape = {**settings, "draft_vocab_size": 32}
    with pytest.raises(ValueError, match="the drafter has draft_vocab_size 48 \\(this run: 32\\)"):
        new_drafter(TrainConfig(warm_start=str(tmp_path / "trained"), **other_shape), tiny_llama, 95, sequences)
    other_method = {**settings, "method": "eagle3" if method == "dflash" else "dflash"}
    with pytest.raises(DrafterError, match="not an? (EAGLE-3|DFlash) drafter"):
        new_drafter(TrainConfig(warm_start=str(tmp_path / "trained"), **other_method), tiny_llama, 95, sequences)
    if method == "dflash":
        with pytest.raises(ValueError, match="--warm-start and --init target both choose the starting weights"):
            TrainConfig(warm_start=str(tmp_path / "trained"), init="target", **settings)


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_training_with_logit_targets_runs_end_to_end(tiny_llama, tmp_path, method):
    from specserve_runtime.training import train as training

    generator = torch.Generator().manual_seed(5)
    data = write_distilled(tmp_path / "data", [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(3)])
    config = training.TrainConfig(method=method, data=data, eval_data=data, out=str(tmp_path / "run"), steps=4, warmup=1,
                                  block_size=4, num_layers=1, anchors=4, depth=2, draft_vocab_size=48, eval_every=2,
                                  eval_sequences=2, targets="logits", init="target" if method == "dflash" else "random")
    summary = training.train(config, tiny_llama, 95, log=lambda message: None)
    assert [h["step"] for h in summary["history"]] == [2, 4] and all(h["loss"] > 0 for h in summary["history"])
    assert (tmp_path / "data" / "taps-1-2-3-5" / "shard-00000.safetensors").exists()  # the last layer tapped too


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_sequences_with_nothing_to_draft_are_skipped_not_trained_on(tiny_llama, tmp_path, monkeypatch, method):
    """A continuation can end at once: a response of 1 token has no position with a next token."""
    from specserve_runtime.training import train as training

    generator = torch.Generator().manual_seed(6)
    whole = [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(2)]
    data = write_distilled(tmp_path / "data", [whole[0], whole[0][:6], whole[1]])  # the second: 1 response token
    real_loss, trained_on = training.sequence_loss, []

    def recording(cfg, drafter, target, head, record, *rest):
        if torch.is_grad_enabled():
            trained_on.append(len(record["response_ids"]))
        return real_loss(cfg, drafter, target, head, record, *rest)

    monkeypatch.setattr(training, "sequence_loss", recording)
    logged = []
    config = training.TrainConfig(method=method, data=data, eval_data=data, out=str(tmp_path / "run"), steps=6, warmup=1,
                                  block_size=4, num_layers=1, anchors=4, depth=2, draft_vocab_size=48, eval_every=6,
                                  eval_sequences=3)
    summary = training.train(config, tiny_llama, 95, log=logged.append)
    assert sorted(trained_on) == [25] * 6 and "skipping 1 of 3 sequences: responses under 2 tokens" in logged
    assert [h["step"] for h in summary["history"]] == [6]  # evaluated on the other two
    only_short = write_distilled(tmp_path / "short", [whole[0][:6]])
    with pytest.raises(ValueError, match="no sequence has a response of 2 tokens"):
        training.train(replace(config, data=only_short, out=str(tmp_path / "short-run")), tiny_llama, 95, log=logged.append)
    with pytest.raises(ValueError, match="no held-out sequence has a response of 2 tokens"):  # checked before any drafting
        training.evaluate(config, None, tiny_llama, None, [{"response_ids": [7]}], [None])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bf16_precision_autocasts_the_training_steps_only(tiny_llama, tmp_path, monkeypatch, precision):
    """bf16 runs each training step's forward (and so its backward) under bf16 autocast; the weights
    stay fp32 and the held-out evaluation runs in fp32, so its figures compare across precisions."""
    from specserve_runtime.training import train as training

    generator = torch.Generator().manual_seed(5)
    data = write_distilled(tmp_path / "data", [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(3)])
    real_loss, calls = training.sequence_loss, []

    def record(*args):
        loss, stats = real_loss(*args)
        calls.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), loss.dtype))
        return loss, stats

    monkeypatch.setattr(training, "sequence_loss", record)
    config = training.TrainConfig(method="dflash", data=data, eval_data=data, out=str(tmp_path / "run"), steps=4, warmup=1,
                                  block_size=4, num_layers=1, anchors=4, draft_vocab_size=48, eval_every=2,
                                  eval_sequences=2, precision=precision)
    summary = training.train(config, tiny_llama, 95, log=lambda message: None)
    bf16 = precision == "bf16"
    assert [autocast for grad, autocast, _ in calls if grad] == [bf16] * 4
    assert [autocast for grad, autocast, _ in calls if not grad] == [False] * 4  # 2 evaluations x 2 sequences
    assert all(dtype == torch.float32 for _, _, dtype in calls)  # the loss is reduced in fp32 either way
    assert [h["step"] for h in summary["history"]] == [2, 4]
    state = torch.load(tmp_path / "run" / "train-state.pt", weights_only=False)
    assert {tensor.dtype for tensor in state["drafter"].values() if tensor.is_floating_point()} == {torch.float32}
    with pytest.raises(ValueError, match="--precision must be fp32 or bf16"):
        training.TrainConfig(method="dflash", data=data, eval_data=data, out="o", precision="fp16")


def test_a_data_curve_point_trains_on_the_first_shards_only(tiny_llama, tmp_path):
    from specserve_runtime.training import train as training

    data = tmp_path / "data"
    write_distilled(data, [list(range(30))])
    (data / "shard-00001.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3] * 20}) + "\n")
    settings = dict(method="eagle3", data=str(data), eval_data=str(data), steps=1, depth=1, draft_vocab_size=48, eval_sequences=1)
    training.train(training.TrainConfig(out=str(tmp_path / "one"), shards=1, **settings), tiny_llama, 95, log=lambda m: None)
    assert (data / "taps-1-2-3" / "shard-00000.safetensors").exists()
    assert not (data / "taps-1-2-3" / "shard-00001.safetensors").exists()  # never read, never computed
    with pytest.raises(ValueError, match=r"--shards 3: .* has only 2 shards"):
        training.train(training.TrainConfig(out=str(tmp_path / "three"), shards=3, **settings), tiny_llama, 95, log=lambda m: None)

    more = tmp_path / "more"  # a second folder (a continuation's, say): its shards come after the first folder's
    write_distilled(more, [list(range(40, 70))])
    both = {**settings, "data": f"{data},{more}"}
    training.train(training.TrainConfig(out=str(tmp_path / "three"), shards=3, **both), tiny_llama, 95, log=lambda m: None)
    assert (data / "taps-1-2-3" / "shard-00001.safetensors").exists() and (more / "taps-1-2-3" / "shard-00000.safetensors").exists()
    with pytest.raises(ValueError, match=r"--shards 4: .* has only 3 shards"):
        training.train(training.TrainConfig(out=str(tmp_path / "four"), shards=4, **both), tiny_llama, 95, log=lambda m: None)


def test_the_loss_decay_follows_the_block_size_unless_given():
    from specserve_runtime.training.train import TrainConfig

    config = lambda **flags: TrainConfig(method="dflash", data="d", eval_data="e", out="o", **flags)  # noqa: E731
    assert [config(block_size=b).decay_gamma for b in (4, 8, 10, 16)] == [2.0, 4.0, 5.0, 7.0]
    assert config(block_size=16, gamma=3.0).decay_gamma == 3.0


@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_eval_drafter_evaluates_a_saved_drafter_on_the_features_it_reads(tiny_llama, tmp_path, method):
    from specserve_runtime.training.train import evaluate_drafter

    from .test_dflash import tiny_drafter

    if method == "dflash":  # one tap, layer 2: not the (1, 2, 3) training taps
        drafter = tiny_drafter(tiny_llama, block_size=4)
        save_dflash(drafter, tmp_path / "drafter")
    else:
        torch.manual_seed(2)
        drafter = Eagle3Drafter(Eagle3Config.for_target(tiny_llama.config, None))
        save_eagle3(drafter, tmp_path / "drafter")
    generator = torch.Generator().manual_seed(5)
    eval_data = write_distilled(tmp_path / "eval", [torch.randint(0, 95, (30,), generator=generator).tolist() for _ in range(3)])
    taps = "-".join(map(str, drafter.config.target_layer_ids))
    whole = evaluate_drafter(method, str(tmp_path / "drafter"), tiny_llama, eval_data, 2, log=lambda message: None)
    most = 3 if method == "dflash" else 4  # a block of 4, or EAGLE-3's default chain
    assert whole["sequences"] == 2 and whole["drafts"] == most and len(whole["engine_per_position"]) == most
    assert 1 <= whole["engine_tau"] <= 1 + most and 1 <= whole["tau"] <= 1 + most
    assert (tmp_path / "eval" / f"taps-{taps}" / "shard-00000.safetensors").exists()
    two = evaluate_drafter(method, str(tmp_path / "drafter"), tiny_llama, eval_data, 2, drafts=2, log=lambda message: None)
    assert two["drafts"] == 2 and len(two["engine_per_position"]) == 2
    if method == "dflash":  # a tree may hold more drafts than the block has slots
        tree = evaluate_drafter(method, str(tmp_path / "drafter"), tiny_llama, eval_data, 2, 5, True, lambda message: None)
        assert tree["tree"] and tree["drafts"] == 5 and 1 <= tree["engine_tau"] <= 1 + most
        assert tree["engine_per_position"][most:] == [0, 0]  # no branch is deeper than the block
    else:  # grown by the engine's proposer at every position
        tree = evaluate_drafter(method, str(tmp_path / "drafter"), tiny_llama, eval_data, 2, 5, True, lambda message: None)
        assert tree["tree"] and tree["drafts"] == 5 and 1 <= tree["engine_tau"] <= 1 + 5


def test_tree_acceptance_follows_the_data_down_any_branch():
    # Slot 1 favours 3 over the data's 2; slots 2 and 3 favour 4 and 0. The data continues 2, 4, 1.
    probs = torch.full((1, 3, 6), 0.02)
    probs[0, 0, 3], probs[0, 0, 2], probs[0, 1, 4], probs[0, 2, 0] = 0.5, 0.44, 0.9, 0.9
    logits, labels, valid = probs.log(), torch.tensor([[2, 4, 1]]), torch.ones(1, 3, dtype=torch.bool)
    assert accepted_prefix(logits.argmax(-1) == labels).tolist() == [0]  # the chain of top tokens fails at once
    # Prefixes by probability, once normalised: 3 (.49), 3-4 (.44), 2 (.43), 3-4-0 (.40), 2-4 (.39).
    assert [tree_accepted(logits, labels, valid, nodes).tolist() for nodes in (2, 3, 4, 5)] == [[0], [1], [1], [2]]
    valid[0, 1] = False  # the data ends after its first token
    assert tree_accepted(logits, labels, valid, 5).tolist() == [1]
